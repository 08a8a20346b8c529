"""Request streams on ``docpage`` pages, for ``vismemo-docqa-base`` (docs/METHOD.md §6): the near-duplicate kinds
users meet. Each base page (a miss) is followed, in mixed order, by the same page with another question (exact),
the same page after another instruction text (exact, a changed context), one or several edited cells (asked about:
approximate, naive reuse answers the old value), a scrolled, shifted or cropped page, a popup over the page, a
switched widget (``ui`` pages) and a rescan (JPEG, brightness, noise): approximate.

The rows are ``synthdoc.BaseRequest``s, as ``synthdoc.Request``s are (the quality evaluation runs them as it runs
the tiny reader's streams), whose ``image`` and ``answer_tokens`` come from ``docpage``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from vismemo_hf.eval import docpage
from vismemo_hf.eval.synthdoc import BaseRequest

KINDS = ("same", "instruction", "edit_asked", "edit_several", "scroll", "crop", "popup", "widget", "rescan", "shift")
#: instruction texts of the ``instruction`` follow-ups (neutral: they change no answer)
INSTRUCTIONS = ("Please read carefully.", "Form copy 3:", "Check this page.", "From the archive:")


@dataclass
class PageRequest(BaseRequest[docpage.DocPage]):
    """A stream row on a ``docpage`` page; ``asked`` is its ``docpage.Question``."""

    asked: docpage.Question | None = None

    def image(self):
        return docpage.render(self.page)

    def answer_tokens(self) -> list[int]:
        assert self.asked is not None  # every row is made by ``request``, which sets it
        return docpage.answer_tokens(self.page, self.asked)


def request(rid: str, page: docpage.DocPage, q: docpage.Question, intended: str, variant: str,
            stale: str | None = None) -> PageRequest:
    """The row asking ``q`` about ``page`` (``stale``: the value an outdated reuse would answer)."""
    return PageRequest(rid, page, q.text, [q.answer], intended, variant, stale is not None, stale, q.instruction,
                       asked=q)


def _follow_up(rng: random.Random, base: docpage.DocPage, first: docpage.Question, kind: str, rid: str):
    if kind == "same":
        q = docpage.random_question(rng, base, instruct=0.0)
        return request(rid, base, q, "exact", kind)
    if kind == "instruction":  # the first question after another text before the image
        if first.kind == "value" and len(base.columns) > 1:  # its instruction names the column: name another one
            q = docpage.ask(base, "value", first.row, (first.column + 1) % len(base.columns))
        else:
            q = docpage.ask(base, first.kind, first.row, first.column, rng.choice(INSTRUCTIONS))
        return request(rid, base, q, "exact", kind)
    if kind in ("edit_asked", "edit_several"):
        cells = [(r, c) for r in range(base.n_rows) for c in range(len(base.columns))]
        picked = rng.sample(cells, 1 if kind == "edit_asked" else min(len(cells), rng.randint(2, 3)))
        page = docpage.edit_cells(base, picked, rng)
        row, column = picked[0]
        q = docpage.ask(page, "cell" if len(page.columns) > 1 else "value", row, column)
        return request(rid, page, q, "approximate", kind, stale=base.values[row][column])
    page = changed_page(rng, base, kind)
    return request(rid, page, docpage.random_question(rng, page, instruct=0.0), "approximate", kind)


#: the follow-ups that change the page without changing an answer (``changed_page``)
PAGE_CHANGES = ("scroll", "crop", "popup", "widget", "rescan", "shift")


def changed_page(rng: random.Random, base: docpage.DocPage, kind: str) -> docpage.DocPage:
    """``base`` after one of ``PAGE_CHANGES`` (``widget``: ``ui`` pages only), drawn from ``rng``."""
    return {"scroll": lambda: docpage.scroll(base, rng.choice([-14, 14, 28])),
            "crop": lambda: docpage.crop(base, rng.choice([6, 10])),
            "popup": lambda: docpage.popup(base, rng),
            "widget": lambda: docpage.toggle(base, rng.randrange(base.n_rows)),
            "rescan": lambda: docpage.rescan(base, rng),
            "shift": lambda: docpage.shift(base, rng.choice([-3, -2, 2, 3]), rng.choice([-2, 0, 2]))}[kind]()


def stream(seed: int, n_bases: int = 12, follow_ups: int = 4) -> list[PageRequest]:
    """A trace of ``n_bases`` pages (layouts in turn), each followed by ``follow_ups`` requests of the kinds in
    turn, released in mixed order (reuse intervals vary)."""
    rng = random.Random(seed)
    out, pending = [], []
    for b in range(n_bases):
        layout = docpage.LAYOUTS[b % len(docpage.LAYOUTS)]
        base = docpage.random_page(seed * 100_003 + b, layout=layout)
        first = docpage.random_question(rng, base, instruct=0.0)
        out.append(request(f"d{seed}b{b}", base, first, "miss", f"base-{layout}"))
        for v in range(follow_ups):
            kind = KINDS[(b * follow_ups + v) % len(KINDS)]
            if layout == "ui" and v == 0:  # every ui page gets its widget switched once
                kind = "widget"
            elif kind == "widget" and layout != "ui":
                kind = "rescan"
            pending.append(_follow_up(rng, base, first, kind, f"d{seed}b{b}v{v}"))
        rng.shuffle(pending)
        release = pending[: rng.randrange(len(pending) + 1)]
        pending = pending[len(release):]
        out.extend(release)
    return out + pending


def reader_pages(model: str, pages: str = "auto"):
    """``(pages, stream builder)`` of a reader: ``docpage`` pages (this module's streams) for
    ``vismemo-docqa-base`` and checkpoints of it, ``synthdoc`` for the tiny reader; ``pages`` names one instead."""
    from vismemo_hf.eval import synthdoc

    if pages == "auto":
        pages = "docpage" if "docqa-base" in str(model) else "synthdoc"
    if pages not in ("docpage", "synthdoc"):
        raise ValueError(f"pages must be auto, docpage or synthdoc, got {pages!r}")
    return pages, (stream if pages == "docpage" else synthdoc.stream)

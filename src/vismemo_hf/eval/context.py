"""Cases where reuse must hold whatever came before the image and however little the page changed
(docs/METHOD.md §6), for both readers: the page stored in one request, then asked about in another.

Classes (``CLASSES``):

* ``text-exact-A-B`` / ``text-approx-A-B``: another instruction text of A-B characters before the image (before the
  stored one: none, or another text of that length); an exact hit on the same page, or an approximate one on the
  page with one value edited (asked about, so a stale reuse answers the old value).
* ``image-exact`` / ``image-approx``: another page before the image (it was stored alone).
* ``digit-edit`` / ``key-edit``: one character of one value (of one key) changed, smaller than a visual token's
  content on the base reader's pages (two glyphs per token), one glyph token of four on the tiny reader's.
* ``rotate`` / ``rescale``: the page turned by 0.5-1 degree or zoomed by 1-3 % about its centre: every token
  changes a little.
* ``insert-row`` / ``erase-cell``: a record inserted (the rows below move down a row), a value erased.
* ``select-row`` / ``highlight-row``: one record's row shown selected (its colours inverted, as a UI selects a row)
  or highlighted (blended with a marker's yellow); the text is unchanged, every token of the row changes.
* ``images-2`` / ``images-3``: the page (stored alone) asked about after two / three other pages, a short text after
  each: an exact hit after several other images.
* ``agent-2`` / ``agent-3``: an agent's window of the last 2 / 3 screenshots, each followed by its action text, then
  the next step, in which the window slid by one screen: the first screen left, the others moved up one place (each
  now after other images than it was) and a new screen came last, a small change of the one before it (a value
  typed, a row highlighted or selected; the last change types the value the first question asks about). Asked about
  the new screen, an approximate hit after other images.

Each case holds three questions (the first about what changed, where something did), whose answers no instruction
text chooses. The texts come from three generators (sentences, chat turns, random words with digits) drawn by
seed, so a held-out seed gives other texts, lengths, pages and edits.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from PIL import Image, ImageOps

from vismemo_hf.eval import docpage, synthdoc, workload

LENGTHS = ((1, 10), (11, 40), (41, 120), (121, 300))
CLASSES = tuple(f"text-{kind}-{lo}-{hi}" for lo, hi in LENGTHS for kind in ("exact", "approx")) + (
    "image-exact", "image-approx", "digit-edit", "key-edit", "rotate", "rescale", "insert-row", "erase-cell",
    "select-row", "highlight-row", "images-2", "images-3", "agent-2", "agent-3")

_WORDS = ("the a of to and in is for on with as by at from this that page report form screen shows please read look "
          "check total date order number item list below next step user assistant open click file window table row "
          "column value name account status update new old first last here what which scroll save send done").split()


def sentence(n: int, rng: random.Random) -> str:
    words: list[str] = []
    while len(" ".join(words)) < n:
        words.append(rng.choice(_WORDS))
    text = " ".join(words)[:n].rstrip()
    return text[:1].upper() + text[1:]


def chat_turns(n: int, rng: random.Random) -> str:
    turns: list[str] = []
    while len(" ".join(turns)) < n:
        turns.append(rng.choice(["User:", "Assistant:"]) + " " + sentence(rng.randint(6, 40), rng) + ".")
    return " ".join(turns)[:n].rstrip()


def random_words(n: int, rng: random.Random) -> str:
    words: list[str] = []
    while len(" ".join(words)) < n:
        words.append("".join(rng.choice(string.ascii_lowercase + string.digits) for _ in range(rng.randint(1, 8))))
    return " ".join(words)[:n].rstrip()


TEXTS = (sentence, chat_turns, random_words)


def instruction_text(rng: random.Random, lo: int, hi: int) -> str:
    """A text of ``lo``-``hi`` characters from one of ``TEXTS``."""
    n = rng.randint(lo, hi)
    text = rng.choice(TEXTS)(n, rng)
    return text if len(text) >= lo else (text + " " + "x" * lo)[:n]


@dataclass(frozen=True)
class Asked:
    question: str
    answers: tuple[str, ...]
    stale: str | None = None  # the answer a reuse of the stored page would give, where it differs


@dataclass(frozen=True)
class Case:
    """A page stored in one request (``stored``: the content before the question, ("text", str) and ("image", PIL)
    parts) and asked about in another (``asked``); ``intended``: the hit kind the second request should be."""

    cls: str
    stored: tuple
    asked: tuple
    questions: tuple[Asked, ...]
    intended: str


class _Pages:
    """What a reader's pages offer the cases: docpage pages for the base reader, synthdoc forms for the tiny one."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def page(self, seed: int, i: int):
        if self.kind == "docpage":
            return docpage.random_page(2**31 + seed * 1009 + i, layout=docpage.LAYOUTS[i % len(docpage.LAYOUTS)])
        return synthdoc.random_form(seed * 1009 + i, n_rows=synthdoc.ROWS - 1, style=synthdoc.STYLES[i % 5])

    def render(self, page):
        return docpage.render(page) if self.kind == "docpage" else synthdoc.render(page)

    def paper(self, page):
        return docpage.PAPER[page.layout] if self.kind == "docpage" else synthdoc.PAPER[page.style]

    def question(self, page, rng: random.Random, skip=()) -> Asked:
        """A question whose answer no instruction text chooses (not about the cells in ``skip``)."""
        if self.kind == "docpage":
            while True:
                row, col = rng.randrange(page.n_rows), rng.randrange(len(page.columns))
                if (row, col) not in skip and page.values[row][col]:
                    break
            kind = "cell" if len(page.columns) > 1 and rng.random() < 0.5 else "key"
            q = docpage.ask(page, kind, row, col)
            return Asked(q.text, (q.answer,))
        rows = [r for r in range(len(page.rows)) if (r, 0) not in skip and page.rows[r][1].strip()]
        key, value = page.rows[rng.choice(rows)]
        return Asked(synthdoc.question_for(key), (value,))

    def about(self, page, row: int, col: int, stale: str | None, by_key: bool = False) -> Asked:
        """The question about cell (row, col): its value, or (``by_key``) its row's key from its value."""
        if self.kind == "docpage":
            kind = "key" if by_key else ("cell" if len(page.columns) > 1 else "value")
            q = docpage.ask(page, kind, row, col)
            return Asked(q.text, (q.answer,), stale)
        key, value = page.rows[row]
        return Asked(synthdoc.question_for(key), (value,), stale)

    def cells(self, page) -> list[tuple[int, int]]:
        if self.kind == "docpage":
            return [(r, c) for r in range(page.n_rows) for c in range(len(page.columns))]
        return [(r, 0) for r in range(len(page.rows))]

    def edit_value(self, page, row, col, rng):
        return docpage.edit_cells(page, [(row, col)], rng) if self.kind == "docpage" else \
            synthdoc.edit_value(page, row, rng)

    def value(self, page, row, col) -> str:
        return page.values[row][col] if self.kind == "docpage" else page.rows[row][1]

    def paint_row(self, page, img: Image.Image, row: int, paint) -> Image.Image:
        """``img`` (``page`` rendered) with record ``row``'s band repainted by ``paint``."""
        if self.kind == "docpage":
            return workload.paint_row(img, page, row, paint)
        top = row * synthdoc.CELL + page.shift[1]
        box = (0, max(0, top), img.width, min(img.height, top + synthdoc.CELL))
        out = img.copy()
        out.paste(paint(img.crop(box)), box[:2])
        return out


def _three(pages: _Pages, page, rng: random.Random, first: Asked | None = None, skip=()) -> tuple[Asked, ...]:
    out = [first] if first is not None else []
    for _ in range(30):  # distinct questions where the page has them
        if len(out) == 3:
            break
        q = pages.question(page, rng, skip)
        if q.question not in {o.question for o in out}:
            out.append(q)
    while len(out) < 3:
        out.append(pages.question(page, rng, skip))
    return tuple(out)


#: the text after each screenshot of an ``agent-*`` case (the step's action) and after each page of ``images-*``
ACTION = "Action {}: click the next field."
NEXT_PAGE = "Page {}."


def _screens(pages: _Pages, base, count: int, rng: random.Random):
    """``count`` screenshots of ``base``, each a small change of the one before (a row highlighted or selected, and
    for the last one a value typed): (the images, the last one's page, the typed cell, the first question: about the
    typed value, stale its old one)."""
    page, paints, out = base, {}, [pages.render(base)]
    cell, first = None, None
    for step in range(1, count):
        if step == count - 1:
            cell = rng.choice(pages.cells(page))
            before = pages.value(page, *cell)
            page = pages.edit_value(page, *cell, rng)
            first = pages.about(page, *cell, before)
        else:
            paints = {rng.choice(pages.cells(page))[0]: rng.choice([workload.highlight, ImageOps.invert])}
        img = pages.render(page)
        for row, paint in paints.items():  # one row marked at a time
            img = pages.paint_row(page, img, row, paint)
        out.append(img)
    assert cell is not None and first is not None  # count >= 2
    return out, page, cell, first


def _multi_image_case(cls: str, pages: _Pages, base, other, rng: random.Random) -> Case:
    """An ``images-*`` or ``agent-*`` case (``make_case``)."""
    kind, count = cls.split("-")
    n = int(count)
    if kind == "images":
        others = [other] + [pages.page(rng.randrange(1 << 30), k) for k in range(1, n)]
        asked: tuple = ()
        for k, page in enumerate(others):
            asked += (("image", pages.render(page)), ("text", NEXT_PAGE.format(k + 1)))
        return Case(cls, (("image", pages.render(base)),), asked + (("image", pages.render(base)),),
                    _three(pages, base, rng), "exact")
    screens, last, cell, first = _screens(pages, base, n + 1, rng)
    stored: tuple = ()
    for i, img in enumerate(screens[:n]):
        stored += (("image", img), ("text", ACTION.format(i + 1)))
    asked = ()
    for i, img in enumerate(screens[1:], start=2):
        asked += (("image", img),) + ((("text", ACTION.format(i)),) if i <= n else ())
    return Case(cls, stored, asked, _three(pages, last, rng, first, {cell}), "approximate")


def _context_case(cls: str, pages: _Pages, base, other, rng: random.Random) -> Case:
    """A ``text-*`` or ``image-*`` case (``make_case``)."""
    render = pages.render
    img = render(base)
    if cls.startswith("text-"):
        _, kind, lo, hi = cls.split("-")
        old = instruction_text(rng, int(lo), int(hi)) if rng.random() < 0.7 else ""
        new = instruction_text(rng, int(lo), int(hi))
        while new == old:
            new = instruction_text(rng, int(lo), int(hi))
        if kind == "exact":
            return Case(cls, (("text", old), ("image", img)), (("text", new), ("image", img)),
                        _three(pages, base, rng), "exact")
        row, col = rng.choice(pages.cells(base))
        page = pages.edit_value(base, row, col, rng)
        first = pages.about(page, row, col, pages.value(base, row, col))
        return Case(cls, (("text", old), ("image", img)), (("text", new), ("image", render(page))),
                    _three(pages, page, rng, first, {(row, col)}), "approximate")
    if cls == "image-exact":
        return Case(cls, (("image", img),), (("image", render(other)), ("image", img)), _three(pages, base, rng),
                    "exact")
    row, col = rng.choice(pages.cells(base))  # image-approx
    page = pages.edit_value(base, row, col, rng)
    first = pages.about(page, row, col, pages.value(base, row, col))
    return Case(cls, (("image", img),), (("image", render(other)), ("image", render(page))),
                _three(pages, page, rng, first, {(row, col)}), "approximate")


def make_case(cls: str, pages: _Pages, base, other, rng: random.Random) -> Case | None:
    """The case of class ``cls`` on page ``base`` (``other``: a page of another layout, for ``image-*`` and
    ``images-*``); None when the page does not allow it (no room for another row)."""
    render = pages.render
    if cls.startswith(("images-", "agent-")):
        return _multi_image_case(cls, pages, base, other, rng)
    img = render(base)
    if cls.startswith(("text-", "image-")):
        return _context_case(cls, pages, base, other, rng)
    row, col = rng.choice(pages.cells(base))
    page: docpage.DocPage | synthdoc.FormPage
    if cls == "digit-edit":
        if pages.kind == "docpage":
            page = docpage.edit_char(base, row, col, rng)
        else:
            page = synthdoc.edit_digit(base, row, rng)
        first = pages.about(page, row, col, pages.value(base, row, col))
    elif cls == "key-edit":
        if pages.kind == "docpage":
            page = docpage.edit_key_char(base, row, rng)
            first = pages.about(page, row, col, base.keys[row], by_key=True)
        else:
            page = synthdoc.edit_key_char(base, row, rng)
            first = pages.about(page, row, col, None)
    elif cls in ("rotate", "rescale"):
        if cls == "rotate":
            turn = rng.choice([-1.0, -0.75, -0.5, 0.5, 0.75, 1.0])
            page = docpage.rotate(base, turn) if pages.kind == "docpage" else synthdoc.rotate(base, turn)
        else:
            factor = rng.choice([0.97, 0.98, 0.99, 1.01, 1.02, 1.03])
            page = docpage.rescale(base, factor) if pages.kind == "docpage" else synthdoc.rescale(base, factor)
        return Case(cls, (("image", img),), (("image", render(page)),), _three(pages, page, rng), "approximate")
    elif cls == "insert-row":
        n_rows = base.n_rows if pages.kind == "docpage" else len(base.rows)
        if pages.kind == "docpage" and not docpage.has_room_for_row(base):
            return None
        at = rng.randrange(n_rows)
        if pages.kind == "docpage":
            doc = docpage.insert_row(base, at, rng)
            page, column = doc, rng.randrange(len(doc.columns))
        else:
            page, column = synthdoc.insert_row(base, at, rng), 0
        inserted = pages.about(page, at, column, None)
        moved = pages.about(page, rng.randrange(at + 1, n_rows + 1), 0, None)  # a row that moved down
        return Case(cls, (("image", img),), (("image", render(page)),),
                    (inserted, moved, pages.question(page, rng, {(at, c) for c in range(3)})), "approximate")
    elif cls == "erase-cell":
        if pages.kind == "docpage":
            page = docpage.erase_cell(base, row, col)
        else:
            page = synthdoc.erase_value(base, row)
        return Case(cls, (("image", img),), (("image", render(page)),), _three(pages, page, rng, skip={(row, col)}),
                    "approximate")
    elif cls in ("select-row", "highlight-row"):
        shown = pages.paint_row(base, img, row, ImageOps.invert if cls == "select-row" else workload.highlight)
        first = pages.about(base, row, col, None)
        return Case(cls, (("image", img),), (("image", shown),), _three(pages, base, rng, first, {(row, col)}),
                    "approximate")
    else:
        raise ValueError(f"unknown context class {cls!r}; classes: {', '.join(CLASSES)}")
    return Case(cls, (("image", img),), (("image", render(page)),), _three(pages, page, rng, first, {(row, col)}),
                "approximate")


def cases(pages: str, seed: int, per_class: int, classes=CLASSES) -> list[Case]:
    """``per_class`` cases of every class in ``classes`` on ``pages`` ("docpage" or "synthdoc"), from ``seed``."""
    source = _Pages(pages)
    out = []
    for cls in classes:
        if cls not in CLASSES:
            raise ValueError(f"unknown context class {cls!r}; classes: {', '.join(CLASSES)}")
        c = CLASSES.index(cls)  # a class's cases do not depend on which other classes are asked for
        rng = random.Random(f"{seed}/{cls}")
        i = made = 0
        while made < per_class:
            base = source.page(seed * 31 + c, i)
            other = source.page(seed * 31 + c + 7_919, i + 2)
            i += 1
            case = make_case(cls, source, base, other, rng)
            if case is not None:
                out.append(case)
                made += 1
    return out


def chat(parts, question: str) -> tuple[list[dict], list]:
    """(messages, images) of one request: ``parts`` in order, then the question."""
    content, images = [], []
    for kind, x in parts:
        if kind == "image":
            content.append({"type": "image"})
            images.append(x)
        elif x:
            content.append({"type": "text", "text": x})
    content.append({"type": "text", "text": question})
    return [{"role": "user", "content": content}], images

"""Streams of requests as users send them (``vismemo bench workload``): a multi-turn chat, a GUI agent's loop, mixed
single-image traffic and the readers' own streams. Each request is a whole conversation (the messages and their
images), sent as one ``generate`` call: a chat re-sends its history at every turn, an agent its last K screenshots.

Pages are ``docpage`` pages rendered at the model's size for a chosen number of visual tokens (``size``), so one
stream runs on any model. Everything is deterministic in the seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from PIL import Image, ImageOps

from vismemo_hf.eval import docpage


@dataclass
class StreamRequest:
    """One request of a stream: ``messages`` in the chat-template format (``{"type": "image"}`` placeholders, in the
    order of ``images``) and what it is (``label``: "turn 3, new page", "step 5", "exact repeat", ...)."""

    messages: list[dict]
    images: list[Image.Image]
    label: str


@dataclass
class Screen:
    """A GUI screen's state: the page under it, its highlighted rows and its selected (inverted) row."""

    page: docpage.DocPage
    highlighted: frozenset[int] = frozenset()
    selected: int | None = None
    changes: list[str] = field(default_factory=list)

    def render(self, size: tuple[int, int]) -> Image.Image:
        img = docpage.render(self.page)
        for row in sorted(self.highlighted):
            img = paint_row(img, self.page, row, highlight)
        if self.selected is not None:
            img = paint_row(img, self.page, self.selected, ImageOps.invert)
        return img if img.size == size else img.resize(size, Image.Resampling.BICUBIC)


def highlight(band: Image.Image) -> Image.Image:
    """A highlighted row: the band blended with a marker's yellow."""
    return Image.blend(band, Image.new("RGB", band.size, (250, 220, 60)), 0.35)


def paint_row(img: Image.Image, page: docpage.DocPage, row: int, paint: Callable[[Image.Image], Image.Image]):
    """``img`` with the band of record ``row`` (its line across the record block) repainted by ``paint``
    (``highlight``, or ``ImageOps.invert`` for a selected row)."""
    top = page.y0 + row * page.pitch + page.offset[1] - 4
    box = (max(0, page.x0 - 8 + page.offset[0]), max(0, top), min(page.side, page.side - 16),
           min(page.side, top + page.pitch))
    if box[3] <= box[1] or box[2] <= box[0]:
        return img
    out = img.copy()
    out.paste(paint(img.crop(box)), box[:2])
    return out


#: the GUI changes between an agent's screenshots, in turn
SCREEN_CHANGES = ("type", "highlight", "popup", "select", "scroll", "toggle")


def next_screen(screen: Screen, change: str, rng: random.Random) -> Screen:
    """``screen`` after one small change: text typed into a field, a row highlighted or selected, a popup, a list
    scrolled by a row, a switch toggled (ui pages)."""
    page, rows = screen.page, screen.page.n_rows
    if change == "type":
        page = docpage.edit_char(page, rng.randrange(rows), 0, rng)
        screen = replace(screen, page=replace(page, popup=None))
    elif change == "highlight":
        screen = replace(screen, highlighted=frozenset({rng.randrange(rows)}))
    elif change == "popup":
        screen = replace(screen, page=docpage.popup(page, rng))
    elif change == "select":
        screen = replace(screen, selected=rng.randrange(rows), page=replace(page, popup=None))
    elif change == "scroll":
        screen = replace(screen, page=docpage.scroll(page, page.pitch))
    elif change == "toggle" and page.layout == "ui":
        screen = replace(screen, page=docpage.toggle(page, rng.randrange(rows)))
    else:
        raise ValueError(f"unknown screen change {change!r}; known: {SCREEN_CHANGES}")
    return replace(screen, changes=[*screen.changes, change])


def _user(*parts) -> dict:
    content = []
    for part in parts:
        content.append({"type": "image"} if isinstance(part, Image.Image) else {"type": "text", "text": part})
    return {"role": "user", "content": content}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def _images(parts: list) -> list[Image.Image]:
    return [p for p in parts if isinstance(p, Image.Image)]


def chat(size: tuple[int, int], seed: int = 0, turns: int = 7) -> list[StreamRequest]:
    """A multi-turn chat about documents, history append-only: a first page and a question, follow-ups about it, a
    second page of another layout, a third page of the first page's layout (a new page of a known template), and
    follow-ups about earlier pages. Every request is the whole conversation so far; the assistant's earlier answers
    are the true answers."""
    rng = random.Random(seed)
    first = docpage.random_page(seed * 7 + 1, layout="form")
    pages = [first, docpage.random_page(seed * 7 + 2, layout="table"), replace(
        docpage.random_page(seed * 7 + 3, layout="form"), x0=first.x0, y0=first.y0, pitch=first.pitch,
        col_x=first.col_x, title=first.title, font=first.font, font_size=first.font_size)]
    images = [docpage.render(p).resize(size, Image.Resampling.BICUBIC) for p in pages]
    # (page index, new page?) of each turn
    plan = [(0, True), (0, False), (1, True), (0, False), (2, True), (1, False), (2, False), (0, False)][:turns]
    history: list[dict] = []
    parts_so_far: list = []
    out = []
    for t, (p, new) in enumerate(plan):
        q = docpage.random_question(rng, pages[p], instruct=0.0)
        parts = ([images[p], f"Page {p + 1}. {q.text}"] if new else [f"About page {p + 1}: {q.text}"])
        history.append(_user(*parts))
        parts_so_far.extend(parts)
        out.append(StreamRequest([dict(m) for m in history], _images(parts_so_far),
                                 f"turn {t + 1}" + (", new page" if new else f", page {p + 1} again")))
        history.append(_assistant(q.answer))
    return out


def agent(size: tuple[int, int], keep: int, seed: int = 0, steps: int = 8) -> list[StreamRequest]:
    """A GUI agent's loop: at each step the task, the last ``keep`` screenshots each followed by the action taken on
    it, and a request for the next action. Each screenshot is a small change of the one before (``SCREEN_CHANGES``
    in turn: typed text, a highlighted row, a popup, a selected row, a scrolled list, a switch)."""
    rng = random.Random(seed)
    screen = Screen(docpage.random_page(seed * 11 + 5, layout="ui"))
    screens = [screen]
    for s in range(1, steps):
        screen = next_screen(screen, SCREEN_CHANGES[(s - 1) % len(SCREEN_CHANGES)], rng)
        screens.append(screen)
    images = [s.render(size) for s in screens]
    task = "Task: fill in the settings form and save it."
    out = []
    for step in range(steps):
        window = range(max(0, step - keep + 1), step + 1)
        parts: list = [task]
        for i in window:
            parts.append(images[i])
            parts.append(f"Action {i + 1}: " + ("click the next field." if i < step else "What is the next action?"))
        out.append(StreamRequest([_user(*parts)], [images[i] for i in window], f"step {step + 1}"))
    return out


#: VisionArena's mix of single-image requests (the paper): exact repeats, near-duplicates and new images
MIX = (("exact", 0.27), ("approximate", 0.33), ("new", 0.40))


def mixed(size: tuple[int, int], seed: int = 0, n: int = 15) -> list[StreamRequest]:
    """Single-image requests in ``MIX``'s proportions: a new page, a repeat of an earlier image, or a near-duplicate
    of one (an edited value, a popup, a toggled switch, a scrolled or rescanned copy), each with a question about
    it. The first request is new; the others are drawn in a shuffled order of the exact counts."""
    rng = random.Random(seed)
    counts = {kind: round(share * n) for kind, share in MIX}
    counts["new"] = n - counts["exact"] - counts["approximate"]
    kinds = [k for k, c in counts.items() for _ in range(c)]
    kinds.remove("new")
    rng.shuffle(kinds)
    kinds = ["new"] + kinds
    seen: list[docpage.DocPage] = []
    out = []
    changes = ("edit", "popup", "scroll", "rescan", "toggle")
    for i, kind in enumerate(kinds):
        if kind == "new" or not seen:
            page = docpage.random_page(seed * 1_000 + i, layout=docpage.LAYOUTS[i % len(docpage.LAYOUTS)])
            label = "new page"
        elif kind == "exact":
            page = rng.choice(seen)
            label = "repeated image"
        else:
            base = rng.choice(seen)
            change = changes[i % len(changes)]
            if change == "toggle" and base.layout != "ui":
                change = "edit"
            page = _near_duplicate(base, change, rng)
            label = f"near-duplicate ({change})"
        seen.append(page)
        q = docpage.random_question(rng, page, instruct=0.0)
        image = docpage.render(page).resize(size, Image.Resampling.BICUBIC)
        out.append(StreamRequest([_user(image, q.text)], [image], label))
    return out


def _near_duplicate(base: docpage.DocPage, change: str, rng: random.Random) -> docpage.DocPage:
    if change == "edit":
        return docpage.edit_cells(base, [(rng.randrange(base.n_rows), 0)], rng)
    if change == "popup":
        return docpage.popup(base, rng)
    if change == "scroll":
        return docpage.scroll(base, 14)
    if change == "rescan":
        return docpage.rescan(base, rng)
    return docpage.toggle(base, rng.randrange(base.n_rows))


def reader_stream(name: str, seed: int = 7200, bases: int = 6) -> list[StreamRequest]:
    """A reader's own stream (``docstream`` pages for the base reader, ``synthdoc`` forms for the tiny one)."""
    from vismemo_hf.eval.docqa import messages
    from vismemo_hf.eval.docstream import reader_pages

    _, build = reader_pages(name, "auto")
    return [StreamRequest(messages(r.question, r.prefix), [r.image()], r.variant) for r in build(seed, n_bases=bases)]


#: the streams ``vismemo bench workload`` runs on every model (``reader`` only on the readers)
STREAMS = ("chat", "agent-1", "agent-2", "agent-3", "mixed")


def build(stream: str, size: tuple[int, int], seed: int = 0) -> list[StreamRequest]:
    """The requests of ``stream`` (a name of ``STREAMS``) with pages of ``size`` px."""
    if stream == "chat":
        return chat(size, seed)
    if stream.startswith("agent-"):
        return agent(size, int(stream.split("-")[1]), seed)
    if stream == "mixed":
        return mixed(size, seed)
    raise ValueError(f"unknown stream {stream!r}; streams: {', '.join(STREAMS)}, reader")

"""Synthetic documents whose answers are known, for the doc-QA model and the quality streams.

A *form* page is a grid of 28x28 px cells (8 columns x 6 rows on a 224x168 page): each row
holds a 3-letter key, a blank cell and a 4-digit value, one glyph per cell, so every glyph
lives in exactly one visual token of a Qwen2-VL model (patch 14, merge 2). A reuse mistake
on the token of an answer glyph therefore shows in the answer. The keys of a page start with
different letters (like a form's distinct labels), so one glyph names a row.

Page types share that grid and differ in what is drawn around the glyphs (never over them):
``form`` (plain), ``table`` (ruled cells, like a bank statement), ``receipt`` (tinted paper,
dotted leaders), ``ui`` (a screen of status rows, each with a status light) and ``chart``
(a bar per row, its length following the value).

Everything is deterministic in its seed.
"""

from __future__ import annotations

import math
import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

from PIL import Image, ImageDraw, ImageEnhance, ImageFont

from vismemo_hf.progress import progress as progress_bar

CELL = 28
COLS, ROWS = 8, 6
KEY_LEN, VALUE_LEN, VALUE_COL = 3, 4, 4
PAGE_SIZE = (COLS * CELL, ROWS * CELL)
KEY_ALPHABET = string.ascii_uppercase
STYLES = ("form", "table", "receipt", "ui", "chart")


@dataclass(frozen=True)
class FormPage:
    """Rows of (key, value); unfilled rows are blank. ``shift`` moves every glyph by (dx, dy) px."""

    rows: tuple[tuple[str, str], ...]
    style: str = "form"
    lights: tuple[bool, ...] = ()  # ``ui`` pages: each row's status light (on / off)
    shift: tuple[int, int] = (0, 0)
    brightness: float = 1.0
    jpeg_quality: int | None = None
    noise: float = 0.0  # std of seeded Gaussian pixel noise (0-255 scale)
    rotation: float = 0.0  # degrees counter-clockwise about the page's centre (scanned askew)
    scale: float = 1.0  # zoom about the page's centre (rescanned at another scale)
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def answer(self, key: str) -> str:
        return dict(self.rows)[key]

    def cell_text(self) -> list[str]:
        """The glyph (or " ") of every cell, row-major: the visual tokens' reading."""
        cells = [" "] * (ROWS * COLS)
        for r, (key, value) in enumerate(self.rows):
            for c, ch in enumerate(key):
                cells[r * COLS + c] = ch
            for c, ch in enumerate(value):
                cells[r * COLS + VALUE_COL + c] = ch
        return cells


def random_form(seed: int, n_rows: int = ROWS, style: str = "form") -> FormPage:
    if style not in STYLES:
        raise ValueError(f"unknown page type {style!r}; known: {STYLES}")
    rng = random.Random(seed)
    firsts = rng.sample(KEY_ALPHABET, n_rows)
    keys = [f + "".join(rng.choice(KEY_ALPHABET) for _ in range(KEY_LEN - 1)) for f in firsts]
    rows = tuple((k, "".join(rng.choice(string.digits) for _ in range(VALUE_LEN))) for k in keys)
    lights = tuple(rng.random() < 0.5 for _ in rows) if style == "ui" else ()
    return FormPage(rows, style, lights)


_FONT: ImageFont.ImageFont | None = None


def _font():
    global _FONT
    if _FONT is None:
        _FONT = ImageFont.load_default(size=22)
    return _FONT


PAPER: dict[str, str | tuple[int, int, int]] = {"form": "white", "table": "white", "receipt": (250, 244, 228),
                                                 "ui": (232, 238, 246), "chart": "white"}


def _decorate(draw: ImageDraw.ImageDraw, page: FormPage) -> None:
    """What a page type draws besides the glyphs: on cell borders or in the blank column, moved with the page."""
    dx, dy = page.shift
    gap = (VALUE_COL - 1) * CELL + dx  # left edge of the blank cell between key and value
    right = PAGE_SIZE[0] - 1 + dx
    for r, (_, value) in enumerate(page.rows):
        top = r * CELL + dy
        if page.style == "table":
            grey = (150, 150, 150)
            draw.rectangle([dx, top, right, top + CELL - 1], outline=grey)
            draw.line([gap, top, gap, top + CELL - 1], fill=grey)
            draw.line([gap + CELL, top, gap + CELL, top + CELL - 1], fill=grey)
        elif page.style == "receipt":
            for x in range(gap + 3, gap + CELL - 2, 4):
                draw.point([(x, top + CELL // 2), (x + 1, top + CELL // 2)], fill=(90, 90, 90))
        elif page.style == "ui":
            draw.rounded_rectangle([dx + 1, top + 1, right - 1, top + CELL - 2], radius=6, outline=(120, 130, 150))
            on = page.lights[r] if r < len(page.lights) else False
            draw.ellipse([gap + 8, top + 8, gap + 19, top + 19], fill=(40, 170, 60) if on else (200, 50, 40))
        elif page.style == "chart" and value.strip():
            length = 3 + int(value[0]) * 2  # 3..21 px, inside the blank cell
            draw.rectangle([gap + 3, top + 9, gap + 3 + length, top + 18], fill=(70, 110, 200))


def render(page: FormPage) -> Image.Image:
    img = Image.new("RGB", PAGE_SIZE, PAPER[page.style])
    draw = ImageDraw.Draw(img)
    _decorate(draw, page)
    font = _font()
    dx, dy = page.shift
    for i, ch in enumerate(page.cell_text()):
        if ch == " ":
            continue
        r, c = divmod(i, COLS)
        left, top, right, bottom = font.getbbox(ch)
        x = c * CELL + (CELL - (right - left)) // 2 - left + dx
        y = r * CELL + (CELL - (bottom - top)) // 2 - top + dy
        draw.text((x, y), ch, fill="black", font=font)
    if page.rotation or page.scale != 1.0:
        img = turn_image(img, page.rotation, page.scale, PAPER[page.style])
    if page.brightness != 1.0:
        img = ImageEnhance.Brightness(img).enhance(page.brightness)
    if page.noise:
        import numpy as np

        pixels = np.asarray(img, dtype=np.float32)
        noisy = pixels + np.random.default_rng(hash(page.rows) & 0xFFFF).normal(0, page.noise, pixels.shape)
        img = Image.fromarray(noisy.clip(0, 255).astype(np.uint8))
    if page.jpeg_quality is not None:
        import io

        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=page.jpeg_quality)
        img = Image.open(buf).convert("RGB")
    return img


# -- variant operators: near-duplicates of a page ------------------------------------------------------
def edit_value(page: FormPage, row: int, rng: random.Random) -> FormPage:
    """One value changed (every digit different, so a stale answer is wrong in every place)."""
    key, value = page.rows[row]
    new = "".join(rng.choice([d for d in string.digits if d != old]) for old in value)
    rows = list(page.rows)
    rows[row] = (key, new)
    return replace(page, rows=tuple(rows))


def toggle_light(page: FormPage, row: int) -> FormPage:
    """A changed widget (``ui`` pages): one status light switched; no glyph changes."""
    if page.style != "ui":
        raise ValueError("only ui pages have status lights")
    lights = list(page.lights)
    lights[row] = not lights[row]
    return replace(page, lights=tuple(lights))


def shift(page: FormPage, dx: int, dy: int = 0) -> FormPage:
    return replace(page, shift=(page.shift[0] + dx, page.shift[1] + dy))


def reencode(page: FormPage, quality: int = 70) -> FormPage:
    return replace(page, jpeg_quality=quality)


def brighten(page: FormPage, factor: float = 0.9) -> FormPage:
    return replace(page, brightness=factor)


def edit_key(page: FormPage, row: int, rng: random.Random) -> FormPage:
    """One key renamed (its first letter kept, so the page's keys still start with different letters)."""
    key, value = page.rows[row]
    new = key[0] + "".join(rng.choice([c for c in KEY_ALPHABET if c != old]) for old in key[1:])
    rows = list(page.rows)
    rows[row] = (new, value)
    return replace(page, rows=tuple(rows))


def edit_key_char(page: FormPage, row: int, rng: random.Random) -> FormPage:
    """One letter of one key changed, not its first (the page's keys keep distinct first letters)."""
    key, value = page.rows[row]
    at = rng.randrange(1, len(key))
    rows = list(page.rows)
    rows[row] = (key[:at] + rng.choice([c for c in KEY_ALPHABET if c != key[at]]) + key[at + 1:], value)
    return replace(page, rows=tuple(rows))


def swap_rows(page: FormPage, a: int, b: int) -> FormPage:
    """Two rows trade places: every glyph of both rows moves."""
    rows, lights = list(page.rows), list(page.lights)
    rows[a], rows[b] = rows[b], rows[a]
    if lights:
        lights[a], lights[b] = lights[b], lights[a]
    return replace(page, rows=tuple(rows), lights=tuple(lights))


def noisy(page: FormPage, std: float = 6.0) -> FormPage:
    return replace(page, noise=std)


def edit_digit(page: FormPage, row: int, rng: random.Random) -> FormPage:
    """One digit of one value changed: an edit of one visual token, the value's other three unchanged."""
    key, value = page.rows[row]
    at = rng.randrange(len(value))
    rows = list(page.rows)
    rows[row] = (key, value[:at] + rng.choice([d for d in string.digits if d != value[at]]) + value[at + 1:])
    return replace(page, rows=tuple(rows))


def rotate(page: FormPage, degrees: float) -> FormPage:
    return replace(page, rotation=page.rotation + degrees)


def rescale(page: FormPage, factor: float) -> FormPage:
    return replace(page, scale=page.scale * factor)


def insert_row(page: FormPage, at: int, rng: random.Random) -> FormPage:
    """A new row inserted before row ``at`` of a page with room for it: the rows from there on move down a row.
    Its key starts with a letter no other key starts with."""
    if len(page.rows) >= ROWS:
        raise ValueError(f"a page holds at most {ROWS} rows")
    firsts = {k[0] for k, _ in page.rows}
    key = rng.choice([c for c in KEY_ALPHABET if c not in firsts]) + "".join(
        rng.choice(KEY_ALPHABET) for _ in range(KEY_LEN - 1))
    value = "".join(rng.choice(string.digits) for _ in range(VALUE_LEN))
    lights = page.lights[:at] + (rng.random() < 0.5,) + page.lights[at:] if page.lights else ()
    return replace(page, rows=page.rows[:at] + ((key, value),) + page.rows[at:], lights=lights)


def erase_value(page: FormPage, row: int) -> FormPage:
    """The value of ``row`` erased (a blank cell); its key stays."""
    rows = list(page.rows)
    rows[row] = (rows[row][0], " " * VALUE_LEN)
    return replace(page, rows=tuple(rows))


# -- request streams -------------------------------------------------------------------------------------
#: the kind of page a stream row is on (covariant: a row's page is only read, so any row is a ``BaseRequest[object]``)
PageT = TypeVar("PageT", covariant=True)


@dataclass
class BaseRequest(Generic[PageT]):
    """One row of a stream: a page, a question and its answers, and the hit kind it is meant to produce. The page's
    kind gives ``image`` and ``answer_tokens``: ``Request`` (a ``FormPage``), ``docstream.PageRequest`` (a
    ``docpage.DocPage``)."""

    id: str
    page: PageT
    question: str
    answers: list[str]
    intended: str  # "miss", "exact" or "approximate"
    variant: str  # how the page came about
    about_edit: bool = False  # the question asks for the value that changed
    stale: str | None = None  # for such questions: the value before the edit (what naive reuse may answer)
    prefix: str = ""  # text before the image (another prefix on a seen page: an exact hit at another offset)

    def image(self) -> Image.Image:
        raise NotImplementedError

    def answer_tokens(self) -> list[int]:
        """The visual tokens that hold the asked value."""
        raise NotImplementedError


@dataclass
class Request(BaseRequest[FormPage]):
    """A stream row on a ``FormPage``."""

    def image(self) -> Image.Image:
        return render(self.page)

    def answer_tokens(self) -> list[int]:
        """The visual tokens that hold the asked value (one token per glyph)."""
        row = [k for k, _ in self.page.rows].index(self.question.rstrip("?"))
        return [row * COLS + VALUE_COL + j for j in range(VALUE_LEN)]


def question_for(key: str) -> str:
    return f"{key}?"


PREFIXES = ("Scan 2.", "Page 7:", "Doc A.", "See:", "Fax 41.")
VARIANTS = ("same", "edit_asked", "edit_other", "shift", "reencode", "prefix", "widget")


def stream(seed: int, n_bases: int = 20, variants_per_base: int = 4) -> list[Request]:
    """A trace: each base page (a miss; page types in turn), then in mixed order its follow-ups: the same
    page with another question or another text before the image (exact), an edited value asked about
    (approximate, naive reuse must fail) or another value, a shifted copy, a re-encoded or brightened copy,
    a switched status light on ui pages (approximate)."""
    rng = random.Random(seed)
    out: list[Request] = []
    pending: list[Request] = []
    for b in range(n_bases):
        base = random_form(seed * 100_003 + b, style=STYLES[b % len(STYLES)])
        r0 = rng.randrange(ROWS)
        key0 = base.rows[r0][0]
        out.append(Request(f"s{seed}b{b}", base, question_for(key0), [base.answer(key0)], "miss", f"base-{base.style}"))
        follow = []
        for v in range(variants_per_base):
            kind = VARIANTS[(v + b) % len(VARIANTS)]
            if kind == "widget" and base.style != "ui":
                kind = "shift"
            row = rng.randrange(ROWS)
            page, about, prefix = base, False, ""
            if kind in ("same", "prefix"):
                row = (r0 + 1 + rng.randrange(ROWS - 1)) % ROWS
                prefix = rng.choice(PREFIXES) if kind == "prefix" else ""
            elif kind == "widget":
                page = toggle_light(base, rng.randrange(ROWS))
            elif kind.startswith("edit"):
                edited_row = rng.randrange(ROWS)
                page = edit_value(base, edited_row, rng)
                about = kind == "edit_asked"
                row = edited_row if about else (edited_row + 1 + rng.randrange(ROWS - 1)) % ROWS
            elif kind == "shift":
                page = shift(base, rng.choice([-3, -2, 2, 3]), rng.choice([-1, 0, 1]))
            else:
                page = reencode(base) if rng.random() < 0.5 else brighten(base, 0.9)
            key = page.rows[row][0]
            follow.append(Request(f"s{seed}b{b}v{v}", page, question_for(key), [page.answer(key)],
                                  "exact" if kind in ("same", "prefix") else "approximate", kind, about,
                                  base.answer(key) if about else None, prefix))
        pending.extend(follow)
        rng.shuffle(pending)
        # release part of the pending follow-ups: reuse intervals vary
        release = pending[: rng.randrange(len(pending) + 1)]
        pending = pending[len(release):]
        out.extend(release)
    out.extend(pending)
    return out


PERTURBATIONS = ("edit_two", "edit_key", "swap_rows", "edit_shift", "noise", "dim", "shift_one")


def perturbation_stream(seed: int, n_bases: int = 20, variants_per_base: int = 3) -> list[Request]:
    """Approximate follow-ups of kinds that ``stream`` never makes, to check routing beyond the variants it
    was designed on: two values edited (one asked), a renamed key asked, two rows swapped (one asked),
    an edited value on a page shifted by one pixel, pixel noise, a dimmed page, a one-pixel shift.
    Each base page comes first (a miss), its follow-ups right after it."""
    rng = random.Random(seed)
    out: list[Request] = []
    for b in range(n_bases):
        base = random_form(seed * 100_003 + b, style=STYLES[b % len(STYLES)])
        r0 = rng.randrange(ROWS)
        key0 = base.rows[r0][0]
        out.append(Request(f"p{seed}b{b}", base, question_for(key0), [base.answer(key0)], "miss", f"base-{base.style}"))
        for v in range(variants_per_base):
            kind = PERTURBATIONS[(v + b * variants_per_base) % len(PERTURBATIONS)]
            row = rng.randrange(ROWS)
            page, about = base, False
            if kind == "edit_two":
                other = (row + 1 + rng.randrange(ROWS - 1)) % ROWS
                page, about = edit_value(edit_value(base, row, rng), other, rng), True
            elif kind == "edit_key":
                page, about = edit_key(base, row, rng), False
            elif kind == "swap_rows":
                page = swap_rows(base, row, (row + 1 + rng.randrange(ROWS - 1)) % ROWS)
            elif kind == "edit_shift":
                page, about = shift(edit_value(base, row, rng), rng.choice([-1, 1])), True
            elif kind == "noise":
                page = noisy(base)
            elif kind == "dim":
                page = brighten(base, 0.75)
            else:
                page = shift(base, rng.choice([-1, 1]), rng.choice([-1, 0, 1]))
            key = page.rows[row][0]
            stale = base.answer(base.rows[row][0]) if about else None
            out.append(Request(f"p{seed}b{b}v{v}", page, question_for(key), [page.answer(key)], "approximate",
                               kind, about, stale))
    return out


# -- streams of real pages (DocVQA / InfographicVQA) -------------------------------------------------------
def shift_image(image: Image.Image, dx: int, dy: int = 0) -> Image.Image:
    """The same page moved by a few pixels, uncovered border filled white."""
    canvas = Image.new("RGB", image.size, "white")
    canvas.paste(image.convert("RGB"), (dx, dy))
    return canvas


def reencode_image(image: Image.Image, quality: int = 70) -> Image.Image:
    import io

    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="JPEG", quality=quality)
    return Image.open(buf).convert("RGB")


def brighten_image(image: Image.Image, factor: float = 0.9) -> Image.Image:
    return ImageEnhance.Brightness(image.convert("RGB")).enhance(factor)


def turn_image(image: Image.Image, degrees: float, scale: float = 1.0, fill="white") -> Image.Image:
    """``image`` turned by ``degrees`` counter-clockwise and zoomed by ``scale`` about its centre, uncovered corners
    filled with ``fill`` (bicubic, like a scanner's deskew)."""
    cx, cy = image.size[0] / 2, image.size[1] / 2
    a = math.radians(degrees)
    cos, sin = math.cos(a) / scale, math.sin(a) / scale  # the inverse map: output pixel -> source pixel
    matrix = (cos, -sin, cx - cx * cos + cy * sin, sin, cos, cy - cx * sin - cy * cos)
    return image.convert("RGB").transform(image.size, Image.Transform.AFFINE, matrix, resample=Image.Resampling.BICUBIC,
                                             fillcolor=fill)


#: near-duplicate copies every real page gets (each keeps the page's answers)
COPIES = ("shift", "reencode", "brighten")


def page_stream(pages, seed: int = 0, near: dict | None = None) -> list[dict]:
    """Rows of a stream over real pages. ``pages``: iterable of (page id, image, [(question, answers), ...]).

    Per page: its first question (a miss), another question on the same image (an exact hit; the first one
    again when the page has one question), and three near-duplicate copies (shifted by a few pixels,
    re-encoded as JPEG, brightened), each asking one of the page's questions in turn (approximate hits).
    ``near``: {page id: id of an earlier page it is a natural near-duplicate of} (``near_duplicates``): such a
    page comes right after that page and is marked ``variant="natural"``, ``intended="approximate"``.
    Follow-ups are released in a shuffled order, interleaved with later pages."""
    rng = random.Random(seed)
    near = near or {}
    pages = list(pages)
    order = [p for p in pages if p[0] not in near]
    for page in pages:  # natural near-duplicates right after the page they resemble
        if page[0] in near:
            at = next((i for i, p in enumerate(order) if p[0] == near[page[0]]), len(order) - 1)
            order.insert(at + 1, page)
    rows, pending = [], []

    def row(page_id, j, question, answers, intended, variant, image):
        return dict(id=f"{page_id}/{j}", question=question, answers=list(answers), intended=intended,
                    variant=variant, about_edit=False, stale="", prefix="", image=image)

    for page_id, image, qas in progress_bar(order, desc="build-stream: pages", unit="page"):
        image = image.convert("RGB")
        natural = page_id in near
        q0, a0 = qas[0]
        rows.append(row(page_id, 0, q0, a0, "approximate" if natural else "miss", "natural" if natural else "base",
                        image))
        q1, a1 = qas[1 % len(qas)]
        pending.append(row(page_id, 1, q1, a1, "exact", "same", image))
        for j, variant in enumerate(COPIES, 2):
            q, a = qas[j % len(qas)]
            if variant == "shift":
                img = shift_image(image, rng.choice([-3, -2, 2, 3]), rng.choice([-2, 0, 2]))
            elif variant == "reencode":
                img = reencode_image(image)
            else:
                img = brighten_image(image, rng.choice([0.85, 0.9, 1.1]))
            pending.append(row(page_id, j, q, a, "approximate", variant, img))
        rng.shuffle(pending)
        cut = rng.randrange(len(pending) + 1)
        rows.extend(pending[:cut])
        pending = pending[cut:]
    return rows + pending


def near_duplicates(images: dict, model, processor, thresholds=None) -> dict:
    """{page id: earlier page id} for pages that pass the lookup's own rule against an earlier page (same grid,
    every centred regional cosine > tau, the fine rule ``LookupThresholds.matches``: fine score (``fine_score``) >=
    the model's tau_fine, or the pixel stage's aligned thumbnails)."""
    import functools

    import torch

    from vismemo_hf.core.features import region_descriptors, thumb_per_token, thumbnail, token_grid
    from vismemo_hf.core.thresholds import LookupThresholds, aligned_similarity, fine_score, regional_cosines
    from vismemo_hf.families import ModelAdapter
    from vismemo_hf.runtime.reference import model_reference

    adapter = ModelAdapter.for_model(model)
    thresholds = thresholds or LookupThresholds()
    with torch.no_grad():
        reference = model_reference(adapter, adapter.base.get_image_features)
    thresholds = thresholds.for_model(reference)
    tau_fine = thresholds.tau_fine
    seen: list[tuple[object, tuple[int, int, int], torch.Tensor, torch.Tensor, Callable[[], torch.Tensor]]] = []
    out = {}
    for page_id, image in progress_bar(images.items(), desc="build-stream: near-duplicates", unit="page"):
        inputs = processor.image_processor(images=[image.convert("RGB")], return_tensors="pt")
        frames, height, width = (int(x) for x in inputs["image_grid_thw"][0])
        grid = (frames, height, width)
        with torch.no_grad():
            (embeds, _), = adapter.encode(adapter.base.get_image_features, inputs["pixel_values"].to(model.dtype),
                                          inputs["image_grid_thw"])
        desc = region_descriptors(embeds, grid, adapter.merge)
        thumb = functools.cache(lambda x=inputs["pixel_values"], g=grid: thumbnail(x, g, **adapter.entropy_kwargs()))
        per = thumb_per_token(token_grid(grid, adapter.merge)[1:])  # thumbnails only when the pixel stage asks
        for other_id, other_grid, other_desc, other_embeds, other_thumb in seen:
            if other_grid != grid:
                continue
            if bool((regional_cosines(desc, other_desc, reference.descriptor_mean) > thresholds.tau).all()) and \
                    thresholds.matches(fine_score(embeds, other_embeds, grid, adapter.merge, reference.token_mean)[0],
                                       tau_fine, lambda o=other_thumb, t=thumb, p=per: aligned_similarity(t(), o(), p)[0]):
                out[page_id] = other_id
                break
        seen.append((page_id, grid, desc, embeds, thumb))
    return out


def request_rows(requests: list[Request]) -> list[dict]:
    return [dict(id=r.id, question=r.question, answers=r.answers, intended=r.intended, variant=r.variant,
                 about_edit=r.about_edit, stale=r.stale or "", prefix=r.prefix, image=render(r.page))
            for r in progress_bar(requests, desc="build-stream: rendering", unit="request")]


def save_rows(rows: list[dict], path) -> str:
    """Write stream rows (with a PIL ``image``) as parquet with ``datasets``; returns the path."""
    from pathlib import Path

    import datasets

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    features = datasets.Features({
        "id": datasets.Value("string"), "question": datasets.Value("string"),
        "answers": datasets.Sequence(datasets.Value("string")), "intended": datasets.Value("string"),
        "variant": datasets.Value("string"), "about_edit": datasets.Value("bool"), "stale": datasets.Value("string"),
        "prefix": datasets.Value("string"),
        "image": datasets.Image(),
    })
    datasets.Dataset.from_list(rows, features=features).to_parquet(str(path))
    return str(path)

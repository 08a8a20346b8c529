"""Realistic synthetic pages for ``vismemo-docqa-base``: 448 x 448 px (256 visual tokens of 28 px), most of them
background (margins, header bands, logos, photos, textures, rules, running text), with small text in two fonts:
each glyph of a record sits in a 14 px cell (one ViT patch), two per visual token, and words run across token
borders. Training jitters pages by a few pixels, and near-duplicates shift them further, so glyphs also straddle
patch and token borders.

A page holds a block of *records*: rows with a key (3 letters, distinct first letters on a page) and one value
per column (4 digits, distinct on a page); ``table`` and ``invoice`` pages name their columns in a header row.
Questions need several tokens: key -> value (``"KEY?"``), row and column -> cell (``"KEY COL?"``) and value ->
key (``"=VALUE?"``). On pages with several columns an *instruction* before the image (``"Use COL."``) chooses
the column of a ``"KEY?"`` question, so what the image's tokens should hold depends on the text before it.

Everything is deterministic in the page's fields (textures draw from ``seed``). ``layout`` records where every
glyph of every cell landed, which gives training its per-token targets and the quality reports the tokens an
answer lives in.
"""

from __future__ import annotations

import io
import math
import random
import string
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageEnhance, ImageFont

from vismemo_hf.eval.synthdoc import turn_image

SIZE = 448  # px per side of a page: 16 x 16 visual tokens
TOKEN = 28  # px per visual token (patch 14, merge 2)
LAYOUTS = ("form", "table", "receipt", "ui", "invoice")
FONTS = ("sans", "mono")
FONT_SIZES = {"sans": (12, 14), "mono": (12, 14)}
GLYPH = 14  # px: the cell of one record glyph (a ViT patch); two glyphs per visual token
KEY_LEN, VALUE_LEN = 3, 4
LETTERS, DIGITS = string.ascii_uppercase, string.digits
#: every glyph a cell may hold, in a fixed order (training's class ids are 1 + index; 0 is "none")
GLYPHS = LETTERS + DIGITS
SLOTS = 4  # glyph cells per token in the per-token reading targets (its 2 x 2 patches)


@cache
def font(name: str, size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """Two fonts that ship with the package or Pillow, so every machine renders the same pages: Pillow's FreeType
    sans (``sans``) and DejaVu Sans Mono (``mono``, ``fonts/``, Bitstream Vera licence)."""
    if name == "mono":
        return ImageFont.truetype(str(Path(__file__).resolve().parent / "fonts" / "DejaVuSansMono.ttf"), size)
    return ImageFont.load_default(size=size)


@dataclass(frozen=True)
class DocPage:
    """One page. ``values[r][c]``: row r's value in column c; ``columns``: the column names ("" for one
    unnamed column). Geometry (``x0``, ``y0``, ``pitch``, ``col_x``) places the record block; the other fields
    are what near-duplicates change."""

    seed: int
    layout: str
    keys: tuple[str, ...]
    columns: tuple[str, ...]
    values: tuple[tuple[str, ...], ...]
    font: str = "sans"
    font_size: int = 14
    side: int = SIZE  # px (square pages; training also draws small ones)
    x0: int = 40
    y0: int = 120
    pitch: int = 32
    col_x: tuple[int, ...] = (120,)
    title: str = "REPORT"
    lights: tuple[bool, ...] = ()  # ui pages: each row's toggle
    popup: tuple[int, int, int, int] | None = None  # (x, y, w, h) of a dialog drawn over the page
    offset: tuple[int, int] = (0, 0)  # everything moved by (dx, dy) px (scrolled / shifted pages)
    crop: tuple[int, int, int, int] | None = None  # (left, top, right, bottom) px kept, rescaled to the page
    rotation: float = 0.0  # degrees counter-clockwise about the page's centre (a page scanned askew)
    scale: float = 1.0  # zoom about the page's centre (a rescan at another scale; > 1 enlarges)
    brightness: float = 1.0
    jpeg_quality: int | None = None
    noise: float = 0.0
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def n_rows(self) -> int:
        return len(self.keys)

    @property
    def grid(self) -> int:
        """Visual tokens per side."""
        return self.side // TOKEN

    @property
    def n_tokens(self) -> int:
        return self.grid**2

    def cell(self, row: int, column: int) -> str:
        return self.values[row][column]


def random_page(seed: int, layout: str | None = None, n_rows: int | None = None, font_name: str | None = None,
                side: int = SIZE) -> DocPage:
    """A page of ``layout`` (else a random one) with ``n_rows`` records (else 3-8; small pages 2-4)."""
    rng = random.Random(seed)
    layout = layout or rng.choice(LAYOUTS)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {LAYOUTS}")
    if side % TOKEN or side < 4 * TOKEN:
        raise ValueError(f"page side must be a multiple of {TOKEN} px, at least {4 * TOKEN}")
    if side < SIZE:
        return _small_page(rng, seed, layout, n_rows or rng.randint(2, 4), font_name, side)
    n_rows = n_rows or rng.randint(3, 8)
    n_cols = rng.randint(2, 3) if layout in ("table", "invoice") else 1
    firsts = rng.sample(LETTERS, n_rows)
    keys = tuple(f + "".join(rng.choice(LETTERS) for _ in range(KEY_LEN - 1)) for f in firsts)
    seen: set[str] = set()
    values = []
    for _ in range(n_rows):
        row = []
        for _ in range(n_cols):
            v = _fresh_value(rng, seen)
            row.append(v)
        values.append(tuple(row))
    columns = tuple(_column_names(rng, n_cols)) if n_cols > 1 else ("",)
    fname = font_name or rng.choice(FONTS)
    font_size = rng.randint(*FONT_SIZES[fname])
    pitch = GLYPH * rng.choice([2, 2, 3])
    top = _cells(rng, 78, 130) if layout != "receipt" else _cells(rng, 56, 98)
    header = pitch if n_cols > 1 else 0
    top = min(top, (SIZE - 24 - header - n_rows * pitch) // GLYPH * GLYPH)
    x0 = {"receipt": _cells(rng, 126, 154), "ui": _cells(rng, 56, 84)}.get(layout, _cells(rng, 28, 70))
    col_x: tuple[int, ...]
    if n_cols == 1:
        col_x = (x0 + (_cells(rng, 70, 126) if layout != "receipt" else _cells(rng, 84, 98)),)
    else:
        first, step = x0 + _cells(rng, 70, 98), _cells(rng, 84, 98)
        col_x = tuple(first + i * step for i in range(n_cols))
    lights = tuple(rng.random() < 0.5 for _ in range(n_rows)) if layout == "ui" else ()
    title = "".join(rng.choice(LETTERS) for _ in range(rng.randint(4, 8)))
    return DocPage(seed, layout, keys, columns, tuple(values), fname, font_size, SIZE, x0, top + header, pitch, col_x,
                   title, lights)


def _small_page(rng: random.Random, seed: int, layout: str, n_rows: int, font_name: str | None, side: int) -> DocPage:
    """A page of ``side`` px with a compact record block (training's cheaper first pages; same fonts and cells)."""
    n_cols = 2 if layout in ("table", "invoice") else 1
    firsts = rng.sample(LETTERS, n_rows)
    keys = tuple(f + "".join(rng.choice(LETTERS) for _ in range(KEY_LEN - 1)) for f in firsts)
    seen: set[str] = set()
    values = tuple(tuple(_fresh_value(rng, seen) for _ in range(n_cols)) for _ in range(n_rows))
    columns = tuple(_column_names(rng, n_cols)) if n_cols > 1 else ("",)
    pitch = 2 * GLYPH
    header = pitch if n_cols > 1 else 0
    x0 = _cells(rng, 14, 28)
    col_x = tuple(x0 + 56 + i * 84 for i in range(n_cols))
    y0 = _cells(rng, 42, max(42, side - 28 - n_rows * pitch)) + header
    lights = tuple(rng.random() < 0.5 for _ in range(n_rows)) if layout == "ui" else ()
    title = "".join(rng.choice(LETTERS) for _ in range(rng.randint(4, 6)))
    fname = font_name or rng.choice(FONTS)
    return DocPage(seed, layout, keys, columns, values, fname, rng.randint(*FONT_SIZES[fname]), side, x0, y0, pitch,
                   col_x, title, lights)


def _cells(rng: random.Random, lo: int, hi: int) -> int:
    """A random multiple of ``GLYPH`` px in [lo, hi] (record text sits on the glyph grid)."""
    return GLYPH * rng.randint(-(-lo // GLYPH), max(-(-lo // GLYPH), hi // GLYPH))


def _fresh_value(rng: random.Random, seen: set[str]) -> str:
    while True:
        v = "".join(rng.choice(DIGITS) for _ in range(VALUE_LEN))
        if v not in seen:
            seen.add(v)
            return v


def _column_names(rng: random.Random, n: int) -> list[str]:
    names: set[str] = set()
    while len(names) < n:
        names.add(rng.choice(LETTERS) + rng.choice(DIGITS))
    return sorted(names)


# -- where the glyphs go -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Glyph:
    char: str
    cx: float  # centre, page px (after offset, before crop)
    cy: float


@dataclass(frozen=True)
class Text:
    """A string drawn on the page: its glyphs and what it is (``kind``: key, value, column or other)."""

    text: str
    x: int
    y: int
    kind: str
    row: int = -1
    column: int = -1
    size: int = 11

    def glyphs(self, fname: str) -> list[Glyph]:
        """Each glyph centred in its cell: the i-th at ``x + GLYPH * i``."""
        half = GLYPH / 2
        return [Glyph(ch, self.x + GLYPH * i + half, self.y + half) for i, ch in enumerate(self.text) if ch != " "]

    def draw(self, draw, fname: str, fill) -> None:
        f = font(fname, self.size)
        for i, ch in enumerate(self.text):
            left, top, right, bottom = f.getbbox(ch)
            x = self.x + GLYPH * i + (GLYPH - (right - left)) / 2 - left
            y = self.y + (GLYPH - (bottom - top)) / 2 - top
            draw.text((x, y), ch, fill=fill, font=f)


def cell_texts(page: DocPage) -> list[Text]:
    """The record block: keys, values and column names, placed by the page's geometry and ``offset``."""
    dx, dy = page.offset
    out = []
    if len(page.columns) > 1:
        for c, name in enumerate(page.columns):
            out.append(Text(name, page.col_x[c] + dx, page.y0 - page.pitch + dy, "column", -1, c, page.font_size))
    for r, key in enumerate(page.keys):
        y = page.y0 + r * page.pitch + dy
        out.append(Text(key, page.x0 + dx, y, "key", r, -1, page.font_size))
        for c, value in enumerate(page.values[r]):
            out.append(Text(value, page.col_x[c] + dx, y, "value", r, c, page.font_size))
    return out


def image_point(page: DocPage, x: float, y: float) -> tuple[float, float]:
    """Where page point (x, y) lands in the rendered image (``crop`` rescales, then ``rotation`` and ``scale`` turn
    and zoom about the centre)."""
    if page.crop is not None:
        left, top, right, bottom = page.crop
        x, y = (x - left) * page.side / (right - left), (y - top) * page.side / (bottom - top)
    if page.rotation or page.scale != 1.0:
        c = page.side / 2
        a = math.radians(page.rotation)
        dx, dy = x - c, y - c  # image y grows downwards: a counter-clockwise turn
        x = c + page.scale * (dx * math.cos(a) + dy * math.sin(a))
        y = c + page.scale * (-dx * math.sin(a) + dy * math.cos(a))
    return x, y


def token_of(page: DocPage, x: float, y: float) -> int | None:
    """Visual token (row-major over the page's token grid) that page point (x, y) falls in, after ``crop``."""
    x, y = image_point(page, x, y)
    if not (0 <= x < page.side and 0 <= y < page.side):
        return None
    return int(y // TOKEN) * page.grid + int(x // TOKEN)


def text_tokens(page: DocPage, text: Text) -> list[int]:
    """The visual tokens holding the glyph centres of ``text`` (sorted, unique)."""
    toks = {token_of(page, g.cx, g.cy) for g in text.glyphs(page.font)}
    return sorted(t for t in toks if t is not None)


def covered_by_popup(page: DocPage, text: Text) -> bool:
    if page.popup is None:
        return False
    x, y, w, h = page.popup
    return any(x <= g.cx < x + w and y <= g.cy < y + h for g in text.glyphs(page.font))


# -- rendering -------------------------------------------------------------------------------------------
PAPER = {"form": (255, 255, 255), "table": (252, 252, 250), "receipt": (236, 232, 222), "ui": (28, 32, 40),
         "invoice": (255, 255, 255)}
INK = {"ui": (230, 232, 236)}


def render(page: DocPage) -> Image.Image:
    rng = random.Random(page.seed * 7919 + 17)
    img = Image.new("RGB", (page.side, page.side), PAPER[page.layout])
    draw = ImageDraw.Draw(img)
    ink = INK.get(page.layout, (20, 20, 24))
    dx, dy = page.offset
    _decorate(img, draw, page, rng, dx, dy)
    for text in cell_texts(page):
        text.draw(draw, page.font, ink)
    if page.popup is not None:
        x, y, w, h = page.popup
        draw.rectangle([x + 3, y + 3, x + w + 3, y + h + 3], fill=(90, 90, 90))
        draw.rectangle([x, y, x + w, y + h], fill=(246, 246, 250), outline=(60, 60, 70))
        draw.rectangle([x, y, x + w, y + 14], fill=(60, 100, 180))
        draw.rectangle([x + w - 44, y + h - 22, x + w - 8, y + h - 8], outline=(60, 60, 70))
    if page.crop is not None:
        img = img.crop(page.crop).resize((page.side, page.side), Image.Resampling.BILINEAR)
    if page.rotation or page.scale != 1.0:
        img = turn_image(img, page.rotation, page.scale, PAPER[page.layout])
    if page.brightness != 1.0:
        img = ImageEnhance.Brightness(img).enhance(page.brightness)
    if page.noise:
        pixels = np.asarray(img, dtype=np.float32)
        noisy = pixels + np.random.default_rng(page.seed & 0xFFFFFFFF).normal(0, page.noise, pixels.shape)
        img = Image.fromarray(noisy.clip(0, 255).astype(np.uint8))
    if page.jpeg_quality is not None:
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=page.jpeg_quality)
        img = Image.open(buf).convert("RGB")
    return img


def _texture(rng: random.Random, w: int, h: int) -> Image.Image:
    """A 'photo': smooth colour noise (a few octaves) with a soft shape, like a product shot or a landscape."""
    base = np.zeros((h, w, 3), np.float32)
    nprng = np.random.default_rng(rng.randrange(2**32))
    for scale in (8, 16, 32):
        small = nprng.uniform(0, 1, (max(2, h // scale), max(2, w // scale), 3)).astype(np.float32)
        up = np.asarray(Image.fromarray((small * 255).astype(np.uint8)).resize((w, h), Image.Resampling.BICUBIC), np.float32)
        base += up * (scale / 8)
    base = base / base.max() * 255
    tint = np.array([rng.randint(60, 255) for _ in range(3)], np.float32)
    return Image.fromarray((base * 0.6 + tint * 0.4).clip(0, 255).astype(np.uint8))


def _filler(rng: random.Random, n: int) -> str:
    """Running text that is never asked about (lower case, so it never reads as a key or a value)."""
    words = ["".join(rng.choice("abcdefghiklmnoprstuvw") for _ in range(rng.randint(2, 7))) for _ in range(n)]
    return " ".join(words)


def _decorate(img, draw, page: DocPage, rng: random.Random, dx: int, dy: int) -> None:
    """Everything that is not a record: header band with title and logo, a photo, running text, rules,
    ruled table cells, dotted leaders, toggles, a footer. Moves with ``offset`` like the records."""
    layout, W = page.layout, page.side
    full = W >= SIZE  # small training pages get a header band, rules and widgets only
    small = font("sans", 9)
    title = font("sans", 18)
    accent = tuple(rng.randint(30, 200) for _ in range(3))
    last_row = page.y0 + (page.n_rows - 1) * page.pitch + dy
    if layout in ("form", "invoice", "table"):
        band = rng.randint(36, 56) if full else rng.randint(22, 30)
        draw.rectangle([0, dy, W, band + dy], fill=accent)
        draw.text((60 + dx, (10 if full else 3) + dy), page.title, fill=(255, 255, 255), font=title)
        if full:
            draw.ellipse([14 + dx, 8 + dy, 44 + dx, 38 + dy], fill=(255, 255, 255))
            draw.rectangle([22 + dx, 16 + dy, 36 + dx, 30 + dy], fill=accent)
    if layout in ("form", "invoice") and full:
        w, h = rng.randint(90, 140), rng.randint(70, 110)
        x = W - w - rng.randint(12, 30)
        y = rng.randint(60, 90)
        if x > page.col_x[-1] + 48 or y + h < page.y0 - page.pitch - 4:  # a photo never covers the records
            img.paste(_texture(rng, w, h), (x + dx, y + dy))
        for i in range(rng.randint(2, 4)):  # an address / paragraph block under the header
            draw.text((page.x0 + dx, 58 + i * 12 + dy - 4), _filler(rng, 4), fill=(110, 110, 110), font=small)
    if layout == "table":
        right = page.col_x[-1] + 56
        top = page.y0 - page.pitch - 8 + dy
        for r in range(page.n_rows + 2):
            y = top + r * page.pitch
            draw.line([page.x0 - 8 + dx, y, right + dx, y], fill=(170, 170, 170))
        for x in (page.x0 - 8, *[c - 8 for c in page.col_x], right):
            draw.line([x + dx, top, x + dx, top + (page.n_rows + 1) * page.pitch], fill=(170, 170, 170))
        draw.rectangle([page.x0 - 7 + dx, top + 1, right - 1 + dx, top + page.pitch - 1], fill=(232, 236, 244))
    if layout == "invoice":
        top = page.y0 - page.pitch - 8 + dy
        draw.line([page.x0 + dx, top + page.pitch - 2, page.col_x[-1] + 60 + dx, top + page.pitch - 2],
                  fill=accent, width=2)
    if layout == "receipt":
        left, right = page.x0 - 20 + dx, page.col_x[0] + 56 + dx
        draw.rectangle([left, (20 if full else 4) + dy, right, W - (20 if full else 4) + dy], fill=(250, 249, 244))
        if full:
            draw.text((left + 20, 30 + dy), page.title, fill=(40, 40, 40), font=title)
        for r in range(page.n_rows):
            y = page.y0 + r * page.pitch + dy + 7
            for x in range(page.x0 + KEY_LEN * GLYPH + 4 + dx, page.col_x[0] - 6 + dx, 4):
                draw.point((x, y), fill=(120, 120, 120))
        draw.line([left + 10, last_row + page.pitch, right - 10, last_row + page.pitch], fill=(60, 60, 60))
        for x in range(left + 10, right - 10, 3) if full else ():  # a barcode
            if rng.random() < 0.55:
                draw.line([x, W - 60 + dy, x, W - 34 + dy], fill=(30, 30, 30))
    if layout == "ui":
        draw.rectangle([0, dy, W, (40 if full else 24) + dy], fill=(44, 50, 64))
        draw.text((56 + dx, (12 if full else 3) + dy), page.title, fill=(230, 232, 236), font=title)
        for i in range(rng.randint(4, 6)) if full else ():  # side-bar icons
            y = 70 + i * 46 + dy
            draw.rounded_rectangle([8 + dx, y, 30 + dx, y + 22], radius=5, fill=accent)
        for r in range(page.n_rows):
            y = page.y0 + r * page.pitch + dy
            draw.rounded_rectangle([page.x0 - 8 + dx, y - 6, W - 20 + dx, y + page.pitch - 10], radius=6,
                                   outline=(70, 78, 96))
            on = page.lights[r] if r < len(page.lights) else False
            tx = W - 70 + dx
            draw.rounded_rectangle([tx, y - 1, tx + 30, y + 13], radius=7, fill=(60, 170, 90) if on else (90, 94, 104))
            knob = tx + 17 if on else tx + 1
            draw.ellipse([knob, y, knob + 12, y + 12], fill=(240, 240, 240))
    if not full:
        return
    # footer: a rule and a line of running text
    fy = W - 26 + dy
    draw.line([20 + dx, fy - 6, W - 20 + dx, fy - 6], fill=(150, 150, 150) if layout != "ui" else (70, 78, 96))
    draw.text((24 + dx, fy), _filler(rng, 6), fill=(130, 130, 130), font=small)


# -- questions ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Question:
    """A question about a page: the text after the image, the instruction before it, the answer, and the cell
    it lives in (``row``, ``column``; ``source``: the ``Text`` kind the answer is read from)."""

    kind: str  # "value", "cell" or "key"
    text: str
    instruction: str
    answer: str
    row: int
    column: int

    @property
    def source(self) -> str:
        return "key" if self.kind == "key" else "value"


NEUTRAL = ("Read the page.", "Scan 2.", "Doc A.", "See:", "Page 7:", "Look below.")


def use_column(name: str) -> str:
    return f"Use {name}."


def ask(page: DocPage, kind: str, row: int, column: int = 0, instruction: str = "") -> Question:
    """The question of ``kind`` about ``row`` (and ``column``). ``"value"`` on a page of several columns needs an
    instruction naming the column (``use_column``); other instructions only precede the image."""
    key = page.keys[row]
    if kind == "key":
        return Question(kind, f"={page.values[row][column]}?", instruction, key, row, column)
    if kind == "cell":
        if len(page.columns) < 2:
            raise ValueError("a cell question needs a page with named columns")
        return Question(kind, f"{key} {page.columns[column]}?", instruction, page.values[row][column], row, column)
    if kind != "value":
        raise ValueError(f"unknown question kind {kind!r}")
    if len(page.columns) > 1:
        instruction = use_column(page.columns[column])
    elif column:
        raise ValueError("a one-column page has only column 0")
    return Question(kind, f"{key}?", instruction, page.values[row][column], row, column)


def random_question(rng: random.Random, page: DocPage, instruct: float = 0.3) -> Question:
    row = rng.randrange(page.n_rows)
    column = rng.randrange(len(page.columns))
    kinds = ["value", "key"] + (["cell"] if len(page.columns) > 1 else [])
    kind = rng.choice(kinds)
    instruction = rng.choice(NEUTRAL) if rng.random() < instruct else ""
    return ask(page, kind, row, column, instruction)


def answer_tokens(page: DocPage, question: Question) -> list[int]:
    """The visual tokens holding the answer's glyphs."""
    for text in cell_texts(page):
        if text.kind == question.source and text.row == question.row and (
                question.source == "key" or text.column == question.column):
            return text_tokens(page, text)
    raise ValueError("question does not name a cell of the page")


# -- near-duplicates --------------------------------------------------------------------------------------
def edit_cells(page: DocPage, cells: list[tuple[int, int]], rng: random.Random) -> DocPage:
    """The values of ``cells`` (row, column) replaced by new ones (every digit different, distinct on the page)."""
    values = [list(r) for r in page.values]
    seen = {v for r in values for v in r}
    for row, column in cells:
        old = values[row][column]
        while True:
            new = "".join(rng.choice([d for d in DIGITS if d != o]) for o in old)
            if new not in seen:
                break
        seen.add(new)
        values[row][column] = new
    return replace(page, values=tuple(tuple(r) for r in values))


def scroll(page: DocPage, dy: int) -> DocPage:
    """The page scrolled by ``dy`` px (content moves up for dy > 0)."""
    return replace(page, offset=(page.offset[0], page.offset[1] - dy))


def shift(page: DocPage, dx: int, dy: int = 0) -> DocPage:
    return replace(page, offset=(page.offset[0] + dx, page.offset[1] + dy))


def crop(page: DocPage, margin: int) -> DocPage:
    """A crop of ``margin`` px off every side, rescaled to the page (a zoomed rescan)."""
    return replace(page, crop=(margin, margin, page.side - margin, page.side - margin))


def popup(page: DocPage, rng: random.Random) -> DocPage:
    """A dialog drawn over part of the page, away from the record block."""
    w, h = rng.randint(120, 180), rng.randint(50, 80)
    x = rng.randint(10, page.side - w - 10)
    block_top, block_bottom = page.y0 - page.pitch, page.y0 + page.n_rows * page.pitch
    room_below = page.side - 30 - h - block_bottom
    y = block_bottom + rng.randint(0, room_below) if room_below > 0 else rng.randint(0, max(0, block_top - h))
    return replace(page, popup=(x, y, w, h))


def toggle(page: DocPage, row: int) -> DocPage:
    """A widget state changed (``ui`` pages): one row's toggle switched; no text changes."""
    if page.layout != "ui":
        raise ValueError("only ui pages have toggles")
    lights = list(page.lights)
    lights[row] = not lights[row]
    return replace(page, lights=tuple(lights))


def rescan(page: DocPage, rng: random.Random) -> DocPage:
    """JPEG re-encoding, a brightness change, or sensor noise."""
    pick = rng.randrange(3)
    if pick == 0:
        return replace(page, jpeg_quality=rng.choice([60, 75, 85]))
    if pick == 1:
        return replace(page, brightness=rng.choice([0.85, 0.9, 1.1]))
    return replace(page, noise=rng.choice([4.0, 6.0]))


def edit_char(page: DocPage, row: int, column: int, rng: random.Random) -> DocPage:
    """One digit of the value at (``row``, ``column``) replaced (the value stays distinct on the page): an edit
    smaller than a visual token, which holds two glyphs."""
    values = [list(r) for r in page.values]
    seen = {v for r in values for v in r}
    old = values[row][column]
    while True:
        at = rng.randrange(len(old))
        new = old[:at] + rng.choice([d for d in DIGITS if d != old[at]]) + old[at + 1:]
        if new not in seen:
            break
    values[row][column] = new
    return replace(page, values=tuple(tuple(r) for r in values))


def edit_key_char(page: DocPage, row: int, rng: random.Random) -> DocPage:
    """One letter of the key of ``row`` replaced, not its first (the page's keys keep distinct first letters)."""
    keys = list(page.keys)
    old = keys[row]
    at = rng.randrange(1, len(old))
    keys[row] = old[:at] + rng.choice([c for c in LETTERS if c != old[at]]) + old[at + 1:]
    return replace(page, keys=tuple(keys))


def rotate(page: DocPage, degrees: float) -> DocPage:
    """The page scanned askew: turned by ``degrees`` about its centre."""
    return replace(page, rotation=page.rotation + degrees)


def rescale(page: DocPage, factor: float) -> DocPage:
    """The page rescanned at another scale: zoomed by ``factor`` about its centre."""
    return replace(page, scale=page.scale * factor)


def has_room_for_row(page: DocPage) -> bool:
    """Whether one more record fits above the footer."""
    return page.n_rows < 8 and page.y0 + (page.n_rows + 1) * page.pitch <= page.side - 40


def insert_row(page: DocPage, at: int, rng: random.Random) -> DocPage:
    """A new record inserted before row ``at``: the records from there on move down by a row (``has_room_for_row``
    must hold). Its key starts with a letter no other key starts with; its values are new on the page."""
    if not has_room_for_row(page):
        raise ValueError("no room for another record on this page")
    firsts = {k[0] for k in page.keys}
    key = rng.choice([c for c in LETTERS if c not in firsts]) + "".join(rng.choice(LETTERS) for _ in range(KEY_LEN - 1))
    seen = {v for r in page.values for v in r}
    values = tuple(_fresh_value(rng, seen) for _ in page.columns)
    lights = page.lights[:at] + (rng.random() < 0.5,) + page.lights[at:] if page.lights else ()
    return replace(page, keys=page.keys[:at] + (key,) + page.keys[at:],
                   values=page.values[:at] + (values,) + page.values[at:], lights=lights)


def erase_cell(page: DocPage, row: int, column: int) -> DocPage:
    """The value at (``row``, ``column``) erased (a blank cell); nothing else moves."""
    values = [list(r) for r in page.values]
    values[row][column] = ""
    return replace(page, values=tuple(tuple(r) for r in values))

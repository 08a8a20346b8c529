"""Synthetic document pages drawn with Pillow (deterministic by seed): a form of key/value rows.

Used by the demo and the tests; variants give the near-duplicates that approximate
reuse is for (an edited value, a shifted copy).
"""

from __future__ import annotations

import random
import string

from PIL import Image, ImageDraw, ImageFont


def form_rows(seed: int, n_rows: int = 6) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    keys = rng.sample([a + b + c for a in "ABCDEFGH" for b in "KLMNPR" for c in "STUVWXYZ"], n_rows)
    return [(k, "".join(rng.choice(string.digits) for _ in range(4))) for k in keys]


def draw_form(rows: list[tuple[str, str]], size: tuple[int, int] = (224, 168), title: str | None = None) -> Image.Image:
    """A white page with one ``KEY  1234`` row per line in black."""
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    y = 6
    if title:
        draw.text((8, y), title, fill="black", font=font)
        y += 18
    line = max(14, (size[1] - y - 6) // max(1, len(rows)))
    for key, value in rows:
        draw.text((10, y), key, fill="black", font=font)
        draw.text((size[0] // 2, y), value, fill="black", font=font)
        draw.line((8, y + line - 3, size[0] - 8, y + line - 3), fill=(200, 200, 200))
        y += line
    return img


def page(seed: int, size: tuple[int, int] = (224, 168)) -> Image.Image:
    return draw_form(form_rows(seed), size, title=f"FORM {seed:04d}")


def edited(seed: int, row: int = 0, value: str = "9999", size: tuple[int, int] = (224, 168)) -> Image.Image:
    """The page of ``seed`` with the value of one row replaced."""
    rows = form_rows(seed)
    rows[row] = (rows[row][0], value)
    return draw_form(rows, size, title=f"FORM {seed:04d}")


def shifted(img: Image.Image, dx: int = 2, dy: int = 0) -> Image.Image:
    """The same page moved by a few pixels (white fill)."""
    from vismemo_hf.eval.synthdoc import shift_image

    return shift_image(img, dx, dy)

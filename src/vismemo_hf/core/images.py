"""The fixed synthetic images whose embeddings define a model's lookup reference (``core.thresholds``), and the
image kinds calibration pairs are drawn from."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

#: pixels of a reference image (224 px: a whole number of tokens for patch 14 and 16 with merge 2)
REFERENCE_SIZE = (224, 224)


#: the kinds of ``synthetic_image``
IMAGE_KINDS = ("text", "form", "screen", "photo", "texture")


def synthetic_image(kind: str, seed: int, size: tuple[int, int] = REFERENCE_SIZE) -> Image.Image:
    """A deterministic synthetic image of ``kind``: a text page or table, a form (one template, other labels and
    values), a screen (bars, buttons, labels), a photo (colour gradient with shapes) or a texture."""
    rng = random.Random(seed)
    font = ImageFont.load_default()
    w, h = size
    if kind == "text":
        img = Image.new("RGB", (w, h), "white")
        draw = ImageDraw.Draw(img)
        ruled = rng.random() < 0.5
        for y in range(8, h - 12, 14):
            words = " ".join("".join(rng.choice("abcdefghijklmnop0123456789") for _ in range(rng.randint(2, 7)))
                             for _ in range(4))
            draw.text((8, y), words, fill="black", font=font)
            if ruled:
                draw.line((4, y + 12, w - 4, y + 12), fill=(150, 150, 150))
        return img
    if kind == "form":  # one template (a title bar, label: value rows) with seeded labels and values
        img = Image.new("RGB", (w, h), "white")
        draw = ImageDraw.Draw(img)
        draw.rectangle((0, 0, w, 18), fill=(60, 90, 160))
        draw.text((6, 4), "FORM " + "".join(rng.choice("ABCDEFGH") for _ in range(4)), fill="white", font=font)
        for y in range(26, h - 14, 16):
            label = "".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(4, 8)))
            value = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
            draw.text((8, y), label + ":", fill="black", font=font)
            draw.text((w // 2, y), value, fill="black", font=font)
            draw.line((6, y + 13, w - 6, y + 13), fill=(200, 200, 200))
        return img
    if kind == "screen":
        img = Image.new("RGB", (w, h), tuple(rng.randint(200, 255) for _ in range(3)))
        draw = ImageDraw.Draw(img)
        for _ in range(6):
            x0, y0 = rng.randint(0, w - 60), rng.randint(0, h - 30)
            draw.rectangle((x0, y0, x0 + rng.randint(30, 120), y0 + rng.randint(12, 30)),
                           fill=tuple(rng.randint(0, 255) for _ in range(3)))
            draw.text((x0 + 4, y0 + 2), "".join(rng.choice("ABCDEFGHXYZ") for _ in range(5)), fill="white", font=font)
        return img
    if kind == "photo":
        top, bottom = (torch.tensor([rng.random() for _ in range(3)], device="cpu") for _ in range(2))
        ramp = torch.linspace(0, 1, h, device="cpu").view(h, 1, 1)
        img = Image.fromarray(((top * (1 - ramp) + bottom * ramp).expand(h, w, 3) * 255).to(torch.uint8).numpy())
        draw = ImageDraw.Draw(img)
        for _ in range(4):
            x0, y0 = rng.randint(0, w - 40), rng.randint(0, h - 40)
            draw.ellipse((x0, y0, x0 + rng.randint(20, 90), y0 + rng.randint(20, 90)),
                         fill=tuple(rng.randint(0, 255) for _ in range(3)))
        return img
    if kind == "texture":
        coarse = torch.rand(3, h // 8, w // 8, device="cpu", generator=torch.Generator().manual_seed(seed))
        pixels = F.interpolate(coarse[None], size=(h, w), mode="bilinear")[0].permute(1, 2, 0) * 255
        return Image.fromarray(pixels.clamp(0, 255).to(torch.uint8).numpy())
    raise ValueError(f"unknown image kind {kind!r}; one of {IMAGE_KINDS}")


def reference_images() -> list[Image.Image]:
    """The fixed images whose embeddings define a model's reference: three of each kind (the forms share one
    template, so the most similar unrelated pair is the closest two different pages of one layout get)."""
    return [synthetic_image(IMAGE_KINDS[i % len(IMAGE_KINDS)], 20261130 + i) for i in range(3 * len(IMAGE_KINDS))]

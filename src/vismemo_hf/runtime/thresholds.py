"""Model-aware approximate lookup: the reference means that centre a model's embeddings, and its thresholds.

Hidden states are anisotropic, and how much depends on the model: on a random-weight tower any
two pages share most of their embedding, so raw cosines of unrelated pages pass any fixed
threshold. The lookup therefore compares embeddings *centred* by the model's reference means:
the mean L2-normalised token and the mean region descriptor of a fixed set of synthetic
images (documents, screens, photos, textures) that the model's own tower encodes once per
process (``model_centers``). ``LookupThresholds`` are ``tau`` (every centred regional cosine)
and ``tau_fine`` (mean centred token cosine); ``vismemo calibrate`` measures them for one model
and writes a preset (``configs/lookup/``) that ``VisMemoCache(thresholds=...)`` takes.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

from vismemo_hf.runtime.features import region_descriptors

#: pixels of a reference image (224 px: a whole number of tokens for patch 14 and 16 with merge 2)
REFERENCE_SIZE = (224, 224)


@dataclass(frozen=True)
class LookupThresholds:
    """``tau``: every centred regional cosine must exceed it (coarse stage); ``tau_fine``: the mean centred token
    cosine must reach it (fine stage). ``fingerprint``: the model they were calibrated for (None: any)."""

    tau: float = 0.8
    tau_fine: float = 0.85
    fingerprint: str | None = None

    def __post_init__(self) -> None:
        for name in ("tau", "tau_fine"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -1.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a cosine in [-1, 1], got {value!r}")

    @classmethod
    def load(cls, name_or_path: str) -> LookupThresholds:
        """A preset of ``configs/lookup/`` by name, or a YAML path (``vismemo calibrate`` writes them)."""
        from vismemo_hf.presets import find, load

        cfg = load("lookup", name_or_path)
        unknown = set(cfg) - {"tau", "tau_fine", "fingerprint", "calibration"}
        if unknown:
            raise ValueError(f"unknown lookup option(s) {sorted(unknown)} in {find('lookup', name_or_path)}")
        return cls(float(cfg["tau"]), float(cfg["tau_fine"]), cfg.get("fingerprint"))

    def as_dict(self) -> dict:
        return asdict(self)


def reference_images() -> list[Image.Image]:
    """Twelve fixed synthetic images of the kinds a VLM reads: text pages, tables, screens, photos, textures."""
    rng = random.Random(20261130)
    font = ImageFont.load_default()
    w, h = REFERENCE_SIZE
    images = []
    for i in range(12):
        kind = i % 4
        if kind == 0:  # a text page or a table
            img = Image.new("RGB", (w, h), "white")
            draw = ImageDraw.Draw(img)
            for y in range(8, h - 12, 14):
                words = " ".join("".join(rng.choice("abcdefghijklmnop0123456789") for _ in range(rng.randint(2, 7)))
                                 for _ in range(4))
                draw.text((8, y), words, fill="black", font=font)
                if i % 8 == 4:
                    draw.line((4, y + 12, w - 4, y + 12), fill=(150, 150, 150))
        elif kind == 1:  # a screen: coloured bars, buttons and labels
            img = Image.new("RGB", (w, h), tuple(rng.randint(200, 255) for _ in range(3)))
            draw = ImageDraw.Draw(img)
            for _ in range(6):
                x0, y0 = rng.randint(0, w - 60), rng.randint(0, h - 30)
                draw.rectangle((x0, y0, x0 + rng.randint(30, 120), y0 + rng.randint(12, 30)),
                               fill=tuple(rng.randint(0, 255) for _ in range(3)))
                draw.text((x0 + 4, y0 + 2), "".join(rng.choice("ABCDEFGHXYZ") for _ in range(5)), fill="white",
                          font=font)
        elif kind == 2:  # a photo: a colour gradient with shapes
            top, bottom = (torch.tensor([rng.random() for _ in range(3)]) for _ in range(2))
            ramp = torch.linspace(0, 1, h).view(h, 1, 1)
            pixels = ((top * (1 - ramp) + bottom * ramp).expand(h, w, 3) * 255).to(torch.uint8)
            img = Image.fromarray(pixels.numpy())
            draw = ImageDraw.Draw(img)
            for _ in range(4):
                x0, y0 = rng.randint(0, w - 40), rng.randint(0, h - 40)
                draw.ellipse((x0, y0, x0 + rng.randint(20, 90), y0 + rng.randint(20, 90)),
                             fill=tuple(rng.randint(0, 255) for _ in range(3)))
        else:  # a texture
            g = torch.Generator().manual_seed(i)
            coarse = torch.rand(3, h // 8, w // 8, generator=g)
            pixels = (F.interpolate(coarse[None], size=(h, w), mode="bilinear")[0].permute(1, 2, 0) * 255)
            img = Image.fromarray(pixels.clamp(0, 255).to(torch.uint8).numpy())
        images.append(img)
    return images


def image_processor(adapter):
    """A Qwen2-VL image processor with the model's patch geometry and normalisation (no hub access)."""
    from transformers import Qwen2VLImageProcessor

    vc = adapter.vision_config
    token_px = vc.patch_size * adapter.merge
    return Qwen2VLImageProcessor(
        size={"shortest_edge": 4 * token_px**2, "longest_edge": 1024 * token_px**2}, patch_size=vc.patch_size,
        temporal_patch_size=vc.temporal_patch_size, merge_size=adapter.merge, image_mean=list(adapter.image_mean),
        image_std=list(adapter.image_std))


def encode_images(adapter, get_image_features, images) -> list[tuple[torch.Tensor, tuple[int, int, int]]]:
    """(embeds, grid) of each image through the model's own tower, in one batch."""
    inputs = image_processor(adapter)(images=[im.convert("RGB") for im in images], return_tensors="pt")
    dtype = next(adapter.model.parameters()).dtype
    device = next(adapter.model.parameters()).device
    with torch.no_grad():
        encoded = adapter.encode(get_image_features, inputs["pixel_values"].to(device=device, dtype=dtype),
                                 inputs["image_grid_thw"].to(device))
    grids = [tuple(int(x) for x in g) for g in inputs["image_grid_thw"].tolist()]
    return [(e.float().cpu(), g) for (e, _), g in zip(encoded, grids)]


def model_centers(adapter, get_image_features) -> tuple[torch.Tensor, torch.Tensor]:
    """(descriptor mean (d,), token mean (d,)) of the reference images under this model."""
    descriptors, tokens = [], []
    for embeds, grid in encode_images(adapter, get_image_features, reference_images()):
        descriptors.append(region_descriptors(embeds, grid, adapter.merge))
        tokens.append(F.normalize(embeds, dim=-1))
    return torch.cat(descriptors).mean(0), torch.cat(tokens).mean(0)


def centred_descriptors(descriptors: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    return descriptors.float() - mean.to(descriptors.device).float()


def regional_cosines(a: torch.Tensor, b: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """(4,) centred cosines of two images' region descriptors (the coarse rule, exactly)."""
    return F.cosine_similarity(centred_descriptors(a, mean), centred_descriptors(b, mean), dim=-1)


def token_cosines(a: torch.Tensor, b: torch.Tensor, token_mean: torch.Tensor) -> torch.Tensor:
    """(N,) centred cosines of two images' L2-normalised tokens (the fine rule, exactly)."""
    m = token_mean.float()
    return F.cosine_similarity(F.normalize(a.float(), dim=-1) - m, F.normalize(b.float(), dim=-1) - m, dim=-1)

"""Model-aware approximate lookup: the reference means that centre a model's embeddings, and its thresholds.

Hidden states are anisotropic, and how much depends on the model: on a random-weight tower any
two pages share most of their embedding, so raw cosines of unrelated pages pass any fixed
threshold. The lookup therefore compares embeddings *centred* by the model's reference means:
the mean L2-normalised token and the mean region descriptor of a fixed set of synthetic
images (text pages, forms of one template, screens, photos, textures) that the model's own tower encodes once per
process (``model_reference``). ``LookupThresholds`` are ``tau`` (every centred regional cosine)
and ``tau_fine`` (mean centred token cosine); by default ``tau_fine`` also stays above the
model's most similar unrelated reference images. ``vismemo calibrate`` measures both for one
model and writes a preset (``configs/lookup/``) that ``VisMemoCache(thresholds=...)`` takes.
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


#: how far above the model's most similar unrelated reference pair an adaptive ``tau_fine`` is kept
UNRELATED_MARGIN = 0.03


@dataclass(frozen=True)
class ModelReference:
    """What the reference images tell about one model: the means that centre its embeddings, and the highest fine
    score (mean centred token cosine) between two unrelated reference images of the same kind."""

    descriptor_mean: torch.Tensor
    token_mean: torch.Tensor
    unrelated_fine: float


@dataclass(frozen=True)
class LookupThresholds:
    """``tau``: every centred regional cosine must exceed it (coarse stage); ``tau_fine``: the mean centred token
    cosine must reach it (fine stage). ``fingerprint``: the model they were calibrated for (None: any).
    ``adaptive``: ``tau_fine`` is raised, per model, to ``UNRELATED_MARGIN`` above its most similar unrelated
    reference pair (on by default; off for calibrated presets and explicit values)."""

    tau: float = 0.8
    tau_fine: float = 0.85
    fingerprint: str | None = None
    adaptive: bool = True

    def fine_for(self, reference: ModelReference) -> float:
        """The fine threshold for a model."""
        if not self.adaptive:
            return self.tau_fine
        return max(self.tau_fine, reference.unrelated_fine + UNRELATED_MARGIN)

    def __post_init__(self) -> None:
        for name in ("tau", "tau_fine"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -1.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a cosine in [-1, 1], got {value!r}")

    @classmethod
    def load(cls, name_or_path: str) -> LookupThresholds:
        """A preset of ``configs/lookup/`` by name, or a YAML path (``vismemo calibrate`` writes them)."""
        from vismemo_hf.presets import find, load

        cfg = load("lookup", name_or_path)
        where = find("lookup", name_or_path)
        unknown = set(cfg) - {"tau", "tau_fine", "fingerprint", "calibration"}
        if unknown:
            raise ValueError(f"unknown lookup option(s) {sorted(unknown)} in {where}")
        missing = {"tau", "tau_fine"} - set(cfg)
        if missing:
            raise ValueError(f"lookup thresholds {where} lack {sorted(missing)}")
        fingerprint = cfg.get("fingerprint")
        if fingerprint is not None and not isinstance(fingerprint, str):
            raise ValueError(f"fingerprint in {where} must be a string, got {fingerprint!r}")
        return cls(cfg["tau"], cfg["tau_fine"], fingerprint, adaptive=False)

    def as_dict(self) -> dict:
        return asdict(self)


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
        top, bottom = (torch.tensor([rng.random() for _ in range(3)]) for _ in range(2))
        ramp = torch.linspace(0, 1, h).view(h, 1, 1)
        img = Image.fromarray(((top * (1 - ramp) + bottom * ramp).expand(h, w, 3) * 255).to(torch.uint8).numpy())
        draw = ImageDraw.Draw(img)
        for _ in range(4):
            x0, y0 = rng.randint(0, w - 40), rng.randint(0, h - 40)
            draw.ellipse((x0, y0, x0 + rng.randint(20, 90), y0 + rng.randint(20, 90)),
                         fill=tuple(rng.randint(0, 255) for _ in range(3)))
        return img
    if kind == "texture":
        coarse = torch.rand(3, h // 8, w // 8, generator=torch.Generator().manual_seed(seed))
        pixels = F.interpolate(coarse[None], size=(h, w), mode="bilinear")[0].permute(1, 2, 0) * 255
        return Image.fromarray(pixels.clamp(0, 255).to(torch.uint8).numpy())
    raise ValueError(f"unknown image kind {kind!r}; one of {IMAGE_KINDS}")


def reference_images() -> list[Image.Image]:
    """The fixed images whose embeddings define a model's reference: three of each kind (the forms share one
    template, so the most similar unrelated pair is the closest two different pages of one layout get)."""
    return [synthetic_image(IMAGE_KINDS[i % len(IMAGE_KINDS)], 20261130 + i) for i in range(3 * len(IMAGE_KINDS))]


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


def model_reference(adapter, get_image_features) -> ModelReference:
    """Encode the reference images with the model's tower: their mean region descriptor and mean L2-normalised
    token centre the lookup; pairs of the same kind give the unrelated-pair fine score."""
    encoded = encode_images(adapter, get_image_features, reference_images())
    descriptors = torch.stack([region_descriptors(e, g, adapter.merge) for e, g in encoded])
    token_mean = torch.cat([F.normalize(e, dim=-1) for e, _ in encoded]).mean(0)
    unrelated = [float(token_cosines(encoded[i][0], encoded[j][0], token_mean).mean())
                 for i in range(len(encoded)) for j in range(i + 1, len(encoded))
                 if i % len(IMAGE_KINDS) == j % len(IMAGE_KINDS) and encoded[i][1] == encoded[j][1]]
    return ModelReference(descriptors.mean((0, 1)), token_mean, max(unrelated))


def regional_cosines(a: torch.Tensor, b: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """(4,) centred cosines of two images' region descriptors (the coarse rule, exactly)."""
    m = mean.float().cpu()
    return F.cosine_similarity(a.float().cpu() - m, b.float().cpu() - m, dim=-1)


def token_cosines(a: torch.Tensor, b: torch.Tensor, token_mean: torch.Tensor) -> torch.Tensor:
    """(N,) centred cosines of two images' L2-normalised tokens (the fine rule, exactly)."""
    m = token_mean.float()
    return F.cosine_similarity(F.normalize(a.float(), dim=-1) - m, F.normalize(b.float(), dim=-1) - m, dim=-1)

"""Model-aware approximate lookup: the reference means that centre a model's embeddings, and its thresholds.

Hidden states are anisotropic, and how much depends on the model: on a random-weight tower any
two pages share most of their embedding, so raw cosines of unrelated pages pass any fixed
threshold. The lookup therefore compares embeddings *centred* by the model's reference means:
the mean L2-normalised token and the mean region descriptor of a fixed set of synthetic
images (text pages, forms of one template, screens, photos, textures) that the model's own tower encodes once per
process (``runtime.reference.model_reference``). ``LookupThresholds`` are ``tau`` (every centred regional cosine)
and ``tau_fine`` (mean centred token cosine); by default ``tau_fine`` also stays above the
model's most similar unrelated reference images. ``vismemo calibrate`` measures both for one
model and writes a preset (``configs/lookup/``) that ``VisMemoCache(thresholds=...)`` takes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from vismemo_hf.core.features import token_grid

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


def regional_cosines(a: torch.Tensor, b: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """(4,) centred cosines of two images' region descriptors (the coarse rule, exactly)."""
    m = mean.float().cpu()
    return F.cosine_similarity(a.float().cpu() - m, b.float().cpu() - m, dim=-1)


def centred_tokens(embeds: torch.Tensor, token_mean: torch.Tensor) -> torch.Tensor:
    """(N, d) L2-normalised tokens centred by the model's mean token, normalised again: what the fine rule compares."""
    return F.normalize(F.normalize(embeds.float(), dim=-1) - token_mean.float().to(embeds.device), dim=-1)


def token_cosines(a: torch.Tensor, b: torch.Tensor, token_mean: torch.Tensor) -> torch.Tensor:
    """(N,) centred cosines of two images' L2-normalised tokens (the fine rule, exactly)."""
    return (centred_tokens(a, token_mean) * centred_tokens(b, token_mean)).sum(-1)


#: the fine stage also compares a request's image with a cached one moved by up to this many visual tokens along
#: each axis (a page scrolled or moved by whole tokens), over the tokens both show
MAX_SHIFT = 1
#: the least share of the image a moved comparison must overlap
MIN_OVERLAP = 0.75


def best_shift(a: torch.Tensor, b: torch.Tensor, hw: tuple[int, int],
               max_shift: int = MAX_SHIFT) -> tuple[float, tuple[int, int]]:
    """(score, (dy, dx)): the highest mean cosine of ``a``'s rows (N, d, unit vectors of an h x w token grid) with
    ``b``'s moved by (dy, dx) tokens (token (r, c) of ``a`` against (r + dy, c + dx) of ``b``) over the tokens both
    hold, for |dy|, |dx| <= ``max_shift`` and an overlap of at least ``MIN_OVERLAP``. The unmoved comparison comes
    first and wins ties; a grid with other than h x w tokens (video frames) is compared unmoved only."""
    a, b = a.float(), b.float().to(a.device)
    h, w = hw
    best = (float((a * b).sum(-1).mean()), (0, 0))
    if a.shape[0] != h * w or b.shape != a.shape:
        return best
    grid_a, grid_b = a.reshape(h, w, -1), b.reshape(h, w, -1)
    for dy in range(-max_shift, max_shift + 1):
        for dx in range(-max_shift, max_shift + 1):
            if (dy, dx) == (0, 0) or (h - abs(dy)) * (w - abs(dx)) < MIN_OVERLAP * h * w:
                continue
            part_a = grid_a[max(0, -dy): h - max(0, dy), max(0, -dx): w - max(0, dx)]
            part_b = grid_b[max(0, dy): h - max(0, -dy), max(0, dx): w - max(0, -dx)]
            score = float((part_a * part_b).sum(-1).mean())
            if score > best[0]:
                best = (score, (dy, dx))
    return best


def fine_score(a: torch.Tensor, b: torch.Tensor, grid: tuple[int, int, int], merge: int,
               token_mean: torch.Tensor) -> tuple[float, tuple[int, int]]:
    """The fine rule at full width for two images' tokens (N, d) of one ``grid``: (score, shift) of ``best_shift``
    on their centred tokens."""
    return best_shift(centred_tokens(a, token_mean), centred_tokens(b, token_mean), token_grid(grid, merge)[1:])

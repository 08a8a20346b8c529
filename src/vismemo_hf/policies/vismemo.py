"""VisMemo: entropy decides what may be reused, normalised warmup attention what is recomputed (METHOD §2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..features import token_cosine
from ..plan import HitKind, ImageFeatures, ImagePlan, WarmupSignals
from .base import RoutingPolicy, register_policy


def normalised_attention(attention: torch.Tensor) -> torch.Tensor:
    """(layers, heads, rows, N) -> (N,): each head's attention to the image rescaled to sum to one
    per query row (a sink-dominated head no longer outweighs the others), then averaged."""
    att = attention.float()
    att = att / att.sum(-1, keepdim=True).clamp_min(1e-12)
    return att.mean(dim=(0, 1, 2))


@register_policy
@dataclass
class VisMemoPolicy(RoutingPolicy):
    name: ClassVar[str] = "vismemo"
    needs_attention: ClassVar[bool] = True

    #: a token is a reuse candidate only if its patch entropy is at most this in both images (ours)
    entropy_threshold: float = 0.3
    #: drop candidates whose encoder outputs differ (cosine below this); None switches the guard off
    guard_cosine: float | None = 0.9

    def reuse_set(self, image: ImageFeatures, alias: ImageFeatures) -> torch.Tensor:
        risk = torch.maximum(image.entropy.float().cpu(), alias.entropy.float().cpu())
        ok = risk <= self.entropy_threshold
        if self.guard_cosine is not None:
            ok &= token_cosine(image.embeds, alias.embeds) >= self.guard_cosine
        candidates = torch.nonzero(ok).flatten()
        order = torch.sort(risk[candidates], stable=True).indices
        return candidates[order][: self.budget(self.reuse_ratio, image.n_tokens)]

    def plan(self, image: ImageFeatures, alias: ImageFeatures, reuse: torch.Tensor, signals: WarmupSignals) -> ImagePlan:
        n = image.n_tokens
        free = torch.ones(n, dtype=torch.bool)
        free[reuse] = False
        rest = torch.nonzero(free).flatten()
        if signals.attention is None or signals.attention.shape[0] == 0:
            score = torch.zeros(n)
        else:
            score = normalised_attention(signals.attention)
        order = torch.sort(score[rest], descending=True, stable=True).indices
        k = min(rest.numel(), self.budget(self.recompute_ratio, n))
        recompute = rest[order[:k]].sort().values
        mask = rest[order[k:]].sort().values
        return ImagePlan(HitKind.APPROXIMATE, n, self.warmup_layers, recompute, reuse.sort().values, mask, alias.key)

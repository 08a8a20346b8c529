"""VisMemo: entropy decides what may be reused, normalised warmup attention what is recomputed (docs/METHOD.md §2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vismemo_hf.core.features import token_cosine
from vismemo_hf.core.plan import ImageFeatures, ImagePlan, WarmupSignals
from vismemo_hf.policies.base import RoutingPolicy, approximate_plan, register_policy, split_by_score


def normalised_attention(attention: torch.Tensor) -> torch.Tensor:
    """(layers, heads, rows, N) -> (N,): each head's attention to the image rescaled to sum to one
    per query row (a sink-dominated head no longer outweighs the others), then averaged."""
    att = attention.float()
    att = att / att.sum(-1, keepdim=True).clamp_min(1e-12)
    return att.mean(dim=(0, 1, 2))


def warmup_score(signals: WarmupSignals, n_tokens: int, normalise: bool = True) -> torch.Tensor:
    if signals.attention is None or signals.attention.shape[0] == 0:
        return torch.zeros(n_tokens)
    if normalise:
        return normalised_attention(signals.attention)
    return signals.attention.float().mean(dim=(0, 1, 2))


@register_policy
@dataclass
class VisMemoPolicy(RoutingPolicy):
    """Ablation switches: ``use_entropy=False`` picks B as the lowest-attention tokens after warmup;
    ``normalise_heads=False`` ranks R by raw attention; ``use_mask=False`` reuses M instead of
    masking it; ``guard_cosine=None`` drops the encoder-cosine guard."""

    name: ClassVar[str] = "vismemo"
    needs_attention: ClassVar[bool] = True

    #: a token is a reuse candidate only if its patch entropy is at most this in both images (ours)
    entropy_threshold: float = 0.3
    #: drop candidates whose encoder outputs differ (cosine below this); None switches the guard off
    guard_cosine: float | None = 0.9
    use_entropy: bool = True
    normalise_heads: bool = True
    use_mask: bool = True

    def _guarded(self, image: ImageFeatures, alias: ImageFeatures) -> torch.Tensor:
        ok = torch.ones(image.n_tokens, dtype=torch.bool)
        if self.guard_cosine is not None:
            ok &= token_cosine(image.embeds, alias.embeds) >= self.guard_cosine
        return ok

    def reuse_set(self, image: ImageFeatures, alias: ImageFeatures) -> torch.Tensor:
        """B: the ceil(beta * N) lowest-risk tokens among those low-entropy in both images (and guarded)."""
        risk = torch.maximum(image.entropy.float().cpu(), alias.entropy.float().cpu())
        candidates = torch.nonzero((risk <= self.entropy_threshold) & self._guarded(image, alias)).flatten()
        order = torch.sort(risk[candidates], stable=True).indices
        return candidates[order][: self.budget(self.reuse_ratio, image.n_tokens)].sort().values

    def prefetch_tokens(self, image: ImageFeatures, alias: ImageFeatures) -> torch.Tensor:
        if not self.use_mask:  # everything but R will be reused
            return torch.arange(image.n_tokens)
        if not self.use_entropy:  # then B depends on warmup attention
            return torch.zeros(0, dtype=torch.long)
        return self.reuse_set(image, alias)  # B is known before warmup

    def plan(self, image: ImageFeatures, alias: ImageFeatures, prefetched: torch.Tensor,
             signals: WarmupSignals) -> ImagePlan:
        n = image.n_tokens
        score = warmup_score(signals, n, self.normalise_heads)
        if not self.use_entropy:  # B = the guarded tokens the window attends to least
            guarded = torch.nonzero(self._guarded(image, alias)).flatten()
            reuse, _ = split_by_score(-score, guarded, self.budget(self.reuse_ratio, n))
        else:
            reuse = prefetched if self.use_mask else self.reuse_set(image, alias)
        free = torch.ones(n, dtype=torch.bool)
        free[reuse] = False
        recompute, rest = split_by_score(score, torch.nonzero(free).flatten(), self.budget(self.recompute_ratio, n))
        if not self.use_mask:  # M is reused instead of masked
            reuse = torch.cat([reuse, rest]).sort().values
        return approximate_plan(self, image, alias, recompute, reuse)

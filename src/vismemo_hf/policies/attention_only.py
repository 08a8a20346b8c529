"""``attention-only``: recompute the top rho*N tokens by raw warmup attention, reuse the rest (the paper's Challenge 3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vismemo_hf.core.plan import ImageFeatures, ImagePlan, WarmupSignals
from vismemo_hf.policies.base import RoutingPolicy, approximate_plan, register_policy, split_by_score
from vismemo_hf.policies.vismemo import warmup_score


@register_policy
@dataclass
class AttentionOnlyPolicy(RoutingPolicy):
    name: ClassVar[str] = "attention-only"
    needs_attention: ClassVar[bool] = True

    def prefetch_tokens(self, image: ImageFeatures, alias: ImageFeatures) -> torch.Tensor:
        return torch.arange(image.n_tokens)  # any token may end up reused

    def plan(self, image: ImageFeatures, alias: ImageFeatures, prefetched, signals: WarmupSignals) -> ImagePlan:
        n = image.n_tokens
        score = warmup_score(signals, n, normalise=False)
        recompute, reuse = split_by_score(score, torch.arange(n), self.budget(self.recompute_ratio, n))
        return approximate_plan(self, image, alias, recompute, reuse)

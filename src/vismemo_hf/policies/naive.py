"""``naive``: reuse every visual token of the matched entry at every layer (what approximate reuse must beat)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vismemo_hf.core.plan import ImageFeatures, ImagePlan, WarmupSignals
from vismemo_hf.policies.base import RoutingPolicy, approximate_plan, register_policy


@register_policy
@dataclass
class NaivePolicy(RoutingPolicy):
    name: ClassVar[str] = "naive"
    warmup_layers: int = 0

    def prefetch_tokens(self, image: ImageFeatures, alias: ImageFeatures) -> torch.Tensor:
        return torch.arange(image.n_tokens)

    def plan(self, image: ImageFeatures, alias: ImageFeatures, prefetched, signals: WarmupSignals) -> ImagePlan:
        empty = torch.zeros(0, dtype=torch.long)
        return approximate_plan(self, image, alias, empty, torch.arange(image.n_tokens))

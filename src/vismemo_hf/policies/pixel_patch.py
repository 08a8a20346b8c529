"""``pixel-patch``: recompute tokens whose pixels differ between the two images, reuse identical ones (Challenge 2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vismemo_hf.core.plan import ImageFeatures, ImagePlan, WarmupSignals
from vismemo_hf.policies.base import RoutingPolicy, approximate_plan, changed_tokens, register_policy


def identical_tokens(image: ImageFeatures, alias: ImageFeatures) -> torch.Tensor:
    changed = changed_tokens(image, alias)
    return torch.zeros(image.n_tokens, dtype=torch.bool) if changed is None else ~changed


@register_policy
@dataclass
class PixelPatchPolicy(RoutingPolicy):
    name: ClassVar[str] = "pixel-patch"
    warmup_layers: int = 0

    def prefetch_tokens(self, image: ImageFeatures, alias: ImageFeatures) -> torch.Tensor:
        return torch.nonzero(identical_tokens(image, alias)).flatten()

    def plan(self, image: ImageFeatures, alias: ImageFeatures, prefetched, signals: WarmupSignals) -> ImagePlan:
        same = identical_tokens(image, alias)
        return approximate_plan(self, image, alias, torch.nonzero(~same).flatten(), torch.nonzero(same).flatten())

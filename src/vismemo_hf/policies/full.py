"""``full``: no reuse at all; every image is prefilled (quality upper bound, latency baseline)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vismemo_hf.core.plan import HitKind, ImageFeatures, ImagePlan, WarmupSignals
from vismemo_hf.policies.base import RoutingPolicy, register_policy


@register_policy
@dataclass
class FullPolicy(RoutingPolicy):
    name: ClassVar[str] = "full"

    def reuses_prefix(self) -> bool:
        return False

    def exact_plan(self, image: ImageFeatures, alias: str, prefix_changed: bool = False) -> ImagePlan:
        return ImagePlan.full(HitKind.EXACT, image.n_tokens, alias)

    def plan(self, image: ImageFeatures, alias: ImageFeatures, prefetched, signals: WarmupSignals) -> ImagePlan:
        return ImagePlan.full(HitKind.APPROXIMATE, image.n_tokens, alias.key)

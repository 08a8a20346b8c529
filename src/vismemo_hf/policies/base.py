"""Policy base class and registry."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from ..plan import HitKind, ImageFeatures, ImagePlan, WarmupSignals

_REGISTRY: dict[str, type["RoutingPolicy"]] = {}


def register_policy(cls: type["RoutingPolicy"]) -> type["RoutingPolicy"]:
    if not getattr(cls, "name", None):
        raise TypeError(f"{cls.__name__} needs a class attribute `name`")
    _REGISTRY[cls.name] = cls
    return cls


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def get_policy(policy: "str | RoutingPolicy", **options) -> "RoutingPolicy":
    """A policy instance from a name and options (unknown options are an error, not ignored)."""
    if isinstance(policy, RoutingPolicy):
        if options:
            raise TypeError("options cannot be combined with a policy instance")
        return policy
    cls = _REGISTRY.get(policy)
    if cls is None:
        raise ValueError(f"unknown policy {policy!r}; available: {', '.join(available_policies())}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"policy {policy!r} has no option(s) {unknown}; it takes {sorted(known)}")
    return cls(**options)


@dataclass
class RoutingPolicy:
    """Shared parameters and the exact-hit / miss plans; subclasses route approximate hits.

    ``reuse_set`` runs before warmup (its K/V can be fetched while warmup runs);
    ``plan`` runs after the ``warmup_layers`` first layers with their signals.
    """

    name: ClassVar[str] = ""
    #: which warmup signals ``plan`` reads; the runner collects only these
    needs_attention: ClassVar[bool] = False

    warmup_layers: int = 3
    recompute_ratio: float = 0.3
    reuse_ratio: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.recompute_ratio <= 1.0 or not 0.0 <= self.reuse_ratio <= 1.0:
            raise ValueError("recompute_ratio and reuse_ratio must lie in [0, 1]")
        if self.warmup_layers < 0:
            raise ValueError("warmup_layers must be >= 0")

    def budget(self, ratio: float, n_tokens: int) -> int:
        return min(n_tokens, math.ceil(ratio * n_tokens - 1e-9))

    def exact_plan(self, image: ImageFeatures, alias: str) -> ImagePlan:
        return ImagePlan.exact(image.n_tokens, alias)

    def miss_plan(self, image: ImageFeatures) -> ImagePlan:
        return ImagePlan.full(HitKind.MISS, image.n_tokens)

    def reuse_set(self, image: ImageFeatures, alias: ImageFeatures) -> torch.Tensor:
        raise NotImplementedError

    def plan(
        self, image: ImageFeatures, alias: ImageFeatures, reuse: torch.Tensor, signals: WarmupSignals
    ) -> ImagePlan:
        raise NotImplementedError

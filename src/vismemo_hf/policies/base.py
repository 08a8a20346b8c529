"""Policy base class, registry and presets."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar

import torch
import yaml

from ..plan import HitKind, ImageFeatures, ImagePlan, WarmupSignals

_REGISTRY: dict[str, type["RoutingPolicy"]] = {}


def register_policy(cls: type["RoutingPolicy"]) -> type["RoutingPolicy"]:
    if not getattr(cls, "name", None):
        raise TypeError(f"{cls.__name__} needs a class attribute `name`")
    _REGISTRY[cls.name] = cls
    return cls


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def _preset(name: str) -> dict | None:
    """A policy preset: a YAML path, or the stem of a file in configs/policies/."""
    from ..presets import config_dir

    path = Path(name)
    if path.suffix not in (".yaml", ".yml"):
        path = config_dir() / "policies" / f"{name}.yaml"
    if not path.is_file():
        return None
    data = yaml.safe_load(path.read_text()) or {}
    if "policy" not in data:
        raise ValueError(f"policy preset {path} needs a `policy:` name")
    return data


def policy_option_names(policy: str) -> set[str]:
    cls = _REGISTRY.get(policy)
    return {f.name for f in fields(cls)} if cls else set()


def get_policy(policy: "str | RoutingPolicy", **options) -> "RoutingPolicy":
    """A policy from a registered name or a preset, with options (unknown options are an error)."""
    if isinstance(policy, RoutingPolicy):
        if options:
            raise TypeError("options cannot be combined with a policy instance")
        return policy
    cls = _REGISTRY.get(policy)
    if cls is None:
        preset = _preset(policy)
        if preset is None:
            presets = sorted(p.stem for p in _presets_dir().glob("*.yaml")) if _presets_dir() else []
            raise ValueError(f"unknown policy {policy!r}; policies: {', '.join(available_policies())}; "
                             f"presets: {', '.join(presets)}")
        name = preset.pop("policy")
        return get_policy(name, **{**preset, **options})
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"policy {policy!r} has no option(s) {unknown}; it takes {sorted(known)}")
    return cls(**options)


def _presets_dir():
    from ..presets import config_dir

    path = config_dir() / "policies"
    return path if path.is_dir() else None


@dataclass
class RoutingPolicy:
    """Shared parameters and the exact-hit / miss plans; subclasses route approximate hits.

    ``prefetch_tokens`` runs before warmup: the late-layer K/V of those tokens are read
    while warmup runs, and ``plan`` (after the first ``warmup_layers`` layers, with their
    signals) should reuse a subset of them, or pay a second read.
    """

    name: ClassVar[str] = ""
    #: which warmup signals ``plan`` reads; the runner collects only these
    needs_attention: ClassVar[bool] = False
    needs_check_kv: ClassVar[bool] = False

    warmup_layers: int = 3
    recompute_ratio: float = 0.3
    reuse_ratio: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.recompute_ratio <= 1.0 or not 0.0 <= self.reuse_ratio <= 1.0:
            raise ValueError("recompute_ratio and reuse_ratio must lie in [0, 1]")
        if self.warmup_layers < 0:
            raise ValueError("warmup_layers must be >= 0")

    @staticmethod
    def budget(ratio: float, n_tokens: int) -> int:
        return min(n_tokens, math.ceil(ratio * n_tokens - 1e-9))

    def exact_plan(self, image: ImageFeatures, alias: str) -> ImagePlan:
        return ImagePlan.exact(image.n_tokens, alias)

    def miss_plan(self, image: ImageFeatures) -> ImagePlan:
        return ImagePlan.full(HitKind.MISS, image.n_tokens)

    def prefetch_tokens(self, image: ImageFeatures, alias: ImageFeatures) -> torch.Tensor:
        """Tokens whose K/V (layers >= ``warmup_layers``) to read before warmup; default none."""
        return torch.zeros(0, dtype=torch.long)

    def plan(
        self, image: ImageFeatures, alias: ImageFeatures, prefetched: torch.Tensor, signals: WarmupSignals
    ) -> ImagePlan:
        raise NotImplementedError


def split_by_score(
    score: torch.Tensor, candidates: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(top ``k`` of ``candidates`` by ``score``, the rest), both sorted by token index; ties keep index order."""
    order = torch.sort(score[candidates], descending=True, stable=True).indices
    return candidates[order[:k]].sort().values, candidates[order[k:]].sort().values


def approximate_plan(policy: RoutingPolicy, image: ImageFeatures, alias: ImageFeatures, recompute, reuse,
                     mask=None, **extra) -> ImagePlan:
    """An approximate-hit plan; ``mask`` defaults to the tokens neither recomputed nor reused."""
    n = image.n_tokens
    if mask is None:
        rest = torch.ones(n, dtype=torch.bool)
        rest[recompute] = False
        rest[reuse] = False
        mask = torch.nonzero(rest).flatten()
    return ImagePlan(HitKind.APPROXIMATE, n, extra.pop("warmup_layers", policy.warmup_layers), recompute, reuse,
                     mask, alias.key, **extra)

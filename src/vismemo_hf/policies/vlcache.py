"""``vlcache``: layer-wise recompute budgets from an offline sensitivity profile (Qin et al., 2025).

At layer l the earliest ceil(r_l * N) visual tokens are recomputed and the rest reused.
The r_l follow a per-layer sensitivity profile (``vismemo profile-vlcache`` writes one to
``configs/vlcache/``), scaled so their mean is ``recompute_ratio`` and made non-increasing
with depth so the recomputed sets nest. Without a profile every layer gets the mean ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from vismemo_hf.core.plan import ImageFeatures, ImagePlan, WarmupSignals
from vismemo_hf.policies.base import RoutingPolicy, approximate_plan, register_policy


def load_profile(profile: str) -> list[float]:
    """Per-layer sensitivities from a YAML path or the name of a file in configs/vlcache/."""
    from vismemo_hf.presets import find, load

    data = load("vlcache", profile)
    assert data is not None  # without missing_ok, load raises for an unknown profile instead
    try:
        values = [float(x) for x in data["sensitivity"]]
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"VL-Cache profile {find('vlcache', profile)} needs `sensitivity:`, a list of numbers "
                         f"({type(err).__name__}: {err})") from None
    if not values:
        raise ValueError(f"VL-Cache profile {find('vlcache', profile)} has no sensitivities")
    return values


def layer_ratios(sensitivity: list[float], mean_ratio: float) -> list[float]:
    """r_l proportional to sensitivity, non-increasing with depth, clipped to [0, 1], mean = ``mean_ratio``."""
    s = torch.tensor(sensitivity, dtype=torch.float64).clamp_min(0) + 1e-12

    def shaped(scale: float) -> torch.Tensor:
        r = (scale * s).flip(0).cummax(0).values.flip(0)  # suffix max: never grows with depth
        return r.clamp(0, 1)

    lo, hi = 0.0, 1.0
    while shaped(hi).mean() < mean_ratio and hi < 1e12:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if shaped(mid).mean() < mean_ratio else (lo, mid)
    return shaped(hi).tolist()


@register_policy
@dataclass
class VLCachePolicy(RoutingPolicy):
    name: ClassVar[str] = "vlcache"

    warmup_layers: int = 0
    profile: str | None = None
    layer_recompute_ratios: list[float] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        #: the profile's sensitivities, read when the policy is built: an unknown or malformed profile is an error
        #: here, not at the first approximate hit
        self._sensitivity = None if self.profile is None else load_profile(self.profile)

    def ratios(self) -> list[float] | None:
        if self.layer_recompute_ratios is not None:
            return list(self.layer_recompute_ratios)
        if self._sensitivity is not None:
            return layer_ratios(self._sensitivity, self.recompute_ratio)
        return None

    def prefetch_tokens(self, image: ImageFeatures, alias: ImageFeatures) -> torch.Tensor:
        return torch.arange(image.n_tokens)

    def plan(self, image: ImageFeatures, alias: ImageFeatures, prefetched, signals: WarmupSignals) -> ImagePlan:
        n = image.n_tokens
        ratios = self.ratios()
        if ratios is None:  # one ratio for every layer
            counts = [self.budget(self.recompute_ratio, n)]
        else:
            counts = [min(n, math.ceil(r * n - 1e-9)) for r in ratios]
            counts = torch.tensor(counts).flip(0).cummax(0).values.flip(0).tolist()  # nest even if given unsorted
        # token i (earliest first) is computed at the layers whose budget exceeds i: a prefix of the layers
        until = (torch.tensor(counts)[None, :] > torch.arange(n)[:, None]).sum(1)
        always = until >= len(counts) if ratios is not None else until > 0
        recompute = torch.nonzero(always).flatten()
        reuse = torch.nonzero(~always).flatten()
        reuse_from = until[reuse] if ratios is not None else torch.zeros_like(reuse)
        return approximate_plan(self, image, alias, recompute, reuse, reuse_from=reuse_from.clamp_min(self.warmup_layers))

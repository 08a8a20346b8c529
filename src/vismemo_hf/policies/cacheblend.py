"""``cacheblend`` (Yao et al., 2025): recompute the tokens whose cached values deviate most at a check layer.

Layer 0 runs on all tokens. At the check layer (``warmup_layers``, default 1) the fresh
K/V of every visual token is projected from this request's hidden states and compared
with the alias's cached K/V; the ``recompute_ratio`` (default 15 %) with the largest
squared deviation (V by default, K with ``use_keys``) summed over heads and dims are
recomputed from the check layer on, the rest reused. Nothing is masked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vismemo_hf.core.plan import ImageFeatures, ImagePlan, WarmupSignals
from vismemo_hf.policies.base import RoutingPolicy, approximate_plan, register_policy, split_by_score


def kv_deviation(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """(H, N, D) x 2 -> (N,): squared deviation summed over heads and dims."""
    return (fresh.float() - cached.float().to(fresh.device)).pow(2).sum(dim=(0, 2)).cpu()


@register_policy
@dataclass
class CacheBlendPolicy(RoutingPolicy):
    name: ClassVar[str] = "cacheblend"
    needs_check_kv: ClassVar[bool] = True

    warmup_layers: int = 1
    recompute_ratio: float = 0.15
    use_keys: bool = False

    def prefetch_tokens(self, image: ImageFeatures, alias: ImageFeatures) -> torch.Tensor:
        return torch.arange(image.n_tokens)  # the check needs every token's cached K/V

    def plan(self, image: ImageFeatures, alias: ImageFeatures, prefetched, signals: WarmupSignals) -> ImagePlan:
        if signals.fresh_kv is None or signals.cached_kv is None:
            raise ValueError("cacheblend needs the fresh and cached K/V of the check layer")
        which = 0 if self.use_keys else 1
        score = kv_deviation(signals.fresh_kv[which], signals.cached_kv[which])
        n = image.n_tokens
        recompute, reuse = split_by_score(score, torch.arange(n), self.budget(self.recompute_ratio, n))
        return approximate_plan(self, image, alias, recompute, reuse)

"""Routing policies, one per file, selected by name: ``VisMemoCache(policy="vismemo")``.

A policy turns (new image, alias, warmup signals) into an ``ImagePlan``; it never touches
the model or the store. Register a new one with ``@register_policy``.
"""

from __future__ import annotations

from vismemo_hf.policies import attend_deviate, attention_only, cacheblend, full, naive, pixel_patch, vismemo, vlcache  # noqa: F401  (register)
from vismemo_hf.policies.base import ContextRouting, RoutingPolicy, available_policies, get_policy, register_policy

__all__ = ["ContextRouting", "RoutingPolicy", "available_policies", "get_policy", "register_policy"]

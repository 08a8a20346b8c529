"""vismemo-hf: approximate visual KV-cache reuse for vision-language models (Qwen-VL, GLM-4V, LLaVA-OneVision)
in transformers.

    import vismemo_hf
    vismemo_hf.enable(model)
    out = model.generate(**inputs, cache=vismemo_hf.VisMemoCache(), max_new_tokens=64)

Data path, one file per step: ``lookup`` -> ``policies`` (make an ``ImagePlan``) ->
``runner`` + ``cache`` + ``attention`` (execute) -> ``store``.

The public names are imported on first use (PEP 562), so that ``import vismemo_hf`` and ``vismemo --help`` do not
load torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "CacheEvent": "vismemo_hf.core.plan",
    "HitKind": "vismemo_hf.core.plan",
    "ImageFeatures": "vismemo_hf.core.plan",
    "ImagePlan": "vismemo_hf.core.plan",
    "WarmupSignals": "vismemo_hf.core.plan",
    "LookupThresholds": "vismemo_hf.core.thresholds",
    "ContextRouting": "vismemo_hf.policies",
    "RoutingPolicy": "vismemo_hf.policies",
    "available_policies": "vismemo_hf.policies",
    "get_policy": "vismemo_hf.policies",
    "register_policy": "vismemo_hf.policies",
    "VisMemoCache": "vismemo_hf.runtime.cache",
    "VisMemoLayer": "vismemo_hf.runtime.cache",
    "VLCacheCompression": "vismemo_hf.runtime.compress",
    "disable": "vismemo_hf.runtime.hooks",
    "enable": "vismemo_hf.runtime.hooks",
    "enabled": "vismemo_hf.runtime.hooks",
    "Entry": "vismemo_hf.store.entry",
    "VisMemoStore": "vismemo_hf.store.store",
    "default_store": "vismemo_hf.store.store",
}

if TYPE_CHECKING:
    from vismemo_hf.core.plan import CacheEvent, HitKind, ImageFeatures, ImagePlan, WarmupSignals
    from vismemo_hf.core.thresholds import LookupThresholds
    from vismemo_hf.policies import ContextRouting, RoutingPolicy, available_policies, get_policy, register_policy
    from vismemo_hf.runtime.cache import VisMemoCache, VisMemoLayer
    from vismemo_hf.runtime.compress import VLCacheCompression
    from vismemo_hf.runtime.hooks import disable, enable, enabled
    from vismemo_hf.store.entry import Entry
    from vismemo_hf.store.store import VisMemoStore, default_store

__all__ = [
    "CacheEvent",
    "ContextRouting",
    "Entry",
    "HitKind",
    "ImageFeatures",
    "ImagePlan",
    "LookupThresholds",
    "RoutingPolicy",
    "VisMemoCache",
    "VisMemoLayer",
    "VisMemoStore",
    "VLCacheCompression",
    "WarmupSignals",
    "available_policies",
    "default_store",
    "disable",
    "enable",
    "enabled",
    "get_policy",
    "register_policy",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vismemo_hf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

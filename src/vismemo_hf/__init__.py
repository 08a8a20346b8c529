"""vismemo-hf: approximate visual KV-cache reuse for Qwen-VL models in transformers.

    import vismemo_hf
    vismemo_hf.enable(model)
    out = model.generate(**inputs, cache=vismemo_hf.VisMemoCache(), max_new_tokens=64)

Data path, one file per step: ``lookup`` -> ``policies`` (make an ``ImagePlan``) ->
``runner`` + ``cache`` + ``attention`` (execute) -> ``store``.
"""

from vismemo_hf.core.plan import CacheEvent, HitKind, ImageFeatures, ImagePlan, WarmupSignals
from vismemo_hf.core.thresholds import LookupThresholds
from vismemo_hf.policies import RoutingPolicy, available_policies, get_policy, register_policy
from vismemo_hf.runtime.cache import VisMemoCache, VisMemoLayer
from vismemo_hf.runtime.compress import VLCacheCompression
from vismemo_hf.runtime.hooks import disable, enable, enabled
from vismemo_hf.store.entry import Entry
from vismemo_hf.store.store import VisMemoStore, default_store

__version__ = "0.1.0"

__all__ = [
    "CacheEvent",
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

"""vismemo-hf: approximate visual KV-cache reuse for Qwen-VL models in transformers.

    import vismemo_hf
    vismemo_hf.enable(model)
    out = model.generate(**inputs, past_key_values=vismemo_hf.VisMemoCache(), max_new_tokens=64)

Data path, one file per step: ``lookup`` -> ``policies`` (make an ``ImagePlan``) ->
``runner`` + ``cache`` + ``attention`` (execute) -> ``store``.
"""

from .cache import VisMemoCache, VisMemoLayer
from .compress import VLCacheCompression
from .entry import Entry
from .hooks import disable, enable, enabled
from .plan import CacheEvent, HitKind, ImageFeatures, ImagePlan, WarmupSignals
from .policies import RoutingPolicy, available_policies, get_policy, register_policy
from .store import VisMemoStore, default_store

__version__ = "0.1.0"

__all__ = [
    "CacheEvent",
    "Entry",
    "HitKind",
    "ImageFeatures",
    "ImagePlan",
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

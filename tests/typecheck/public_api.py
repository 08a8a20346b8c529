"""The public API used as README.md's "Use" section uses it, for mypy (``tests/test_types.py``; never run).

mypy checks this module with ``disallow_any_expr`` (pyproject.toml ``[tool.mypy]``): no expression here may have a
type that is or contains ``Any``. ``SIGNATURES`` names the public functions, classes and methods as values (mypy
lets a call's callee be ``Any``-typed, not a value), so one of them missing one annotation (a parameter then typed
``Any``, or an unknown return) fails the check; ``assert_type`` pins what the calls give back. ``VLModel``
stands for what ``AutoModelForImageTextToText.from_pretrained`` returns: transformers' modeling code is not
followed (only ``transformers.cache_utils``, whose ``Cache`` a ``VisMemoCache`` is), to keep the check fast.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from transformers.cache_utils import Cache
from typing_extensions import assert_type

import vismemo_hf
from vismemo_hf import (
    CacheEvent,
    Entry,
    HitKind,
    ImageFeatures,
    ImagePlan,
    LookupThresholds,
    RoutingPolicy,
    VisMemoCache,
    VisMemoLayer,
    VisMemoStore,
    VLCacheCompression,
    WarmupSignals,
)


class VLModel(torch.nn.Module):
    """A Qwen-VL ``*ForConditionalGeneration`` as far as this file needs one."""

    def generate(self, *, cache: Cache, max_new_tokens: int, **inputs: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def readme_use(model: VLModel, inputs: dict[str, torch.Tensor]) -> None:
    assert_type(vismemo_hf.enable(model), VLModel)  # once per model: hooks + attention function
    store = vismemo_hf.VisMemoStore()
    assert_type(store, VisMemoStore)
    cache = vismemo_hf.VisMemoCache(store=store)  # one cache per generate call
    assert_type(cache, VisMemoCache)
    out = model.generate(**inputs, cache=cache, max_new_tokens=64)
    assert_type(out, torch.Tensor)
    for event in cache.events:  # one per image (per copy under beam search)
        assert_type(event, CacheEvent)
        assert_type(event.kind, HitKind)
        assert_type(event.alias, str | None)
        assert_type(event.recomputed, int)
        assert_type(event.reused, int)
        assert_type(event.masked, int)
        assert_type(event.prefix_changed, bool)
        assert_type(event.fallback, str | None)
        assert_type(event.bytes_read, int)
        assert_type(event.timings, dict[str, float])
        assert_type(event.plan, ImagePlan | None)
    assert_type(vismemo_hf.disable(model), VLModel)
    with vismemo_hf.enabled(model) as enabled:  # for a block only
        assert_type(enabled, VLModel)
    with vismemo_hf.enabled(model, image_mean=(0.5, 0.5, 0.5), image_std=[0.5, 0.5, 0.5]):
        pass


def stores_and_caches(model: VLModel) -> None:
    vismemo_hf.enable(model, image_mean=(0.48, 0.46, 0.41), image_std=(0.27, 0.26, 0.28))
    assert_type(vismemo_hf.default_store(), VisMemoStore)
    store = VisMemoStore(device_bytes="1GiB", host_bytes=2**30, disk_dir="/tmp/vismemo", disk_bytes="8 GiB",
                         device=torch.device("cpu"), protect=2, victim_share=0.1, kv_format="int8", keep_ratio=0.5,
                         thresholds=["qwen2.5-vl-7b"], secret=False, namespace="tenant",
                         remote_options={"prefix": "vismemo", "timeout_s": 0.5})
    VisMemoStore(device_bytes={"cuda:0": "8GiB", "cuda:1": None}, remote_url="redis://localhost:6379/0")
    assert_type(VisMemoStore.from_config("default", kv_format="int8"), VisMemoStore)
    assert_type(store.thresholds_for("fingerprint"), LookupThresholds | None)
    assert_type(len(store), int)
    assert_type("key" in store, bool)
    assert_type(store.tier_of("key"), str | None)
    store.add_thresholds(LookupThresholds.load("qwen2.5-vl-7b"))
    store.flush()
    store.close()
    cache = VisMemoCache(store=store, policy="vismemo", warmup_layers=3, recompute_ratio=0.3, reuse_ratio=0.1,
                         thresholds=LookupThresholds(tau=0.8, tau_fine=0.85), tau=0.8, tau_fine=None, top_k=5,
                         store_misses=True, compress=VLCacheCompression(ratio=0.1), namespace="tenant", model=model,
                         context={"routing": "check"})
    VisMemoCache(policy=vismemo_hf.get_policy("cacheblend", recompute_ratio=0.15), thresholds="qwen2.5-vl-7b")
    assert_type(cache.events, list[CacheEvent])
    assert_type(cache.store, VisMemoStore)
    assert_type(cache.policy, RoutingPolicy)
    assert_type(cache.lookup_thresholds("fingerprint"), LookupThresholds)
    assert_type(cache.get_seq_length(), int)


@vismemo_hf.register_policy
class EveryTokenReused(RoutingPolicy):
    """A routing of one's own (README: ``@register_policy`` adds one)."""

    name: ClassVar[str] = "every-token-reused"

    def plan(self, image: ImageFeatures, alias: ImageFeatures, prefetched: torch.Tensor,
             signals: WarmupSignals) -> ImagePlan:
        return ImagePlan.exact(image.n_tokens, alias.key)


def policies() -> None:
    assert_type(EveryTokenReused, type[EveryTokenReused])
    assert_type(vismemo_hf.available_policies(), list[str])
    policy = vismemo_hf.get_policy("every-token-reused", warmup_layers=1)
    assert_type(policy, RoutingPolicy)
    assert_type(policy.miss_plan(ImageFeatures("key", (1, 4, 4), torch.zeros(4, 8))), ImagePlan)
    plan = ImagePlan.full(HitKind.MISS, 4)
    assert_type(plan.complete, bool)
    assert_type(plan.computed_at(0), torch.Tensor)
    thresholds = LookupThresholds.load("qwen2.5-vl-7b")
    assert_type(thresholds.tau_fine, float)
    assert_type(thresholds.fingerprint, str | None)


#: every public function, class (its constructor) and method, each checked as a value: none may take or give ``Any``.
#: Left out: what returns JSON-like dicts (``VisMemoStore.stats``, ``CacheEvent.as_dict``, ``LookupThresholds.as_dict``,
#: ``RoutingPolicy.verification``) and the transformers ``Cache`` methods ``VisMemoCache`` / ``VisMemoLayer`` inherit.
SIGNATURES: list[object] = [
    vismemo_hf.enable, vismemo_hf.disable, vismemo_hf.enabled, vismemo_hf.default_store, vismemo_hf.get_policy,
    vismemo_hf.register_policy, vismemo_hf.available_policies,
    VisMemoStore, VisMemoStore.from_config, VisMemoStore.put, VisMemoStore.put_later, VisMemoStore.flush,
    VisMemoStore.clear, VisMemoStore.get, VisMemoStore.peek, VisMemoStore.get_tokens, VisMemoStore.lookup_section,
    VisMemoStore.candidates, VisMemoStore.reference, VisMemoStore.set_reference, VisMemoStore.add_thresholds,
    VisMemoStore.thresholds_for, VisMemoStore.discard, VisMemoStore.record, VisMemoStore.tier_of, VisMemoStore.close,
    VisMemoCache, VisMemoCache.owner, VisMemoCache.lookup_thresholds, VisMemoCache.layer, VisMemoCache.update,
    VisMemoCache.get_seq_length, VisMemoCache.get_mask_sizes, VisMemoCache.crop, VisMemoCache.reorder_cache,
    VisMemoCache.batch_repeat_interleave, VisMemoCache.batch_select_indices, VisMemoCache.reset,
    VisMemoCache.restart, VisMemoCache.rewound_to, VisMemoCache.drop_layers, VisMemoCache.advance,
    VisMemoLayer, VisMemoLayer.open, VisMemoLayer.preload, VisMemoLayer.update, VisMemoLayer.attention_mask,
    VisMemoLayer.slot_columns, VisMemoLayer.keep_slots, VisMemoLayer.settle, VisMemoLayer.slot_of,
    RoutingPolicy, RoutingPolicy.signal_needs, RoutingPolicy.decision_layer, RoutingPolicy.early_plan,
    RoutingPolicy.prefetch, RoutingPolicy.route, RoutingPolicy.budget, RoutingPolicy.exact_plan,
    RoutingPolicy.context_recompute, RoutingPolicy.context_plan, RoutingPolicy.miss_plan,
    RoutingPolicy.prefetch_tokens, RoutingPolicy.plan,
    LookupThresholds, LookupThresholds.load, LookupThresholds.fine_for, LookupThresholds.near,
    LookupThresholds.matches,
    ImagePlan, ImagePlan.exact, ImagePlan.full, ImagePlan.computed_at, ImagePlan.computed_count_at,
    ImagePlan.reuse_selected_at, ImagePlan.reused_at, ImagePlan.limited_to,
    ImageFeatures, ImageFeatures.stored, ImageFeatures.stored_rows, ImageFeatures.moved,
    CacheEvent, WarmupSignals, Entry, Entry.features, Entry.compressed, Entry.check, VLCacheCompression,
    VLCacheCompression.keep, HitKind,
]

"""``enable(model)`` / ``disable(model)`` / ``with enabled(model)``: install and remove what routes a model's
forwards through VisMemo. Nothing is copied from the modeling code, and the model keeps its own attention
implementation: only a forward that runs a slot layout (reused or masked tokens) routes the text model's attention
to the ``"vismemo"`` function, for its duration and in its own thread.

Installed on the model (every piece is a module-level function bound to the module it serves, so a
``copy.deepcopy`` of an enabled model runs with its own modules, and ``disable`` finds the pieces by identity):

* a forward pre-hook and hook on the base model: open and close the forward's ``ForwardContext``, run the lookup
  of a prefill with images;
* the text model's ``forward``: the prefill runner when the lookup asks for it, else the model's own forward;
* the base model's ``get_image_features``: inside ``generate`` with a ``VisMemoCache`` the images are encoded on
  first use (so exact hits skip the vision tower); everywhere else it is the model's own;
* the generation model's ``_prepare_multimodal_encoder_kwargs_for_generation``: marks that deferral;
* the generation model's ``generate``: the model's own, counted as a request in progress (the store's writer
  starts its background jobs between requests);
* on the attention modules of the text model and the vision tower, a ``families.routing.ConfigView`` of their config:
  a forward that needs VisMemo's attention routes them to it in its own thread, never for the model as a whole.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch
from transformers import PretrainedConfig

from vismemo_hf.families import ModelAdapter, routing, tower_kv
from vismemo_hf.families.base import execution_device
from vismemo_hf.runtime import attention, forward, reference
from vismemo_hf.runtime import gate as gates
from vismemo_hf.runtime import keys as keys_ahead
from vismemo_hf.runtime import prefix as prefixes
from vismemo_hf.runtime.cache import VisMemoCache
from vismemo_hf.runtime.lookup import DeferredImageFeatures, lookup_request
from vismemo_hf.runtime.runner import computed_in_full, finish_native, run_prefill
from vismemo_hf.store.background import ACTIVITY

#: the model ``enable`` / ``disable`` / ``enabled`` are given, and return
ModelT = TypeVar("ModelT", bound="torch.nn.Module")

#: set while ``generate`` pre-encodes the images of a request that has a VisMemoCache
_DEFER_IMAGES: ContextVar[bool] = ContextVar("vismemo_defer_images", default=False)
_PREPARE = "_prepare_multimodal_encoder_kwargs_for_generation"
#: the tokens that restore ``prefix.LAST_ONLY`` after each generation-model forward in progress in this context
_LAST_TOKENS: ContextVar[tuple] = ContextVar("vismemo_last_tokens", default=())


def _cache_of(kwargs) -> VisMemoCache | None:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return cache if isinstance(cache, VisMemoCache) else None


def _call_own(module, name: str, *args, **kwargs):
    """Call what ``enable`` replaced: the instance attribute it found (accelerate's wrapper, say) or the class's
    function (both recorded at ``enable``, so that ``torch.compile`` traces them as plain calls)."""
    instance, function = module._vismemo_installation.replaced[name]
    if instance is not None:
        return instance(*args, **kwargs)
    return function(module, *args, **kwargs)


def _own(module, name: str):
    """What ``enable`` replaced, as a callable (for code that keeps it, like a deferred encoder)."""
    return functools.partial(_call_own, module, name)


# -- the installed pieces ---------------------------------------------------------------------------------
def _image_features(self, pixel_values, *args, **kwargs):
    if _DEFER_IMAGES.get():
        kwargs.setdefault("return_dict", True)
        deferred = DeferredImageFeatures(_own(self, "get_image_features"), pixel_values, args, kwargs)
        adapter = getattr(self, "_vismemo", None)
        if adapter is not None:  # the exact keys' hashing overlaps generate's preparation of the prefill
            deferred.keys = keys_ahead.start(adapter, pixel_values, adapter.deferred_geometry(deferred))
        return deferred
    return _call_own(self, "get_image_features", pixel_values, *args, **kwargs)


def _signed_as(function, original):
    """A copy of ``function`` that shows ``original``'s signature: ``generate`` reads the encoder's parameters to
    choose what it passes (and takes out of the forward's arguments), so the installed encoder must name the
    family's own (``image_grid_thw``, ``image_sizes``, ``batch_num_images``, ...)."""
    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__, copy.__doc__, copy.__qualname__ = function.__kwdefaults__, function.__doc__, \
        function.__qualname__
    copy.__signature__ = inspect.signature(original)
    return copy


def _generate(self, *args, **kwargs):
    """The model's own ``generate``, counted as a request in progress: the store's writer starts its background jobs
    between requests, not between a request's decoding steps (``store.background.Activity``)."""
    ACTIVITY.enter()
    try:
        return _call_own(self, "generate", *args, **kwargs)
    finally:
        ACTIVITY.leave()
        cache = _cache_of(kwargs)
        if cache is not None:
            forward.settle_gate(cache)  # a generate of one token: its prefill ends here


def _prepare_multimodal(self, model_kwargs, *args, **kwargs):
    token = _DEFER_IMAGES.set(_cache_of(model_kwargs) is not None)
    try:
        return _call_own(self, _PREPARE, model_kwargs, *args, **kwargs)
    finally:
        _DEFER_IMAGES.reset(token)


def _before(module, args, kwargs):
    cache = _cache_of(kwargs)
    adapter = getattr(module, "_vismemo", None)
    if cache is None or adapter is None:
        return None
    if kwargs.get("use_cache") is False:
        raise ValueError(
            "a VisMemoCache needs use_cache=True: with use_cache=False the model does not keep the reused K/V "
            "and would compute wrong logits; drop use_cache=False, or pass no cache to run without VisMemo")
    ctx = forward.open_forward(cache, kwargs.get("attention_mask"), adapter)
    try:
        return args, _look_up(ctx, adapter, kwargs)
    except BaseException:
        forward.close_forward(ctx, 0)
        raise


def _look_up(ctx, adapter, kwargs):
    encoded = dict(kwargs.get("mm_encoder_outputs") or {})
    deferred = encoded.get("image")
    deferred = deferred if isinstance(deferred, DeferredImageFeatures) and not deferred.looked_up else None
    expand, ran, ahead = 1, None, None
    if kwargs.get("pixel_values") is not None:
        pixels, grids = kwargs["pixel_values"], adapter.image_geometry(kwargs)
    elif deferred is not None:  # generate() asked for the encoder before the prefill (and maybe expanded it)
        pixels, grids, expand, ran, ahead = deferred.pixel_values, adapter.deferred_geometry(deferred), \
            deferred.expand_factor, deferred.encoded, deferred.keys
    else:
        return kwargs
    ids = kwargs.get("input_ids")
    full_outputs = kwargs.get("output_attentions") or kwargs.get("output_hidden_states")
    if ids is None or ctx.cache.get_seq_length() > 0 or full_outputs:
        # no ids to find the images by, a continuation of a cache, or every layer's outputs asked for: the images
        # are computed as the model computes them (nothing looked up, nothing stored; a deferred encoder output
        # resolves on first use, generate's expansion of it included)
        return kwargs
    cache = ctx.cache
    cache.serve(adapter.fingerprint)  # the policy with the model's calibrated context tolerance, where it has one
    gate = gates.gate_for(adapter, repr(cache.policy)) if cache.approximate == "auto" else None
    looks = cache.approximate != "never" and (gate is None or gate.looks())
    request, outputs = lookup_request(adapter, cache, ids, pixels, grids, _own(adapter.base, "get_image_features"),
                                      ctx.valid, expand=expand, encoded=ran, videos=_videos(kwargs, encoded),
                                      token_types=kwargs.get("mm_token_type_ids"), approximate=looks,
                                      digests=ahead.digests(pixels, adapter.image_count(grids)) if ahead else None)
    ctx.request = request
    if gate is not None:
        ctx.gate = (gate, looks, request.approximate_ms, int(ids.numel()))
    if deferred is not None:
        deferred.provide(outputs)
    encoded["image"] = outputs
    return {**kwargs, "pixel_values": None, "mm_encoder_outputs": encoded}


def _videos(kwargs, encoded):
    """What identifies each video of the request (for the context hash of the images after it): its pixels when the
    forward has them, else its encoder output (``generate`` encodes videos before the prefill)."""
    if kwargs.get("pixel_values_videos") is not None:
        return kwargs["pixel_values_videos"], kwargs.get("video_grid_thw")
    video = encoded.get("video")
    if video is not None and getattr(video, "pooler_output", None) is not None:
        return tuple(video.pooler_output), kwargs.get("video_grid_thw")
    return None


def _after(module, args, kwargs, output):
    cache = _cache_of(kwargs)
    ctx = forward.current(cache) if cache is not None else None
    if ctx is None:
        return None
    ids = kwargs.get("input_ids")
    forward.close_forward(ctx, ids.shape[1] if ids is not None else kwargs["inputs_embeds"].shape[1])
    return None


def _text_forward(self, *args, **kwargs):
    cache = _cache_of(kwargs)
    ctx = forward.current(cache) if cache is not None else None
    if ctx is None:
        return _call_own(self, "forward", *args, **kwargs)
    request = ctx.take_request()
    if request is not None and request.prefix is not None and request.prefix.length:
        out = _after_prefix(self, ctx, request, kwargs)
        finish_native(ctx.adapter, request, ctx, kwargs.get("position_ids"))
        prefixes.slide_later(ctx.adapter, cache, request.prefix, request.images, kwargs)
        return out
    plans = None
    if request is not None and request.needs_runner:
        plans = computed_in_full(ctx.adapter, cache, request)  # nothing reused: the model's own forward runs it
    if request is not None and request.needs_runner and plans is None:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "cache")}
        with attention.slot_attention(self.layers[0].self_attn.config):
            out = run_prefill(ctx.adapter, request, **{**kwargs, "ctx": ctx})
        prefixes.slide_later(ctx.adapter, cache, request.prefix, request.images, kwargs)
        return out
    if cache.mapped:  # decoding over a layout with left-out slots: the slot masks
        with attention.slot_attention(self.layers[0].self_attn.config):
            out = _call_own(self, "forward", *args, **kwargs)
    else:
        out = _call_own(self, "forward", *args, **kwargs)
    if request is not None:  # a prefill the model computed itself: its complete images become entries
        finish_native(ctx.adapter, request, ctx, kwargs.get("position_ids"), plans)
        prefixes.slide_later(ctx.adapter, cache, request.prefix, request.images, kwargs)
    elif cache.watch is not None:  # an answer after a reuse: computed in full when the model is unsure of it
        if args:
            cache.watch = None
        else:
            out = cache.watch.after_step(self, kwargs, out, cache, ctx.adapter.output_head, _own_forward)
    return out


def _after_prefix(text, ctx, request, kwargs):
    """The text model's own forward over the tokens after a reused prefix (``runtime.prefix``), the prefix's K/V in
    the cache first, as in a continuation of a cache."""
    length = request.prefix.length
    prefixes.preload(ctx.cache, request.prefix, lambda i: execution_device(text.layers[i]))
    ctx.reused_prefix = length
    return _call_own(text, "forward", **prefixes.suffix(kwargs, length))


def _last_only(module, args, kwargs):
    """Before the generation model's forward: whether its caller reads the last position's logits only. A compiled
    forward (``torch.compile``, a compiled decoding step) is a decoding step: nothing to record, and dynamo cannot
    trace a ``ContextVar.set``."""
    if torch.compiler.is_compiling():
        return
    keep = kwargs.get("logits_to_keep")
    last = isinstance(keep, int) and keep == 1 and kwargs.get("labels") is None
    _LAST_TOKENS.set((*_LAST_TOKENS.get(), prefixes.LAST_ONLY.set(last)))


def _last_only_done(module, args, kwargs, output):
    if torch.compiler.is_compiling():
        return
    tokens = _LAST_TOKENS.get()
    if tokens:
        prefixes.LAST_ONLY.reset(tokens[-1])
        _LAST_TOKENS.set(tokens[:-1])


def _own_forward(module, **kwargs):
    return _call_own(module, "forward", **kwargs)


# -- installation -----------------------------------------------------------------------------------------
@dataclass
class _Installation:
    """What ``enable`` changed on one module: name -> (the instance attribute it replaced or None, the class's
    function)."""

    replaced: dict = field(default_factory=dict)


def _replace(module, name: str, function) -> None:
    own = module.__dict__.get(name)
    record = module.__dict__.setdefault("_vismemo_installation", _Installation())
    record.replaced[name] = (own, getattr(type(module), name))
    setattr(module, name, types.MethodType(function, module))


def _restore(module) -> None:
    installation = module.__dict__.pop("_vismemo_installation", None)
    if installation is None:
        return
    for name, (own, _) in installation.replaced.items():
        if own is None:
            module.__dict__.pop(name, None)
        else:
            setattr(module, name, own)


def _routed(adapter) -> list:
    """The parts whose attention modules a forward routes to VisMemo's functions (``families.routing``): the text
    model, and the vision tower when it has a config of its own (whose K/V partial encodes are lent)."""
    visual = getattr(adapter.base, "visual", None)
    return [adapter.text] + ([visual] if isinstance(getattr(visual, "config", None), PretrainedConfig) else [])


def enable(model: ModelT, *, image_mean: Sequence[float] | None = None,
           image_std: Sequence[float] | None = None) -> ModelT:
    """Prepare a model of a supported family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL (-MoE), GLM-4.1V, GLM-4.6V, GLM-4.5V;
    ``families.FAMILIES``), its ``*ForConditionalGeneration`` or its base ``*Model``, for ``VisMemoCache``; returns
    the model.

    Idempotent (a second call refreshes the normalisation; the model fingerprint follows weight changes by
    itself). ``image_mean`` / ``image_std`` override the family's processor normalisation (used to recover pixels
    for patch entropy). The model keeps its attention implementation. The lookup's one-time setup (encoding the
    reference images with the model's tower, ``runtime.reference``) runs here, not in the first request.
    """
    previous = getattr(model, "_vismemo", None)
    if previous is not None:
        refreshed = ModelAdapter.for_model(model, image_mean=image_mean, image_std=image_std)
        previous.image_mean, previous.image_std = refreshed.image_mean, refreshed.image_std
        previous._weights.params = None  # parameters are listed again
        return model
    adapter = ModelAdapter.for_model(model, image_mean=image_mean, image_std=image_std)
    attention.register()
    for root in _routed(adapter):
        routing.install(routing.attention_modules(root, root.config), root.config)
    base, text = adapter.base, adapter.text
    _replace(base, "get_image_features", _signed_as(_image_features, type(base).get_image_features))
    _replace(text, "forward", _text_forward)
    if hasattr(model, _PREPARE):
        _replace(model, _PREPARE, _prepare_multimodal)
    if hasattr(model, "generate"):
        _replace(model, "generate", _signed_as(_generate, cast(Any, type(model)).generate))  # a GenerationMixin
    base.register_forward_pre_hook(_before, with_kwargs=True)
    base.register_forward_hook(_after, with_kwargs=True, always_call=True)
    if model is not base:
        model.register_forward_pre_hook(_last_only, with_kwargs=True)
        model.register_forward_hook(_last_only_done, with_kwargs=True, always_call=True)
    for module in {id(m): m for m in (model, base, text)}.values():
        module._vismemo = adapter
    reference.prepare(adapter, _own(base, "get_image_features"))  # the one-time setup, here instead of a request's
    tower_kv.register()  # what a miss's encode would first import and register
    return model


def disable(model: ModelT) -> ModelT:
    """Undo ``enable``: hooks removed, the replaced methods and the attention modules' configs restored; the model
    then computes exactly as before ``enable``. Returns the model."""
    adapter = getattr(model, "_vismemo", None)
    if adapter is None:
        return model
    base, text = adapter.base, adapter.text
    for module in {id(m): m for m in (model, base)}.values():
        for hooks, ours in ((module._forward_pre_hooks, (_before, _last_only)),
                            (module._forward_hooks, (_after, _last_only_done))):
            for hook_id in [i for i, hook in hooks.items() if hook in ours]:
                del hooks[hook_id]
                module._forward_hooks_with_kwargs.pop(hook_id, None)
                module._forward_pre_hooks_with_kwargs.pop(hook_id, None)
                module._forward_hooks_always_called.pop(hook_id, None)
    for root in _routed(adapter):
        routing.uninstall(routing.attention_modules(root, root.config))
    for module in {id(m): m for m in (model, base, text)}.values():
        _restore(module)
        module.__dict__.pop("_vismemo", None)
    return model


@contextlib.contextmanager
def enabled(model: ModelT, **options: Sequence[float] | None) -> Iterator[ModelT]:
    """``with enabled(model): ...``: VisMemo for the block only (a model enabled before stays enabled)."""
    already = getattr(model, "_vismemo", None) is not None
    enable(model, **options)
    try:
        yield model
    finally:
        if not already:
            disable(model)

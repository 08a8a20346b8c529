"""``enable(model)`` / ``disable(model)`` / ``with enabled(model)``: install and remove the lookup hooks, the
prefill runner and the attention function. Nothing is copied from the modeling code; ``disable`` puts back
exactly what ``enable`` replaced."""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field

from vismemo_hf.families import ModelAdapter
from vismemo_hf.runtime import attention, context
from vismemo_hf.runtime.cache import VisMemoCache
from vismemo_hf.runtime.lookup import DeferredImageFeatures, lookup_request
from vismemo_hf.runtime.runner import run_prefill


def _cache_of(kwargs) -> VisMemoCache | None:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return cache if isinstance(cache, VisMemoCache) else None


def enable(model, *, image_mean=None, image_std=None):
    """Prepare a Qwen2-VL / Qwen2.5-VL / Qwen3-VL model for ``VisMemoCache``; returns the model.

    Idempotent (a second call refreshes the model fingerprint, e.g. after loading new
    weights). Attention runs through SDPA. ``image_mean`` / ``image_std`` override the
    family's processor normalisation (used to recover pixels for patch entropy).
    """
    adapter = ModelAdapter.for_model(model, image_mean=image_mean, image_std=image_std)
    previous = getattr(model, "_vismemo", None)
    if previous is not None:
        previous.fingerprint, previous.image_mean, previous.image_std = (
            adapter.fingerprint, adapter.image_mean, adapter.image_std)
        return model
    attention.register()
    base, text = adapter.base, adapter.text
    undo = _Installation(previous_attention=model.config.text_config._attn_implementation,
                         own_attributes={(m, name): m.__dict__[name] for m, name in
                                         ((base, "get_image_features"), (text, "forward")) if name in m.__dict__})
    sub_config = next(name for name in model.config.sub_configs if getattr(model.config, name) is
                      model.config.text_config)
    model.set_attn_implementation({sub_config: attention.ATTENTION_NAME})
    undo.sub_config = sub_config
    get_image_features = base.get_image_features

    def deferred_image_features(pixel_values, image_grid_thw=None, **kwargs):
        kwargs.setdefault("return_dict", True)
        return DeferredImageFeatures(get_image_features, pixel_values, image_grid_thw, kwargs)

    text_forward = text.forward

    def before(module, args, kwargs):
        cache = _cache_of(kwargs)
        if cache is None:
            return None
        if kwargs.get("use_cache") is False:
            raise ValueError(
                "a VisMemoCache needs use_cache=True: with use_cache=False the model does not keep the reused K/V "
                "and would compute wrong logits; drop use_cache=False, or pass no past_key_values to run "
                "without VisMemo")
        ctx = context.open_forward(cache, kwargs.get("attention_mask"))
        try:
            return args, _look_up_images(ctx, kwargs)
        except BaseException:
            context.close_forward(ctx, 0)
            raise

    def _look_up_images(ctx, kwargs):
        encoded = dict(kwargs.get("mm_encoder_outputs") or {})
        deferred = encoded.get("image")
        deferred = deferred if isinstance(deferred, DeferredImageFeatures) and not deferred.looked_up else None
        expand, ran = 1, None
        if kwargs.get("pixel_values") is not None:
            pixels, grids = kwargs["pixel_values"], kwargs["image_grid_thw"]
        elif deferred is not None:  # generate() asked for the encoder before the prefill (and maybe expanded it)
            pixels, grids, expand, ran = (deferred.pixel_values, deferred.image_grid_thw, deferred.expand_factor,
                                          deferred.encoded)
        else:
            return kwargs
        request, outputs = lookup_request(adapter, ctx.cache, kwargs.get("input_ids"), pixels, grids,
                                          get_image_features, ctx.valid, expand=expand, encoded=ran)
        ctx.request = request
        if deferred is not None:
            deferred.provide(outputs)
        encoded["image"] = outputs
        return {**kwargs, "pixel_values": None, "mm_encoder_outputs": encoded}

    def after(module, args, kwargs, output):
        cache = _cache_of(kwargs)
        ctx = context.current(cache) if cache is not None else None
        if ctx is None:
            return None
        ids = kwargs.get("input_ids")
        context.close_forward(ctx, ids.shape[1] if ids is not None else kwargs["inputs_embeds"].shape[1])
        return None

    def forward(self, *args, **kwargs):
        cache = _cache_of(kwargs)
        ctx = context.current(cache) if cache is not None else None
        if ctx is not None and ctx.request is not None:
            kwargs = {k: v for k, v in kwargs.items() if k != "past_key_values"}
            return run_prefill(adapter, ctx.take_request(), **{**kwargs, "ctx": ctx})
        return text_forward(*args, **kwargs)

    base.get_image_features = deferred_image_features
    undo.handles.append(base.register_forward_pre_hook(before, with_kwargs=True))
    undo.handles.append(base.register_forward_hook(after, with_kwargs=True, always_call=True))
    text.forward = types.MethodType(forward, text)
    model._vismemo = adapter
    model._vismemo_installation = undo
    return model


@dataclass
class _Installation:
    """What ``enable`` changed on a model, to put back."""

    previous_attention: str | None
    own_attributes: dict  # (module, name) -> the instance attribute it had before (e.g. accelerate's forward)
    sub_config: str = "text_config"
    handles: list = field(default_factory=list)


def disable(model):
    """Undo ``enable``: hooks removed, ``forward`` / ``get_image_features`` and the text model's attention
    implementation restored; the model then computes exactly as before ``enable``. Returns the model."""
    undo = getattr(model, "_vismemo_installation", None)
    if undo is None:
        return model
    adapter = model._vismemo
    for handle in undo.handles:
        handle.remove()
    for module, name in ((adapter.base, "get_image_features"), (adapter.text, "forward")):
        if (module, name) in undo.own_attributes:
            setattr(module, name, undo.own_attributes[(module, name)])
        else:
            module.__dict__.pop(name, None)
    model.set_attn_implementation({undo.sub_config: undo.previous_attention})
    del model._vismemo, model._vismemo_installation
    return model


@contextlib.contextmanager
def enabled(model, **options):
    """``with enabled(model): ...``: VisMemo for the block only (a model enabled before stays enabled)."""
    already = getattr(model, "_vismemo", None) is not None
    enable(model, **options)
    try:
        yield model
    finally:
        if not already:
            disable(model)

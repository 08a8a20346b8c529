"""``enable(model)``: install the lookup hook, the prefill runner and the attention function."""

from __future__ import annotations

import types

from . import attention, context
from .cache import VisMemoCache
from .families import ModelAdapter
from .lookup import DeferredImageFeatures, lookup_request
from .runner import run_prefill


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
    adapter.text.config._attn_implementation = attention.ATTENTION_NAME
    base, text = adapter.base, adapter.text
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
    base.register_forward_pre_hook(before, with_kwargs=True)
    base.register_forward_hook(after, with_kwargs=True, always_call=True)
    text.forward = types.MethodType(forward, text)
    model._vismemo = adapter
    return model

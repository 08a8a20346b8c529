"""The ``"vismemo"`` attention function: the model's own attention plus two duties, for the forwards that need them.

The text model runs its own attention implementation (sdpa, eager, flash) in every forward that has a plain
layout. A forward with a slot layout (reused, masked or left-out tokens) routes its attention modules to this
function for its duration (``slot_attention``; ``families.routing``: in the forward's own thread only), which

1. on a layer whose slots are not the plain sequence, builds the mask from the slots' request columns instead of
   the model's positional mask, and runs the prefill's queries in blocks that each see only the key slots up to
   their last visible one (a dense mask makes SDPA pay for every masked future pair; blocks skip most of them).
   Eager models compute it with their eager attention, the others with SDPA (flash kernels take no slot masks);
2. during warmup, records the observation window's attention probabilities for the policy.

Any other call (another thread's plain forward of the same model, the vision tower) goes to the model's own
implementation unchanged.
"""

from __future__ import annotations

import sys

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from vismemo_hf.families import routing
from vismemo_hf.runtime import forward

ATTENTION_NAME = "vismemo"


def own_implementation(config) -> str | None:
    """The attention implementation the model runs (also while a forward of this thread routes it here)."""
    return routing.own_implementation(config)


def slot_attention(view: routing.ConfigView):
    """Route the text model's attention modules (``view``: their ``routing.ConfigView``) through ``"vismemo"`` for a
    forward with a slot layout, in this thread only: the model's other forwards, in other threads, run its own."""
    return routing.routed(view, ATTENTION_NAME)


def _eager_of(module):
    """The modeling file's own eager attention (each family defines one)."""
    return sys.modules[type(module).__module__].eager_attention_forward


def native_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """What the model's own implementation computes."""
    name = own_implementation(module.config)
    return ALL_ATTENTION_FUNCTIONS.get_interface(name, _eager_of(module))(
        module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def masked_attention(module, query, key, value, mask, blocks=None, scaling=None, layout=None, **kwargs):
    """Attention under a boolean slot mask (B, 1, q, S), None meaning plain causal: the model's eager attention for
    eager models (an additive mask), else SDPA over query blocks (``blocked_sdpa``; ``layout``: the
    ``schedule.Layout`` whose mask it is, which keeps the blocks' additive masks for every layer)."""
    if own_implementation(module.config) == "eager":
        if layout is not None and layout.mask is mask and mask is not None:
            return _eager_of(module)(module, query, key, value, layout.additive(query.dtype, eager=True)[0],
                                     scaling=scaling, **kwargs)
        if mask is None:
            q, s = query.shape[-2], key.shape[-2]
            mask = torch.ones(q, s, dtype=torch.bool, device=query.device).tril(s - q)[None, None]
        additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
        additive.masked_fill_(~mask, torch.finfo(query.dtype).min)
        return _eager_of(module)(module, query, key, value, additive, scaling=scaling, **kwargs)
    return blocked_sdpa(module, query, key, value, mask, blocks or [], scaling=scaling, layout=layout, **kwargs)


def window_probabilities(module, query, key, mask, rows, scaling) -> torch.Tensor:
    """Softmax attention of the query ``rows`` (B, W) over all keys: (B, heads, W, S).

    ``mask`` None means plain causal attention over a plain layout (query row i sees slots <= i)."""
    idx = rows[:, None, :, None].expand(-1, query.shape[1], -1, query.shape[-1])
    q = query.gather(2, idx).float()
    batch, heads, window, dim = q.shape
    kv_heads = key.shape[1]
    # grouped query heads share their K/V head: one matmul per K/V head, no repeated (copied) keys
    scores = torch.matmul(q.reshape(batch, kv_heads, heads // kv_heads * window, dim), key.float().transpose(-1, -2))
    # in place: the scores are this function's own, (B, heads, W, S) floats that each extra pass would copy
    scores = scores.reshape(batch, heads, window, -1).mul_(scaling if scaling is not None else dim ** -0.5)
    if mask is not None:
        m = mask.gather(2, rows[:, None, :, None].expand(-1, mask.shape[1], -1, mask.shape[-1]))
        scores = scores.masked_fill_(~m, float("-inf")) if m.dtype == torch.bool else scores.add_(m.float())
    else:
        future = torch.arange(key.shape[-2], device=key.device)[None, None, None, :] > rows[:, None, :, None]
        scores = scores.masked_fill_(future, float("-inf"))
    return torch.softmax(scores, dim=-1)


#: torch's SDPA takes ``enable_gqa`` from 2.5 on
_MASKED_GQA_ON_CPU = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def blocked_sdpa(module, query, key, value, mask, blocks, scaling=None, layout=None, **kwargs):
    """SDPA of each query block over the key prefix its rows can see (``schedule.query_blocks``): exactly SDPA, the
    keys left out being masked for every row of the block. With ``layout`` (whose ``mask`` and ``blocks`` these are)
    the blocks' masks are its additive ones, converted once for all layers instead of by SDPA at every call."""
    additive = layout.additive(query.dtype) if layout is not None and layout.mask is mask and mask is not None \
        else None
    if len(blocks) <= 1:
        return sdpa_attention_forward(module, query, key, value, additive[0] if additive else mask, scaling=scaling,
                                      **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    gqa = {}
    if groups > 1 and query.device.type == "cpu" and _MASKED_GQA_ON_CPU:
        gqa = {"enable_gqa": True}  # the CPU kernel reads grouped heads under a mask: the same values, no copies
    elif groups > 1:  # grouped K/V heads repeated once for every block (per SDPA call they would be copied again);
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # CUDA's fused kernels take no masked GQA
    dropout = kwargs.get("dropout", 0.0)
    outs = [torch.nn.functional.scaled_dot_product_attention(
        query[:, :, r0:r1], key[:, :, :end], value[:, :, :end],
        attn_mask=additive[i] if additive else mask[:, :, r0:r1, :end], dropout_p=dropout, scale=scaling,
        **gqa).transpose(1, 2) for i, (r0, r1, end) in enumerate(blocks)]
    return torch.cat(outs, dim=1), None  # (B, q, heads, D), laid out by the concatenation itself


def vismemo_attention_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
    ctx = forward.current()
    layer_idx = getattr(module, "layer_idx", None)
    if ctx is None or ctx.adapter is None or layer_idx is None or layer_idx >= len(ctx.cache.layers) or \
            routing.own(getattr(module, "config", None)) is not ctx.adapter.text.config:
        return native_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    layer = ctx.cache.layers[layer_idx]
    layout = ctx.layout
    if layout is not None:  # a layer the prefill runner runs: its slots in column order, its mask and query blocks
        attention_mask = layout.mask
        out = masked_attention(module, query, key, value, attention_mask, layout.blocks, scaling=scaling,
                               layout=layout, **kwargs)
    elif layer.mapped:  # a later forward over a layer with left-out slots
        attention_mask = layer.attention_mask(query.shape[-2], ctx.valid)
        out = masked_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    else:
        out = native_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    capture = ctx.capture
    if capture is not None and capture.layer == layer_idx:
        capture.probs = window_probabilities(module, query, key, attention_mask, capture.rows, scaling)
    return out


def register() -> None:
    """Register the attention function and its mask function under ``ATTENTION_NAME``."""
    AttentionInterface.register(ATTENTION_NAME, vismemo_attention_forward)
    # Without a registered mask function transformers builds no mask at all for a custom name.
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)

"""The attention function ``enable()`` installs ("vismemo"): SDPA plus two duties.

1. On a layer whose slots are not the plain sequence (reused / masked tokens), build the
   mask from the slots' request columns instead of the model's positional mask, and run the
   prefill's queries in blocks that each see only the key slots up to their last visible one
   (a dense mask makes SDPA pay for every masked future pair; blocks skip most of them).
2. During warmup, record the observation window's attention probabilities (SDPA does not
   return them) for the policy.

With any other cache (or none) it is exactly SDPA, so an enabled model still serves
ordinary requests unchanged.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from vismemo_hf.runtime import context

ATTENTION_NAME = "vismemo"


def window_probabilities(module, query, key, mask, rows, scaling) -> torch.Tensor:
    """Softmax attention of the query ``rows`` (B, W) over all keys: (B, heads, W, S).

    ``mask`` None means plain causal attention over a plain layout (query row i sees slots <= i)."""
    idx = rows[:, None, :, None].expand(-1, query.shape[1], -1, query.shape[-1])
    q = query.gather(2, idx).float()
    batch, heads, window, dim = q.shape
    kv_heads = key.shape[1]
    # grouped query heads share their K/V head: one matmul per K/V head, no repeated (copied) keys
    scores = torch.matmul(q.reshape(batch, kv_heads, heads // kv_heads * window, dim), key.float().transpose(-1, -2))
    scores = scores.reshape(batch, heads, window, -1) * (scaling if scaling is not None else dim ** -0.5)
    if mask is not None:
        m = mask.gather(2, rows[:, None, :, None].expand(-1, mask.shape[1], -1, mask.shape[-1]))
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.float()
    else:
        future = torch.arange(key.shape[-2], device=key.device)[None, None, None, :] > rows[:, None, :, None]
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1)


#: query rows per block at least (smaller blocks cost more in call overhead than they save)
MIN_BLOCK_ROWS = 32
MAX_BLOCKS = 16


def query_blocks(mask: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first row, end row, key end) of each query block of a boolean (B, 1, q, S) mask: the block's rows see
    no key slot at or after ``key end``. One block (the whole mask) when the queries are few."""
    q_len, s_len = mask.shape[-2:]
    blocks = min(MAX_BLOCKS, q_len // MIN_BLOCK_ROWS)
    if blocks <= 1:
        return [(0, q_len, s_len)]
    bounds = torch.linspace(0, q_len, blocks + 1).round().long().tolist()
    out = []
    for r0, r1 in zip(bounds[:-1], bounds[1:]):
        seen = torch.nonzero(mask[:, :, r0:r1].any(dim=(0, 1, 2))).flatten()
        out.append((r0, r1, int(seen[-1]) + 1 if seen.numel() else s_len))
    return out


def blocked_sdpa(module, query, key, value, mask, blocks, scaling=None, **kwargs):
    """SDPA of each query block over the key prefix its rows can see (``query_blocks``): exactly SDPA, the
    keys left out being masked for every row of the block."""
    if len(blocks) <= 1:
        return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, **kwargs)
    outs = []
    for r0, r1, end in blocks:
        out, _ = sdpa_attention_forward(module, query[:, :, r0:r1], key[:, :, :end], value[:, :, :end],
                                        mask[:, :, r0:r1, :end], scaling=scaling, **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=1), None


def vismemo_attention_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
    ctx = context.current()
    layer_idx = getattr(module, "layer_idx", None)
    if ctx is None or layer_idx is None or layer_idx >= len(ctx.cache.layers):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    layer = ctx.cache.layers[layer_idx]
    order = None
    if layer.query_columns is not None and ctx.slot_mask is not None:  # a prefill layout: its mask and blocks
        attention_mask, order = ctx.slot_mask, ctx.slot_order
        if order is not None:  # keys in request-column order: each query block sees a prefix of them
            idx = order[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[-1])
            key, value = key.gather(2, idx), value.gather(2, idx)
        out = blocked_sdpa(module, query, key, value, attention_mask, ctx.slot_blocks, scaling=scaling, **kwargs)
    else:
        if layer.query_columns is not None:
            attention_mask = layer.attention_mask(ctx.valid)
        out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    capture = ctx.capture
    if capture is not None and capture.layer == layer_idx:
        probs = window_probabilities(module, query, key, attention_mask, capture.rows, scaling)
        if order is not None:  # back to the cache layer's slot order
            probs = torch.empty_like(probs).scatter_(-1, order[:, None, None, :].expand_as(probs), probs)
        capture.probs = probs
    return out


def register() -> None:
    """Register the attention function and its mask function under ``ATTENTION_NAME``."""
    AttentionInterface.register(ATTENTION_NAME, vismemo_attention_forward)
    # Without a registered mask function transformers builds no mask at all for a custom name.
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)

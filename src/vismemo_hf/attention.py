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

from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "vismemo"

#: the VisMemoCache of the forward pass in progress (set by the hooks enable() installs)
ACTIVE_CACHE: ContextVar = ContextVar("vismemo_active_cache", default=None)


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


def blocked_sdpa(module, query, key, value, mask, scaling=None, blocks: int = 1, **kwargs):
    """SDPA of ``blocks`` query blocks, each over the key prefix its rows can see (exactly SDPA: the
    keys left out are masked for every row of the block)."""
    q_len = query.shape[2]
    if blocks <= 1 or mask is None or mask.dtype != torch.bool:
        return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, **kwargs)
    bounds = torch.linspace(0, q_len, blocks + 1).round().long().tolist()
    outs = []
    for r0, r1 in zip(bounds[:-1], bounds[1:]):
        part = mask[:, :, r0:r1]
        seen = torch.nonzero(part.any(dim=(0, 1, 2))).flatten()
        end = int(seen[-1]) + 1 if seen.numel() else mask.shape[-1]
        out, _ = sdpa_attention_forward(module, query[:, :, r0:r1], key[:, :, :end], value[:, :, :end],
                                        part[..., :end], scaling=scaling, **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=1), None


#: query rows per block at least (smaller blocks cost more in call overhead than they save)
MIN_BLOCK_ROWS = 128
MAX_BLOCKS = 8


def vismemo_attention_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
    cache = ACTIVE_CACHE.get()
    layer_idx = getattr(module, "layer_idx", None)
    if cache is None or not cache._in_forward or layer_idx is None or layer_idx >= len(cache.layers):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    layer = cache.layers[layer_idx]
    blocks = 1
    if layer.query_columns is not None:
        attention_mask = cache._slot_mask if cache._slot_mask is not None else layer.attention_mask(cache.valid_columns)
        blocks = min(MAX_BLOCKS, query.shape[2] // MIN_BLOCK_ROWS)
    out = blocked_sdpa(module, query, key, value, attention_mask, scaling=scaling, blocks=blocks, **kwargs)
    capture = cache._capture
    if capture is not None and capture[0] == layer_idx:
        probs = window_probabilities(module, query, key, attention_mask, capture[1], scaling)
        cache.captured[layer_idx] = (probs, layer.columns)
    return out


def register() -> None:
    """Register the attention function and its mask function under ``ATTENTION_NAME``."""
    AttentionInterface.register(ATTENTION_NAME, vismemo_attention_forward)
    # Without a registered mask function transformers builds no mask at all for a custom name.
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)

"""Step 4 of the data path: images computed at every layer become store entries (encoder output, descriptors,
entropy, context hash and the patch-first K/V of every layer, read from the cache's layers)."""

from __future__ import annotations

import logging

import torch

from vismemo_hf.core.plan import HitKind
from vismemo_hf.store.entry import Entry
from vismemo_hf.store.store import store_call

logger = logging.getLogger(__name__)


def image_kv(cache, match) -> torch.Tensor:
    """(N, L, 2, H, D) K/V of the image's tokens in every layer of ``cache`` (on the CPU)."""
    cols = match.columns(torch.arange(match.n_tokens))
    per_layer = []
    for layer in cache.layers:
        slots = layer.slot_of(cols, match.row).to(layer.keys.device)
        per_layer.append(torch.stack([layer.keys[match.row][:, slots], layer.values[match.row][:, slots]]).cpu())
    return torch.stack(per_layer).permute(3, 0, 1, 2, 4).contiguous()


def write_entries(adapter, cache, done: list[tuple], importance=lambda i: None) -> None:
    """Store the images of ``done`` ((index, match, plan, offset)) whose plan computed every token at every layer,
    each key once; non-finite K/V are never stored. ``importance(index)``: what a compressed store keeps first."""
    if not cache.store_misses:
        return
    seen = set()
    for i, match, plan, offset in done:
        key = match.features.key
        if match.kind is HitKind.EXACT or not plan.complete or key in seen:
            continue
        seen.add(key)
        kv = image_kv(cache, match)
        if not bool(torch.isfinite(kv).all()):
            logger.warning("vismemo: image %s has non-finite K/V; not stored", key[:12])
            continue
        entry = Entry(key=key, fingerprint=adapter.fingerprint, grid=match.features.grid, embeds=match.embeds.detach(),
                      deepstack=match.deepstack.detach() if match.deepstack is not None else None,
                      descriptors=match.descriptors, entropy=match.features.entropy, kv=kv, offset=offset,
                      patch_hashes=match.features.patch_hashes, prefix=match.prefix)
        weights = importance(i)
        store_call("write", lambda e=entry, w=weights: cache.store.put(e, importance=w), None)

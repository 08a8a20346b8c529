"""Step 4 of the data path: images computed at every layer become store entries (encoder output, descriptors,
entropy, thumbnail, context hash and the patch-first K/V of every layer, read from the cache's layers)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from vismemo_hf.core.checks import all_finite
from vismemo_hf.core.plan import HitKind
from vismemo_hf.families.base import execution_device
from vismemo_hf.store.background import Announced
from vismemo_hf.store.entry import Entry
from vismemo_hf.store.faults import store_call

logger = logging.getLogger(__name__)


def image_kv(layers: list[tuple], match) -> torch.Tensor:
    """(N, L, 2, H, D) K/V of the image's tokens from ``layers`` ((keys, values, columns) of each cache layer; columns
    None: slot i holds column i), on the CPU."""
    cols = match.columns(torch.arange(match.n_tokens))
    if all(keys.device.type == "cpu" for keys, _, _ in layers):
        return _host_image_kv(layers, match, cols)
    per_layer = []
    for keys, values, columns in layers:
        slots = cols if columns is None else _slots(columns[match.row], cols)
        slots = slots.to(keys.device)
        per_layer.append(torch.stack([keys[match.row][:, slots], values[match.row][:, slots]]))
    if len({t.device for t in per_layer}) == 1:  # one copy to the host (on a GPU each copy waits for the stream)
        stacked = to_host(torch.stack(per_layer))
    else:
        stacked = torch.stack([to_host(t) for t in per_layer])
    return stacked.permute(3, 0, 1, 2, 4).contiguous()  # laid out on the host, not in the GPU's memory


def _host_image_kv(layers: list[tuple], match, cols: torch.Tensor) -> torch.Tensor:
    """``image_kv`` of layers on the host, each token's K/V copied once into the entry's layout (the writer shares the
    machine's memory bandwidth with the request being served)."""
    keys0 = layers[0][0]
    n = match.n_tokens
    out = torch.empty((n, len(layers), 2, keys0.shape[1], keys0.shape[3]), dtype=keys0.dtype)
    for layer, (keys, values, columns) in enumerate(layers):
        slots = cols if columns is None else _slots(columns[match.row], cols)
        first = int(slots[0]) if n else 0
        span = n and bool((slots == torch.arange(first, first + n)).all())  # consecutive: a view, not a gather
        for j, t in enumerate((keys, values)):
            rows = t[match.row]  # (H, S, D)
            out[:, layer, j].copy_((rows[:, first:first + n] if span else rows.index_select(1, slots)).transpose(0, 1))
    return out


#: the largest pinned buffer a copy from a GPU to the host goes through (bytes)
STAGING_BYTES = 64 << 20


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in (pageable) host memory. From a GPU through a pinned buffer of at most ``STAGING_BYTES``, a chunk at a
    time: a copy into pageable memory goes through the driver's own small staging and holds the stream (which the
    request's decoding steps queue behind) far longer; an entry's K/V and tower K/V of 1,024 visual tokens are 144
    and 486 MiB at Qwen3-VL-8B's geometry."""
    if t.device.type != "cuda":
        return t.cpu()
    t = t.contiguous()
    out = torch.empty(t.shape, dtype=t.dtype)
    step = max(1, STAGING_BYTES // t.element_size())
    staging = torch.empty(min(step, t.numel()), dtype=t.dtype, pin_memory=True)
    staged_copy(t.view(-1), out.view(-1), staging)
    return out


def staged_copy(src: torch.Tensor, out: torch.Tensor, staging: torch.Tensor) -> None:
    """Copy 1-d ``src`` into 1-d ``out`` through ``staging``, ``staging.numel()`` elements at a time."""
    step = staging.numel()
    for start in range(0, src.numel(), max(1, step)):
        n = min(step, src.numel() - start)
        staging[:n].copy_(src[start:start + n])
        out[start:start + n].copy_(staging[:n])


def _slots(row_columns: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    table = torch.full((int(row_columns.max()) + 2,), -1, dtype=torch.long, device=row_columns.device)
    ok = row_columns >= 0
    table[row_columns[ok]] = torch.nonzero(ok).flatten()
    slots = table[columns.to(table.device).clamp(max=table.numel() - 1)]
    if bool((slots < 0).any()):
        raise RuntimeError("the image's columns are not all in the layer")
    return slots


def reused_encoder(match) -> bool:
    """Whether the image's encoder output is partly its alias's (a pixel-first hit, ``runtime.lookup``): its K/V,
    even computed at every layer, are not a full prefill's, so it never becomes an entry (an exact hit on it would
    not equal plain transformers)."""
    return match.encoded_tokens is not None and 0 < match.n_tokens and match.encoded_tokens < match.n_tokens \
        and match.kind is not HitKind.EXACT


def write_entries(adapter, cache, done: list[tuple], importance=lambda i: None) -> None:
    """Store the images of ``done`` ((index, match, plan, offset)) whose plan computed every token at every layer
    from their own encoder output (``reused_encoder``), each key once, off the request's critical path: the cache
    layers' tensors as they are now are handed to the store, which gathers and writes the entries on its writer
    thread; each is announced to its index at once (the next request finds it, a read of it waits for its write).
    Non-finite K/V are never stored. ``importance(index)``: what a compressed store keeps first."""
    if not cache.store_misses:
        return
    layers = [(layer.keys, layer.values, layer.columns) for layer in cache.layers]
    fingerprint, seen = cache.owner(adapter.fingerprint), set()
    for i, match, plan, offset in done:
        key = match.features.key
        if match.kind is HitKind.EXACT or not plan.complete or key in seen or reused_encoder(match):
            continue
        seen.add(key)
        weights = importance(i)

        gather = functools.cache(functools.partial(image_kv, layers, match))  # once, by whoever reads it first

        def build(match=match, offset=offset, weights=weights, gather=gather):
            kv = gather()
            if not all_finite(kv):
                logger.warning("vismemo: image %s has non-finite K/V; not stored", match.features.key[:12])
                return None
            return _entry(match, fingerprint, kv, offset), weights

        announced = Announced(key, fingerprint, tuple(match.features.grid), match.descriptors,
                              _hashes_of(match.features), match.prefix, match.context, match.embeds.detach(),
                              match.deepstack, gather, offset, match.thumbnail) if match.descriptors is not None else None
        store_call("write", lambda b=build, a=announced: cache.store.put_later(b, a), None)


def _hashes_of(features) -> Callable[[], torch.Tensor | None]:
    """What gives an image's token pixel hashes (computed on first use: off a miss's path, ``store.catalog``)."""
    return lambda: features.patch_hashes


def columns_kv(layers: list[tuple], row: int, columns: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (K, V) (1, H, len(columns), D) of request ``columns`` of ``row`` from ``layers`` ((keys, values,
    slot columns or None) of each cache layer), on the layer's device."""
    out = []
    for keys, values, slot_columns in layers:
        slots = columns if slot_columns is None else _slots(slot_columns[row], columns)
        slots = slots.to(keys.device)
        out.append((keys[row:row + 1].index_select(2, slots), values[row:row + 1].index_select(2, slots)))
    return out


def complete_later(adapter, cache, runs: list[tuple], positions: torch.Tensor, exact_before) -> None:
    """Make the images an approximate hit served entries of their own, so that the next request with one is an
    exact hit: on the store's writer thread, off the request's path, each image's tokens are computed in full over
    the K/V of the columns before it (which ``exact_before(index)`` says a full prefill computed: nothing inexact
    before the image), from its own whole encoder output, with the model's own text layers, as a miss's prefill
    computes them. ``runs``: (index, match, plan, offset) of the request's images; ``positions`` (3, B, L)."""
    if not cache.store_misses or positions.shape[1] != 1:
        return
    layers = [(layer.keys, layer.values, layer.columns) for layer in cache.layers]
    fingerprint, seen = cache.owner(adapter.fingerprint), set()
    for i, match, plan, offset in runs:
        key = match.features.key
        if match.kind is not HitKind.APPROXIMATE or key in seen or not exact_before(i) or \
                (plan.complete and not reused_encoder(match)):
            continue
        seen.add(key)

        def build(match=match, offset=offset):
            own = match.whole_encode(match) if match.whole_encode is not None else match
            kv = _computed_kv(adapter, layers, own, positions[:, :, own.start:own.start + own.n_tokens])
            if not all_finite(kv):
                return None
            return _entry(own, fingerprint, kv, offset), None

        store_call("write", lambda b=build: cache.store.put_when_idle(b), None)


@torch.no_grad()
def _computed_kv(adapter, layers: list[tuple], match, positions: torch.Tensor) -> torch.Tensor:
    """(N, L, 2, H, D) K/V of ``match``'s tokens computed by the text model over the K/V of the columns before it."""
    from transformers import DynamicCache

    before = DynamicCache()
    if match.start:
        for i, (k, v) in enumerate(columns_kv(layers, match.row, torch.arange(match.start))):
            before.update(k, v, i)
    device = execution_device(adapter.text)
    embeds = match.embeds.to(device)[None]
    extra = {}
    if match.deepstack is not None:  # Qwen3-VL: the tower's intermediate features of every token
        extra = {"visual_pos_masks": torch.ones(1, match.n_tokens, dtype=torch.bool, device=device),
                 "deepstack_visual_embeds": [d.to(device, embeds.dtype) for d in match.deepstack]}
    positions = positions[0] if adapter.positions_1d else positions
    adapter.text(inputs_embeds=embeds.to(next(adapter.text.parameters()).dtype), position_ids=positions.to(device),
                 cache=before, use_cache=True, **extra)
    span = slice(match.start, match.start + match.n_tokens)
    per_layer = [torch.stack([to_host(layer.keys[0, :, span]), to_host(layer.values[0, :, span])])
                 for layer in before.layers]
    return torch.stack(per_layer).permute(3, 0, 1, 2, 4).contiguous()


def _entry(match, fingerprint: str, kv: torch.Tensor, offset: int) -> Entry:
    """The entry of ``match``'s image, its features computed here (on the writer's thread, off the request's path)."""
    feats = match.features
    tower = match.tower_kv() if callable(match.tower_kv) else match.tower_kv  # laid out here
    tower = tower if tower is not None and all_finite(tower) else None
    entropy = feats.entropy
    thumb = match.thumbnail() if match.thumbnail is not None else None
    return Entry(key=feats.key, fingerprint=fingerprint, grid=feats.grid, embeds=match.embeds.detach(),
                 deepstack=match.deepstack.detach() if match.deepstack is not None else None,
                 descriptors=match.descriptors, entropy=entropy, kv=kv, offset=offset,
                 patch_hashes=feats.patch_hashes, prefix=match.prefix, context=match.context,
                 thumbnail=thumb,
                 tower_kv=to_host(tower) if tower is not None else None,
                 tile_digests=match.tile_digests() if match.tile_digests is not None else None)

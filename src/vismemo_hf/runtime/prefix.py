"""Prefix reuse (docs/METHOD.md §9): a request whose leading tokens equal an earlier request's, text by its ids and
images by their exact keys, takes that prefix's K/V whole from the store's prefix blocks (``store.prefixes``) and
computes only the rest with the model's own forward, as ``generate`` computes a continuation of a cache.

Exact: a block is reused only where everything up to its end is the same, and only blocks whose K/V a full prefill
computed (or reused whole from such blocks) are stored: nothing after the first image an approximate hit
served. The images inside a reused prefix are neither looked up nor encoded; a prefix is reused only when it holds
one. Used for one unpadded row whose caller reads the last position's logits only (``generate``'s prefill); any other
prefill still stores its blocks.
"""

from __future__ import annotations

import bisect
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from vismemo_hf.store.faults import store_call
from vismemo_hf.store.prefixes import block_ends, block_hashes

#: set while a model forward whose caller reads the last position's logits only runs (``generate``'s
#: ``logits_to_keep=1``): only such a prefill may skip the hidden states of a reused prefix
LAST_ONLY: ContextVar[bool] = ContextVar("vismemo_last_only", default=False)


@dataclass(frozen=True)
class PrefixPlan:
    """One row's blocks: their chain hashes and ends (``store.prefixes.block_ends``), how many the store holds, and the
    tokens reused (0: none) with their K/V, one (layers, 2, KV heads, its tokens, head dim) tensor per block."""

    hashes: tuple[str, ...]
    ends: tuple[int, ...] = ()
    held: int = 0
    length: int = 0
    blocks: tuple[torch.Tensor, ...] = ()

    def blocks_within(self, column: int) -> int:
        """How many blocks end at or before ``column``."""
        return bisect.bisect_right(self.ends, column)


def plan(cache, owner: str, input_ids: torch.Tensor, spans: list[tuple[int, int]], counts: list[int],
         keys: list[str], eligible: bool) -> PrefixPlan | None:
    """The prefix plan of a one-row request (host ``input_ids`` (1, L); ``spans`` / ``counts`` / ``keys``: each
    image's (row, first column), tokens and exact key); None when the store keeps no prefixes or the request is not
    one row. ``eligible``: the prefix may be reused (else its blocks are only written)."""
    prefixes = getattr(cache.store, "prefixes", None)
    if prefixes is None or input_ids.shape[0] != 1 or not cache.store_misses and not eligible:
        return None
    ids = input_ids[0].tolist()
    images = sorted((start, n, key) for (_, start), n, key in zip(spans, counts, keys))
    hashes, ends = tuple(block_hashes(owner, ids, images)), tuple(block_ends(len(ids), images))
    held = store_call("prefix", lambda: prefixes.longest(hashes), 0)
    length = min(ends[held - 1] if held else 0, len(ids) - 1)  # the last token is computed: its logits are the answer's
    for start, n, _ in images:
        if start < length < start + n:  # an image is reused whole or not at all
            length = start
    # a prefix is reused when it holds an image: text alone (a system prompt) saves little, and the images after a
    # reused prefix are computed in full, without their own lookup
    if not eligible or length < 1 or not any(start + n <= length for start, n, _ in images):
        return PrefixPlan(hashes, ends, held)
    needed = bisect.bisect_left(ends, length) + 1  # the blocks up to the one that holds the prefix's last token
    blocks = store_call("prefix", lambda: prefixes.read(hashes[:needed]), None)
    if blocks is None:
        return PrefixPlan(hashes, ends, held)
    return PrefixPlan(hashes, ends, held, length, tuple(blocks))


def preload(cache, prefix: PrefixPlan, device_of) -> None:
    """Fill ``cache``'s layers with the reused prefix's K/V (``device_of(layer)``: where each layer computes)."""
    kv = torch.cat(prefix.blocks, dim=3)[:, :, :, :prefix.length]  # (layers, 2, H, P, D)
    for i in range(kv.shape[0]):
        device = device_of(i)
        layer = cache.layer(i)
        layer.lazy_initialization(kv[i, 0][None], kv[i, 1][None])
        layer.keys = kv[i, 0][None].to(device, non_blocking=True)
        layer.values = kv[i, 1][None].to(device, non_blocking=True)
    cache.advance(prefix.length)


def suffix(kwargs: dict, length: int) -> dict:
    """The text model's arguments for the tokens after a reused prefix of ``length`` tokens."""
    out = dict(kwargs)
    out["inputs_embeds"] = kwargs["inputs_embeds"][:, length:]
    if kwargs.get("position_ids") is not None:
        out["position_ids"] = kwargs["position_ids"][..., length:]
    visual = kwargs.get("visual_pos_masks")
    if visual is not None:  # Qwen3-VL's deepstack: the features of the visual tokens after the prefix
        before = int(visual[:, :length].sum())
        out["visual_pos_masks"] = visual[:, length:]
        if kwargs.get("deepstack_visual_embeds") is not None:
            out["deepstack_visual_embeds"] = [d[before:] for d in kwargs["deepstack_visual_embeds"]]
    return out


def write(cache, prefix: PrefixPlan | None, exact_until: int) -> None:
    """Store the blocks of ``prefix`` that lie before column ``exact_until`` (what a full prefill computed there)
    and the store does not hold yet: gathered from the cache's layers as they are now, on the store's writer
    thread."""
    if prefix is None or not cache.store_misses:
        return
    whole = prefix.blocks_within(exact_until)
    first = max(prefix.held, prefix.blocks_within(prefix.length))
    if whole <= first or any(layer.mapped for layer in cache.layers):
        return
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    hashes = prefix.hashes[first:whole]
    bounds = (0, *prefix.ends)[first:whole + 1]
    prefixes = cache.store.prefixes

    def gather():  # one copy of the whole span to the host, cut into blocks (few operations: the writer's Python
        s, e = bounds[0], bounds[-1]  # shares the interpreter with the requests)
        span = torch.stack([torch.stack([k[0, :, s:e], v[0, :, s:e]]) for k, v in layers]).cpu()
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        prefixes.add(hashes, [block.clone() for block in torch.split(span, sizes, dim=3)])

    def announce():
        writer, key = cache.store.writer, f"prefix:{hashes[-1]}"
        prefixes.announce(hashes, writer.submit(lambda: store_call("prefix", gather, None), key),
                          lambda: writer.wait_for(key))

    store_call("prefix", announce, None)

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
import time
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from vismemo_hf.runtime.writeback import reused_encoder
from vismemo_hf.store.faults import store_call
from vismemo_hf.store.prefixes import Speculation, block_ends, block_hashes

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
    #: the row's token ids and its images' (first column, tokens, exact key), in column order
    ids: tuple[int, ...] = ()
    images: tuple[tuple[int, int, str], ...] = ()

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
    row = (tuple(ids), tuple(images))
    if not eligible or length < 1 or not any(start + n <= length for start, n, _ in images):
        return PrefixPlan(hashes, ends, held, 0, (), *row)
    needed = bisect.bisect_left(ends, length) + 1  # the blocks up to the one that holds the prefix's last token
    blocks = store_call("prefix", lambda: prefixes.read(hashes[:needed]), None)
    if blocks is None:
        return PrefixPlan(hashes, ends, held, 0, (), *row)
    return PrefixPlan(hashes, ends, held, length, tuple(blocks), *row)


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


def slide_later(adapter, cache, prefix: PrefixPlan | None, matches, kwargs: dict) -> None:
    """After a prefill, when its images look like a window sliding over them (an agent keeping its last K
    screenshots: ``PrefixBlocks.window_slid``): compute, while no request runs, the blocks of the same request without
    its first image (the text before the first image, then the second image and everything up to the last image's
    end, at the positions that request gives them) and keep them as prefix blocks, so that the next step, which
    starts that way, reuses them whole. Exact: the K/V the next step's own prefill computes there, from the images'
    own encoder output (an image inside a reused prefix: its entry's) over the same text.

    The work is speculative: it starts only while no request is in progress, and a request that needs the blocks
    (or starts at all) before they are written calls it off and computes what it needs itself
    (``store.prefixes.Speculation``). ``matches``: the
    request's images (``ImageMatch``) in its order; ``kwargs``: the text model's arguments of the prefill."""
    blocks = _sliding(adapter, cache, prefix, matches, kwargs)
    if blocks is None or prefix is None:
        return
    images, embeds = prefix.images, kwargs["inputs_embeds"]
    (s1, _, _), (s2, _, _) = images[0], images[1]
    shift = s2 - s1
    moved = tuple((s - shift, n, k) for s, n, k in images[1:])
    ids = prefix.ids[:s1] + prefix.ids[s2:]
    end = moved[-1][0] + moved[-1][1]
    owner = cache.owner(adapter.fingerprint)
    ends = [e for e in block_ends(len(ids), moved) if e <= end]
    hashes = block_hashes(owner, ids, moved)[:len(ends)]
    held = store_call("prefix", lambda: blocks.held(hashes), len(hashes))
    if held >= len(hashes):
        return
    # what the work keeps until it runs: the K/V of the text before the first image and the request's embeddings
    # after it, copied out of the request's tensors (a view would keep the whole cache alive meanwhile)
    head = [(layer.keys[:, :, :s1].clone(), layer.values[:, :, :s1].clone()) for layer in cache.layers]  # per
    # layer: a device map puts layers on several devices
    positions = kwargs.get("position_ids")
    positions = (torch.arange(len(prefix.ids), device=embeds.device)[None] if positions is None else positions)
    positions = (positions[None].expand(3, -1, -1) if positions.ndim == 2 else positions)[-3:]
    # the columns from the second image on, at the positions they have once the first image and the text after it
    # are gone: every one moves back by what separates the two images' first positions
    after = positions[..., s2:s2 + end - s1] - (positions[..., s2:s2 + 1] - positions[..., s1:s1 + 1])
    # images whose encoder output is not in ``embeds``: inside a reused prefix (zeros stand for them) or partly
    # their alias's (a pixel-first hit; an image an approximate hit served is completed as an entry of its own
    # before this runs, on the same thread: ``writeback.complete_later``)
    inside = {m.start for m in matches if m.found_by == "prefix" or reused_encoder(m)}
    visual, deepstack = kwargs.get("visual_pos_masks"), kwargs.get("deepstack_visual_embeds")
    later = embeds[0, s2:s2 + end - s1].clone()
    spec = Speculation()
    first = held

    def compute():
        if not spec.start():
            return
        t0 = time.perf_counter()
        try:
            rank = None
            if deepstack is not None and visual is not None:  # Qwen3-VL: each image's rows of the deepstack features
                if int(visual.sum()) != sum(n for _, n, _ in images):
                    return
                rank = {s: int(visual[0, :s].sum()) for s, _, _ in images}
            tail = _slid_kv(adapter, cache, head, later, after, s1, s2, images[1:], inside,
                            deepstack, rank, owner, spec)
            if tail is not None:
                bounds = (0, *ends)[first:]
                span = torch.stack([torch.stack([k[0, :, bounds[0]:end], v[0, :, bounds[0]:end]]) for k, v in tail])
                sizes = [b - a for a, b in zip(bounds, bounds[1:])]
                blocks.add(hashes[first:], [b.clone() for b in torch.split(span.cpu(), sizes, dim=3)])
        finally:
            spec.done()
            blocks.speculated((time.perf_counter() - t0) * 1e3)

    def announce():
        completer, key = cache.store.completer, f"prefix:{hashes[-1]}"
        future = completer.submit(lambda: store_call("prefix", compute, None), key)
        blocks.announce(hashes[first:], future, lambda: completer.wait_for(key), claim=spec.claim)
        blocks.speculating(hashes[-1])

    store_call("prefix", announce, None)


def _sliding(adapter, cache, prefix: PrefixPlan | None, matches, kwargs: dict):
    """The store's prefix blocks when the prefill of ``prefix`` looks like a window sliding over its images and its
    next step may be computed ahead (``slide_later``), else None."""
    if prefix is None or len(prefix.images) < 2 or not cache.store_misses or not cache.policy.reuses_prefix():
        return None
    blocks = getattr(cache.store, "prefixes", None)
    embeds = kwargs.get("inputs_embeds")
    if blocks is None or embeds is None or embeds.shape[0] != 1 or embeds.shape[1] != len(prefix.ids):
        return None
    if any(layer.mapped for layer in cache.layers) or len(cache.layers) != adapter.num_layers:
        return None
    starts = {m.start for m in matches}
    if any(s not in starts for s, _, _ in prefix.images):
        return None  # a video or an image the lookup did not see: not a window of images
    if not store_call("prefix", lambda: blocks.window_slid([k for _, _, k in prefix.images]), False):
        return None
    if any(p.device.type == "meta" for p in adapter.text.parameters()):
        return None  # offloaded weights (accelerate): their hooks load a layer's weights for one forward at a time
    return blocks


@torch.no_grad()
def _slid_kv(adapter, cache, head, embeds, positions, s1: int, s2: int, images, inside: set, deepstack, rank,
             owner: str, spec: Speculation):
    """Per layer, (K, V) (1, H, s1 + len(embeds), D): the ``s1`` columns of ``head`` (per layer, (1, H, s1, D) keys
    and values) and, computed over them by the text model, the columns ``embeds`` (the request's from its column
    ``s2`` on) at ``positions``. Images of
    ``images`` ((column in the request, tokens, key)) that started in ``inside`` take their encoder output from
    their entries; None when one is gone."""
    from transformers import DynamicCache

    from vismemo_hf.families.base import execution_device

    class Stoppable(DynamicCache):  # the speculation stops at the next layer once a request needs the machine
        def update(self, *args, **kwargs):
            if not spec.running:
                raise _CalledOff
            return super().update(*args, **kwargs)

    device = execution_device(adapter.text)
    embeds = embeds.clone()
    extra_ds: list[list[torch.Tensor]] = []
    for s, n, key in images:
        if s in inside:
            entry = cache.store.peek(key, owner)
            if entry is None or entry.embeds is None or rank is not None and entry.deepstack is None:
                return None
            embeds[s - s2:s - s2 + n] = entry.embeds.to(embeds.device, embeds.dtype)
            if rank is not None:
                extra_ds.append([d.to(device) for d in entry.deepstack])
        elif rank is not None:
            extra_ds.append([d[rank[s]:rank[s] + n].to(device) for d in deepstack])
    before = Stoppable()
    for i, (k, v) in enumerate(head):
        DynamicCache.update(before, k, v, i)
    extra = {}
    if rank is not None:
        mask = torch.zeros(1, embeds.shape[0], dtype=torch.bool, device=device)
        for s, n, _ in images:
            mask[0, s - s2:s - s2 + n] = True
        extra = {"visual_pos_masks": mask,
                 "deepstack_visual_embeds": [torch.cat([per[j] for per in extra_ds]).to(device, embeds.dtype)
                                             for j in range(len(extra_ds[0]))]}
    positions = positions[0] if adapter.positions_1d else positions
    dtype = next(adapter.text.parameters()).dtype
    try:
        adapter.text(inputs_embeds=embeds[None].to(device, dtype), position_ids=positions.to(device), cache=before,
                     use_cache=True, **extra)
    except _CalledOff:
        return None
    return [(layer.keys, layer.values) for layer in before.layers]


class _CalledOff(Exception):
    """A speculation's forward stopped: a request needs the machine, or the blocks, before it was done."""

"""Step 1 of the data path: find every image of a request in the store (METHOD §1).

Runs before the model's forward (a pre-hook installed by ``enable``): exact lookup by key,
the vision tower for the images that missed it (exact hits reuse the stored encoder
output), then the two-stage approximate lookup. Its result, a ``PrefillRequest``, is left
on the cache for the runner; the model receives ``mm_encoder_outputs`` instead of pixels.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

import torch

from .features import exact_key, patch_entropy, patch_hashes, region_descriptors, token_cosine
from .plan import CacheEvent, HitKind, ImageFeatures, ImagePlan
from .entry import Entry

logger = logging.getLogger(__name__)


@dataclass
class ImageState:
    """One image of the request on its way through lookup, planning and execution."""

    row: int
    start: int  # first request column of its visual tokens
    features: ImageFeatures
    embeds: torch.Tensor
    deepstack: torch.Tensor | None
    descriptors: torch.Tensor | None
    kind: HitKind
    alias: ImageFeatures | None = None
    alias_entry: Entry | None = None  # the whole entry, exact hits only
    alias_offset: int = 0
    score: float | None = None
    offset: int = 0  # M-RoPE start position in this request
    plan: ImagePlan | None = None
    prefetched: torch.Tensor | None = None  # approximate hits: tokens read before warmup
    fetched: object | None = None  # runner.FetchedKV
    fetch_index: torch.Tensor | None = None  # position of each plan.reuse token in fetched
    fetch_future: object | None = None  # a background read started before warmup
    attention: list[torch.Tensor] = field(default_factory=list)  # per warmup layer (H, rows, N)
    timings: dict[str, float] = field(default_factory=dict)
    prefix: str = ""  # hash of the text (and earlier images) before the image in its row
    prefix_changed: bool = False  # exact hits: the stored entry was computed after another prefix
    restored: tuple | None = None  # (FetchedKV, positions) of masked tokens given back for decoding
    bytes_read: int = 0  # alias K/V bytes read for this image

    @property
    def n_tokens(self) -> int:
        return self.features.n_tokens

    def columns(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens + self.start

    def event(self) -> CacheEvent:
        plan = self.plan
        return CacheEvent(
            kind=self.kind,
            alias=self.alias.key if self.alias is not None else None,
            key=self.features.key,
            row=self.row,
            n_tokens=self.n_tokens,
            recomputed=plan.recompute.numel(),
            reused=plan.reuse.numel(),
            masked=plan.mask.numel(),
            score=self.score,
            timings=dict(self.timings),
            plan=plan,
            prefix_changed=self.prefix_changed,
            bytes_read=self.bytes_read,
        )


class DeferredImageFeatures:
    """Vision-tower output computed on first use.

    ``generate`` encodes images before the prefill, when the cache (and so the store) is
    not known yet. ``enable`` makes ``get_image_features`` return this instead; the lookup
    then runs the tower only for images without an exact hit and ``provide``s the result.
    Any other reader (a plain cache, user code) gets the real output on first access.
    """

    def __init__(self, encode, pixel_values, image_grid_thw, kwargs):
        self.pixel_values, self.image_grid_thw = pixel_values, image_grid_thw
        self._encode, self._kwargs, self._output = encode, kwargs, None

    @property
    def resolved(self) -> bool:
        return self._output is not None

    def provide(self, output) -> None:
        self._output = output

    def resolve(self):
        if self._output is None:
            self._output = self._encode(self.pixel_values, self.image_grid_thw, **self._kwargs)
        return self._output

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.resolve(), name)

    def __getitem__(self, item):
        return self.resolve()[item]


@dataclass
class PrefillRequest:
    images: list[ImageState]


def image_spans(input_ids: torch.Tensor, image_token_id: int, counts: list[int]) -> list[tuple[int, int]]:
    """(row, first column) of each image, in the order of ``image_grid_thw``; checks the token counts."""
    spans = []
    for row in range(input_ids.shape[0]):
        is_img = (input_ids[row] == image_token_id).to(torch.int8)
        edges = torch.diff(torch.cat([is_img.new_zeros(1), is_img, is_img.new_zeros(1)]))
        starts = torch.nonzero(edges == 1).flatten().tolist()
        ends = torch.nonzero(edges == -1).flatten().tolist()
        spans.extend((row, s, e - s) for s, e in zip(starts, ends))
    lengths = [n for _, _, n in spans]
    if lengths != list(counts):
        # adjacent images without separators would merge into one run; Qwen processors always separate them
        raise ValueError(
            f"image placeholder runs {lengths} do not match image_grid_thw token counts {list(counts)}: "
            "use the model's processor to build inputs"
        )
    return [(row, start) for row, start, _ in spans]


def store_call(what: str, fn, default):
    """Run a store call; a fault is logged and gives ``default`` (a miss, no entry stored), never an error."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - any store failure must degrade, not break serving
        logger.warning("vismemo: store %s failed (%s: %s); continuing without it", what, type(err).__name__, err)
        return default


def _compatible(entry: Entry | None, n_tokens: int, n_layers: int) -> bool:
    return entry is not None and entry.n_tokens == n_tokens and entry.n_layers == n_layers


def prefix_digest(input_ids: torch.Tensor, valid: torch.Tensor | None, start: int, earlier: list[str]) -> str:
    """Hash of what precedes an image in its row: the real (unpadded) token ids before column ``start``
    and the keys of the row's earlier images (their placeholder tokens alone would not tell them apart)."""
    ids = input_ids[:start]
    if valid is not None:
        ids = ids[valid[:start].to(ids.device)]
    h = hashlib.blake2b(ids.to(torch.int64).cpu().numpy().tobytes(), digest_size=16)
    for key in earlier:
        h.update(key.encode())
    return h.hexdigest()


def lookup_request(adapter, cache, input_ids, pixel_values, grids, get_image_features,
                   valid: torch.Tensor | None = None) -> tuple[PrefillRequest, object]:
    """Look every image up; return the request state and the ``mm_encoder_outputs["image"]`` object.
    ``valid``: (B, columns) False at padding, so that a left-padded row hashes its prefix like an unpadded one."""
    if input_ids is None:
        raise ValueError("VisMemoCache needs input_ids (not inputs_embeds) to locate the images of a request")
    if cache.get_seq_length() > 0:
        raise NotImplementedError("VisMemoCache supports images only in the first forward of a cache (the prefill)")
    store, fp, merge = cache.store, adapter.fingerprint, adapter.merge
    grid_list = [tuple(int(x) for x in g) for g in grids.tolist()]
    counts = [t * h * w // merge**2 for t, h, w in grid_list]
    spans = image_spans(input_ids, adapter.image_token_id, counts)
    patch_rows = torch.tensor([t * h * w for t, h, w in grid_list]).cumsum(0).tolist()
    pixels = torch.tensor_split(pixel_values, patch_rows[:-1])
    n_layers = adapter.num_layers

    t0 = time.perf_counter()
    keys = [exact_key(fp, p, g) for p, g in zip(pixels, grid_list)]
    entries = [store_call("read", lambda k=k: store.get(k, fp), None) for k in keys]
    exact = [_compatible(e, n, n_layers) for e, n in zip(entries, counts)]
    t_exact = (time.perf_counter() - t0) * 1e3

    todo = [i for i, hit in enumerate(exact) if not hit]
    encoded: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    t_encoder = 0.0
    if todo:
        t0 = time.perf_counter()
        fresh = adapter.encode(get_image_features, torch.cat([pixels[i] for i in todo]), grids[todo])
        t_encoder = (time.perf_counter() - t0) * 1e3
        encoded = dict(zip(todo, fresh))

    images = []
    earlier: dict[int, list[str]] = {}
    for i, ((row, start), key, grid) in enumerate(zip(spans, keys, grid_list)):
        t0 = time.perf_counter()
        prefix = prefix_digest(input_ids[row], None if valid is None else valid[row], start, earlier.get(row, []))
        earlier.setdefault(row, []).append(key)
        if exact[i]:
            entry = entries[i]
            feats = entry.features()
            state = ImageState(row, start, feats, entry.embeds, entry.deepstack, entry.descriptors, HitKind.EXACT,
                               alias=feats, alias_entry=entry, alias_offset=entry.offset, score=1.0,
                               prefix=prefix, prefix_changed=entry.prefix != prefix)
            encoder_ms = 0.0
        else:
            embeds, deepstack = encoded[i]
            entropy = patch_entropy(pixels[i], **adapter.entropy_kwargs())
            feats = ImageFeatures(key, grid, embeds, entropy, patch_hashes(pixels[i], merge))
            desc = region_descriptors(embeds, grid, merge)
            state = ImageState(row, start, feats, embeds, deepstack, desc, HitKind.MISS, prefix=prefix)
            _approximate(state, cache, fp, n_layers)
            encoder_ms = t_encoder
        state.timings["lookup"] = t_exact / len(keys) + (time.perf_counter() - t0) * 1e3
        state.timings["encoder"] = encoder_ms
        images.append(state)
    outputs = adapter.encoder_outputs([(s.embeds, s.deepstack) for s in images])
    return PrefillRequest(images), outputs


def _approximate(state: ImageState, cache, fp: str, n_layers: int) -> None:
    """Coarse (descriptor index) then fine (per-token cosine) stage; sets kind/alias on success."""
    if cache.top_k == 0:
        return
    feats = state.features
    found = store_call("index", lambda: cache.store.candidates(fp, feats.grid, state.descriptors, cache.tau, cache.top_k), [])
    best, best_score = None, float("-inf")
    for key, _ in found:
        entry = store_call("read", lambda k=key: cache.store.peek(k, fp), None)
        if not _compatible(entry, feats.n_tokens, n_layers):
            continue
        score = float(token_cosine(feats.embeds, entry.embeds).mean())
        if score > best_score:
            best, best_score = entry, score
    if best is not None and best_score >= cache.tau_fine:
        state.kind = HitKind.APPROXIMATE
        state.alias = best.features()
        state.alias_offset = best.offset
        state.score = best_score

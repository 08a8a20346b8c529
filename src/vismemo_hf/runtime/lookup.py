"""Step 1 of the data path: find every image of a request in the store (docs/METHOD.md §1).

Runs before the model's forward (a pre-hook installed by ``enable``): exact lookup by key,
the vision tower for the images that missed it (exact hits reuse the stored encoder
output), then the two-stage approximate lookup. Its result, a ``PrefillRequest``, is left
on the cache for the runner; the model receives ``mm_encoder_outputs`` instead of pixels.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from vismemo_hf.core.checks import all_finite
from vismemo_hf.core.context import context_change, context_sketch
from vismemo_hf.core.features import (
    centred_sketches,
    exact_key,
    region_descriptors,
    tensor_digest,
    thumb_per_token,
    token_grid,
    token_sketch,
)
from vismemo_hf.core.pixel_first import encoder_tokens, partly_changed, pixel_changes
from vismemo_hf.core.plan import HitKind, ImageFeatures
from vismemo_hf.core.thresholds import (
    ENCODER_PIXEL_AGREE,
    MAX_DRIFT,
    MAX_ZOOM_DRIFT,
    aligned_similarity,
    best_shift,
    local_drift,
    regional_cosines,
    zoom_drift,
)
from vismemo_hf.runtime import prefix as prefixes
from vismemo_hf.runtime.reference import reference_for
from vismemo_hf.store.background import Announced
from vismemo_hf.store.entry import Entry
from vismemo_hf.store.faults import store_call

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImageMatch:
    """What the lookup found for one image of the request: where it sits, its features, and the entry it may reuse
    (``alias``: the cached image's features; ``alias_entry``: the whole entry, exact hits only). Frozen: a runner
    that cannot use the alias computes the image as ``as_miss()``."""

    row: int
    start: int  # first request column of its visual tokens
    features: ImageFeatures
    embeds: torch.Tensor
    deepstack: torch.Tensor | None
    descriptors: torch.Tensor | None
    kind: HitKind
    prefix: str = ""  # hash of the context before the image in its row
    alias: ImageFeatures | None = None
    alias_entry: Entry | None = None
    #: an exact hit on an entry still being written: what gives its K/V (``Announced.kv``), read without waiting
    alias_kv: Callable[[], torch.Tensor] | None = None
    alias_offset: int = 0
    score: float | None = None
    prefix_changed: bool = False  # a hit whose alias's K/V were computed after another context before the image
    context: torch.Tensor | None = None  # sketch of the context before the image (``core.context``)
    #: a hit after another context: the tokens by which it differs from the alias's (None: unknown or not text alone)
    context_change: int | None = None
    lookup_bytes: int = 0  # lookup-section bytes of the candidates the fine stage scored
    lookup_ms: float = 0.0
    encoder_ms: float = 0.0
    thumbnail: Callable[[], torch.Tensor] | None = None  # the image's (H, W) uint8 thumbnail, computed on first call
    pixel_score: float | None = None  # an approximate hit the pixel stage accepted: its aligned thumbnail similarity
    aligned: bool = True  # False: a copy warped (zoomed, turned) so far that its tokens do not line up with the alias's
    drift: float = 0.0  # approximate hits: how far parts of the copy move against its centre (``local_drift``), tokens
    host_embeds: torch.Tensor | None = None  # a miss's encoder output, read to the host once (descriptors, sketch)
    #: the tokens the vision tower ran for (None: the whole image; 0: none, an exact hit); an approximate hit found by
    #: its pixels encodes its changed tokens only (``core.pixel_first``) and keeps its alias's output for the rest
    encoded_tokens: int | None = None
    #: which stage found the alias: "key" (exact), "pixels" (pixel-first), "encoder" (coarse and fine stages),
    #: "thumbnail" (the aligned pixel stage); None: a miss
    found_by: str | None = None
    #: (layers, 2, patches, width) the tower's own K/V of a whole-image encode (``families.tower_kv``), or what gives
    #: them when called (laid out by the entry's build), kept with the entry so that an edited copy's partial encode
    #: can attend to it; None: not captured
    tower_kv: torch.Tensor | Callable[[], torch.Tensor] | None = None
    #: a call that gives the digests of the tiles the tower encodes alone (``VisionTower.tile_digests``), kept with the
    #: entry so that an edited copy re-encodes only its changed tiles; None: the tower encodes the image whole
    tile_digests: Callable[[], torch.Tensor] | None = None
    #: an image whose encoder output is partly its alias's, lent tower K/V (``encoded_tokens`` < its tokens): what
    #: gives the match its own whole-image encode (``_whole_encoder``), which a plan that computes the image in full
    #: starts from (``runtime.runner``); None: the encoder output is the image's own (a whole or tiled encode)
    whole_encode: Callable[[ImageMatch], ImageMatch] | None = None

    @property
    def n_tokens(self) -> int:
        return self.features.n_tokens

    def columns(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens + self.start

    def as_miss(self) -> ImageMatch:
        return replace(self, kind=HitKind.MISS, alias=None, alias_entry=None, alias_kv=None, alias_offset=0, score=None,
                       prefix_changed=False, context_change=None, pixel_score=None, aligned=True, found_by=None)


@dataclass(frozen=True)
class PixelAlias:
    """What the pixel-first stage found for an image (docs/METHOD.md §1, step 2): the stored ``entry`` it shows
    edited, its (N,) ``changed`` tokens, the ``share`` of its tokens unchanged, and (``tiles``) what gives the image's
    tile digests (a tower that encodes tiles alone re-encodes the changed ones)."""

    entry: Entry
    changed: torch.Tensor
    share: float
    tiles: Callable[[], torch.Tensor] | None = None


class DeferredImageFeatures:
    """Vision-tower output computed on first use.

    ``generate`` encodes images before the prefill, when the cache (and so the store) is
    not known yet. ``enable`` makes ``get_image_features`` return this instead; the lookup
    then runs the tower only for images without an exact hit and ``provide``s the result.
    Any other reader (a plain cache, user code) gets the real output on first access.
    Beam search and ``num_return_sequences`` make ``generate`` expand the output before the
    forward (it rewrites ``pooler_output`` and ``deepstack_features``): those writes are kept
    aside, so the lookup still sees the original images and knows the expansion factor.
    """

    _OWN = ("pixel_values", "args", "kwargs", "_encode", "_output", "_assigned", "_provided", "keys")

    def __init__(self, encode, pixel_values, args: tuple, kwargs: dict):
        self.pixel_values, self.args, self.kwargs = pixel_values, tuple(args), kwargs
        self._encode, self._output = encode, None
        #: the images' pixel digests hashed ahead (``runtime.keys``), or None
        self.keys = None
        self._assigned: dict = {}
        self._provided = False

    def __setattr__(self, name, value):
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:  # generate's expansion of the encoder output
            self._assigned[name] = value

    def argument(self, name: str):
        """The encoder call's second argument (``image_grid_thw``, ``image_sizes``), given by position or as
        ``name``."""
        return self.args[0] if self.args else self.kwargs.get(name)

    @property
    def looked_up(self) -> bool:
        """The lookup already provided this request's output."""
        return self._provided

    @property
    def encoded(self):
        """The tower's output for the original images, if it ran already (else None)."""
        return self._output

    @property
    def expand_factor(self) -> int:
        """How many copies of each request row ``generate`` made (1: none)."""
        expanded = self._assigned.get("pooler_output")
        if expanded is None or self._output is None:
            return 1
        return max(1, len(expanded) // max(1, len(self._output.pooler_output)))

    def provide(self, output) -> None:
        self._output, self._assigned, self._provided = output, {}, True

    def resolve(self):
        if self._output is None:
            self._output = self._encode(self.pixel_values, *self.args, **self.kwargs)
        return self._output

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._assigned:
            return self._assigned[name]
        return getattr(self.resolve(), name)

    def __getitem__(self, item):
        return self.resolve()[item]


@dataclass(frozen=True)
class PrefillRequest:
    """The lookup's result for one prefill. ``needs_runner``: some image reuses K/V (or the cache compresses, or the
    store keeps compressed entries): the prefill runner executes it; else the model's own forward does, and its
    images are stored afterwards."""

    images: tuple[ImageMatch, ...]
    needs_runner: bool = True
    #: the row's prefix blocks (``runtime.prefix``): their K/V reused when ``prefix.length`` > 0 (the model's own
    #: forward then computes the rest), written at the end of the prefill; None: the request keeps no prefix
    prefix: prefixes.PrefixPlan | None = None
    #: ms the approximate lookup took (pixel stage and fine stage), hit or not (``runtime.gate``)
    approximate_ms: float = 0.0


def host_copies(tree):
    """``tree`` with every tensor copied to the host in one transfer (their bytes side by side: one
    synchronisation on an accelerator instead of one per tensor; for the small tensors that decide a request: ids,
    masks, geometry)."""
    leaves, spec = tree_flatten(tree)
    moving = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    if moving:
        parts = [leaves[i].detach().contiguous() for i in moving]
        chunks, offsets, offset = [], [], 0
        for p in parts:  # each part at a multiple of 8 bytes: its dtype can view it back
            n = p.numel() * p.element_size()
            pad = -n % 8
            chunks += [p.reshape(-1).view(torch.uint8), p.new_zeros(pad, dtype=torch.uint8)]
            offsets.append(offset)
            offset += n + pad
        flat = torch.cat(chunks).cpu()
        for i, p, at in zip(moving, parts, offsets):
            leaves[i] = flat[at : at + p.numel() * p.element_size()].view(p.dtype).reshape(p.shape)
    return tree_unflatten(leaves, spec)


def _runs(mask: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, first column, length) of every run of True in the (B, L) ``mask``, row by row."""
    out: list[tuple[int, int, int]] = []
    for row in range(mask.shape[0]):
        flags = mask[row].to(torch.int8)
        edges = torch.diff(torch.cat([flags.new_zeros(1), flags, flags.new_zeros(1)]))
        starts = torch.nonzero(edges == 1).flatten().tolist()
        ends = torch.nonzero(edges == -1).flatten().tolist()
        out.extend((row, s, e - s) for s, e in zip(starts, ends))
    return out


def image_spans(spans: list[tuple[int, int, int]], counts: list[int]) -> list[tuple[int, int]]:
    """(row, first column) of each image, in the order of ``image_grid_thw``, from the runs of image placeholders
    (``_runs`` of ``ModelAdapter.image_mask``); checks the token counts."""
    lengths = [n for _, _, n in spans]
    if lengths != list(counts):
        # adjacent images without separators would merge into one run; the processors always separate them
        raise ValueError(
            f"image placeholder runs {lengths} do not match image_grid_thw token counts {list(counts)}: "
            "use the model's processor to build inputs"
        )
    return [(row, start) for row, start, _ in spans]


def _usable(adapter, cache, entry: Entry | None, key: str, grid) -> bool:
    """An entry the model can use as it is; an inconsistent one is logged and removed (a miss, never wrong K/V)."""
    if entry is None:
        return False
    problem = adapter.entry_problem(entry, grid)
    if problem is None:
        return True
    logger.warning("vismemo: entry %s does not fit this model (%s); removed", key[:12], problem)
    store_call("discard", lambda: cache.store.discard(key), None)
    return False


def prefix_digest(input_ids: torch.Tensor, valid: torch.Tensor | None, start: int, earlier: list[str]) -> str:
    """Hash of what precedes an image in its row: the real (unpadded) token ids before column ``start``
    and the identities of the row's earlier images and videos (their placeholder tokens alone would not tell them
    apart): image keys, video content hashes."""
    ids = input_ids[:start]
    if valid is not None:
        ids = ids[valid[:start].to(ids.device)]
    h = hashlib.blake2b(ids.to(torch.int64).cpu().numpy().tobytes(), digest_size=16)
    for key in earlier:
        h.update(key.encode())
    return h.hexdigest()


def _expanded_order(image_mask: torch.Tensor, n_images: int, expand: int) -> list[int]:
    """Original image index of each image of a request whose rows ``generate`` repeated ``expand`` times each."""
    if expand == 1:
        return list(range(n_images))
    per_row = [sum(1 for _ in _runs(image_mask[row:row + 1])) for row in range(0, image_mask.shape[0], expand)]
    if sum(per_row) != n_images:
        raise ValueError(f"expanded request rows hold {sum(per_row)} images, the encoder saw {n_images}")
    order, first = [], 0
    for count in per_row:
        order.extend(list(range(first, first + count)) * expand)
        first += count
    return order


def video_items(video_mask: torch.Tensor, merge: int, videos) -> dict[int, list[tuple[int, str]]]:
    """{row: [(first column, content hash), ...]} of the request's videos, from the (B, L) mask of their
    placeholders (``ModelAdapter.video_mask``). ``videos``: (pixel_values_videos,
    video_grid_thw) or (per-video encoder outputs, video_grid_thw), or None. A video may span several placeholder
    runs (Qwen3-VL puts a timestamp before each frame): runs are given to videos in order by token count."""
    if videos is None:
        return {}
    content, grids = videos
    if isinstance(content, torch.Tensor):  # pixels: one slice of patch rows per video
        sizes = [int(t * h * w) for t, h, w in grids.tolist()] if grids is not None else [content.shape[0]]
        content, tokens = torch.split(content, sizes), [n // merge**2 for n in sizes]
    else:
        tokens = [int(part.shape[0]) for part in content]
    runs = _runs(video_mask)
    out: dict[int, list[tuple[int, str]]] = {}
    run = 0
    for part, count in zip(content, tokens):
        if run >= len(runs):
            break
        row, first, _ = runs[run]
        taken = 0
        while run < len(runs) and taken < count:
            taken += runs[run][2]
            run += 1
        out.setdefault(row, []).append((first, tensor_digest(part)))
    return out


def lookup_request(adapter, cache, input_ids, pixel_values, grids, get_image_features,
                   valid: torch.Tensor | None = None, expand: int = 1, encoded=None,
                   videos=None, token_types: torch.Tensor | None = None,
                   approximate: bool = True, digests: list[bytes] | None = None) -> tuple[PrefillRequest, object]:
    """Look every image up; return the request's matches and the ``mm_encoder_outputs["image"]`` object.

    ``valid``: (B, columns) False at padding, so that a left-padded row hashes its prefix like an unpadded one.
    ``expand``: ``generate`` repeated every row that many times (beam search, ``num_return_sequences``): the
    images of ``pixel_values`` are looked up once per copy of their row. ``encoded``: the tower's output for
    those images when it already ran (it is not run again). ``videos``: what identifies the request's videos
    (``video_items``), part of the context hash of every image after them. ``token_types``: the processor's
    ``mm_token_type_ids`` (families whose videos share the image placeholder tell them apart by it).
    ``approximate``: look for approximate hits (False: exact hits and prefixes only; ``runtime.gate``).
    ``digests``: each image's pixel digest, hashed ahead (``runtime.keys``), or None."""
    # two reads: decisions read host copies of the ids (types, padding) and geometry; keys, pixel features and
    # thumbnails one host copy of the pixels as the tower reads them (``tower_pixels``); the tower the device's own
    input_ids, token_types, valid, grids = host_copies((input_ids, token_types, valid, grids))
    image_mask = adapter.image_mask(input_ids, token_types)
    n_images = adapter.image_count(grids)
    source = _expanded_order(image_mask, n_images, expand)
    placeholder_runs = _runs(image_mask)
    lengths = _first_copy_lengths(source, [n for _, _, n in placeholder_runs], n_images)
    items = adapter.split_images(pixel_values, grids, lengths)
    items = [items[i] for i in source]
    grid_list = [g for _, g, _ in items]
    spans = image_spans(placeholder_runs, [adapter.tokens_in(g) for g in grid_list])
    t0 = time.perf_counter()
    originals = {i: source.index(i) for i in sorted(set(source))}  # original image -> its first copy
    owner = cache.owner(adapter.fingerprint)
    host = adapter.split_images(adapter.tower_pixels(pixel_values).cpu(), grids, lengths)  # as the tower reads them
    keys = {i: exact_key(owner, host[i][0], grid_list[j], digests[i] if digests is not None else None)
            for i, j in originals.items()}
    compressing = cache.compress is not None or (cache.store_misses and cache.store.keep_ratio is not None)
    prefix, covered = _prefix(adapter, cache, owner, input_ids, spans, grid_list, [keys[i] for i in source],
                              expand == 1 and valid is None and videos is None and not compressing)
    reused = bool(covered) or (prefix is not None and prefix.length > 0)
    contexts = _contexts(input_ids, valid, spans, [keys[i] for i in source],
                         video_items(adapter.video_mask(input_ids, token_types), adapter.merge, videos),
                         owner.encode() + getattr(cache.store, "context_key", b""))
    pending, entries = _exact_stage(adapter, cache, owner, originals, keys, grid_list, contexts, reused)
    exact_ms = (time.perf_counter() - t0) * 1e3 / max(1, len(source))
    todo = [i for i in originals if entries[i] is None and i not in pending and originals[i] not in covered]
    pixels, extras = [host[i][0] for i in source], [host[i][2] for i in source]
    hashes, firsts, tiles, pixel_ms = _pixel_stage(adapter, cache, owner, {i: originals[i] for i in todo}, pixels,
                                                   extras, grid_list, keys, contexts, reused or not approximate)
    approximate_ms = pixel_ms * len(todo)
    t0 = time.perf_counter()
    lendable = {i: replace(f, tiles=tiles[i]) for i, f in firsts.items()
                if adapter.tile_encoder or _lends(adapter, cache.policy, f, *contexts[originals[i]])}
    partial, encodings, wholes = _encode_request(adapter, cache, get_image_features, lendable, todo,
                                                 {i: items[originals[i]] for i in todo}, encoded, approximate)
    encoder_ms = (time.perf_counter() - t0) * 1e3
    images = []
    for j, i in enumerate(source):
        t0 = time.perf_counter()
        (row, start), (digest, sketch), entry = spans[j], contexts[j], entries[i]
        if j in covered:
            match = _prefix_match(adapter, row, start, keys[i], grid_list[j], digest, sketch)
        elif i in pending:
            match = _pending_match(adapter, (row, start), keys[i], grid_list[j], pending[i], (pixels[j], extras[j]),
                                   digest, sketch)
        elif entry is not None:
            match = _exact_match(row, start, entry, digest, sketch)
            store_call("index", lambda e=entry: cache.store.note_pixels(e.key, e.patch_hashes), None)
        else:
            match = _computed(adapter, (row, start), keys[i], grid_list[j], encodings[i],
                              (pixels[j], hashes[i], extras[j]), (digest, sketch), encoder_ms=encoder_ms,
                              encoded_tokens=partial[i][2] if i in partial else None, tile_digests=tiles[i],
                              whole_encode=wholes.get(i))
            if i in firsts:
                match = _pixel_first_match(match, firsts[i])
            elif not reused and approximate:
                t1 = time.perf_counter()
                match = _approximate(adapter, match, cache, get_image_features)
                approximate_ms += (time.perf_counter() - t1) * 1e3
        stages = exact_ms + (pixel_ms if entry is None else 0.0)
        images.append(replace(match, lookup_ms=stages + (time.perf_counter() - t0) * 1e3))
    outputs = adapter.encoder_outputs([(m.embeds, m.deepstack) for m in images])
    needs_runner = not reused and (compressing or any(m.kind is not HitKind.MISS for m in images))
    return PrefillRequest(tuple(images), needs_runner, prefix, approximate_ms), outputs


def _computed(adapter, span: tuple[int, int], key: str, grid, encoding, pixels, context, **found) -> ImageMatch:
    """The match of an image the lookup encoded (a miss until a later stage finds it): its features, from
    ``encoding`` (embeds, deepstack, tower K/V) and ``pixels`` (its pixel values, patch hashes, extras as the tower
    reads them); ``context`` is its (digest, sketch); ``found`` the encoder's other outputs (``ImageMatch`` fields)."""
    embeds, deepstack, tower = encoding
    values, hashes, extras = pixels
    feats = ImageFeatures(key, grid, embeds, rows=adapter.token_rows, heights=adapter.hash_rows,
                          pixel_features=adapter.pixel_features(values, grid, hashes, extras))
    host_embeds = embeds.detach().float().cpu()
    return ImageMatch(*span, feats, embeds, deepstack, region_descriptors(host_embeds, grid, adapter.merge),
                      HitKind.MISS, context[0], context=context[1], thumbnail=adapter.thumbnail_of(values, grid, extras),
                      host_embeds=host_embeds, tower_kv=tower, **found)


def _prefix(adapter, cache, owner: str, input_ids, spans, grids, keys: list[str], eligible: bool):
    """(the request's ``prefix.PrefixPlan`` or None, the images inside its reused prefix): those are neither
    looked up nor encoded, and every image after the prefix is computed in full. Reused only by a prefill whose caller
    reads the last position's logits alone (``prefix.LAST_ONLY``)."""
    counts = [adapter.tokens_in(g) for g in grids]
    plan = prefixes.plan(cache, owner, input_ids, spans, counts, keys,
                         eligible and prefixes.LAST_ONLY.get() and cache.policy.reuses_prefix())
    if plan is None or not plan.length:
        return plan, set()
    return plan, {j for j, (_, start) in enumerate(spans) if start + counts[j] <= plan.length}


def _pixel_stage(adapter, cache, owner: str, todo: dict[int, int], pixels, extras, grids, keys: dict, contexts,
                 reused: bool):
    """(hashes, pixel-first aliases, tile digests, ms per image) of the images ``todo`` (image -> its first copy)
    without an exact hit; after a reused prefix no alias is looked for (every image there is computed in full).
    ``contexts``: each copy's (digest, sketch)."""
    t0 = time.perf_counter()
    hashes = {i: None if reused else _hashes_for_lookup(adapter, cache, owner, pixels[j], grids[j], extras[j])
              for i, j in todo.items()}
    firsts = {i: found for i, j in todo.items()
              if (found := _pixel_alias(adapter, cache, owner, grids[j], hashes[i], keys[i], contexts[j])) is not None}
    tiles = {i: adapter.tile_digests(pixels[j], grids[j], extras[j]) for i, j in todo.items()}
    return hashes, firsts, tiles, (time.perf_counter() - t0) * 1e3 / max(1, len(todo))


def _prefix_match(adapter, row: int, start: int, key: str, grid, digest: str, sketch) -> ImageMatch:
    """An image inside a reused prefix: its K/V come with the prefix's, so it needs no encoder output (zeros stand
    in for it in the model's inputs, at positions the prefill does not compute)."""
    embeds, deepstack = adapter.placeholder_output(adapter.tokens_in(grid))
    feats = ImageFeatures(key, tuple(grid), embeds)
    return ImageMatch(row, start, feats, embeds, deepstack, None, HitKind.EXACT, digest, alias=feats, score=1.0,
                      context=sketch, encoded_tokens=0, found_by="prefix")


def _exact_entry(adapter, cache, key: str, grid) -> Entry | None:
    """The stored entry of ``key`` if it can serve this model, else None."""
    entry = store_call("read", lambda: cache.store.get(key, cache.owner(adapter.fingerprint)), None)
    return entry if _usable(adapter, cache, entry, key, grid) else None


def _first_copy_lengths(source: list[int], runs: list[int], n_images: int) -> list[int]:
    """Each original image's placeholder run: its first copy's (``source``: the original image of each copy)."""
    lengths = [0] * n_images
    for j in reversed(range(min(len(source), len(runs)))):
        lengths[source[j]] = runs[j]
    return lengths


def _exact_stage(adapter, cache, owner: str, originals: dict[int, int], keys: dict[int, str], grids, contexts,
                 reused: bool) -> tuple[dict[int, Announced], dict[int, Entry | None]]:
    """(announcements, entries) by original image: the entries still being written that a request is served from
    without waiting (``_pending_served``), and the stored entries of the others (None: none usable, or inside a
    reused prefix)."""
    if reused:
        return {}, dict.fromkeys(originals)
    pending = {i: found for i, j in originals.items()
               if (found := _pending_served(cache, owner, keys[i], *contexts[j])) is not None}
    return pending, {i: None if i in pending else _exact_entry(adapter, cache, keys[i], grids[j])
                     for i, j in originals.items()}


def _announcement(cache, owner: str, key: str) -> Announced | None:
    """The announcement of ``key``'s entry while it is still being written for ``owner`` (None once written)."""
    found = store_call("index", lambda: cache.store.pending_image(key), None)
    if found is None or found.embeds is None or found.prefix is None or found.fingerprint != owner:
        return None
    return found


def _in_full(cache, found: Announced, digest: str, sketch: torch.Tensor | None) -> bool:
    """Whether the routing computes an image announced by ``found`` in full here anyway: another context before it
    than the entry's (``RoutingPolicy.context_in_full``, an agent's screen that moved in its window)."""
    return found.prefix != digest and cache.policy.context_in_full(True, context_change(found.context, sketch))


def _pending_in_full(cache, owner: str, key: str, digest: str, sketch: torch.Tensor | None) -> Announced | None:
    """The announcement of ``key``'s entry still being written when an image would be computed in full against it
    (``_in_full``): an approximate candidate then is passed over unread (it would give nothing)."""
    found = _announcement(cache, owner, key)
    return found if found is not None and _in_full(cache, found, digest, sketch) else None


def _pending_served(cache, owner: str, key: str, digest: str, sketch: torch.Tensor | None) -> Announced | None:
    """The announcement of ``key``'s entry while it is still being written, when a request is served from it without
    waiting for the write: an exact hit on its K/V (``Announced.kv``, finite), or, where the routing computes the
    image in full anyway (``_in_full``), on its encoder output. None: read as usual (a read waits for the write)."""
    found = _announcement(cache, owner, key)
    if found is None or _in_full(cache, found, digest, sketch):
        return found
    kv = store_call("read", found.kv, None) if found.kv is not None else None
    return found if kv is not None and all_finite(kv) else None


def _pending_match(adapter, span: tuple[int, int], key: str, grid, found: Announced, pixels, digest: str,
                   sketch: torch.Tensor | None) -> ImageMatch:
    """An exact hit on an entry still being written (``_pending_served``), from its announcement: its K/V and
    encoder output (or, another context before it, its encoder output, the image computed in full:
    ``RoutingPolicy.early_plan``); ``pixels``: its (pixel values, extras)."""
    values, extras = pixels
    assert found.embeds is not None  # ``_pending_served`` takes announcements that carry them
    feats = ImageFeatures(key, grid, found.embeds, rows=adapter.token_rows, heights=adapter.hash_rows,
                          pixel_features=adapter.pixel_features(values, grid, None, extras))
    changed = found.prefix != digest
    return ImageMatch(*span, feats, found.embeds, found.deepstack, found.descriptors, HitKind.EXACT, digest,
                      alias=feats, alias_kv=found.kv, alias_offset=found.offset, score=1.0, prefix_changed=changed,
                      context=sketch, context_change=context_change(found.context, sketch) if changed else None,
                      encoded_tokens=0, found_by="key")


def _exact_match(row: int, start: int, entry: Entry, prefix: str, sketch: torch.Tensor | None) -> ImageMatch:
    feats = entry.features()
    changed = entry.prefix != prefix
    return ImageMatch(row, start, feats, entry.embeds, entry.deepstack, entry.descriptors, HitKind.EXACT, prefix,
                      alias=feats, alias_entry=entry, alias_offset=entry.offset, score=1.0, prefix_changed=changed,
                      context=sketch, context_change=context_change(entry.context, sketch) if changed else None,
                      encoded_tokens=0, found_by="key")


def _approximate_lookup(adapter, cache) -> bool:
    """Whether this cache and model make approximate lookups at all."""
    if cache.top_k == 0 or not adapter.approximate:
        return False
    if cache.policy.decision_layer(HitKind.APPROXIMATE) >= adapter.num_layers:  # nothing left to reuse
        logger.info("vismemo: the routing's warmup leaves no layer to reuse in a %d-layer model; no approximate "
                    "lookup", adapter.num_layers)
        return False
    return True


def _hashes_for_lookup(adapter, cache, owner: str, pixels: torch.Tensor, grid, extra) -> torch.Tensor | None:
    """The image's token pixel hashes when a pixel-first lookup can use them (the index holds images of its model
    and grid), else None (computed later, when needed)."""
    if not _approximate_lookup(adapter, cache) or cache.lookup_thresholds(adapter.fingerprint).same_pixels is None or \
            not store_call("index", lambda: cache.store.knows_pixels(owner, tuple(grid)), False):
        return None
    return adapter.patch_hashes(pixels, grid, extra)


def _pixel_alias(adapter, cache, owner: str, grid, hashes: torch.Tensor | None, own: str, context: tuple) -> \
        PixelAlias | None:
    """Pixel-first stage (docs/METHOD.md §1, step 2): the ``PixelAlias`` of the first candidate of the pixel index that
    the image shows edited (``pixel_changes``), or None. The image's own key (``own``: an entry the exact stage
    could not read or use) is never its alias, nor an entry still being written that the image would be computed
    in full against (``context``: the image's (digest, sketch); ``_pending_in_full``): a request does not wait
    for it."""
    same_pixels = cache.lookup_thresholds(adapter.fingerprint).same_pixels
    if hashes is None or same_pixels is None:
        return None
    found = store_call("index", lambda: cache.store.pixel_candidates(owner, tuple(grid), hashes, cache.top_k), [])
    rows = adapter.hash_rows(hashes, grid) if found else None
    for key, _ in found:
        if key == own or _pending_in_full(cache, owner, key, *context) is not None:
            continue
        entry = store_call("read", lambda k=key: cache.store.peek(k, owner), None)
        if not _usable(adapter, cache, entry, key, tuple(grid)):
            continue
        changed = pixel_changes(hashes, entry.patch_hashes, same_pixels, rows)
        if changed is not None and adapter.same_layout(SimpleNamespace(patch_hashes=hashes), entry):
            return PixelAlias(entry, changed, 1.0 - float(changed.float().mean()))
    return None


def _lends(adapter, policy, found: PixelAlias, prefix: str, sketch: torch.Tensor | None) -> bool:
    """Whether a pixel-first alias may lend its encoder output (``RoutingPolicy.lends_encoder``, told how much of
    one token row the edit changed): not where the
    routing computes the image in full before any layer runs (a context change that is not small), where only the
    image's own whole encode gives plain transformers' answer, nor after another context the routing does not verify.
    Later fallbacks (probes, an unsure answer, a page changed everywhere) start the prefill again from the whole
    encode (``ImageMatch.whole_encode``). A tower that re-encodes whole tiles (``VisionTower.tile_encoder``) gives
    every token what the whole encode gives it, and lends after any context."""
    entry = found.entry
    changed = entry.prefix != prefix
    rows = adapter.hash_rows(entry.patch_hashes, entry.grid) if entry.patch_hashes is not None else None
    return policy.lends_encoder(changed, context_change(entry.context, sketch) if changed else None, found.changed, rows)


def _encode_request(adapter, cache, get_image_features, firsts: dict, todo: list[int], items: dict, encoded,
                    approximate: bool = True) -> tuple[dict, dict, dict]:
    """(partial, encodings, wholes) of the images without an exact hit (``items``: image -> its (pixels, grid,
    extra)): ``_encode_changed`` for those found by their pixels when the policy reuses the encoder (a failure there
    encodes them whole), one batch through the tower for the rest, keeping the tower's K/V when entries are
    written (``_encode``); ``wholes``: the ``_whole_encoder`` of each image lent its alias's tower K/V.
    ``approximate``: this request looks for approximate hits. When it does not (``runtime.gate``: they do not pay
    on the model, or ``approximate="never"``) the tower's K/V, which only an approximate hit's partial encode reads,
    are not kept: the request pays nothing for hits its model does not take (an entry without them is encoded
    whole when it is an alias)."""
    reusing = encoded is None and (adapter.partial_encoder or adapter.tile_encoder) and cache.policy.reuses_encoder()
    try:
        partial, lent = _encode_changed(adapter, get_image_features, {i: firsts[i] for i in firsts if reusing},
                                        {i: items[i] for i in firsts})
    except (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError) as err:  # never out of generate
        logger.warning("vismemo: a partial encode failed (%s); encoding the whole images", err)
        partial, lent = {}, set()
    rest = [i for i in todo if i not in partial]
    capturing = approximate and adapter.partial_encoder and cache.policy.reuses_encoder() and cache.store_misses
    encodings = {**_encode(adapter, get_image_features, rest, encoded, [items[i] for i in rest], capturing),
                 **{i: (*out[:2], None) for i, out in partial.items()}}
    return partial, encodings, {i: _whole_encoder(adapter, get_image_features, items[i], capturing) for i in lent}


def _whole_encoder(adapter, get_image_features, item: tuple, capturing: bool) -> Callable[[ImageMatch], ImageMatch]:
    """What turns a match lent its alias's encoder output into one with the image's own whole encode of ``item``
    ((pixels, grid, extra) on the tower's device): its embeddings, deepstack, descriptors and (``capturing``) tower
    K/V, so that its entry, once computed in full, is a miss's. The tower runs at most once, however many copies of
    the image the request holds; ``encoded_tokens`` counts both encodes."""
    done: list = []

    def whole(match: ImageMatch) -> ImageMatch:
        t0 = time.perf_counter()
        if not done:
            done.extend(_encode(adapter, get_image_features, [0], None, [item], capturing)[0])
        embeds, deepstack, tower = done
        host = embeds.detach().float().cpu()
        features = copy.copy(match.features)
        features.embeds = embeds
        return replace(match, features=features, embeds=embeds, deepstack=deepstack, host_embeds=host,
                       descriptors=region_descriptors(host, match.features.grid, adapter.merge), tower_kv=tower,
                       encoded_tokens=match.n_tokens + (match.encoded_tokens or 0), whole_encode=None,
                       encoder_ms=match.encoder_ms + (time.perf_counter() - t0) * 1e3)

    return whole


def _encode_changed(adapter, get_image_features, found: dict[int, PixelAlias], items: dict) -> tuple[dict, set]:
    """({image: (embeds, deepstack, tokens encoded)}, the images lent tower K/V) of pixel-first hits (``found``:
    image -> its ``PixelAlias``, with its ``tiles``) whose alias kept its tower K/V: the
    tower runs, in one call, for
    each image's changed tokens (whole windows of a windowed tower), which attend at every full-attention block to
    the alias's other patches (``families.tower_kv``); the changed tokens take its output, the others keep the
    alias's. An alias without tower K/V is encoded in full (a partial encode without the rest of the image as context
    is measured wrong: ``results/quality/encoder-reuse.md``); none lent when the family's tower cannot. A tower that
    encodes tiles alone re-encodes the changed tiles of the images it can by itself (``VisionTower.encode_edited``)."""
    own = adapter.encode_edited(get_image_features, {i: (items[i], f.entry, f.changed, f.tiles)
                                                     for i, f in found.items()}) if found and adapter.tile_encoder else {}
    found = {i: f for i, f in found.items() if i not in own and adapter.lendable(f.entry.tower_kv, items[i][0].shape[0])}
    wanted = {}
    for i, f in found.items():
        if bool(f.changed.any()):
            wanted[i] = encoder_tokens(f.changed, token_grid(f.entry.grid, adapter.merge)[1:], halo=0,
                                       window=adapter.encoder_window)
    fresh = adapter.encode_tokens(get_image_features, [(items[i][0], items[i][1], t) for i, t in wanted.items()],
                                  lent=[found[i].entry.tower_kv for i in wanted]) if wanted else []
    if fresh is None:
        return own, set()
    fresh = dict(zip(wanted, fresh))
    out = {}
    for i, f in found.items():
        entry, changed = f.entry, f.changed
        embeds, deepstack = _on_device(entry.embeds, items[i][0]), entry.deepstack
        deepstack = _on_device(deepstack, items[i][0]) if deepstack is not None else None
        if i in fresh:
            at = torch.searchsorted(wanted[i], torch.nonzero(changed).flatten())
            new, extra = fresh[i]
            embeds = embeds.to(new.dtype).index_copy(0, torch.nonzero(changed).flatten().to(new.device),
                                                     new[at.to(new.device)])
            if deepstack is not None and extra is not None:
                deepstack = deepstack.to(extra.dtype).index_copy(1, torch.nonzero(changed).flatten().to(extra.device),
                                                                 extra[:, at.to(extra.device)])
        out[i] = (embeds, deepstack, int(wanted[i].numel()) if i in wanted else 0)
    return {**own, **out}, set(out)


def _on_device(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return tensor.to(like.device) if tensor.device != like.device else tensor


def _pixel_first_match(match: ImageMatch, found: PixelAlias) -> ImageMatch:
    """The match as an approximate hit on the entry its pixels found (tokens in place: no shift, no warp)."""
    entry = found.entry
    changed_prefix = entry.prefix != match.prefix
    return replace(match, kind=HitKind.APPROXIMATE, alias=entry.features(), alias_offset=entry.offset, score=found.share,
                   prefix_changed=changed_prefix, found_by="pixels",
                   context_change=context_change(entry.context, match.context) if changed_prefix else None)


def _encode(adapter, get_image_features, todo: list[int], encoded, items, capturing: bool = False) -> dict:
    """Encoder output (embeds, deepstack, tower K/V or None) of the images without an exact hit: from the tower's
    earlier run when there was one, else one batch through it now; ``capturing``: the tower's own K/V are kept for
    the entries these images become (encoder reuse)."""
    if not todo:
        return {}
    if encoded is not None:
        per_image = adapter.split_encoded(encoded)
        return {i: (*per_image[i], None) for i in todo}
    if not capturing:
        return {i: (*out, None) for i, out in zip(todo, adapter.encode_images(get_image_features, items))}
    pixels = torch.cat([p for p, _, _ in items]) if len(items) > 1 else items[0][0]  # one image: no copy
    grids = torch.tensor([g for _, g, _ in items], device=pixels.device)
    try:
        per_image, towers = adapter.encode_capturing(get_image_features, pixels, grids) \
            if all(g[0] == 1 for _, g, _ in items) else (adapter.encode(get_image_features, pixels, grids), None)
    except (RuntimeError, NotImplementedError, KeyError, AttributeError) as err:  # never out of generate
        logger.warning("vismemo: the tower's K/V could not be kept (%s); encoding without", err)
        per_image, towers = adapter.encode(get_image_features, pixels, grids), None
    towers = towers if towers is not None else [None] * len(per_image)
    return {i: (*out, tower) for i, out, tower in zip(todo, per_image, towers)}


def _contexts(input_ids, valid, spans, keys, videos: dict, sketch_key: bytes) -> list[tuple[str, torch.Tensor]]:
    """(context hash, context sketch) of every image: the row's text before it and the images and videos before
    it; ``sketch_key`` keys the sketch's hashes (``core.context``)."""
    earlier = {row: list(items) for row, items in videos.items()}
    out = []
    for (row, start), key in zip(spans, keys):
        before = [ident for at, ident in sorted(earlier.get(row, [])) if at < start]
        ids = input_ids[row][:start]
        if valid is not None:
            ids = ids[valid[row][:start].to(ids.device)]
        out.append((prefix_digest(input_ids[row], None if valid is None else valid[row], start, before),
                    context_sketch(ids, before, sketch_key)))
        earlier.setdefault(row, []).append((start, key))
    return out


def _reference(adapter, store, get_image_features, owner: str):
    """The model's reference (``runtime.reference``), kept by every store that serves it (for the model and for
    ``owner``, the namespace whose index it centres)."""
    if store.reference(owner) is None:
        fp = adapter.fingerprint
        store.set_reference(fp, reference_for(adapter, get_image_features))
        store.set_reference(owner, store.reference(fp))
    return store.reference(owner)


def _approximate(adapter, match: ImageMatch, cache, get_image_features) -> ImageMatch:
    """Coarse stage (the store's descriptor index), then the fine stage from each candidate's lookup section
    (descriptors and token sketches, never its encoder output): the match as an approximate hit, or unchanged. Both
    stages compare embeddings centred by the model's reference means (``core/thresholds.py``); the fine stage also
    compares the candidate moved by a visual token (``best_shift``), and a moved match reuses its K/V at the moved
    positions (``ImageFeatures.moved``). With a pixel stage (calibrated or derived), candidates below the fine
    threshold are also compared by their thumbnails, aligned across zooms and moves of part of a token
    (``_fine_stage``); a match of the tokens alone is taken only when the thumbnails agree (``_thumbnails_agree``)."""
    fp, owner = adapter.fingerprint, cache.owner(adapter.fingerprint)
    if not _approximate_lookup(adapter, cache):
        return match
    thresholds = cache.lookup_thresholds(fp)
    if thresholds.fingerprint not in (None, fp):
        raise ValueError(f"lookup thresholds calibrated for model {thresholds.fingerprint[:12]} used with model "
                         f"{fp[:12]}: run `vismemo calibrate` for this model or pass thresholds=None")
    reference = store_call("index", lambda: _reference(adapter, cache.store, get_image_features, owner), None)
    if reference is None:
        return match
    thresholds = thresholds.for_model(reference)
    feats = match.features
    found = store_call("index", lambda: cache.store.candidates(owner, feats.grid, match.descriptors, thresholds.tau,
                                                               cache.top_k), [])
    sketch = token_sketch(match.host_embeds if match.host_embeds is not None else feats.embeds) if found else None
    mine = centred_sketches(sketch, reference.token_mean) if sketch is not None else None
    hw = token_grid(feats.grid, adapter.merge)[1:]
    scored, read = [], 0
    for key, _ in found:
        # found: both computed above; a miss looked up here has its region descriptors (``lookup_request``)
        assert sketch is not None and mine is not None and match.descriptors is not None
        if _pending_in_full(cache, owner, key, match.prefix, match.context) is not None:
            continue  # an entry still being written that this image would be computed in full against: no wait
        section = store_call("read", lambda k=key: cache.store.lookup_section(k, owner), None)
        if section is None:
            continue
        descriptors, other, thumb = section
        read += descriptors.numel() * 4 + other.numel() * 2 + (thumb.numel() if thumb is not None else 0)
        if descriptors.shape != match.descriptors.shape or other.shape != sketch.shape:
            continue
        if not bool((regional_cosines(match.descriptors, descriptors, reference.descriptor_mean) > thresholds.tau).all()):
            continue  # the projected index let it through; the exact coarse rule does not
        scored.append((*best_shift(mine, centred_sketches(other, reference.token_mean), hw, adapter.max_shift), key,
                       thumb))
    match = replace(match, lookup_bytes=read)
    thumb_hw = adapter.thumbnail_hw(feats.grid)
    chosen = _fine_stage(scored, thresholds, thresholds.tau_fine, match.thumbnail, thumb_hw)
    if chosen is None:
        return match
    best, best_score, moved_by, pixel, zoom, thumb = chosen
    if pixel is None and not _thumbnails_agree(match, thumb, thumb_hw):
        return match  # the tower's tokens agree, the pixels do not: another page of the candidate's layout
    entry = store_call("read", lambda: cache.store.peek(best, owner), None)
    if not _usable(adapter, cache, entry, best, feats.grid):
        return match
    alias = entry.features().moved(moved_by, hw)
    if not adapter.same_layout(feats, alias):
        return match  # as many tokens, other places (``ModelAdapter.same_layout``)
    if pixel is not None and partly_changed(feats.patch_hashes, alias.patch_hashes):
        return match  # the pixel stage is for copies changed everywhere a little (``core.pixel_first``)
    drift = local_drift(match.thumbnail(), thumb, thumb_per_token(thumb_hw)) if thumb is not None and \
        match.thumbnail is not None and _changed_share(feats, alias) > UNWARPED_SHARE else 0.0
    store_call("index", lambda: cache.store.note_pixels(entry.key, entry.patch_hashes), None)
    return replace(match, kind=HitKind.APPROXIMATE, alias=alias, found_by="thumbnail" if pixel is not None else "encoder",
                   alias_offset=entry.offset, score=best_score, pixel_score=pixel,
                   prefix_changed=entry.prefix != match.prefix, drift=drift,
                   context_change=context_change(entry.context, match.context) if entry.prefix != match.prefix
                   else None,
                   aligned=zoom_drift(zoom, thumb_hw) <= MAX_ZOOM_DRIFT and drift <= MAX_DRIFT)


def _thumbnails_agree(match: ImageMatch, thumb: torch.Tensor | None, hw: tuple[int, int]) -> bool:
    """Whether the request's thumbnail shows the fine stage's candidate (``thumb``), aligned across its moves and
    zooms, at least ``ENCODER_PIXEL_AGREE``; True when either has none (a family without thumbnails)."""
    mine = match.thumbnail() if thumb is not None and match.thumbnail is not None else None
    if mine is None:
        return True
    assert thumb is not None  # read only with a candidate thumbnail
    return aligned_similarity(mine, thumb, thumb_per_token(hw), hopeless_below=ENCODER_PIXEL_AGREE,
                              enough=ENCODER_PIXEL_AGREE)[0] >= ENCODER_PIXEL_AGREE


#: a copy with at most this share of its tokens' pixels changed (a local edit) is not checked for a warp: a turned
#: or zoomed page changes every token that shows anything
UNWARPED_SHARE = 0.1


def _changed_share(image: ImageFeatures, alias: ImageFeatures) -> float:
    """The share of ``image``'s tokens whose pixels differ from ``alias``'s (1 when either's hashes are unknown)."""
    mine, theirs = image.patch_hashes, alias.patch_hashes
    if mine is None or theirs is None or mine.shape != theirs.shape:
        return 1.0
    return float((mine != theirs).float().mean())


#: the most candidates near the fine threshold whose thumbnails the pixel stage aligns, best first
PIXEL_CANDIDATES = 2


def _fine_stage(scored: list, thresholds, tau_fine: float, thumbnail, hw) -> tuple | None:
    """(key, score, shift, pixel score or None, zoom, thumbnail) of the candidate the fine rule accepts
    (``LookupThresholds.matches``) from ``scored`` ((score, shift, key, thumbnail) of each): the best score when it
    reaches ``tau_fine``, else the first of the ``PIXEL_CANDIDATES`` best near ones whose thumbnail aligns with the
    request's; else None."""
    scored = sorted(scored, key=lambda c: -c[0])  # stable: of equal scores the first found wins
    if not scored:
        return None
    score, shift, key, thumb = scored[0]
    if score >= tau_fine:
        return key, score, shift, None, 1.0, thumb
    near = [c for c in scored if thresholds.near(c[0], tau_fine) and c[3] is not None][:PIXEL_CANDIDATES]
    mine = thumbnail() if near and thumbnail is not None else None
    if mine is None:
        return None
    for score, shift, key, thumb in near:
        pixel, zoom = aligned_similarity(mine, thumb, thumb_per_token(hw), hopeless_below=thresholds.tau_pixel)
        if thresholds.matches(score, tau_fine, lambda p=pixel: p):
            return key, score, shift, pixel, zoom, thumb
    return None

"""Per-image features used by lookup and routing (docs/METHOD.md §1, §2 (patch entropy)).

All functions take one image's slice of the processor output: ``pixels`` are its rows of
``pixel_values`` (one row per ViT patch, merge windows contiguous) and ``grid`` is its
``image_grid_thw`` row ``(t, h, w)`` in pre-merge patches.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from functools import lru_cache

import blake3
import torch
import torch.nn.functional as F
from crc32c import crc32c

ENTROPY_BINS = 32
#: width of a token sketch (the fine lookup stage's compact stand-in for a token's embedding)
SKETCH_DIM = 32


@lru_cache(maxsize=16)
def projection(dim: int, out: int, seed: int = 0) -> torch.Tensor:
    """(dim, min(dim, out)) matrix with orthonormal columns (the identity when ``dim <= out``): fixed by its seed,
    so every process projects alike."""
    if dim <= out:
        return torch.eye(dim)
    g = torch.Generator().manual_seed(seed * 1_000_003 + dim)
    q, _ = torch.linalg.qr(torch.randn(dim, out, generator=g, dtype=torch.float64))
    return q.float().contiguous()


def token_grid(grid: tuple[int, int, int], merge: int) -> tuple[int, int, int]:
    t, h, w = grid
    return t, h // merge, w // merge


def checked_namespace(namespace) -> str:
    """``namespace`` if it is a usable one (a non-empty str of at most 256 characters), else a ValueError."""
    if not isinstance(namespace, str) or not 0 < len(namespace) <= 256:
        raise ValueError(f"namespace must be a non-empty str of at most 256 characters, got {type(namespace).__name__}"
                         f"{f' of length {len(namespace)}' if isinstance(namespace, str) else ''}")
    return namespace


def scoped(fingerprint: str, namespace: str | None) -> str:
    """The owner of a namespace's entries for a model (the fingerprint its entries, keys and index carry): the
    model fingerprint itself without a namespace, else a 32-hex hash of both, so that no read, key or lookup of
    one namespace matches another's."""
    if namespace is None:
        return fingerprint
    return hashlib.sha256(f"vismemo namespace\0{namespace}\0{fingerprint}".encode()).hexdigest()[:32]


def exact_key(fingerprint: str, pixels: torch.Tensor | None, grid: tuple[int, int, int],
              digest: bytes | None = None) -> str:
    """Hash of (model fingerprint, grid, preprocessed pixel bytes): equal keys mean the same image for the same model.

    BLAKE3 of the fingerprint, the grid and the pixels' ``pixel_digest`` (given as ``digest`` when it was hashed
    ahead: ``runtime.keys``), itself BLAKE3 of every byte (a cryptographic hash, several times faster than SHA-256 and
    on several threads for large images: ``results/perf/exact-key.md``); no digest depends on the threads, so keys
    are the same on every machine that shares a store."""
    if digest is None:
        if pixels is None:
            raise ValueError("exact_key needs the pixels or their digest")
        digest = pixel_digest(pixels)
    h = blake3.blake3(b"vismemo key\0" + fingerprint.encode() + b"\0")
    h.update(repr(tuple(int(g) for g in grid)).encode() + b"\0")
    h.update(digest)
    return h.hexdigest()


def pixel_digest(pixels: torch.Tensor) -> bytes:
    """32-byte BLAKE3 of a tensor's dtype, shape and bytes (an image's pixels as its tower reads them)."""
    data = _host_bytes(pixels)
    return _update(_hasher(data), pixels, data).digest()


def tensor_digest(tensor: torch.Tensor) -> str:
    """128-bit BLAKE3 of a tensor's dtype, shape and bytes (a video's content in the hash of what precedes an
    image): as fast as ``exact_key``."""
    data = _host_bytes(tensor)
    return _update(_hasher(data), tensor, data).hexdigest(16)


#: below this many bytes one thread hashes: the binding starts a pool of threads for each multithreaded hasher (a
#: pool of its own, not a process-wide one, which a forked child could not use), which saves nothing on an image
#: of fewer than about a thousand float32 tokens (``results/perf/exact-key.md``)
PARALLEL_BYTES = 16 << 20


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    data = tensor.detach().to("cpu").contiguous()
    return data.reshape(-1).view(torch.uint8).numpy().data if data.numel() else memoryview(b"")


def _hasher(data: memoryview):
    return blake3.blake3(max_threads=_threads() if len(data) >= PARALLEL_BYTES else 1)


def _update(h, tensor: torch.Tensor, data: memoryview):
    h.update(repr((str(tensor.dtype), tuple(tensor.shape))).encode() + b"\0")
    if len(data):
        h.update(data)  # the buffer itself: no copy
    return h


@functools.cache
def _threads() -> int:
    """Up to 8 threads, as many as this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, cores or 1))


def patch_hashes(pixels: torch.Tensor, merge: int) -> torch.Tensor:
    """(N,) CRC-32C of each visual token's pixel bytes: equal pixels, equal hash (CRC-32C, not zlib's CRC-32: x86
    and ARM compute it with one instruction)."""
    data = pixels.detach().cpu().contiguous()
    rows = data.view(torch.uint8).reshape(data.shape[0] // (merge * merge), -1).numpy()
    return torch.tensor([crc32c(row) for row in rows], dtype=torch.int64)


#: Rec. 601 luma weights of R, G and B
LUMA = (0.299, 0.587, 0.114)


def _luma_weights(channels: int) -> torch.Tensor:
    return torch.tensor(LUMA) if channels == 3 else torch.full((channels,), 1 / channels)


def patch_entropy(
    pixels: torch.Tensor,
    *,
    channels: int,
    temporal_patch: int,
    patch: int,
    merge: int,
    image_mean,
    image_std,
) -> torch.Tensor:
    """Normalised Shannon entropy in [0, 1] of each visual token's 8-bit luma histogram (32 bins).

    Undoes the processor's normalisation, takes the first temporal frame of the token's
    merge x merge patches and histograms its luma. One channel at a time, in place, and one ``bincount`` for
    every token's histogram: the values of an RGB image's float arithmetic, without its temporaries (a
    4,096-token image is 50 M values).
    """
    x = pixels.detach().float().cpu().reshape(-1, channels, temporal_patch, patch, patch)[:, :, 0]
    mean = torch.as_tensor(image_mean, dtype=torch.float32).reshape(-1).expand(channels)  # one value: every channel's
    std = torch.as_tensor(image_std, dtype=torch.float32).reshape(-1).expand(channels)
    if channels == 3:
        luma = None
        for c in range(3):  # LUMA[c] * clamp(x * std + mean, 0, 1), summed in channel order
            v = (x[:, c] * std[c]).add_(mean[c]).clamp_(0, 1)
            v = LUMA[c] * v
            luma = v if luma is None else luma.add_(v)
        assert luma is not None  # the loop above ran for three channels
    else:
        luma = (x * std.view(1, -1, 1, 1) + mean.view(1, -1, 1, 1)).clamp(0, 1).mean(1)
    levels = luma.mul_(255).round_().clamp_(0, 255)  # integers 0..255, exact in float32
    bins = levels.reshape(-1, merge * merge * patch * patch).div_(256 // ENTROPY_BINS).floor_()  # level * 32 // 256
    tokens = bins.shape[0]
    index = bins.to(torch.long).add_(torch.arange(tokens)[:, None] * ENTROPY_BINS)  # each token its own counters
    counts = torch.bincount(index.reshape(-1), minlength=tokens * ENTROPY_BINS)
    counts = counts.reshape(tokens, ENTROPY_BINS).float()
    p = counts / counts.sum(1, keepdim=True)
    ent = -(p * torch.log2(p.clamp_min(1e-12))).sum(1)
    return (ent / math.log2(ENTROPY_BINS)).clamp(0, 1)


#: thumbnail pixels per visual token and side (fewer for a large image, so that no side exceeds ``THUMB_MAX``)
THUMB_PER_TOKEN = 7
THUMB_MAX = 160
#: Gaussian blur before the thumbnail is averaged down, in thumbnail pixels
THUMB_BLUR = 0.5


def thumbnail(pixels: torch.Tensor, grid: tuple[int, int, int], *, channels: int, temporal_patch: int, patch: int,
              merge: int, image_mean, image_std) -> torch.Tensor:
    """(H, W) uint8 luma of the image, area-averaged to ``THUMB_PER_TOKEN`` px per visual token (fewer for large
    images): what the lookup's pixel stage aligns (``core.thresholds.aligned_similarity``; docs/METHOD.md §1)."""
    _, h, w = grid
    x = pixels[: h * w].detach().cpu().reshape(-1, channels, temporal_patch, patch, patch)[:, :, 0]
    luma = _luma(x, 1, image_mean, image_std)
    bh, bw = h // merge, w // merge
    image = luma.reshape(bh, bw, merge, merge, patch, patch).permute(0, 2, 4, 1, 3, 5).reshape(h * patch, w * patch)
    return _shrunk(image, thumbnail_shape(token_grid(grid, merge)[1:]))


def view_thumbnail(view: torch.Tensor, hw: tuple[int, int], *, image_mean, image_std) -> torch.Tensor:
    """``thumbnail`` of one normalised (C, H, W) view of an image laid over ``hw`` visual tokens (LLaVA-OneVision's
    base view: the whole image at the tower's tile size)."""
    return _shrunk(_luma(view.detach().cpu(), 0, image_mean, image_std), thumbnail_shape(hw))


def _luma(x: torch.Tensor, dim: int, image_mean, image_std) -> torch.Tensor:
    """Luma in [0, 1] of normalised pixels ``x`` whose channels lie along ``dim`` (that axis dropped); linear in the
    normalised values: no RGB image is made."""
    channels = x.shape[dim]
    weights = _luma_weights(channels)
    scale = weights * torch.as_tensor(image_std, dtype=torch.float32)
    bias = float((weights * torch.as_tensor(image_mean, dtype=torch.float32)).sum())
    luma = x.select(dim, 0).float() * float(scale[0])
    for c in range(1, channels):  # summed in channel order, in place: the values of the sum of the products
        luma.add_(x.select(dim, c).float() * float(scale[c]))
    return luma.add_(bias).clamp_(0, 1)


def _shrunk(image: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """(H, W) luma in [0, 1] -> the ``shape`` uint8 thumbnail: averaged down, blurred, averaged to ``shape``."""
    step = image.shape[0] / shape[0]  # image px per thumbnail px
    pre = max(1, int(step) // 2)  # averaged down to about twice the thumbnail first: the blur stays cheap
    image = _averaged(image, (image.shape[0] // pre, image.shape[1] // pre))
    image = _blur(image, THUMB_BLUR * step / pre)  # band-limited: a warp of it resamples it faithfully
    small = _averaged(image, shape)
    return (small * 255).round().clamp(0, 255).to(torch.uint8)


def _averaged(image: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """(H, W) area-averaged to ``shape``: a plain average pool where ``shape`` divides it (the same values as the
    adaptive pool's, at a fraction of its cost), else the adaptive pool."""
    (h, w), (sh, sw) = image.shape, shape
    if h % sh == 0 and w % sw == 0 and h // sh == w // sw:
        return F.avg_pool2d(image[None, None], h // sh)[0, 0]
    return F.adaptive_avg_pool2d(image[None, None], shape)[0, 0]


def _blur(image: torch.Tensor, sigma: float) -> torch.Tensor:
    """(H, W) under a separable Gaussian of ``sigma`` px (edges replicated)."""
    r = int(3 * sigma) + 1
    g = torch.exp(-torch.arange(-r, r + 1, dtype=torch.float32) ** 2 / (2 * sigma**2))
    g = g / g.sum()
    x = F.pad(image[None, None], (r, r, r, r), mode="replicate")
    return F.conv2d(F.conv2d(x, g.view(1, 1, 1, -1)), g.view(1, 1, -1, 1))[0, 0]


def thumb_per_token(hw: tuple[int, int]) -> int:
    """Thumbnail pixels per visual token of an image of ``hw`` tokens."""
    return max(1, min(THUMB_PER_TOKEN, THUMB_MAX // max(hw)))


def thumbnail_shape(hw: tuple[int, int]) -> tuple[int, int]:
    """(H, W) of the thumbnail laid over ``hw`` visual tokens."""
    per = thumb_per_token(hw)
    return hw[0] * per, hw[1] * per


def region_descriptors(embeds: torch.Tensor, grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """Four unit-norm descriptors: the mean of L2-normalised token embeddings over each 2x2 region."""
    t, h, w = token_grid(grid, merge)
    e = F.normalize(embeds.detach().float().cpu(), dim=-1).reshape(t, h, w, -1)
    hs, ws = math.ceil(h / 2), math.ceil(w / 2)
    rows = [slice(0, hs), slice(hs, h) if h > hs else slice(0, hs)]
    cols = [slice(0, ws), slice(ws, w) if w > ws else slice(0, ws)]
    desc = torch.stack([e[:, r, c].reshape(-1, e.shape[-1]).mean(0) for r in rows for c in cols])
    return F.normalize(desc, dim=-1)


def token_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-position cosine similarity of two (N, d) embedding tensors (computed on ``a``'s device, returned on CPU)."""
    a = a.detach().float()
    return F.cosine_similarity(a, b.detach().to(a.device).float(), dim=-1).cpu()


def token_sketch(embeds: torch.Tensor) -> torch.Tensor:
    """(N, d) embeddings -> (N, SKETCH_DIM) fp16 sketches: L2-normalised tokens under a fixed orthonormal projection.
    Projection is linear, so a sketch centred by the projected mean is the projection of the centred token, and
    sketch cosines estimate token cosines (docs/METHOD.md §1 step 4) from 64 bytes per token."""
    e = F.normalize(embeds.detach().float().cpu(), dim=-1)
    return (e @ projection(e.shape[-1], SKETCH_DIM, seed=1)).to(torch.float16)


def centred_sketches(sketch: torch.Tensor, token_mean: torch.Tensor | None) -> torch.Tensor:
    """(N, s) sketches centred by the projected ``token_mean`` (d,) when given, as unit vectors."""
    s = sketch.float()
    if token_mean is not None:
        s = s - token_mean.float().cpu() @ projection(token_mean.shape[0], SKETCH_DIM, seed=1)
    return F.normalize(s, dim=-1)


def sketch_cosine(a: torch.Tensor, b: torch.Tensor, token_mean: torch.Tensor | None) -> torch.Tensor:
    """Per-token cosine of two sketches (N, s), both centred by the projected ``token_mean`` (d,) when given."""
    return (centred_sketches(a, token_mean) * centred_sketches(b, token_mean)).sum(-1)

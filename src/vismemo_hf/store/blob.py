"""The byte layout of an entry in the host and disk tiers (raw bytes, never pickle).

    [header][token 0 block][token 1 block]...[token N-1 block][metadata]

* header: fixed ``struct`` with magic, layout version, dtype, shapes, grid, offset, model
  fingerprint, key, the hash of the text before the image, the size of each region, a CRC-32C
  digest of the metadata, a salt and a MAC (sealed blobs), and last a CRC-32 of all the header's
  bytes before it.
* token block (patch-first): for each layer l, an 8-byte CRC-32C of the layer's K/V followed
  by that K/V (2 x heads x head_dim values). In an 8-bit blob (``KV_FORMATS``) the values are
  int8 or fp8 e4m3, followed by one fp16 scale per (K or V, head): 2 x heads x (head_dim + 2)
  bytes instead of 2 x heads x head_dim x 2 for bf16. The late layers of one token (l >= W) with
  their hashes are one contiguous byte range: an approximate hit reads one range per
  reused token and can check every layer it read.
* metadata: first the lookup section (region descriptors, the luma thumbnail when kept, and token
  sketches: all the lookup reads of a candidate, with its own digest in the header), then encoder output,
  deepstack features, patch entropy and patch hashes (what routing needs without any K/V), and where kept the
  context sketch, the tower's K/V and the tiles' digests (header flags 64, 128, 256).

A *sealed* blob (a store with a secret, ``Seal``; docs/METHOD.md §5) carries MACs where the checksums are: the
header an HMAC-SHA256 under a key derived from the secret, the regions and every (token, layer) block an AES-GMAC
tag under a key of the blob's own (derived from its random salt), each block's nonce its (row, layer), and the whole
K/V region one more tag. Checksums catch corruption; MACs catch anyone without the secret: a sparse read checks the
tags of exactly the blocks it read, a full read the region's in one pass.
"""

from __future__ import annotations

import hmac
import os
import struct
import zlib
from dataclasses import dataclass, field

import torch
from crc32c import crc32c

from vismemo_hf.core.context import SIZE as CONTEXT_SIZE
from vismemo_hf.core.features import THUMB_MAX
from vismemo_hf.store.entry import Entry
from vismemo_hf.store.faults import StoreFault

MAGIC = b"VMEM"
LAYOUT_VERSION = 8
_FIELDS = struct.Struct("<4sHBH" + "I" * 13 + "q32s64s16sQQ16s16s16s16s16s")  # the MAC last (zeros while computed)
MAC_BYTES = 16
SEALED = 32  # header flag: MACs in place of checksums
CONTEXT = 64  # header flag: the context sketch (``Entry.context``) at the end of the metadata
TOWER = 128  # header flag: the tower's K/V (``Entry.tower_kv``) after it: its (F, patches, width), then the values
TILES = 256  # header flag: the tiles' digests (``Entry.tile_digests``) last: their count, then the digests
_HEADER_CRC = struct.Struct("<I")
HEADER_SIZE = _FIELDS.size + _HEADER_CRC.size
HASH_BYTES = 8

DTYPES = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
#: stored K/V formats: name -> (header flag, storage dtype, largest magnitude); None: the model's dtype
KV_FORMATS = {"int8": (4, torch.int8, 127.0), "fp8": (8, torch.float8_e4m3fn, 448.0)}
_FLAG_FORMAT = {flag: name for name, (flag, _, _) in KV_FORMATS.items()}
#: what a tier's ``lookup`` gives the fine stage: (descriptors, token sketches, thumbnail or None, bytes it read)
LookupSection = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None", int]


def quantize(kv: torch.Tensor, kv_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., H, D) K/V -> (values in the format's dtype, fp16 scales (..., H, 1)): one scale per head vector
    (per token, layer, K or V and head), its absolute maximum mapped to the format's largest value."""
    _, dtype, top = KV_FORMATS[kv_format]
    x = kv.float()
    scale = (x.abs().amax(-1, keepdim=True) / top).clamp_min(1e-12).half()
    q = x / scale.float()
    q = q.round().clamp(-top, top) if dtype == torch.int8 else q.clamp(-top, top)
    return q.to(dtype), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (values.float() * scale.float()).to(dtype)


def round_trip(kv: torch.Tensor, kv_format: str | None) -> torch.Tensor:
    """The K/V a blob of ``kv_format`` gives back (the input itself when None)."""
    if kv_format is None:
        return kv
    return dequantize(*quantize(kv, kv_format), kv.dtype)


class BlobError(StoreFault, ValueError):
    """A blob that must not be used: corrupt, truncated, foreign or of another layout."""


class ForgedBlob(BlobError):
    """A blob whose MAC a store with a secret cannot verify: written without the secret, or altered since."""


class ForeignSeal(ForgedBlob):
    """A blob whose header this store cannot verify: sealed under another secret, sealed while this store has none,
    or unsealed while it has one. Another trust domain's blob in a shared tier is not this store's to judge: it is
    refused (a miss) and left where it lies (``Placement.corrupt``)."""


class Seal:
    """A store secret (``VisMemoStore(secret=...)``): seals the blobs this store writes and verifies the blobs it
    reads. Only keys derived from the secret are kept (its value never reaches a log, a repr or an error)."""

    def __init__(self, secret: str | bytes):
        raw = secret.encode() if isinstance(secret, str) else secret
        if not isinstance(raw, bytes) or len(raw) < 16:
            raise ValueError("a store secret must be a str or bytes of at least 16 bytes")
        self._key = hmac.digest(raw, b"vismemo-hf blob seal 1", "sha256")

    def __repr__(self) -> str:
        return "Seal(<secret>)"

    def context_key(self) -> bytes:
        """The key of the context sketches (``core.context``) this store's entries keep."""
        return hmac.digest(self._key, b"context sketch", "sha256")

    def header_mac(self, fields: bytes) -> bytes:
        return hmac.digest(self._key, fields, "sha256")[:MAC_BYTES]

    def for_blob(self, salt: bytes) -> BlobSeal:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        return BlobSeal(AESGCM(hmac.digest(self._key, b"blob" + salt, "sha256")[:16]))


class BlobSeal:
    """The MACs of one blob's regions and blocks: AES-GMAC (AES-GCM over no plaintext) under the blob's key, a
    distinct nonce per region and per (row, layer) block."""

    def __init__(self, aead) -> None:
        self._aead = aead

    def region(self, name: bytes, data) -> bytes:
        return self._aead.encrypt(name + bytes(11), b"", data)

    def blocks(self, rows: torch.Tensor, skip: int, row_ids, first_layer: int) -> torch.Tensor:
        """(T, L) int64 of each block's tag (its first 8 bytes), blocks as ``_crc_rows`` reads them."""
        t, layers, width = rows.shape
        flat = rows.contiguous().reshape(-1).numpy().data
        encrypt, pack, tags = self._aead.encrypt, struct.Struct("<cIH5x").pack, []
        for i, row in enumerate(row_ids):
            for layer in range(layers):
                start = (i * layers + layer) * width
                tags.append(encrypt(pack(b"B", int(row), first_layer + layer), b"", flat[start + skip : start + width])[:8])
        return torch.frombuffer(bytearray(b"".join(tags)), dtype=torch.int64).reshape(t, layers) if tags else \
            torch.zeros(t, layers, dtype=torch.int64)


def _crc_rows(rows: torch.Tensor, skip: int = 0) -> torch.Tensor:
    """(T, L, bytes) uint8 -> (T, L) CRC-32C of each row's bytes after the first ``skip``, as int64. Rows are read
    in place (no copy) when ``rows`` is contiguous; CRC-32C runs in hardware where the CPU has it."""
    t, layers, width = rows.shape
    flat = rows.contiguous().reshape(-1).numpy().data
    sums = [crc32c(flat[start + skip : start + width]) for start in range(0, t * layers * width, width)]
    return torch.tensor(sums, dtype=torch.int64).reshape(t, layers)


def block_hashes(kv: torch.Tensor) -> torch.Tensor:
    """(N, L, 2, H, D) K/V -> (N, L) CRC-32C of each (token, layer) block's bytes."""
    n, layers = kv.shape[:2]
    return _crc_rows(kv.contiguous().view(torch.uint8).reshape(n, layers, -1))


@dataclass(frozen=True)
class BlobHeader:
    dtype: torch.dtype
    flags: int
    n_tokens: int
    n_layers: int
    kv_heads: int
    head_dim: int
    embed_dim: int
    deepstack_levels: int
    grid: tuple[int, int, int]
    offset: int
    fingerprint: str
    key: str
    meta_digest: bytes
    meta_bytes: int
    total_bytes: int
    prefix: str = ""
    sketch_dim: int = 0
    lookup_digest: bytes = b""
    kv_count: int = 0  # token blocks: n_tokens, or fewer for a compressed entry (flag 16: their tokens in the metadata)
    kv_mac: bytes = b""  # sealed: the MAC of the whole K/V region (what a full read checks instead of every block's)
    thumb: tuple[int, int] = (0, 0)  # (H, W) of the thumbnail in the lookup section; (0, 0): none
    seal: BlobSeal | None = field(default=None, compare=False, repr=False)  # a sealed blob's, once its MAC checked

    def digest(self, name: bytes, region) -> bytes:
        """The 16-byte digest of a region (``b"M"`` metadata, ``b"L"`` lookup section): its MAC when sealed."""
        return self.seal.region(name, _view(region)) if self.seal is not None else meta_digest(region)

    def sums(self, rows: torch.Tensor, skip: int, row_ids, first_layer: int) -> torch.Tensor:
        """What each block's 8-byte slot must hold: its MAC when sealed, else its CRC-32C."""
        if self.seal is not None:
            return self.seal.blocks(rows, skip, row_ids, first_layer)
        return _crc_rows(rows, skip)

    @property
    def kv_format(self) -> str | None:
        """The stored K/V format (``KV_FORMATS``), None for the model's dtype."""
        return next((name for flag, name in _FLAG_FORMAT.items() if self.flags & flag), None)

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer of one token: its hash and its K/V (8-bit values and their scales)."""
        if self.kv_format is not None:
            return HASH_BYTES + 2 * self.kv_heads * (self.head_dim + 2)
        return HASH_BYTES + 2 * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def token_bytes(self) -> int:
        return self.n_layers * self.layer_bytes

    def token_range(self, token: int, first_layer: int) -> tuple[int, int]:
        """(start, length) of layers >= ``first_layer`` of ``token``."""
        start = HEADER_SIZE + token * self.token_bytes + first_layer * self.layer_bytes
        return start, (self.n_layers - first_layer) * self.layer_bytes

    @property
    def meta_start(self) -> int:
        return HEADER_SIZE + self.kv_count * self.token_bytes

    @property
    def lookup_bytes(self) -> int:
        """Bytes of the lookup section (descriptors, thumbnail and sketches) at the start of the metadata."""
        return 4 * self.embed_dim * 4 + self.thumb[0] * self.thumb[1] + self.n_tokens * self.sketch_dim * 2


def parse_header(data: bytes, seal: Seal | None = None) -> BlobHeader:
    """The header of a blob; with ``seal`` (a store's secret) it must carry a valid MAC (else ``ForgedBlob``)."""
    if len(data) < HEADER_SIZE:
        raise BlobError("truncated header")
    raw = bytes(data[:HEADER_SIZE])
    if raw[:4] != MAGIC:
        raise BlobError("not a vismemo blob")
    if zlib.crc32(raw[: _FIELDS.size]) != _HEADER_CRC.unpack(raw[_FIELDS.size :])[0]:
        raise BlobError("header checksum mismatch")
    (magic, version, dtype, flags, n, layers, heads, hdim, edim, levels, t, h, w, sketch_dim, kv_count, thumb_h, thumb_w,
     offset, fp, key, digest, meta, total, prefix, lookup_digest, salt, kv_mac, mac) = _FIELDS.unpack(raw[: _FIELDS.size])
    if magic != MAGIC:
        raise BlobError("not a vismemo blob")
    if version != LAYOUT_VERSION:
        raise BlobError(f"layout version {version}, expected {LAYOUT_VERSION}")
    if dtype not in DTYPES:
        raise BlobError(f"unknown dtype code {dtype}")
    if bin(flags & 12).count("1") > 1 or flags & ~511 or kv_count > n or (kv_count != n and not flags & 16):
        raise BlobError(f"unknown flags {flags:#x}")
    sealed = None
    if flags & SEALED:
        if seal is None:
            raise ForeignSeal("a sealed blob: this store has no secret to verify it")
        if not hmac.compare_digest(seal.header_mac(raw[: _FIELDS.size - MAC_BYTES] + bytes(MAC_BYTES)), mac):
            raise ForeignSeal("header MAC mismatch (another secret's blob, or altered)")
        sealed = seal.for_blob(salt)
    elif seal is not None:
        raise ForeignSeal("a blob without a MAC in a store with a secret")
    try:
        fingerprint, key = fp.decode("ascii").rstrip("\0"), key.decode("ascii").rstrip("\0")
    except UnicodeDecodeError as err:
        raise BlobError("header names are not ascii") from err
    header = BlobHeader(DTYPES[dtype], flags, n, layers, heads, hdim, edim, levels, (t, h, w), offset,
                        fingerprint, key, digest, meta, total, prefix.hex() if any(prefix) else "", sketch_dim,
                        lookup_digest, kv_count, kv_mac, (thumb_h, thumb_w), sealed)
    if header.meta_start + meta != total or header.lookup_bytes > meta:
        raise BlobError("header sizes disagree")
    if max(header.thumb) > max(THUMB_MAX, h, w):  # a thumbnail has at most one pixel per token beyond THUMB_MAX
        raise BlobError(f"thumbnail {header.thumb} is too large for grid {header.grid}")
    return header


def _meta_tensors(entry: Entry) -> list[torch.Tensor]:
    thumb = entry.thumbnail if entry.thumbnail is not None else torch.zeros(0, dtype=torch.uint8)
    kv_dtype = entry.full_kv().dtype
    tensors = [entry.descriptors.float(), thumb.to(torch.uint8), entry.token_sketches.half(), entry.entropy.float(),
               entry.embeds.to(kv_dtype)]
    if entry.deepstack is not None:
        tensors.append(entry.deepstack.to(kv_dtype))
    if entry.patch_hashes is not None:
        tensors.append(entry.patch_hashes.long())
    if entry.kv_tokens is not None:
        tensors.append(entry.kv_tokens.long())
    if entry.context is not None:
        tensors.append(entry.context.long())
    if entry.tower_kv is not None:
        layers, _, patches, width = entry.tower_kv.shape
        tensors += [torch.tensor([layers, patches, width], dtype=torch.int64), entry.tower_kv.to(kv_dtype)]
    if entry.tile_digests is not None:
        tensors += [torch.tensor([entry.tile_digests.numel()], dtype=torch.int64), entry.tile_digests.long()]
    return [t.detach().cpu().contiguous() for t in tensors]


def _raw(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def encode(entry: Entry, kv_format: str | None = None, seal: Seal | None = None) -> bytes:
    """Serialise an entry (with K/V) to a blob; ``kv_format`` (``KV_FORMATS``) stores its K/V in 8 bits; ``seal``
    (a store's secret) seals it."""
    kv = entry.full_kv().detach().cpu().contiguous()
    n, layers, _, heads, hdim = kv.shape
    if kv_format is None:
        per_layer = kv.reshape(n, layers, -1).view(torch.uint8)
    else:
        values, scale = quantize(kv, kv_format)
        per_layer = torch.cat([values.reshape(n, layers, -1).view(torch.uint8),
                               scale.reshape(n, layers, -1).view(torch.uint8)], dim=-1)
    salt = os.urandom(16) if seal is not None else bytes(16)
    sealing = seal.for_blob(salt) if seal is not None else None
    hashes = sealing.blocks(per_layer, 0, range(n), 0) if sealing is not None else _crc_rows(per_layer)  # (N, L)
    blocks = torch.cat([hashes.unsqueeze(-1).view(torch.uint8), per_layer], dim=-1)
    parts = [_raw(t) for t in _meta_tensors(entry)]
    meta = b"".join(parts)
    digest = sealing.region if sealing is not None else (lambda _, data: meta_digest(data))
    flags = (1 if entry.deepstack is not None else 0) | (2 if entry.patch_hashes is not None else 0)
    flags |= SEALED if seal is not None else 0
    flags |= KV_FORMATS[kv_format][0] if kv_format is not None else 0
    flags |= 16 if entry.kv_tokens is not None else 0
    flags |= CONTEXT if entry.context is not None else 0
    flags |= TOWER if entry.tower_kv is not None else 0
    flags |= TILES if entry.tile_digests is not None else 0
    levels = entry.deepstack.shape[0] if entry.deepstack is not None else 0
    body_start = HEADER_SIZE + blocks.numel()
    fields = _FIELDS.pack(
        MAGIC, LAYOUT_VERSION, DTYPE_CODES[kv.dtype], flags, entry.n_tokens, layers, heads, hdim,
        entry.embeds.shape[-1], levels,
        *entry.grid, entry.token_sketches.shape[-1], n, *(entry.thumbnail.shape if entry.thumbnail is not None else (0, 0)),
        int(entry.offset), entry.fingerprint.encode("ascii"), entry.key.encode("ascii"), digest(b"M", meta), len(meta),
        body_start + len(meta), bytes.fromhex(entry.prefix) if entry.prefix else bytes(16),
        digest(b"L", b"".join(parts[:3])), salt,
        sealing.region(b"K", blocks.numpy().data.cast("B")) if sealing is not None else bytes(16),
        bytes(MAC_BYTES),
    )
    if seal is not None:
        fields = fields[:-MAC_BYTES] + seal.header_mac(fields)
    return fields + _HEADER_CRC.pack(zlib.crc32(fields)) + blocks.numpy().tobytes() + meta


def _view(data) -> memoryview:
    return data.numpy().data if isinstance(data, torch.Tensor) else memoryview(data)


def meta_digest(meta) -> bytes:
    """16-byte digest of a region (bytes or a uint8 tensor) of an unsealed blob: its CRC-32C and its length."""
    view = _view(meta)
    return struct.pack("<IQ4x", crc32c(view), len(view))


def decode_meta(header: BlobHeader, meta) -> Entry:
    """Entry without K/V (``kv=None``) from the metadata region (bytes, or a uint8 tensor whose memory the entry
    may then share); checks its digest."""
    buf = meta if isinstance(meta, torch.Tensor) else torch.frombuffer(bytearray(meta), dtype=torch.uint8)
    if buf.numel() != header.meta_bytes:
        raise BlobError("metadata size does not match its header")
    if not hmac.compare_digest(header.digest(b"M", buf), header.meta_digest):
        raise _mismatch(header, "metadata digest mismatch")
    pos = 0

    def take(count: int, dtype: torch.dtype, shape) -> torch.Tensor:
        nonlocal pos
        nbytes = count * dtype.itemsize
        part = buf[pos : pos + nbytes]
        try:  # a view when the offset is aligned for the dtype: no copy
            out = part.view(dtype)
        except RuntimeError:
            out = part.clone().view(dtype)
        pos += nbytes
        return out.reshape(shape)

    n, d = header.n_tokens, header.embed_dim
    descriptors = take(4 * d, torch.float32, (4, d))
    thumb = take(header.thumb[0] * header.thumb[1], torch.uint8, header.thumb)
    sketch = take(n * header.sketch_dim, torch.float16, (n, header.sketch_dim))
    entropy = take(n, torch.float32, (n,))
    embeds = take(n * d, header.dtype, (n, d))
    levels = header.deepstack_levels
    deepstack = take(levels * n * d, header.dtype, (levels, n, d)) if header.flags & 1 else None
    patch_hashes = take(n, torch.int64, (n,)) if header.flags & 2 else None
    kv_tokens = take(header.kv_count, torch.int64, (header.kv_count,)) if header.flags & 16 else None
    context = take(CONTEXT_SIZE, torch.int64, (CONTEXT_SIZE,)).clone() if header.flags & CONTEXT else None
    tower = None
    if header.flags & TOWER:
        if pos + 24 > buf.numel():
            raise BlobError("metadata size does not match its header")
        layers, patches, width = (int(x) for x in take(3, torch.int64, (3,)))
        if min(layers, patches, width) <= 0 or pos + 2 * layers * patches * width * header.dtype.itemsize > buf.numel():
            raise BlobError("tower K/V size does not match the metadata")
        tower = take(2 * layers * patches * width, header.dtype, (layers, 2, patches, width))
    tiles = None
    if header.flags & TILES:
        count = int(take(1, torch.int64, (1,))[0]) if pos + 8 <= buf.numel() else -1
        if not 0 < count <= max(1, n) or pos + 8 * count > buf.numel():
            raise BlobError("tile digests do not match the metadata")
        tiles = take(count, torch.int64, (count,)).clone()
    if pos != buf.numel():
        raise BlobError("metadata size does not match its header")
    return Entry(header.key, header.fingerprint, header.grid, embeds, deepstack, descriptors, entropy, None,
                 header.offset, patch_hashes, prefix=header.prefix, n_layers=header.n_layers, sketch=sketch,
                 kv_tokens=kv_tokens, thumbnail=thumb if thumb.numel() else None, context=context, tower_kv=tower,
                 tile_digests=tiles)


def decode_lookup(header: BlobHeader, section) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(descriptors (4, d) fp32, sketches (N, s) fp16, thumbnail (H, W) uint8 or None) from the lookup section
    (bytes or a uint8 tensor); checks its digest."""
    buf = section if isinstance(section, torch.Tensor) else torch.frombuffer(bytearray(section), dtype=torch.uint8)
    if buf.numel() != header.lookup_bytes:
        raise BlobError("lookup section size does not match its header")
    if not hmac.compare_digest(header.digest(b"L", buf), header.lookup_digest):
        raise _mismatch(header, "lookup section digest mismatch")
    d, n, s = header.embed_dim, header.n_tokens, header.sketch_dim
    descriptors = buf[: 4 * d * 4].clone().view(torch.float32).reshape(4, d)
    (th, tw), start = header.thumb, 4 * d * 4
    thumb = buf[start : start + th * tw].clone().reshape(th, tw) if th * tw else None
    return descriptors, buf[start + th * tw :].clone().view(torch.float16).reshape(n, s), thumb


def decode_entry(header: BlobHeader, data: torch.Tensor) -> Entry:
    """The whole entry, K/V included, from a whole blob (uint8 tensor, whose memory the entry then shares);
    checks the digest and every hash."""
    entry = decode_meta(header, data[header.meta_start :])
    region = data[HEADER_SIZE : header.meta_start]
    if header.seal is not None and not hmac.compare_digest(header.digest(b"K", region), header.kv_mac):
        raise ForgedBlob("K/V region MAC mismatch")
    entry.kv = decode_blocks(header, region.view(header.kv_count, header.token_bytes), 0,
                             checked=header.seal is not None)
    entry.n_layers = header.n_layers
    return entry


def decode_ranges(header: BlobHeader, chunks: list[bytes], first_layer: int, rows) -> tuple[torch.Tensor, int]:
    """K/V of the stored rows ``rows`` whose ranges (``header.token_range(row, first_layer)``) were read, and their
    bytes."""
    length = header.token_range(0, first_layer)[1]
    if any(len(c) != length for c in chunks):
        raise BlobError("truncated blob")
    data = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).view(len(chunks), length)
    return decode_blocks(header, data, first_layer, rows), len(chunks) * length


def _mismatch(header: BlobHeader, what: str) -> BlobError:
    return ForgedBlob(what.replace("digest", "MAC").replace("hash", "MAC")) if header.seal is not None else BlobError(what)


def decode_blocks(header: BlobHeader, data: torch.Tensor, first_layer: int, rows=None, checked: bool = False
                  ) -> torch.Tensor:
    """(T, L - first_layer, 2, H, D) K/V from T token ranges of layers >= ``first_layer``; checks each layer hash
    (MAC when sealed) unless the caller ``checked`` the whole region already.

    ``data`` is a uint8 tensor (T, (L - first_layer) * layer_bytes); ``rows``: their stored rows (default 0..T-1)."""
    t = data.shape[0]
    layers = header.n_layers - first_layer
    blocks = data.reshape(t, layers, header.layer_bytes)
    payload = blocks[..., HASH_BYTES:]
    if not checked:
        stored = blocks[..., :HASH_BYTES].clone().view(torch.int64).reshape(t, layers)
        rows = range(t) if rows is None else rows.tolist() if isinstance(rows, torch.Tensor) else rows
        if not torch.equal(header.sums(blocks, HASH_BYTES, rows, first_layer), stored):  # read in place
            raise _mismatch(header, "K/V block hash mismatch")
    shape = (t, layers, 2, header.kv_heads, header.head_dim)
    if header.kv_format is not None:
        split = 2 * header.kv_heads * header.head_dim
        values = payload[..., :split].contiguous().view(KV_FORMATS[header.kv_format][1]).reshape(shape)
        scale = payload[..., split:].contiguous().view(torch.float16).reshape(*shape[:-1], 1)
        return dequantize(values, scale, header.dtype)
    try:  # a strided view when the bytes are aligned for the dtype: no copy
        kv = payload.view(header.dtype)
    except RuntimeError:
        kv = payload.clone().view(header.dtype)
    return kv.reshape(shape)

"""One blob reader for the tiers that hold blobs behind a byte-range interface (a disk file, a Redis value).

A ``ByteSource`` answers range reads of a key's blob and reads it whole into a buffer; the ``BlobReader`` turns
that into what the store asks of a tier (header, metadata, lookup section, sparse token ranges, whole entries),
checking every part (``blob.py``): the header's key and checksum, the source's own check of the header (file
size, index record), digests and per-layer hashes, and a whole read's header again at the end.
"""

from __future__ import annotations

from typing import Protocol

import torch

from vismemo_hf.store import blob
from vismemo_hf.store.entry import Entry


def read_buffer(size: int) -> torch.Tensor:
    """A uint8 buffer a full read lands in: pinned when CUDA exists, so that the copy of its K/V to the GPU runs
    without blocking (torch's pinned-memory cache reuses the blocks of earlier reads)."""
    return torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


class ByteSource(Protocol):
    def ranges(self, key: str, spans: list[tuple[int, int]]) -> list[bytes]:
        """The bytes of each (start, length) of the blob of ``key``; KeyError when it is gone."""
        ...

    def read_into(self, key: str, view: memoryview) -> None:
        """The whole blob into ``view`` (its exact size); KeyError when it is gone."""
        ...

    def check(self, key: str, header: blob.BlobHeader) -> None:
        """Raise ``blob.BlobError`` if the source knows the header to be wrong for ``key`` (size, record)."""
        ...


class BlobReader:
    def __init__(self, source: ByteSource, seal: blob.Seal | None = None) -> None:
        self.source, self.seal = source, seal

    def _range(self, key: str, start: int, length: int) -> bytes:
        (data,) = self.source.ranges(key, [(start, length)])
        if len(data) != length:
            raise blob.BlobError("truncated blob")
        return data

    def header(self, key: str) -> blob.BlobHeader:
        header = blob.parse_header(self._range(key, 0, blob.HEADER_SIZE), self.seal)
        if header.key != key:
            raise blob.BlobError("blob stored under another key")
        self.source.check(key, header)
        return header

    def meta(self, key: str) -> Entry:
        header = self.header(key)
        return blob.decode_meta(header, self._range(key, header.meta_start, header.meta_bytes))

    def lookup(self, key: str) -> blob.LookupSection:
        header = self.header(key)
        section = self._range(key, header.meta_start, header.lookup_bytes)
        return (*blob.decode_lookup(header, section), blob.HEADER_SIZE + header.lookup_bytes)

    def tokens(self, key: str, tokens: torch.Tensor, first_layer: int) -> tuple[torch.Tensor, int]:
        """K/V of ``tokens`` (rows of the stored K/V) at layers >= ``first_layer``: one range per token."""
        header = self.header(key)
        spans = [header.token_range(int(t), first_layer) for t in tokens.tolist()]
        chunks = self.source.ranges(key, spans) if spans else []
        if spans and not any(chunks):  # deleted between the header read and now
            raise KeyError(key)
        return blob.decode_ranges(header, chunks, first_layer, tokens)

    def full(self, key: str) -> Entry:
        return self.read_full(key)[1]

    def read_full(self, key: str, header: blob.BlobHeader | None = None) -> tuple[blob.BlobHeader, Entry]:
        """The header (read now unless given) and the whole entry, read into one buffer (the entry's memory)."""
        header = header if header is not None else self.header(key)
        data = read_buffer(header.total_bytes)
        self.source.read_into(key, data.numpy().data)
        if blob.parse_header(data[: blob.HEADER_SIZE].numpy().tobytes(), self.seal) != header:
            raise blob.BlobError("blob replaced while it was read")
        return header, blob.decode_entry(header, data)

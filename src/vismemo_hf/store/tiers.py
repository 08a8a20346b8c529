"""The local tiers of the store; each holds entries in its own form and knows only its own bytes.

Every tier (these three and ``remote.RemoteTier``) offers the same ``Tier`` interface, so ``VisMemoStore`` reads,
places, touches, evicts and reports on all of them alike; a new tier is one class with these methods.

* ``DeviceTier`` (L1): decoded entries, K/V on the tier's device; reads are indexing.
* ``HostTier`` (L2): blobs as uint8 tensors (pinned when CUDA exists); sparse reads gather.
  Full reads of the lower tiers land in pinned buffers too (``ranges.read_buffer``).
* ``DiskTier`` (L3): blobs as raw-byte files of a ``diskcache`` directory, read through ``ranges.BlobReader``:
  sparse reads are positioned reads of the ranges they need. Pickled values are refused, never loaded.

Recency order lives here (``OrderedDict``); what to evict and where it goes is decided by
``VisMemoStore``.
"""

from __future__ import annotations

import fcntl
import io
import logging
import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from typing import Protocol, runtime_checkable

import diskcache
import torch
from diskcache.core import MODE_BINARY, MODE_PICKLE

from vismemo_hf.store import blob
from vismemo_hf.store.entry import Entry
from vismemo_hf.store.ranges import BlobReader

logger = logging.getLogger(__name__)


def token_rows(kv: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``kv[tokens]``, as a view (no copy) when ``tokens`` is every token in order."""
    if tokens.numel() == kv.shape[0] and bool((tokens.cpu() == torch.arange(kv.shape[0])).all()):
        return kv
    return kv[tokens.to(kv.device)]


def layer_major(kv: torch.Tensor | None) -> torch.Tensor | None:
    """The same (N, L, 2, H, D) K/V, laid out layer by layer in memory (a view of an (L, 2, H, N, D) tensor): one
    layer's keys (or values) of every token are then one block, what a prefill copies into that layer whole."""
    if kv is None or kv.permute(1, 2, 3, 0, 4).is_contiguous():
        return kv
    return kv.permute(1, 2, 3, 0, 4).contiguous().permute(3, 0, 1, 2, 4)


@runtime_checkable
class Tier(Protocol):
    """What the store asks of a tier. ``lru``: its keys, least recently used first (values are the tier's own);
    ``shared``: other processes see it too (a read never removes from it). ``put`` / ``pop`` take and give the
    item in the tier's own form (a decoded ``Entry`` for the device tier, blob bytes for the others). ``identity``:
    the (key, model fingerprint) the stored bytes name (None: only the read itself can tell), checked before a read
    is used, so that bytes stored under another key or of another model are never served."""

    name: str
    budget: int | None
    bytes: int
    shared: bool

    @property
    def lru(self) -> OrderedDict: ...
    def __contains__(self, key: str) -> bool: ...
    def sizeof(self, item) -> int: ...
    def put(self, key: str, item) -> None: ...
    def pop(self, key: str): ...
    def discard(self, key: str) -> None: ...
    def touch(self, key: str) -> None: ...
    def identity(self, key: str) -> tuple[str, str] | None: ...
    def full(self, key: str) -> Entry: ...
    def meta(self, key: str) -> Entry: ...
    def lookup(self, key: str) -> blob.LookupSection: ...
    def tokens(self, key: str, tokens: torch.Tensor, first_layer: int) -> tuple[torch.Tensor, int]: ...
    def stats(self) -> dict: ...


class _Local:
    """What the RAM tiers share: an ``lru`` mapping, touch, discard and stats."""

    shared = False
    lru: OrderedDict

    def __contains__(self, key: str) -> bool:
        return key in self.lru

    def touch(self, key: str) -> None:
        self.lru.move_to_end(key)

    def discard(self, key: str) -> None:
        if key in self.lru:
            self.pop(key)

    def stats(self) -> dict:
        return {"bytes": self.bytes, "budget": self.budget, "entries": len(self.lru)}


class DeviceTier(_Local):
    name = "device"

    def __init__(self, budget: int | None, device: str | torch.device = "cpu"):
        self.budget, self.device = budget, torch.device(device)
        self.lru: OrderedDict[str, Entry] = OrderedDict()
        self.bytes = 0

    def sizeof(self, entry: Entry) -> int:
        return entry.nbytes

    def put(self, key: str, entry: Entry) -> None:
        def move(t):  # asynchronous from pinned host memory (blobs read by the host, disk and remote tiers)
            return None if t is None else t.to(self.device, non_blocking=True)

        moved = replace(entry, embeds=move(entry.embeds), kv=layer_major(move(entry.kv)), deepstack=move(entry.deepstack))
        self.lru[key] = moved
        self.bytes += moved.nbytes

    def pop(self, key: str) -> Entry:
        entry = self.lru.pop(key)
        self.bytes -= entry.nbytes
        return entry

    def identity(self, key: str) -> tuple[str, str]:
        entry = self.lru[key]
        return entry.key, entry.fingerprint

    def full(self, key: str) -> Entry:
        return self.lru[key]

    def meta(self, key: str) -> Entry:
        return self.lru[key]

    def lookup(self, key: str) -> blob.LookupSection:
        entry = self.lru[key]
        return entry.descriptors, entry.sketch, entry.thumbnail, 0  # in memory: nothing read

    def tokens(self, key: str, tokens: torch.Tensor, first_layer: int) -> tuple[torch.Tensor, int]:
        kv = self.lru[key].kv
        out = token_rows(kv, tokens)[:, first_layer:]
        return out, out.numel() * out.element_size()


class HostTier(_Local):
    name = "host"

    def __init__(self, budget: int | None, name: str = "host", seal: blob.Seal | None = None):
        self.budget, self.name, self.seal = budget, name, seal
        self.lru: OrderedDict[str, tuple[blob.BlobHeader, torch.Tensor]] = OrderedDict()
        self.bytes = 0
        self.pin = torch.cuda.is_available()

    @staticmethod
    def sizeof(data: bytes) -> int:
        return len(data)

    def put(self, key: str, data: bytes) -> None:
        tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if self.pin:
            tensor = tensor.pin_memory()
        self.lru[key] = (blob.parse_header(data[: blob.HEADER_SIZE], self.seal), tensor)
        self.bytes += tensor.numel()

    def pop(self, key: str) -> bytes:
        _, tensor = self.lru.pop(key)
        self.bytes -= tensor.numel()
        return tensor.numpy().tobytes()

    def identity(self, key: str) -> tuple[str, str]:
        header = self.lru[key][0]
        return header.key, header.fingerprint

    def full(self, key: str) -> Entry:
        header, data = self.lru[key]
        return blob.decode_entry(header, data)

    def meta(self, key: str) -> Entry:
        header, data = self.lru[key]
        return blob.decode_meta(header, data[header.meta_start :])  # views of the blob: no copy

    def lookup(self, key: str) -> blob.LookupSection:
        header, data = self.lru[key]
        section = data[header.meta_start : header.meta_start + header.lookup_bytes]
        return (*blob.decode_lookup(header, section), header.lookup_bytes)

    @staticmethod
    def _blocks(header, data, tokens, first_layer) -> torch.Tensor:
        region = data[blob.HEADER_SIZE : header.meta_start].view(header.kv_count, header.token_bytes)
        start = first_layer * header.layer_bytes
        return blob.decode_blocks(header, region[tokens][:, start:], first_layer, tokens)

    def tokens(self, key: str, tokens: torch.Tensor, first_layer: int) -> tuple[torch.Tensor, int]:
        header, data = self.lru[key]
        kv = self._blocks(header, data, tokens.cpu(), first_layer)
        return kv, tokens.numel() * header.token_range(0, first_layer)[1]


#: what iterating a shared directory yields for a key that is not a raw string (written by another program)
FOREIGN_KEY = object()


class SafeDisk(diskcache.Disk):
    """diskcache storage that only ever handles raw bytes: pickled keys or values are refused."""

    def put(self, key):
        if not isinstance(key, str):
            raise TypeError("vismemo disk keys are strings")
        return super().put(key)

    def get(self, key, raw):
        if not raw:  # a pickled key another program stored here: never unpickled, never ours
            return FOREIGN_KEY
        return super().get(key, raw)

    def store(self, value, read, key=diskcache.core.UNKNOWN):
        if not (read or isinstance(value, (bytes, bytearray))):
            raise TypeError("vismemo disk values are raw bytes")
        return super().store(value, read, key=key)

    def fetch(self, mode, filename, value, read):
        if mode == MODE_PICKLE:
            raise blob.BlobError("pickled value refused")
        return super().fetch(mode, filename, value, read)


class ReadOnlyDirectory:
    """A diskcache directory this process may read but not write (a shared, read-only mount): its index read
    through SQLite in read-only mode, each blob opened from its own file. Writes and deletes are refused."""

    def __init__(self, directory: str):
        import sqlite3
        from urllib.parse import quote

        self.directory = directory
        db = quote(os.path.join(directory, "cache.db"))
        try:
            self._db = sqlite3.connect(f"file:{db}?mode=ro", uri=True, check_same_thread=False)
            self._db.execute("SELECT 1 FROM Cache LIMIT 1")
        except sqlite3.Error:  # a WAL database needs its shared-memory file: read the snapshot as it is
            self._db = sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True, check_same_thread=False)

    def iterkeys(self):
        for key, raw in self._db.execute("SELECT key, raw FROM Cache ORDER BY rowid").fetchall():
            yield key if raw else FOREIGN_KEY

    def get(self, key, default=None, read=True):
        row = self._db.execute("SELECT filename, mode FROM Cache WHERE key = ? AND raw = 1", (key,)).fetchone()
        if row is None or row[0] is None:
            return default
        if row[1] == MODE_PICKLE:
            raise blob.BlobError("pickled value refused")
        return open(os.path.join(self.directory, row[0]), "rb")  # noqa: SIM115 - the caller closes it

    def set(self, *args, **kwargs):
        raise PermissionError(f"{self.directory} is read-only")

    def delete(self, key) -> bool:
        return False

    def close(self) -> None:
        self._db.close()


class DiskTier:
    name = "disk"
    shared = True

    def __init__(self, directory: str, budget: int | None, seal: blob.Seal | None = None):
        self.directory, self.budget = os.path.expanduser(directory), budget
        self.read_only = False
        try:
            os.makedirs(self.directory, exist_ok=True)
            self.cache = diskcache.Cache(self.directory, disk=SafeDisk, size_limit=2**62, eviction_policy="none",
                                         disk_min_file_size=0)
        except Exception:  # noqa: BLE001 - not writable here: serve what it holds if it holds anything
            if not os.path.isfile(os.path.join(self.directory, "cache.db")):
                raise
            self.cache, self.read_only = ReadOnlyDirectory(self.directory), True
            logger.warning("vismemo: disk tier %s is read-only here: serving its entries, storing nothing new",
                           self.directory)
        self.lru: OrderedDict[str, int] = OrderedDict()  # key -> blob size
        self.reader = BlobReader(self, seal)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vismemo-disk")
        self._pending: dict[str, object] = {}  # key -> its queued write
        self._failed: list[str] = []  # appended by the writer thread (list.append is atomic)
        self.bytes = 0
        self.foreign = 0  # keys or values in the directory that are not vismemo blobs (skipped, left alone)
        self.range_reads = 0  # positioned reads of sparse (approximate-hit) reads
        self.others_evicted = 0  # blobs deleted to keep the shared directory within the budget (any process's)

    def __contains__(self, key: str) -> bool:
        return key in self.lru

    def touch(self, key: str) -> None:
        self.lru.move_to_end(key)

    def stats(self) -> dict:
        return {"bytes": self.bytes, "budget": self.budget, "entries": len(self.lru), "foreign": self.foreign,
                "range_reads": self.range_reads, "read_only": self.read_only, "directory_bytes": self._directory_bytes(),
                "directory_evictions": self.others_evicted}

    def _directory_bytes(self) -> int | None:
        try:
            return self.shared_bytes()
        except Exception:  # noqa: BLE001 - a read-only directory's index
            return None

    @staticmethod
    def sizeof(data: bytes) -> int:
        return len(data)

    def _is_blob(self, key) -> bool:
        """Whether ``key`` holds a vismemo blob (by its magic); other programs' keys and values are not ours."""
        if not isinstance(key, str):
            return False
        try:
            with self._open(key) as handle:
                return handle.read(len(blob.MAGIC)) == blob.MAGIC
        except Exception:  # noqa: BLE001 - a pickled or unreadable value: not a blob of ours
            return False

    def scan(self, unusable):
        """Keys and headers of every blob in the directory, oldest write first (a restart rebuilds its index and
        recency order from these). Keys and values of other programs are skipped and counted in ``foreign``; a
        blob of ours that fails its checks goes to ``unusable(key, error)``."""
        self.foreign = 0
        found = []
        for key in list(self.cache.iterkeys()):
            if not self._is_blob(key):
                self.foreign += 1
                continue
            try:
                with self._open(key) as handle:
                    written = os.fstat(handle.fileno()).st_mtime
                found.append((written, key, self.header(key)))
            except Exception as err:  # noqa: BLE001 - a corrupt or forged blob of ours
                unusable(key, err)
        for _, key, header in sorted(found, key=lambda f: f[0]):  # oldest first: the LRU end
            yield key, header

    def track(self, key: str, size: int) -> None:
        """Count a blob as held (before its background write lands)."""
        if key not in self.lru:
            self.lru[key] = size
            self.bytes += size

    def write(self, key: str, data: bytes) -> None:
        """Write a blob as a file of its own (so later reads can be positioned reads). With a budget, under the
        directory's lock (every process's writes in turn), the least recently stored blobs of the directory, any
        process's, are deleted first until it fits: the directory's blob bytes stay within ``budget`` whatever the
        number of processes sharing it (this process's own evictions keep their exact-priority order)."""
        if self.budget is None:
            self.cache.set(key, io.BytesIO(data), read=True)
            return
        with self._directory_lock():
            self._fit(len(data), key)
            self.cache.set(key, io.BytesIO(data), read=True)

    def shared_bytes(self) -> int:
        """Bytes of every value in the directory, every process's: diskcache's own count in its database."""
        return int(self.cache.reset("size"))

    @contextmanager
    def _directory_lock(self):
        with open(os.path.join(self.directory, "vismemo-writers.lock"), "a+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _fit(self, size: int, key: str) -> None:
        while self.shared_bytes() + size > self.budget:
            oldest = self.cache._sql("SELECT key FROM Cache WHERE raw = 1 AND mode = ? ORDER BY store_time LIMIT 32",
                                     (MODE_BINARY,)).fetchall()
            victims = [k for (k,) in oldest if k != key and self._is_blob(k)]
            if not victims:
                return
            for victim in victims:
                self.cache.delete(victim)
                self.others_evicted += 1
                if self.shared_bytes() + size <= self.budget:
                    return

    def write_async(self, key: str, data: bytes) -> None:
        """Count the blob as held now and write it on the writer thread. A write that lands after its entry was
        evicted deletes its file (the file must not outlive its entry); a failed write is reported by
        ``take_failures``. Writes are serialised, so a later write of the same key lands after this delete."""
        self.track(key, len(data))

        def write():
            try:
                self.write(key, data)
            except Exception as err:  # noqa: BLE001 - disk full, unwritable directory, ...
                logger.warning("vismemo: disk write failed (%s: %s); serving continues without it",
                               type(err).__name__, err)
                self._failed.append(key)
                return
            if key not in self.lru:
                self.cache.delete(key)

        self._pending[key] = self._writer.submit(write)

    def pending(self, key: str) -> bool:
        """A write of ``key`` is queued."""
        future = self._pending.get(key)
        return future is not None and not future.done()

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for future in pending.values():
            future.result()

    def take_failures(self) -> list[str]:
        failed = []
        while self._failed:
            failed.append(self._failed.pop())
        return failed

    def put(self, key: str, data: bytes) -> None:
        self.track(key, len(data))
        self.write(key, data)

    def discard(self, key: str) -> None:
        self.bytes -= self.lru.pop(key, 0)
        try:
            self.cache.delete(key)
        except Exception as err:  # noqa: BLE001
            logger.warning("vismemo: could not delete disk blob %s (%s)", key[:12], err)

    def pop(self, key: str) -> None:
        """Gone (the lowest local tier demotes to nothing)."""
        self.discard(key)

    def _open(self, key: str):
        handle = self.cache.get(key, default=None, read=True)
        if handle is None:
            raise KeyError(key)
        return handle

    # -- ByteSource (ranges.py): positioned reads of the blob's file --------------------------------------
    def ranges(self, key: str, spans: list[tuple[int, int]]) -> list[bytes]:
        with self._open(key) as handle:
            return [os.pread(handle.fileno(), length, start) for start, length in spans]

    def read_into(self, key: str, view: memoryview) -> None:
        with self._open(key) as handle:
            if handle.readinto(view) != len(view) or handle.read(1):
                raise blob.BlobError("blob size does not match its header")

    def check(self, key: str, header: blob.BlobHeader) -> None:
        with self._open(key) as handle:
            if os.fstat(handle.fileno()).st_size != header.total_bytes:
                raise blob.BlobError("blob size does not match its header")

    # -- reads --------------------------------------------------------------------------------------------
    def header(self, key: str) -> blob.BlobHeader:
        return self.reader.header(key)

    def identity(self, key: str) -> tuple[str, str]:
        header = self.header(key)
        return header.key, header.fingerprint

    def meta(self, key: str) -> Entry:
        return self.reader.meta(key)

    def lookup(self, key: str) -> blob.LookupSection:
        return self.reader.lookup(key)

    def full(self, key: str) -> Entry:
        return self.reader.full(key)

    def tokens(self, key: str, tokens: torch.Tensor, first_layer: int) -> tuple[torch.Tensor, int]:
        self.range_reads += tokens.numel()
        return self.reader.tokens(key, tokens, first_layer)

    def close(self) -> None:
        self.flush()
        self._writer.shutdown(wait=True)
        self.cache.close()

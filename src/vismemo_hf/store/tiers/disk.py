"""The disk tier (L3): blobs as raw-byte files of a ``diskcache`` directory (``directory.py``), shareable between
processes and persistent, read through ``ranges.BlobReader``: sparse reads are positioned reads of the ranges they
need. Pickled values are refused, never loaded. A damaged index (``cache.db`` not a database, or malformed) is moved
aside into ``quarantine/`` with the blobs it named, and the tier starts empty in the same directory. Writes run in
the background (``write_async``); the store learns of failed ones from ``take_failures`` and ``take_lost``."""

from __future__ import annotations

import io
import logging
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from contextlib import suppress

import diskcache
import torch
from diskcache.core import DBNAME

from vismemo_hf.store import blob
from vismemo_hf.store.background import background_pool
from vismemo_hf.store.entry import Entry
from vismemo_hf.store.ranges import BlobReader
from vismemo_hf.store.tiers.base import BYTES, COPY, News, TierBase
from vismemo_hf.store.tiers.directory import (
    ReadOnlyDirectory,
    damaged,
    directory_lock,
    file_id,
    open_index,
    passing,
    quarantine,
    sweep_orphans,
)

logger = logging.getLogger(__name__)

#: seconds between two tries to open writable a directory that was not writable for a passing reason (disk full)
REOPEN_S = 10.0


def _drain(items: list) -> list:
    """Everything another thread appended to ``items``, taken out (list.pop is atomic)."""
    out = []
    while items:
        out.append(items.pop())
    return out


#: seconds after which a value file no index row names is taken for an interrupted write and removed at open
ORPHAN_S = 600.0


def _sweep_at_open(tier) -> int:
    """Remove value files no row of the tier's index names, older than ``ORPHAN_S`` (a write cut by SIGKILL or a
    power loss leaves its file behind, uncounted by any budget); a younger one may be a write still in flight."""
    try:
        with tier._directory_lock():
            return sweep_orphans(tier.directory, time.time() - ORPHAN_S)
    except Exception as err:  # noqa: BLE001 - a sweep that fails leaves the files: never an open failure
        logger.warning("vismemo: disk tier %s: orphan sweep failed (%s)", tier.directory, err)
        return 0


def open_or_quarantine(directory: str, lock, quarantine_index, thorough: bool = False) -> diskcache.Cache:
    """The directory's index; a damaged one is quarantined (``quarantine_index(error)``) and an empty one made in its
    place. That happens under the directory's ``lock`` and after a second try, so that of several processes opening
    the same damaged directory the first moves it aside and the others open the index it made. ``thorough``: every
    page of the index checked too (after damage was seen: a file overwritten in place may still open through its
    journal)."""
    try:
        return open_index(directory, thorough)
    except sqlite3.DatabaseError as err:
        if not damaged(err):
            raise
    with lock():
        try:
            return open_index(directory, thorough=True)
        except sqlite3.DatabaseError as err:
            if not damaged(err):
                raise
            try:
                quarantine_index(err)
            except OSError as move:  # both are the cause: the damage, and why it stays where it is
                raise OSError(move.errno, f"its index is damaged ({type(err).__name__}: {err}) and could not be "
                                          f"moved aside ({move})") from err
            return open_index(directory)


def value_kind(open_value, key) -> str | blob.BlobError:
    """``"blob"`` (a vismemo blob, by its magic), ``"foreign"`` (another program's key or value: left alone), or the
    ``BlobError`` of a value whose file the index names but that cannot be read whole: deleted, emptied or replaced
    behind the index (a temporary-file cleaner, a user freeing space). Such a row holds nothing yet counts against
    the directory's budget, so it goes the way of a corrupt blob (logged, its row removed). ``open_value(key)``: the
    tier's read handle of a key (``KeyError`` when the index answers none)."""
    if not isinstance(key, str):
        return "foreign"
    try:
        handle = open_value(key)
    except KeyError:  # the index lists it, but its file could not be opened (diskcache then answers None)
        return blob.BlobError("the index names it but its file is missing or unreadable")
    except Exception:  # noqa: BLE001 - a pickled or inline value of another program
        return "foreign"
    if not hasattr(handle, "read"):  # an inline value (bytes) of another program
        return "foreign"
    with handle:
        try:
            head = handle.read(len(blob.MAGIC))
        except OSError as err:
            return blob.BlobError(f"its file cannot be read ({err})")
    if head == blob.MAGIC:
        return "blob"
    if len(head) < len(blob.MAGIC) and isinstance(getattr(handle, "name", None), str):
        return blob.BlobError(f"its file holds {len(head)} bytes, fewer than a blob's header")
    return "foreign"


class DiskTier(TierBase):
    name = "disk"
    holds = BYTES
    admits = COPY
    shared = True

    def __init__(self, directory: str, budget: int | None, seal: blob.Seal | None = None):
        self.directory, self.budget = os.path.expanduser(directory), budget
        self._read_only = False
        self._reopen_at: float | None = None  # read-only for a passing reason (disk full): when to try writable again
        self.quarantined = 0  # damaged indexes moved aside (the tier then starts empty here)
        self._index_id: tuple | None = None  # (device, inode) of the index file this process has open
        self._reopen_lock = threading.Lock()
        self._in_write: str | None = None  # the key the writer thread is writing
        self._reopening: Future[None] | None = None  # the writer thread's try to open the index writable again
        try:
            os.makedirs(self.directory, exist_ok=True)
            self.cache = self._open_writable()
        except Exception as err:  # noqa: BLE001 - not writable here: serve what it holds if it holds anything
            if damaged(err) or not os.path.isfile(os.path.join(self.directory, DBNAME)):
                raise
            try:
                self.cache, self._read_only = ReadOnlyDirectory(self.directory), True
            except Exception:  # noqa: BLE001 - not readable either: the first failure is the cause to report
                raise err from None
            if passing(err):
                self._reopen_at = time.monotonic() + REOPEN_S
            logger.warning("vismemo: disk tier %s is read-only here (%s: %s): serving its entries, storing nothing "
                           "new%s", self.directory, type(err).__name__, err,
                           "; opening it writable again later" if passing(err) else "")
        self.swept = 0 if self._read_only else _sweep_at_open(self)
        self.lru: OrderedDict[str, int] = OrderedDict()  # key -> blob size
        self.reader = BlobReader(self, seal)
        self._writer = background_pool("vismemo-disk")
        self._closed = False
        self._pending: dict[str, Future[None]] = {}  # key -> its queued write
        self._failed: list[str] = []  # appended by the writer thread (list.append is atomic)
        self._lost: list[str] = []  # held keys an index opened again does not name (appended by the writer thread)
        self.reopened = 0  # times the index was opened again (replaced or damaged under this process)
        self.bytes = 0
        self.foreign = 0  # keys or values in the directory that are not vismemo blobs (skipped, left alone)
        self.range_reads = 0  # positioned reads of sparse (approximate-hit) reads
        self.others_evicted = 0  # blobs deleted to keep the shared directory within the budget (any process's)
        self._told = False  # whether ``news`` has given what the directory held at open

    def __str__(self) -> str:
        return f"disk tier {self.directory}"

    @property
    def read_only(self) -> bool:
        """Whether this process stores nothing here. A directory that was not writable for a passing reason (a full
        disk at open, an index another program held locked) is opened writable again, one try per ``REOPEN_S``,
        when a write asks: on the writer thread, so that no request waits for the try."""
        if self._read_only and self._reopen_at is not None and time.monotonic() >= self._reopen_at:
            self._reopen_at = time.monotonic() + REOPEN_S  # one try at a time
            self._reopening = self._writer.submit(self._try_writable)
        return self._read_only

    def _try_writable(self) -> None:
        try:
            cache = self._open_writable()
        except Exception as err:  # noqa: BLE001 - still not writable
            self._reopen_at = time.monotonic() + REOPEN_S if passing(err) else None
        else:
            self.cache, self._read_only, self._reopen_at = cache, False, None
            logger.warning("vismemo: disk tier %s is writable again", self.directory)

    def stats(self) -> dict:
        return {"bytes": self.bytes, "budget": self.budget, "entries": len(self.lru), "foreign": self.foreign,
                "range_reads": self.range_reads, "read_only": self._read_only, "directory_bytes": self._directory_bytes(),
                "directory_evictions": self.others_evicted, "quarantined": self.quarantined,
                "reopened": self.reopened, "swept": self.swept}

    # -- opening ------------------------------------------------------------------------------------
    def _open_writable(self, thorough: bool = False) -> diskcache.Cache:
        """The directory's index (``open_or_quarantine``), noting which file it is."""
        cache = open_or_quarantine(self.directory, self._directory_lock, self._quarantine, thorough)
        self._index_id = file_id(self.directory)
        return cache

    def _recover(self, failed: diskcache.Cache, why: str, writing: str | None = None) -> None:
        """Open the directory's index again after ``failed`` (the index this process had) proved no longer the
        directory's (another file under its name, or damaged where it lies); once, whichever thread saw it first.
        Later reads and writes go where every other process looks; the entries this process counted and the new
        index does not name are misses from now on (their bytes are not read)."""
        with self._reopen_lock:
            if self.cache is not failed:  # another thread has opened it again already
                return
            self.cache = self._open_writable(thorough=True)
            with suppress(Exception):
                failed.close()
            named = set(self.cache.iterkeys())
            # the serving thread forgets them; a write still queued or running lands in the new index
            written = {writing, self._in_write}
            self._lost.extend(k for k in list(self.lru) if k not in named and k not in written and not self.pending(k))
            self.reopened += 1
        logger.warning("vismemo: disk tier %s: %s; opened its index again", self.directory, why)

    def _indexed(self, fn, writing: str | None = None):
        """``fn(index)``; when the index proves damaged, it is opened again and ``fn`` runs once more."""
        cache = self.cache
        try:
            return fn(cache)
        except sqlite3.DatabaseError as err:
            if not damaged(err) or self._read_only:
                raise
            self._recover(cache, f"its index is damaged ({err})", writing)
            return fn(self.cache)

    def _current(self, key: str) -> None:
        """Before writing ``key``: reopen the index if the directory's file is not the one this process opened."""
        if self._index_id is not None and file_id(self.directory) != self._index_id:
            self._recover(self.cache, "its index file was replaced", key)

    def _quarantine(self, err: Exception) -> None:
        target = quarantine(self.directory)
        self.quarantined += 1
        logger.warning("vismemo: disk tier %s: its index is damaged (%s: %s); moved to %s, starting empty",
                       self.directory, type(err).__name__, err, target)

    def _directory_bytes(self) -> int | None:
        try:
            return self.shared_bytes()
        except Exception:  # noqa: BLE001 - a read-only directory's index
            return None

    def news(self, unusable: Callable[[str, Exception], None]) -> Iterable[News]:
        """At the first call, every blob of the directory, oldest write first, counted as held (a restart rebuilds its
        index and recency order from these); none later (other processes' writes are seen at the next open). Keys
        and values of other programs are skipped and counted in ``foreign``; a blob of ours that fails its checks
        goes to ``unusable(key, error)``."""
        if self._told:
            return
        self._told, self.foreign = True, 0
        found = []
        for key in list(self.cache.iterkeys()):
            kind = value_kind(self._open, key)
            if isinstance(kind, Exception):
                unusable(key, kind)
                continue
            if kind == "foreign":
                self.foreign += 1
                continue
            try:
                with self._open(key) as handle:
                    written = os.fstat(handle.fileno()).st_mtime
                found.append((written, key, self.header(key)))
            except Exception as err:  # noqa: BLE001 - a corrupt or forged blob of ours
                unusable(key, err)
        for _, key, header in sorted(found, key=lambda f: f[0]):  # oldest first: the LRU end
            self.track(key, header.total_bytes)
            try:
                meta = self.meta(key)
            except Exception as err:  # noqa: BLE001
                unusable(key, err)
                continue
            yield key, meta.fingerprint, meta.grid, meta.descriptors

    def counts(self) -> dict[str, int]:
        return {"quarantined": self.quarantined}  # damaged indexes moved aside when the tier opened

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
        self._in_write = key  # not lost if the index is opened again meanwhile: it is being written into the new one
        try:
            self._current(key)
            self._indexed(lambda _: self._write(key, data), writing=key)  # damaged where it lies: reopened, again
        finally:
            self._in_write = None

    def _write(self, key: str, data: bytes) -> None:
        if self.budget is None:
            self._store(key, data)
            return
        with self._directory_lock():
            self._fit(len(data), key)
            self._store(key, data)

    def _store(self, key: str, data: bytes) -> None:
        """Set ``key``'s blob as a key inserted now. diskcache iterates a directory in the order its keys were
        inserted, and an overwrite keeps its key's old place: deleting the old blob first, in the same transaction
        (other processes see one blob or the other, never none), keeps that order the order of the writes. The old
        blob's file is deleted only after the commit: a write failing or killed half-way leaves the old blob as it
        was (another process's, acknowledged), and a failed write's own file is removed with it."""
        disk = self.cache.disk
        disk.start_write()
        try:
            with disk.holding_removals(), self.cache.transact():  # the old file goes only after the commit
                self.cache.delete(key)
                self.cache.set(key, io.BytesIO(data), read=True)
        except BaseException:
            disk.drop_written()  # rolled back: no row names the new file
            raise

    def shared_bytes(self) -> int:
        """Bytes of every value in the directory, every process's: diskcache's own count (its ``size`` setting)."""
        return int(self._indexed(lambda cache: cache.reset("size")))

    def _directory_lock(self):
        return directory_lock(self.directory, self.__dict__.setdefault("_holding", threading.local()))

    def _fits(self, size: int) -> bool:
        return self.budget is None or self.shared_bytes() + size <= self.budget

    def _fit(self, size: int, key: str) -> None:
        """Delete the directory's least recently stored blobs (any process's, never ``key``'s) until ``size`` more
        bytes fit; other programs' keys are passed over, however many come first."""
        if self._fits(size):
            return
        for victim in self._oldest_blobs(key):
            self.cache.delete(victim)
            self.others_evicted += 1
            if self._fits(size):
                return

    def _oldest_blobs(self, skip: str):
        """The directory's blobs, least recently stored first: diskcache's iteration order, the order its keys were
        inserted (``_store`` inserts a rewritten key anew), with the rows whose file is gone (``value_kind``). Read
        lazily, a batch at a time, as ``_fit`` deletes."""
        return (key for key in self.cache if key != skip and value_kind(self._open, key) != "foreign")

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
        reopening, self._reopening = self._reopening, None
        if reopening is not None:
            reopening.result()

    def take_failures(self) -> list[str]:
        return _drain(self._failed)

    def take_lost(self) -> list[str]:
        """Keys this process held that the index, opened again, does not name."""
        return _drain(self._lost)

    def put(self, key: str, data: bytes) -> None:
        self.track(key, len(data))
        self.write(key, data)

    def forget(self, key: str) -> None:
        """Stop counting ``key`` as held, leaving the directory as it is: after a write of it that failed, what the
        directory holds under the key (another process's blob, or nothing) is not this process's to delete."""
        self.bytes -= self.lru.pop(key, 0)

    def discard(self, key: str) -> None:
        self.bytes -= self.lru.pop(key, 0)
        try:
            self._indexed(lambda cache: cache.delete(key))
        except Exception as err:  # noqa: BLE001
            logger.warning("vismemo: could not delete disk blob %s (%s)", key[:12], err)

    def pop(self, key: str) -> None:
        """Gone (the lowest local tier demotes to nothing)."""
        self.discard(key)

    def _open(self, key: str):
        handle = self._indexed(lambda cache: cache.get(key, default=None, read=True))
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
        """Wait for the writes, then close the index: the writer thread's connection too (diskcache keeps one per
        thread), else it stays open after the tier, its write-ahead log left unmerged into the index. Closing twice
        is closing once."""
        self.flush()
        if not self._closed:
            self._closed = True
            self._writer.submit(self.cache.close).result()
            self._writer.shutdown(wait=True)
        self.cache.close()

"""The local tiers of the store; each holds entries in its own form and knows only its own bytes.

Every tier (these three and ``remote.RemoteTier``) offers the same ``Tier`` interface, so ``VisMemoStore`` reads,
places, touches, evicts and reports on all of them alike; a new tier is one class with these methods.

* ``DeviceTier`` (L1): decoded entries, K/V on the tier's device; reads are indexing.
* ``HostTier`` (L2): blobs as uint8 tensors (pinned when CUDA exists); sparse reads gather.
  Full reads of the lower tiers land in pinned buffers too (``ranges.read_buffer``).
* ``DiskTier`` (L3): blobs as raw-byte files of a ``diskcache`` directory, read through ``ranges.BlobReader``:
  sparse reads are positioned reads of the ranges they need. Pickled values are refused, never loaded. A damaged
  index (``cache.db`` not a database, or malformed) is moved aside into ``quarantine/`` with the blobs it named, and
  the tier starts empty in the same directory. Only diskcache's public API is used.

Recency order lives here (``OrderedDict``); what to evict and where it goes is decided by
``VisMemoStore``.
"""

from __future__ import annotations

import errno
import fcntl
import io
import logging
import os
import re
import sqlite3
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import replace
from typing import Protocol, runtime_checkable
from urllib.parse import quote

import diskcache
import torch
from diskcache.core import DBNAME, MODE_PICKLE

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
    """diskcache storage that only ever handles raw bytes: pickled keys or values are refused. Inside
    ``holding_removals`` the files a thread's operations would delete are deleted only once the block ends without an
    error (after its transaction committed)."""

    def __init__(self, directory, **kwargs):
        super().__init__(directory, **kwargs)
        self._held = threading.local()

    @contextmanager
    def holding_removals(self):
        """diskcache deletes a file of a nested operation (a ``delete`` inside ``transact``) when that operation ends,
        before the transaction commits: a transaction that then rolls back (a write failing, a process killed) would
        leave its row naming a deleted file. Held here, they are deleted after the block, or not at all after an
        error (the rows naming them are back)."""
        held = self._held.files = []
        try:
            yield
        finally:
            self._held.files = None
        for path in held:  # reached only when the block ended without an error
            diskcache.Disk.remove(self, path)

    def remove(self, file_path):
        held = getattr(self._held, "files", None)
        if held is not None:
            held.append(file_path)
            return
        super().remove(file_path)

    def put(self, key):
        if not isinstance(key, str):
            raise TypeError("vismemo disk keys are strings")
        return super().put(key)

    def get(self, key, raw):
        if not raw:  # a pickled key another program stored here: never unpickled, never ours
            return FOREIGN_KEY
        return super().get(key, raw)

    def filename(self, key=diskcache.core.UNKNOWN, value=diskcache.core.UNKNOWN):
        name, full_path = super().filename(key, value)
        self._held.writing = full_path  # the file ``store`` is about to write
        return name, full_path

    def store(self, value, read, key=diskcache.core.UNKNOWN):
        """A value's file; a write that fails half-way (disk full) removes what it wrote (no index names it)."""
        if not (read or isinstance(value, (bytes, bytearray))):
            raise TypeError("vismemo disk values are raw bytes")
        self._held.writing = None
        try:
            out = super().store(value, read, key=key)
        except BaseException:
            if self._held.writing is not None:
                with suppress(OSError):
                    os.remove(self._held.writing)
            raise
        finally:
            self._held.written, self._held.writing = self._held.writing, None
        return out

    def start_write(self) -> None:
        """Forget which file this thread's last ``store`` wrote (committed since): ``drop_written`` then removes only
        a file of the write that follows."""
        self._held.written = None

    def drop_written(self) -> None:
        """Remove the file this thread's last ``store`` wrote: its row did not commit (the transaction failed)."""
        path, self._held.written = getattr(self._held, "written", None), None
        if path is not None:
            with suppress(OSError):
                os.remove(path)

    def fetch(self, mode, filename, value, read):
        if mode == MODE_PICKLE:
            raise blob.BlobError("pickled value refused")
        return super().fetch(mode, filename, value, read)


class ReadOnlyDirectory:
    """A diskcache directory this process may read but not write (a shared, read-only mount): its index read
    through SQLite in read-only mode, each blob opened from its own file. Writes and deletes are refused."""

    def __init__(self, directory: str):
        self.directory = directory
        db = quote(os.path.join(directory, DBNAME))
        try:
            self._db = self._connect(f"file:{db}?mode=ro")
        except sqlite3.Error:  # a WAL database needs its shared-memory file: read the snapshot as it is
            self._db = self._connect(f"file:{db}?mode=ro&immutable=1")  # else the error says why it is unusable

    @staticmethod
    def _connect(uri: str) -> sqlite3.Connection:
        """A connection to a diskcache index whose table of keys reads (not some other file named ``cache.db``)."""
        db = sqlite3.connect(uri, uri=True, check_same_thread=False)
        try:
            db.execute("SELECT key, raw, filename, mode FROM Cache LIMIT 1").fetchall()
        except sqlite3.Error:
            db.close()
            raise
        return db

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


#: where a damaged index and the blobs it named are moved, inside the directory (kept, never deleted)
QUARANTINE = "quarantine"
#: the index's own files: the database and SQLite's journals of it (a journal must never meet another database)
_INDEX_FILES = (DBNAME, f"{DBNAME}-wal", f"{DBNAME}-shm", f"{DBNAME}-journal")
#: diskcache's folders of value files (two hex digits, ``Disk.filename``)
_VALUE_FOLDER = re.compile(r"[0-9a-f]{2}")


#: seconds between two tries to open writable a directory that was not writable for a passing reason (disk full)
REOPEN_S = 10.0


def passing(err: BaseException) -> bool:
    """Whether opening a directory writable failed for a reason that passes (a full disk, an I/O error), not
    because this process may not write it (permissions, a read-only mount or database)."""
    if isinstance(err, sqlite3.OperationalError):
        text = str(err).lower()
        return not any(word in text for word in ("readonly", "read-only", "unable to open", "permission"))
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.ENOMEM)
    return False


def damaged(err: BaseException) -> bool:
    """Whether SQLite found the index file itself damaged (not a database, malformed), not merely locked, unwritable
    or of another schema: only such a file is quarantined."""
    if not isinstance(err, sqlite3.DatabaseError):
        return False
    name = getattr(err, "sqlite_errorname", None)  # Python >= 3.11
    if name is None:  # both codes come as the base class itself; every other code has a subclass
        return type(err) is sqlite3.DatabaseError
    return name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT"))


def open_index(directory: str, thorough: bool = False) -> diskcache.Cache:
    """diskcache's index of ``directory``, every key of it read once (``thorough``: every page checked by SQLite's
    ``quick_check``): a damaged index shows now, at open, not in the middle of serving."""
    cache = diskcache.Cache(directory, disk=SafeDisk, size_limit=2**62, eviction_policy="none", disk_min_file_size=0)
    try:
        for _ in cache.iterkeys():
            pass
        if thorough:  # SQLite's own check, on a connection of ours (diskcache's stays behind its public API)
            db = sqlite3.connect(os.path.join(directory, DBNAME))
            try:
                (result,) = db.execute("PRAGMA quick_check").fetchone()
            finally:
                db.close()
            if result != "ok":
                raise sqlite3.DatabaseError(f"database disk image is malformed ({result})")
    except BaseException:
        cache.close()
        raise
    return cache


@contextmanager
def _directory_lock(directory: str, held: threading.local):
    """Every process's writes to ``directory`` in turn; taken again by the thread holding it (a write that finds the
    index damaged opens it again under the same lock), it is held once (``held``: the tier's count per thread)."""
    if getattr(held, "depth", 0):
        held.depth += 1
        try:
            yield
        finally:
            held.depth -= 1
        return
    with open(os.path.join(directory, "vismemo-writers.lock"), "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        held.depth = 1
        try:
            yield
        finally:
            held.depth = 0
            fcntl.flock(handle, fcntl.LOCK_UN)


def _file_id(directory: str) -> tuple | None:
    """(device, inode) of the directory's index file (None: there is none)."""
    try:
        st = os.stat(os.path.join(directory, DBNAME))
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _drain(items: list) -> list:
    """Everything another thread appended to ``items``, taken out (list.pop is atomic)."""
    out = []
    while items:
        out.append(items.pop())
    return out


#: seconds after which a value file no index row names is taken for an interrupted write and removed at open
ORPHAN_S = 600.0


def sweep_orphans(directory: str, before: float) -> int:
    """Remove the value files of ``directory`` that its index does not name and that were last written before
    ``before`` (a time); returns how many. The caller holds the directory's lock, under which writes commit."""
    uri = "file:" + quote(os.path.join(directory, DBNAME)) + "?mode=ro"
    db = sqlite3.connect(uri, uri=True)
    try:
        named = {f for (f,) in db.execute("SELECT filename FROM Cache WHERE filename IS NOT NULL")}
    finally:
        db.close()
    removed = 0
    for folder in os.listdir(directory):
        if not _VALUE_FOLDER.fullmatch(folder) or not os.path.isdir(os.path.join(directory, folder)):
            continue
        for root, _, files in os.walk(os.path.join(directory, folder)):
            for name in files:
                path = os.path.join(root, name)
                if not name.endswith(".val") or os.path.relpath(path, directory) in named:
                    continue
                with suppress(FileNotFoundError):  # another process's sweep or eviction got there first
                    if os.stat(path).st_mtime < before:
                        os.remove(path)
                        removed += 1
    if removed:
        logger.warning("vismemo: disk tier %s: removed %d value files no entry names (interrupted writes)",
                       directory, removed)
    return removed


def _sweep_at_open(tier) -> int:
    """Remove value files no row of the tier's index names, older than ``ORPHAN_S`` (a write cut by SIGKILL or a
    power loss leaves its file behind, uncounted by any budget); a younger one may be a write still in flight."""
    try:
        with tier._directory_lock():
            return sweep_orphans(tier.directory, time.time() - ORPHAN_S)
    except Exception as err:  # noqa: BLE001 - a sweep that fails leaves the files: never an open failure
        logger.warning("vismemo: disk tier %s: orphan sweep failed (%s)", tier.directory, err)
        return 0


def quarantine(directory: str) -> str:
    """Move a damaged index, its journals and the value folders it named into ``quarantine/<time>-<id>/`` of the
    directory: the bytes stay for whoever wants to look at them (nothing is deleted), and the blobs of the old index
    are not left behind unnamed, uncounted, among those of the new one. Returns that folder."""
    folder = os.path.join(directory, QUARANTINE)
    os.makedirs(folder, exist_ok=True)
    target = tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=folder)
    for name in sorted(os.listdir(directory)):
        if name in _INDEX_FILES or _VALUE_FOLDER.fullmatch(name):
            os.replace(os.path.join(directory, name), os.path.join(target, name))
    return target


class DiskTier:
    name = "disk"
    shared = True

    def __init__(self, directory: str, budget: int | None, seal: blob.Seal | None = None):
        self.directory, self.budget = os.path.expanduser(directory), budget
        self._read_only = False
        self._reopen_at: float | None = None  # read-only for a passing reason (disk full): when to try writable again
        self.quarantined = 0  # damaged indexes moved aside (the tier then starts empty here)
        self._index_id: tuple | None = None  # (device, inode) of the index file this process has open
        self._reopen_lock = threading.Lock()
        self._in_write: str | None = None  # the key the writer thread is writing
        try:
            os.makedirs(self.directory, exist_ok=True)
            self.cache = self._open_writable()
        except Exception as err:  # noqa: BLE001 - not writable here: serve what it holds if it holds anything
            if damaged(err) or not os.path.isfile(os.path.join(self.directory, DBNAME)):
                raise
            self.cache, self._read_only = ReadOnlyDirectory(self.directory), True
            if passing(err):
                self._reopen_at = time.monotonic() + REOPEN_S
            logger.warning("vismemo: disk tier %s is read-only here (%s: %s): serving its entries, storing nothing "
                           "new%s", self.directory, type(err).__name__, err,
                           "; opening it writable again later" if passing(err) else "")
        self.swept = 0 if self._read_only else _sweep_at_open(self)
        self.lru: OrderedDict[str, int] = OrderedDict()  # key -> blob size
        self.reader = BlobReader(self, seal)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vismemo-disk")
        self._closed = False
        self._pending: dict[str, object] = {}  # key -> its queued write
        self._failed: list[str] = []  # appended by the writer thread (list.append is atomic)
        self._lost: list[str] = []  # held keys an index opened again does not name (appended by the writer thread)
        self.reopened = 0  # times the index was opened again (replaced or damaged under this process)
        self.bytes = 0
        self.foreign = 0  # keys or values in the directory that are not vismemo blobs (skipped, left alone)
        self.range_reads = 0  # positioned reads of sparse (approximate-hit) reads
        self.others_evicted = 0  # blobs deleted to keep the shared directory within the budget (any process's)

    def __contains__(self, key: str) -> bool:
        return key in self.lru

    @property
    def read_only(self) -> bool:
        """Whether this process stores nothing here. A directory that was not writable for a passing reason (a full
        disk at open) is opened writable again, one try per ``REOPEN_S``, when a write asks."""
        if self._read_only and self._reopen_at is not None and time.monotonic() >= self._reopen_at:
            try:
                cache = self._open_writable()
            except Exception as err:  # noqa: BLE001 - still not writable
                self._reopen_at = time.monotonic() + REOPEN_S if passing(err) else None
            else:
                self.cache, self._read_only, self._reopen_at = cache, False, None
                logger.warning("vismemo: disk tier %s is writable again", self.directory)
        return self._read_only

    def touch(self, key: str) -> None:
        self.lru.move_to_end(key)

    def stats(self) -> dict:
        return {"bytes": self.bytes, "budget": self.budget, "entries": len(self.lru), "foreign": self.foreign,
                "range_reads": self.range_reads, "read_only": self._read_only, "directory_bytes": self._directory_bytes(),
                "directory_evictions": self.others_evicted, "quarantined": self.quarantined,
                "reopened": self.reopened, "swept": self.swept}

    # -- opening ------------------------------------------------------------------------------------
    def _open_writable(self, thorough: bool = False) -> diskcache.Cache:
        """The directory's index; a damaged one is quarantined and an empty one made in its place. That happens
        under the directory's lock and after a second try, so that of several processes opening the same damaged
        directory the first moves it aside and the others open the index it made. ``thorough``: every page of the
        index checked too (after damage was seen: a file overwritten in place may still open through its journal)."""
        try:
            cache = open_index(self.directory, thorough)
        except sqlite3.DatabaseError as err:
            if not damaged(err):
                raise
            with self._directory_lock():
                try:
                    cache = open_index(self.directory, thorough=True)
                except sqlite3.DatabaseError as err:
                    if not damaged(err):
                        raise
                    self._quarantine(err)
                    cache = open_index(self.directory)
        self._index_id = _file_id(self.directory)
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
            writing = {writing, self._in_write}
            self._lost.extend(k for k in list(self.lru) if k not in named and k not in writing and not self.pending(k))
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
        if self._index_id is not None and _file_id(self.directory) != self._index_id:
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
        return _directory_lock(self.directory, self.__dict__.setdefault("_holding", threading.local()))

    def _fits(self, size: int) -> bool:
        return self.shared_bytes() + size <= self.budget

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
        inserted (``_store`` inserts a rewritten key anew). Read lazily, a batch at a time, as ``_fit`` deletes."""
        return (key for key in self.cache if key != skip and self._is_blob(key))

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

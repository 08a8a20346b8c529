"""The diskcache directory under the disk tier (``disk.DiskTier``): raw-byte storage that refuses pickles
(``SafeDisk``), a read-only view of a directory this process may not write (``ReadOnlyDirectory``), opening an index
and telling damage from other failures (``open_index``, ``damaged``, ``passing``), the directory's lock for every
process's writes (``directory_lock``), the quarantine of a damaged index, and the sweep of value files no index
names. Only diskcache's public API is used."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import sqlite3
import tempfile
import threading
import time
from contextlib import contextmanager, suppress
from urllib.parse import quote

import diskcache
from diskcache.core import DBNAME, MODE_PICKLE

from vismemo_hf.store import blob

logger = logging.getLogger(__name__)

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


#: seconds an SQLite call on the index waits for another connection's lock before it fails (diskcache's default is
#: 60): an index another program holds locked makes the store read-only, or a write fail (a miss later), within
#: this time instead of stalling a request for a minute. The project's own writers take the directory's lock first,
#: so they never wait on each other here.
INDEX_TIMEOUT_S = 2.0


def _lock_free(directory: str) -> None:
    """An ``OperationalError`` ("database is locked") when another connection holds the index's write lock for
    longer than ``INDEX_TIMEOUT_S``: diskcache's own open retries its first writes for 60 s whatever its timeout."""
    path = os.path.join(directory, DBNAME)
    if not os.path.isfile(path):
        return
    db = sqlite3.connect(path, timeout=INDEX_TIMEOUT_S, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        db.execute("ROLLBACK")
    finally:
        db.close()


def open_index(directory: str, thorough: bool = False) -> diskcache.Cache:
    """diskcache's index of ``directory``, every key of it read once (``thorough``: every page checked by SQLite's
    ``quick_check``): a damaged index shows now, at open, not in the middle of serving."""
    _lock_free(directory)
    cache = diskcache.Cache(directory, timeout=INDEX_TIMEOUT_S, disk=SafeDisk, size_limit=2**62,
                            eviction_policy="none", disk_min_file_size=0)
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
def directory_lock(directory: str, held: threading.local):
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


def file_id(directory: str) -> tuple | None:
    """(device, inode) of the directory's index file (None: there is none)."""
    try:
        st = os.stat(os.path.join(directory, DBNAME))
    except OSError:
        return None
    return st.st_dev, st.st_ino


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


def quarantine(directory: str) -> str:
    """Move a damaged index, its journals and the value folders it named into ``quarantine/<time>-<id>/`` of the
    directory: the bytes stay for whoever wants to look at them (nothing is deleted), and the blobs of the old index
    are not left behind unnamed, uncounted, among those of the new one. Returns that folder."""
    folder = os.path.join(directory, QUARANTINE)
    if os.path.lexists(folder) and not os.path.isdir(folder):  # something else took the name: a folder of its own
        folder = tempfile.mkdtemp(prefix=f"{QUARANTINE}-", dir=directory)
    os.makedirs(folder, exist_ok=True)
    target = tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=folder)
    for name in sorted(os.listdir(directory)):
        if name in _INDEX_FILES or _VALUE_FOLDER.fullmatch(name):
            os.replace(os.path.join(directory, name), os.path.join(target, name))
    return target

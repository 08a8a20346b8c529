"""What a store directory may hold that is not a usable index: a damaged one is quarantined (its bytes kept, the
cause logged, counted) and the disk tier starts empty in the same directory; a store never fails to construct."""

import logging
import os
import sqlite3

import pytest
import torch

from vismemo_hf import VisMemoStore
from vismemo_hf.store.tiers import QUARANTINE

from test_store import _entry


def _random_bytes(directory) -> bytes:
    return os.urandom(8192)


def _header_then_garbage(directory) -> bytes:
    """A real index's first page, then garbage: SQLite opens it, then finds it malformed."""
    store = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=directory / "real", disk_bytes=None)
    for i in range(3):
        store.put(_entry(f"real{i}", seed=i))
    store.close()
    return (directory / "real" / "cache.db").read_bytes()[:4096] + os.urandom(16384)


@pytest.mark.parametrize("garbage", [_random_bytes, _header_then_garbage])
def test_a_damaged_index_is_quarantined_and_the_tier_starts_anew(tmp_path, caplog, garbage):
    directory = tmp_path / "store"
    directory.mkdir()
    bad = garbage(tmp_path)
    (directory / "cache.db").write_bytes(bad)
    with caplog.at_level(logging.WARNING, logger="vismemo_hf.store.tiers"):
        store = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=directory, disk_bytes=2**30)
    assert store.disk is not None and not store.disk.read_only
    assert "damaged (DatabaseError" in caplog.text and "read-only" not in caplog.text  # the real cause
    (moved,) = (directory / QUARANTINE).glob("*/cache.db")
    assert moved.read_bytes() == bad  # kept as it was, never deleted
    assert store.stats()["quarantined"] == 1 and store.stats()["tiers"]["disk"]["quarantined"] == 1
    entry = _entry("after", seed=7)
    assert store.put(entry)
    store.flush()
    assert store.tier_of("after") == "disk" and torch.equal(store.get("after", "fp").kv, entry.kv)
    store.close()
    reopened = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=directory, disk_bytes=2**30)
    assert reopened.tier_of("after") == "disk" and reopened.stats()["quarantined"] == 0
    assert [p.name for p in (directory / QUARANTINE).iterdir()] == [moved.parent.name]
    reopened.close()


@pytest.mark.parametrize("name", ["cache.db-wal", "cache.db-shm"])
def test_garbage_journal_files_beside_a_sound_index_keep_its_entries(tmp_path, name):
    """SQLite reads the index's write-ahead log and its shared-memory file at open; garbage there (a log whose
    checksums fail, an index it rebuilds) leaves a sound index as it was: nothing is quarantined or lost."""
    store = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=None)
    entry = _entry("kept")
    store.put(entry)
    store.close()
    assert not (tmp_path / name).exists()  # every connection closed: the log merged into the index, both removed
    (tmp_path / name).write_bytes(os.urandom(8192))
    reopened = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=None)
    assert reopened.stats()["quarantined"] == 0 and not (tmp_path / QUARANTINE).exists()
    assert torch.equal(reopened.get("kept", "fp").kv, entry.kv)
    reopened.close()


def test_a_damaged_index_that_cannot_be_moved_leaves_the_store_without_its_disk_tier(tmp_path, monkeypatch, caplog):
    """A damaged index in a directory this process cannot change (a read-only mount): the store is built without
    the disk tier, the damage logged as the cause, and the file left where it is."""
    from vismemo_hf.store.tiers import disk as disk_tier

    (tmp_path / "cache.db").write_bytes(b"\x00garbage" * 512)

    def read_only(self, err):
        raise PermissionError(f"[Errno 30] Read-only file system: {self.directory}")

    monkeypatch.setattr(disk_tier.DiskTier, "_quarantine", read_only)
    store = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=None)
    assert store.disk is None and "file is not a database" in caplog.text
    assert (tmp_path / "cache.db").read_bytes() == b"\x00garbage" * 512
    assert store.put(_entry("a")) is False and store.stats()["quarantined"] == 0


def test_sqlite_damage_codes_are_told_from_other_failures():
    from vismemo_hf.store.tiers import damaged

    con = sqlite3.connect(":memory:")
    with pytest.raises(sqlite3.OperationalError) as locked:
        con.execute("SELECT * FROM no_such_table")
    assert not damaged(locked.value) and not damaged(PermissionError("read-only"))


@pytest.mark.parametrize("cause", ["disk I/O error", "database or disk is full"])
def test_a_directory_full_at_open_is_written_again_once_it_has_room(tmp_path, monkeypatch, cause):
    """Found by ``vismemo bench soak``: a process that opened a shared directory while its disk was full (SQLite:
    "disk I/O error" or "database or disk is full") took it for a read-only directory and stored nothing on disk
    for the rest of its life. A full disk passes: the tier serves read-only meanwhile, then opens writable again."""
    from vismemo_hf.store.tiers import disk as disk_tier

    first = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=None)
    first.put(_entry("before"))
    first.close()
    real, calls = disk_tier.DiskTier._open_writable, []

    def full_once(self):
        calls.append(1)
        if len(calls) == 1:
            raise sqlite3.OperationalError(cause)
        return real(self)

    monkeypatch.setattr(disk_tier.DiskTier, "_open_writable", full_once)
    monkeypatch.setattr(disk_tier, "REOPEN_S", 0.0)
    store = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=None)
    assert store.stats()["tiers"]["disk"]["read_only"] and store.tier_of("before") == "disk"
    entry = _entry("after", seed=3)
    store.put(entry)  # asks for the reopen, on the writer thread: this put does not wait for it
    assert store.stats()["writes_read_only"] == 1
    store.flush()
    assert len(calls) == 2 and not store.stats()["tiers"]["disk"]["read_only"]
    assert store.put(entry)
    store.flush()
    assert store.tier_of("after") == "disk" and store.stats()["writes_read_only"] == 1
    store.close()
    reopened = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=None)
    assert torch.equal(reopened.get("after", "fp").kv, entry.kv) and reopened.tier_of("before") == "disk"
    reopened.close()


def test_a_directory_this_process_may_not_write_is_not_retried(tmp_path, monkeypatch):
    from vismemo_hf.store.tiers import disk as disk_tier

    first = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=None)
    first.put(_entry("before"))
    first.close()
    calls = []

    def refuse(self):
        calls.append(1)
        raise PermissionError(f"[Errno 30] Read-only file system: {self.directory}")

    monkeypatch.setattr(disk_tier.DiskTier, "_open_writable", refuse)
    monkeypatch.setattr(disk_tier, "REOPEN_S", 0.0)
    store = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=None)
    assert store.put(_entry("after", seed=3)) is False and store.stats()["writes_read_only"] == 1
    assert len(calls) == 1 and store.disk.read_only


class _CutWrite:
    """Stands in for ``io.BytesIO`` in ``tiers/disk.py``: the blob's bytes in two halves, and between them ``cut()``."""

    def __init__(self, data, cut):
        self.data, self.pos, self.cut = bytes(data), 0, cut

    def read(self, size=-1):
        if self.pos >= len(self.data):
            return b""
        if self.pos:
            self.cut()
        n = len(self.data) // 2 if self.pos == 0 else len(self.data) - self.pos
        out = self.data[self.pos : self.pos + n]
        self.pos += len(out)
        return out


def test_a_rewrite_that_fails_keeps_the_blob_another_process_stored(tmp_path, monkeypatch):
    """Found by ``vismemo bench soak``: a process writing again a key another process had stored (both missed the
    page) deletes the old blob and inserts its own in one transaction; when the new file could not be written (disk
    full) the transaction rolled back, but the old blob's file was already gone: its entry, acknowledged by the
    other process's ``flush()``, named a missing file (unreadable) for every process."""
    import errno
    import types

    from vismemo_hf.store.tiers import disk as disk_tier

    a, b = (VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=2**30) for _ in range(2))
    entry = _entry("page", seed=5)
    a.put(entry)
    a.flush()  # acknowledged

    def full():
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier, "io", types.SimpleNamespace(BytesIO=lambda data: _CutWrite(data, full)))
    b.put(_entry("page", seed=5))  # b never saw a's blob: it writes the key again, and the write fails
    b.flush()
    assert b.stats()["write_failures"] == 1
    monkeypatch.undo()
    reader = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=2**30)
    assert reader.tier_of("page") == "disk" and torch.equal(reader.get("page", "fp").kv, entry.kv)
    for store in (a, b, reader):
        store.close()


_KILLED_REWRITER = """
import os, sys, time, types
sys.path.insert(0, {tests!r})
from vismemo_hf import VisMemoStore
from vismemo_hf.store.tiers import disk as disk_tier
from test_store import _entry
from test_store_faults import _CutWrite

store = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir={directory!r}, disk_bytes=2**30)
open({opened!r}, "w").close()
while not os.path.exists({go!r}):
    time.sleep(0.01)

def stop():
    open({marker!r}, "w").close()
    time.sleep(60)

disk_tier.io = types.SimpleNamespace(BytesIO=lambda data: _CutWrite(data, stop))
store.put(_entry("page", seed=5))
store.flush()
"""


def test_a_process_killed_in_the_middle_of_a_rewrite_keeps_the_blob_another_process_stored(tmp_path):
    """The same, SIGKILLed half-way through writing the new file (inside the transaction): the old blob and the row
    naming it are what the directory holds afterwards."""
    import signal
    import subprocess
    import sys
    import time

    directory = tmp_path / "shared"
    paths = {name: str(tmp_path / name) for name in ("opened", "go", "marker")}
    script = _KILLED_REWRITER.format(tests=os.path.dirname(__file__), directory=str(directory), **paths)
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "VISMEMO_STORE": "memory"})
    try:
        for _ in range(600):  # it opened the directory before the entry was stored: it does not know it
            if os.path.exists(paths["opened"]) or proc.poll() is not None:
                break
            time.sleep(0.05)
        entry = _entry("page", seed=5)
        a = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=directory, disk_bytes=2**30)
        a.put(entry)
        a.flush()
        open(paths["go"], "w").close()
        for _ in range(600):
            if os.path.exists(paths["marker"]) or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert os.path.exists(paths["marker"]), "the rewrite never started"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    reader = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=directory, disk_bytes=2**30)
    assert reader.tier_of("page") == "disk" and torch.equal(reader.get("page", "fp").kv, entry.kv)
    assert torch.equal(a.get("page", "fp").kv, entry.kv)
    a.close()
    reader.close()


def test_a_write_that_fails_half_way_leaves_no_file_behind(tmp_path, monkeypatch):
    """Found by ``vismemo bench soak``: a blob write failing half-way (disk full) left its partial file in the
    directory, named by no index: bytes no budget counts, never deleted. The file goes with the failed write."""
    import errno
    import types

    from vismemo_hf.store.tiers import disk as disk_tier

    store = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=2**30)
    store.put(_entry("kept"))
    store.flush()

    def full():
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier, "io", types.SimpleNamespace(BytesIO=lambda data: _CutWrite(data, full)))
    store.put(_entry("lost", seed=2))
    store.flush()
    monkeypatch.undo()
    assert store.stats()["write_failures"] == 1
    assert len(list(tmp_path.rglob("*.val"))) == 1  # the blob of "kept" only
    store.close()


def test_a_write_whose_row_cannot_be_stored_leaves_no_file_behind(tmp_path, monkeypatch):
    """The file written, then the index refusing its row (SQLite: "database or disk is full"): the transaction rolls
    back and the file, named by no index, goes too."""
    from vismemo_hf.store.tiers import disk as disk_tier

    store = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=2**30)
    store.put(_entry("kept"))
    store.flush()
    real = disk_tier.diskcache.Cache.set

    def set_then_full(self, *args, **kwargs):
        real(self, *args, **kwargs)
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(disk_tier.diskcache.Cache, "set", set_then_full)
    store.put(_entry("lost", seed=2))
    store.flush()
    monkeypatch.undo()
    assert store.stats()["write_failures"] == 1
    assert len(list(tmp_path.rglob("*.val"))) == 1
    reader = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=2**30)
    assert reader.tier_of("kept") == "disk" and reader.tier_of("lost") is None
    store.close()
    reader.close()


@pytest.mark.parametrize("how", ["replace", "overwrite"])
def test_a_process_whose_index_was_replaced_or_overwritten_writes_where_the_others_look(tmp_path, how):
    """Found by ``vismemo bench soak``: ``cache.db`` replaced by another file while processes had it open (they went
    on writing into the old one, which no process opening the directory sees), or overwritten in place (every write
    failed from then on). A write now checks that the directory's index is the one it opened, and opens it again
    when it is not, or when it is damaged where it lies."""
    db = tmp_path / "cache.db"
    a = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=2**30)
    a.put(_entry("before", seed=1))
    a.flush()
    garbage = os.urandom(max(8192, db.stat().st_size))
    if how == "replace":
        (tmp_path / "new.tmp").write_bytes(garbage)
        os.replace(tmp_path / "new.tmp", db)
    else:
        with open(db, "r+b") as handle:
            handle.write(garbage)
    after = _entry("after", seed=2)
    assert a.put(after)
    a.flush()
    assert a.stats()["tiers"]["disk"]["reopened"] == 1 and a.stats()["write_failures"] == 0
    assert torch.equal(a.get("after", "fp").kv, after.kv)
    assert a.get("before", "fp") is None  # the damaged index's entries went to quarantine: a miss, never garbage
    fresh = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=2**30)
    assert fresh.tier_of("after") == "disk" and torch.equal(fresh.get("after", "fp").kv, after.kv)
    assert list((tmp_path / QUARANTINE).glob("*/cache.db"))  # the garbage kept, never deleted
    for store in (a, fresh):
        store.close()


def test_value_files_no_entry_names_are_swept_at_open_once_old(tmp_path):
    """Found by ``vismemo bench soak``: a process killed while writing a blob leaves its file, which no row names and
    no budget counts. Opening the directory removes such files once older than ``ORPHAN_S`` (a younger one may be
    another process's write in flight); named blobs stay."""
    import time

    from vismemo_hf.store.tiers import disk as disk_tier

    store = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=2**30)
    entry = _entry("kept", seed=3)
    store.put(entry)
    store.close()
    folder = next(p for p in tmp_path.iterdir() if p.is_dir() and len(p.name) == 2)
    old, young = folder / "cut-old.val", folder / "cut-young.val"
    for path in (old, young):
        path.write_bytes(b"half a blob")
    past = time.time() - disk_tier.ORPHAN_S - 60
    os.utime(old, (past, past))
    reopened = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=2**30)
    assert not old.exists() and young.exists()
    assert reopened.stats()["tiers"]["disk"]["swept"] == 1
    assert torch.equal(reopened.get("kept", "fp").kv, entry.kv)
    reopened.close()


def test_two_processes_write_on_after_their_shared_index_is_overwritten_in_place(tmp_path):
    """Found by ``vismemo bench soak``: with two processes writing (a journal of live pages beside the index), an
    index overwritten in place could still open through its journal, so every later write failed as malformed
    (90 write failures in a run), and a write that found the damage while holding the directory's lock waited for
    that lock forever. Now the index opened again after damage is checked page by page (``quick_check``), the lock
    is held once by the thread that has it, and both processes' later writes are where a new process looks."""
    db = tmp_path / "cache.db"
    a, b = (VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=2**30) for _ in range(2))
    for i in range(12):
        (a if i % 2 else b).put(_entry(f"before{i}", seed=i))
    a.flush()
    b.flush()
    with open(db, "r+b") as handle:
        handle.write(os.urandom(max(8192, db.stat().st_size)))
    for i in range(4):
        for name, store in (("a", a), ("b", b)):
            assert store.put(_entry(f"{name}{i}", seed=100 + i))
            store.flush()
    for store in (a, b):
        assert store.stats()["write_failures"] == 0 and store.stats()["tiers"]["disk"]["reopened"] >= 1
    fresh = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=2**30)
    for key in ("a2", "a3", "b2", "b3"):  # written once both had opened the index again
        assert fresh.tier_of(key) == "disk" and fresh.get(key, "fp") is not None
    for store in (a, b, fresh):
        store.close()


@pytest.mark.parametrize("damage", ["delete", "empty", "directory"])
def test_blob_files_gone_behind_the_index_are_dropped_at_open_and_free_the_budget(tmp_path, caplog, damage):
    """A cleaner deleting old files, a user freeing space: rows whose file is gone, emptied or replaced hold nothing,
    so they are logged and removed (not counted as another program's keys), and their bytes no longer count against
    the directory's budget: the entries stored after them all fit."""
    entries = [_entry(f"e{i}", n=64, layers=4, seed=i) for i in range(6)]
    size = len(VisMemoStore(device_bytes=0, host_bytes=0).placement.encode(entries[0]))
    options = {"device_bytes": 0, "host_bytes": 0, "disk_dir": tmp_path, "disk_bytes": int(3.5 * size)}
    store = VisMemoStore(**options)
    for entry in entries[:3]:
        assert store.put(entry)
    store.close()
    files = [p for p in tmp_path.rglob("*.val")]
    assert len(files) == 3
    for path in files:
        path.unlink()
        if damage == "empty":
            path.write_bytes(b"")
        elif damage == "directory":
            path.mkdir()
    with caplog.at_level(logging.WARNING):
        store = VisMemoStore(**options)
    disk = store.stats()["tiers"]["disk"]
    assert disk["foreign"] == 0 and disk["entries"] == 0 and store.stats()["corrupt"] == 3
    assert caplog.text.count("unusable (BlobError") == 3
    for entry in entries[3:]:
        assert store.put(entry)
    store.flush()
    assert all(store.tier_of(e.key) == "disk" for e in entries[3:])  # nothing evicted for the rows that held nothing
    assert store.stats()["tiers"]["disk"]["directory_bytes"] <= options["disk_bytes"]
    store.close()


def test_another_programs_values_in_the_directory_are_left_alone(tmp_path):
    import diskcache

    other = diskcache.Cache(str(tmp_path))
    other.set("small", b"inline bytes")
    other.set("large", b"x" * 100_000)
    other.set(("tuple", 1), {"pickled": True})
    other.close()
    store = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=None)
    assert store.stats()["tiers"]["disk"]["foreign"] == 3 and store.stats()["corrupt"] == 0
    store.close()
    other = diskcache.Cache(str(tmp_path))
    assert other.get("small") == b"inline bytes" and other.get("large") == b"x" * 100_000
    other.close()


def test_an_index_another_program_holds_locked_makes_the_store_read_only_without_a_long_wait(tmp_path):
    """diskcache waits 60 s for a lock by default: the store (and every reopen try) would stall a request that long.
    The index's busy timeout is ``INDEX_TIMEOUT_S``; the tier serves read-only, and its reopen tries run on the writer
    thread, never in a request."""
    import time

    from vismemo_hf.store.tiers import directory as directory_mod

    first = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=None)
    entry = _entry("before")
    first.put(entry)
    first.close()
    holder = sqlite3.connect(tmp_path / "cache.db", timeout=0, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        t0 = time.monotonic()
        store = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=None)
        opened = time.monotonic() - t0
        assert opened < 4 * directory_mod.INDEX_TIMEOUT_S + 5
        t0 = time.monotonic()
        store.put(_entry("during", seed=2))
        assert time.monotonic() - t0 < 1.0  # a put does not wait for the index's lock
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    store.flush()
    store.close()
    reopened = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=None)
    assert torch.equal(reopened.get("before", "fp").kv, entry.kv)
    reopened.close()


def test_a_file_named_like_the_quarantine_folder_does_not_keep_a_damaged_index_in_place(tmp_path, caplog):
    (tmp_path / QUARANTINE).write_bytes(b"a file of someone else's")
    (tmp_path / "cache.db").write_bytes(b"\x00garbage" * 512)
    store = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=None)
    assert store.disk is not None and not store.disk.read_only and store.stats()["quarantined"] == 1
    (moved,) = tmp_path.glob(f"{QUARANTINE}-*/*/cache.db")
    assert moved.read_bytes() == b"\x00garbage" * 512
    assert (tmp_path / QUARANTINE).read_bytes() == b"a file of someone else's"
    assert store.put(_entry("a"))
    store.close()


def test_an_index_neither_writable_nor_readable_is_logged_with_its_first_cause(tmp_path, monkeypatch, caplog):
    """The read-only fallback failing too used to replace the cause in the log with its own error."""
    from vismemo_hf.store.tiers import disk as disk_tier

    first = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=None)
    first.put(_entry("a"))
    first.close()

    def io_error(self, thorough=False):
        raise sqlite3.OperationalError("disk I/O error")

    def unreadable(directory):
        raise sqlite3.OperationalError("no such table: Cache")

    monkeypatch.setattr(disk_tier.DiskTier, "_open_writable", io_error)
    monkeypatch.setattr(disk_tier, "ReadOnlyDirectory", unreadable)
    with caplog.at_level(logging.WARNING):
        store = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=None)
    assert store.disk is None and "unusable (OperationalError: disk I/O error)" in caplog.text
    assert "no such table" not in caplog.text


def test_an_exact_hit_with_no_room_above_or_back_keeps_its_entry_in_the_copy_tier(tmp_path, monkeypatch):
    """The read of a host tier's blob takes it out to promote it; when neither a tier above nor its own takes it
    back, it stays where the disk tier's copy holds it (``Placement.to_copy_or_drop``): never lost, never an error."""
    store = VisMemoStore(device_bytes=0, host_bytes="64MiB", disk_dir=tmp_path, disk_bytes=None)
    entry = _entry("a")
    assert store.put(entry)
    store.flush()
    assert store.tier_of("a") == "host"
    monkeypatch.setattr(store.placement, "place_first", lambda *a, **k: False)
    monkeypatch.setattr(store.placement, "place", lambda *a, **k: False)
    got = store.get("a", "fp")
    assert got is not None and torch.equal(got.kv, entry.kv)
    monkeypatch.undo()
    assert store.tier_of("a") == "disk"
    again = store.get("a", "fp")
    assert again is not None and torch.equal(again.kv, entry.kv)
    store.close()

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
    from vismemo_hf.store import tiers

    (tmp_path / "cache.db").write_bytes(b"\x00garbage" * 512)

    def read_only(self, err):
        raise PermissionError(f"[Errno 30] Read-only file system: {self.directory}")

    monkeypatch.setattr(tiers.DiskTier, "_quarantine", read_only)
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

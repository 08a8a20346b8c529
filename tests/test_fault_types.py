"""Faults typed at one boundary (``store/faults.py``): a store or I/O fault becomes a miss, counted and logged with
its cause; any other exception is a bug of the library, which propagates in strict mode (``VISMEMO_STRICT=1``, how
the test suite runs) and otherwise degrades to a miss too, logged with its traceback and counted as a bug."""

import logging

import pytest
import torch
from transformers import DynamicCache

import vismemo_hf
from vismemo_hf import HitKind, VisMemoStore
from vismemo_hf.store import StoreFault, fault_counts, store_call
from vismemo_hf.store.blob import BlobError, ForgedBlob
from vismemo_hf.store.faults import is_fault
from vismemo_hf.store.tiers.base import TierUnavailable

from conftest import build_inputs, forget_bugs, generate


class _RedisLikeError(Exception):
    """What the Redis client raises (ConnectionError, ResponseError, ...): recognised by its module."""


_RedisLikeError.__module__ = "redis.exceptions"


@pytest.mark.parametrize("err", [OSError("disk gone"), OSError(28, "No space left on device"), EOFError(),
                                 MemoryError(), TierUnavailable("server down"), BlobError("crc"), ForgedBlob("mac"),
                                 StoreFault("any"), _RedisLikeError("CLUSTERDOWN")])
def test_store_and_io_faults_are_faults(err):
    assert is_fault(err)


@pytest.mark.parametrize("err", [AttributeError("to_disk_or_drop"), TypeError("bad call"), KeyError("k"),
                                 NameError("x"), IndexError("i"), AssertionError(), ZeroDivisionError()])
def test_a_bug_is_no_fault(err):
    assert not is_fault(err)


def test_a_fault_gives_the_default_counted_and_logged(caplog):
    before = fault_counts()

    def read():
        raise OSError("disk gone")

    with caplog.at_level(logging.WARNING, logger="vismemo_hf.store.faults"):
        assert store_call("read", read, "miss") == "miss"
    after = fault_counts()
    assert after["fault"] == before.get("fault", 0) + 1 and after["read/fault"] == before.get("read/fault", 0) + 1
    assert "store read failed (OSError: disk gone)" in caplog.text


def _bug():
    raise AttributeError("'Placement' object has no attribute 'to_disk_or_drop'")


def test_a_bug_propagates_in_strict_mode(monkeypatch):
    monkeypatch.setenv("VISMEMO_STRICT", "1")
    with pytest.raises(AttributeError, match="to_disk_or_drop"):
        store_call("write", _bug, None)
    forget_bugs()


def test_outside_strict_mode_a_bug_is_a_miss_counted_and_logged_with_its_traceback(monkeypatch, caplog):
    monkeypatch.setenv("VISMEMO_STRICT", "0")
    before = fault_counts()
    with caplog.at_level(logging.ERROR, logger="vismemo_hf.store.faults"):
        assert store_call("write", _bug, "default") == "default"
    after = fault_counts()
    assert after["bug"] == before.get("bug", 0) + 1 and after["store write/bug"] >= 1
    assert "a bug of the library" in caplog.text and "Traceback" in caplog.text
    forget_bugs()


class _BuggyStore(VisMemoStore):
    """A store whose exact read has a bug of the library (not a fault); no prefix blocks (the repeated request
    would be served by its prefix, the exact read not reached)."""

    broken = False

    def __init__(self):
        super().__init__(prefix_bytes=0)

    def get(self, *a, **k):
        if self.broken:
            _bug()
        return super().get(*a, **k)


def test_a_bug_in_a_store_read_fails_generate_in_strict_mode_and_is_a_miss_outside(qwen2, pages, monkeypatch):
    model, processor = qwen2
    inputs = build_inputs(processor, [pages["base"]])
    _, ref = generate(model, inputs, DynamicCache(), 2)
    store = _BuggyStore()
    generate(model, inputs, vismemo_hf.VisMemoCache(store=store), 1)
    store.flush()
    store.broken = True
    monkeypatch.setenv("VISMEMO_STRICT", "1")
    with pytest.raises(AttributeError, match="to_disk_or_drop"):
        generate(model, inputs, vismemo_hf.VisMemoCache(store=store, tau=1.0), 2)
    monkeypatch.setenv("VISMEMO_STRICT", "0")
    cache = vismemo_hf.VisMemoCache(store=store, tau=1.0)
    _, scores = generate(model, inputs, cache, 2)
    assert cache.events[0].kind is HitKind.MISS and torch.allclose(scores, ref, atol=1e-4)
    forget_bugs()

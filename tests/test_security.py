"""Shared tiers with a store secret (sealed blobs) and namespaces between tenants (docs/METHOD.md §5)."""

import logging
from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache

import vismemo_hf
from vismemo_hf import HitKind, VisMemoCache, VisMemoStore
from vismemo_hf.store import blob

from conftest import REDIS_SERVER, build_inputs, generate, stored
from test_store import _entry

SECRET = "correct horse battery staple 42"
OPTS = dict(policy="vismemo", reuse_ratio=0.5, entropy_threshold=1.0)


def _disk(path, **kw):
    return VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=str(path), **kw)


def _remote(url, **kw):
    return VisMemoStore(device_bytes=0, host_bytes=0, remote_url=url, remote_options={"refresh_s": 0}, **kw)


def _plant(writer, key: str, source: vismemo_hf.store.entry.Entry) -> None:
    """What an attacker with write access does: ``source``'s K/V under ``key``, written with the library's own
    blob code (valid checksums)."""
    writer.put(replace(source, key=key))
    writer.flush()


def _keys(store):
    store.flush()
    return list(store.catalog.where)


@pytest.mark.parametrize("tier", ["disk", "redis"])
@pytest.mark.parametrize("forger", ["no secret", "another secret"])
def test_a_planted_entry_is_a_miss_equal_to_a_full_prefill(qwen2, pages, tmp_path, request, tier, forger):
    """Page Y's K/V stored under page X's key by a writer without the secret: a reader with the secret misses on
    X (and answers as a full prefill), counts the forgery and removes it."""
    if tier == "redis":
        if REDIS_SERVER is None:
            pytest.skip("redis-server not installed")
        server = request.getfixturevalue("server")
        make = lambda **kw: _remote(server.url, **kw)  # noqa: E731
    else:
        make = lambda **kw: _disk(tmp_path / "shared", **kw)  # noqa: E731
    model, processor = qwen2
    honest = make(secret=SECRET)
    stored(model, processor, pages["base"], store=honest, **OPTS)
    (key_x,) = _keys(honest)
    honest.close()
    scratch = stored(model, processor, pages["noise"], **OPTS)  # the attacker's own run of page Y
    (key_y,) = _keys(scratch)
    entry_y = scratch.get(key_y, scratch.catalog.fingerprint_of(key_y))
    attacker = make(secret=False if forger == "no secret" else "not the secret, but long enough")
    _plant(attacker, key_x, entry_y)
    attacker.close()

    inputs = build_inputs(processor, [pages["base"]])
    _, ref = generate(model, inputs, DynamicCache(), 3)
    reader = make(secret=SECRET)
    cache = VisMemoCache(store=reader, **OPTS)
    _, scores = generate(model, inputs, cache, 3)
    assert cache.events[0].kind is HitKind.MISS
    assert (scores - ref).abs().max() <= 1e-4
    assert reader.stats()["forged"] >= 1 and reader.stats()["sealed"]
    reader.flush()
    again = VisMemoCache(store=reader, **OPTS)  # the miss stored a sealed entry of its own: an exact hit now
    _, scores = generate(model, inputs, again, 3)
    assert again.events[0].kind is HitKind.EXACT and (scores - ref).abs().max() <= 1e-4
    reader.close()


def test_a_sealed_entry_moved_to_another_key_is_a_miss(tmp_path):
    store = _disk(tmp_path, secret=SECRET)
    store.put(_entry("k1", n=6, layers=4))
    store.flush()
    disk = store.disk
    with disk._open("k1") as handle:
        data = handle.read()
    disk.write("k2", data)  # a valid sealed blob, under a key it was not written for
    store.close()
    reader = _disk(tmp_path, secret=SECRET)
    assert reader.get("k2", "fp") is None and "k2" not in reader
    assert torch.equal(reader.get("k1", "fp").kv, _entry("k1", n=6, layers=4).kv)


def test_every_block_of_a_sparse_read_is_authenticated(tmp_path):
    """One token's block rewritten with a recomputed CRC (what a forger can do): a sparse read of it fails its
    MAC; a read of other tokens does not touch it and serves."""
    from crc32c import crc32c

    entry = _entry("k", n=8, layers=4)
    store = _disk(tmp_path, secret=SECRET)
    for key in ("k", "whole"):
        store.put(replace(entry, key=key))
        store.flush()
        header = store.disk.header(key)
        start, _ = header.token_range(5, 2)
        with store.disk._open(key) as handle:
            data = bytearray(handle.read())
        payload = slice(start + blob.HASH_BYTES, start + header.layer_bytes)
        data[payload] = bytes(len(data[payload]))
        data[start : start + blob.HASH_BYTES] = crc32c(bytes(data[payload])).to_bytes(8, "little")
        store.disk.write(key, bytes(data))
    assert torch.equal(store.get_tokens("k", "fp", torch.tensor([1, 3]), 2), entry.kv[[1, 3], 2:])
    assert store.get_tokens("k", "fp", torch.tensor([3, 5]), 2) is None
    assert store.stats()["forged"] == 1 and "k" not in store
    assert store.get("whole", "fp") is None  # a full read checks the whole K/V region's MAC
    assert store.stats()["forged"] == 2
    store.close()


def test_sealed_and_unsealed_stores_do_not_read_each_other(tmp_path):
    """Neither serves the other's blobs, and neither deletes them: one process started without the secret (or with
    another) must not empty a shared directory, nor the other way round."""
    sealed = _disk(tmp_path / "a", secret=SECRET)
    entry = _entry("k", n=4, layers=2)
    sealed.put(entry)
    sealed.close()
    plain = _disk(tmp_path / "a")  # no secret: cannot check the MACs, serves nothing of it
    assert plain.get("k", "fp") is None and plain.stats()["forged"] == 1 and "k" not in plain
    plain.put(_entry("u", n=4, layers=2))
    plain.close()
    reader = _disk(tmp_path / "a", secret=SECRET)
    assert reader.get("u", "fp") is None and reader.stats()["forged"] >= 1
    assert torch.equal(reader.get("k", "fp").kv, entry.kv)  # its own blob, left in place by the other store
    reader.close()
    other = _disk(tmp_path / "a", secret="another secret of 16+ bytes")
    assert other.get("k", "fp") is None and other.get("u", "fp") is None
    other.close()
    assert _disk(tmp_path / "a").get("u", "fp") is not None
    assert _disk(tmp_path / "a", secret=SECRET).get("k", "fp") is not None


def test_the_secret_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("VISMEMO_STORE_SECRET", SECRET)
    writer = _disk(tmp_path)
    assert writer.stats()["sealed"]
    writer.put(_entry("k", n=4, layers=2))
    writer.close()
    assert _disk(tmp_path, secret=SECRET).get("k", "fp") is not None
    monkeypatch.delenv("VISMEMO_STORE_SECRET")
    assert _disk(tmp_path, secret="another secret of 16+ bytes").get("k", "fp") is None


def test_the_secret_never_appears_in_logs_stats_or_errors(tmp_path, caplog, qwen2, pages):
    caplog.set_level(logging.DEBUG)
    store = _disk(tmp_path, secret=SECRET)
    model, processor = qwen2
    stored(model, processor, pages["base"], store=store, **OPTS)
    (key,) = _keys(store)
    store.close()
    forger = _disk(tmp_path, secret=False)
    _plant(forger, key, _entry(key, n=4, layers=2))
    forger.close()
    reader = _disk(tmp_path, secret=SECRET)
    generate(model, build_inputs(processor, [pages["base"]]), VisMemoCache(store=reader, **OPTS), 1)
    texts = [caplog.text, repr(reader.stats()), repr(reader.__dict__), repr(reader.placement.seal)]
    with pytest.raises(ValueError) as short:
        VisMemoStore(secret=SECRET[:8])
    texts.append(str(short.value))
    assert reader.stats()["forged"] >= 1
    assert not any(SECRET in t or SECRET[:8] in t for t in texts)


def _two_tenants(model, processor, pages, store):
    ours = VisMemoCache(store=store, namespace="tenant-a", **OPTS)
    generate(model, build_inputs(processor, [pages["base"]]), ours, 1)
    store.flush()
    found = {}
    for page in ("base", "edit"):
        theirs = VisMemoCache(store=store, namespace="tenant-b", store_misses=False, **OPTS)
        generate(model, build_inputs(processor, [pages[page]]), theirs, 1)
        found[page] = theirs.events[0].kind
        store.flush()
    return found


def test_namespaces_never_hit_each_other(qwen2, pages):
    model, processor = qwen2
    store = VisMemoStore()
    assert _two_tenants(model, processor, pages, store) == {"base": HitKind.MISS, "edit": HitKind.MISS}
    for namespace, page, kind in (("tenant-a", "base", HitKind.EXACT), ("tenant-a", "edit", HitKind.APPROXIMATE),
                                  ("tenant-b", "base", HitKind.MISS), (None, "edit", HitKind.MISS),
                                  ("tenant-b", "edit", HitKind.APPROXIMATE)):
        cache = VisMemoCache(store=store, namespace=namespace, **OPTS)
        generate(model, build_inputs(processor, [pages[page]]), cache, 1)
        assert cache.events[0].kind is kind, (namespace, page)
    assert VisMemoStore(namespace="tenant-a").namespace == "tenant-a"
    with pytest.raises(ValueError, match="namespace"):
        VisMemoCache(store=store, namespace="")


def test_namespaces_hold_across_processes_through_a_shared_directory(qwen2, pages, tmp_path):
    model, processor = qwen2
    first = _disk(tmp_path, namespace="tenant-a")
    generate(model, build_inputs(processor, [pages["base"]]), VisMemoCache(store=first, **OPTS), 1)
    first.close()
    other = _disk(tmp_path, namespace="tenant-b")
    cache = VisMemoCache(store=other, **OPTS)
    generate(model, build_inputs(processor, [pages["base"]]), cache, 1)
    assert cache.events[0].kind is HitKind.MISS
    same = _disk(tmp_path)
    cache = VisMemoCache(store=same, namespace="tenant-a", **OPTS)
    generate(model, build_inputs(processor, [pages["base"]]), cache, 1)
    assert cache.events[0].kind is HitKind.EXACT

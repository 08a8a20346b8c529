"""The tiered store: budgets, sparse I/O, integrity, persistence, sharing, exact-priority LRU."""

import multiprocessing as mp
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

import vismemo_hf
from vismemo_hf import Entry, HitKind, VisMemoStore
from vismemo_hf.store import blob

from conftest import build_inputs, generate
from test_store import _entry


def make_entry(key: str, fp: str = "fp", layers: int = 3, dtype=torch.float32) -> Entry:
    seed = sum(map(ord, key))
    n = 2 + seed % 5
    g = torch.Generator().manual_seed(seed)
    return Entry(key=key, fingerprint=fp, grid=(1, 2, 2 * n), embeds=torch.randn(n, 8, generator=g).to(dtype),
                 deepstack=None, descriptors=torch.nn.functional.normalize(torch.randn(4, 8, generator=g), dim=-1),
                 entropy=torch.rand(n, generator=g), kv=torch.randn(n, layers, 2, 2, 4, generator=g).to(dtype),
                 offset=seed % 7, patch_hashes=torch.arange(n) * seed)


def blob_size(key: str) -> int:
    return len(blob.encode(make_entry(key)))


def check_invariants(store: VisMemoStore) -> None:
    stats = store.stats()
    for name, tier in stats["tiers"].items():
        if tier["budget"] is not None:
            assert tier["bytes"] <= tier["budget"], name
    in_tiers = set(store.device.lru) | set(store.host.lru) | set(store.victim.lru)
    if store.disk is not None:
        in_tiers |= set(store.disk.lru)
    assert stats["entries"] == len(store) == len(in_tiers) == len(store.catalog.index)
    assert not set(store.device.lru) & (set(store.host.lru) | set(store.victim.lru))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "get", "tokens", "peek"]), st.integers(0, 11)), max_size=50),
       budgets=st.tuples(st.integers(0, 3000), st.integers(0, 6000), st.integers(0, 12000)),
       victim=st.sampled_from([0.0, 0.3]))
def test_random_operations_respect_budgets_and_keys(tmp_path_factory, ops, budgets, victim):
    store = VisMemoStore(device_bytes=budgets[0], host_bytes=budgets[1], disk_dir=tmp_path_factory.mktemp("d"),
                         disk_bytes=budgets[2], victim_share=victim)
    for op, k in ops:
        key = f"key{k}"
        expected = make_entry(key)
        if op == "put":
            store.put(expected)
        elif op == "get":
            got = store.get(key, "fp")
            assert got is None or (got.key == key and torch.equal(got.kv.cpu(), expected.kv))
        elif op == "tokens":
            tokens = torch.tensor([0, expected.n_tokens - 1])
            got = store.get_tokens(key, "fp", tokens, 1)
            assert got is None or torch.equal(got.cpu(), expected.kv[tokens][:, 1:])
        else:
            got = store.peek(key, "fp")
            assert got is None or (got.key == key and torch.equal(got.embeds.cpu(), expected.embeds))
        assert store.get(key, "other-model") is None
        check_invariants(store)
    store.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_reads_touch_exactly_the_expected_ranges(tmp_path, tier, dtype):
    store = VisMemoStore(device_bytes=0, host_bytes=None if tier == "host" else 0, disk_dir=tmp_path, disk_bytes=None)
    entry = make_entry("sparse", layers=5, dtype=dtype)
    assert store.put(entry)
    store.flush()
    assert store.tier_of("sparse") == tier
    tokens = torch.tensor([0, 2, 3])
    before = store.stats()["bytes_read_sparse"]
    ranges = []
    if tier == "disk":  # record the positioned reads (offset, length) the sparse read makes
        read = store.disk.ranges
        store.disk.ranges = lambda key, spans: (ranges.extend((s, n) for s, n in spans), read(key, spans))[1]
    got = store.get_tokens("sparse", "fp", tokens, 2)
    full = store.get("sparse", "fp")
    assert torch.equal(got, entry.kv[tokens][:, 2:]) and torch.equal(got, full.kv.cpu()[tokens][:, 2:])
    header = blob.parse_header(blob.encode(entry)[: blob.HEADER_SIZE])
    per_token = (5 - 2) * (blob.HASH_BYTES + 2 * 2 * 4 * dtype.itemsize)
    assert store.stats()["bytes_read_sparse"] - before == len(tokens) * per_token
    if tier == "disk":
        ranges = [r for r in ranges if r != (0, blob.HEADER_SIZE)]  # the header reads aside
        assert ranges == [header.token_range(t, 2) for t in tokens.tolist()]
        assert all(length == per_token for _, length in ranges)
        assert store.stats()["tiers"]["disk"]["range_reads"] == len(tokens)
    store.close()


def test_exact_hits_promote_and_approximate_reads_do_not(tmp_path):
    store = VisMemoStore(device_bytes=10**6, host_bytes=10**6, disk_dir=tmp_path, disk_bytes=10**7)
    entry = make_entry("promote")
    store.put(entry)
    store.flush()
    store.device.pop("promote")  # as if evicted long ago: only the disk copy is left
    assert store.tier_of("promote") == "disk"
    store.get_tokens("promote", "fp", torch.tensor([1]), 1)
    assert store.tier_of("promote") == "disk"
    assert store.get("promote", "fp") is not None and store.tier_of("promote") == "device"
    assert store.stats()["hits_by_tier"] == {"device": 0, "host": 0, "disk": 2, "remote": 0}
    store.close()


def test_exact_priority_lru_keeps_an_exact_hit_entry_that_plain_lru_evicts():
    size = make_entry("a").nbytes
    sizes = {k: make_entry(k).nbytes for k in "abcd"}
    budget = sizes["a"] + sizes["b"] + sizes["c"] + 1

    def run(protect):
        store = VisMemoStore(device_bytes=budget, protect=protect)
        for k in "abc":
            store.put(make_entry(k))
        assert store.get("a", "fp") is not None  # "a" serves an exact hit ...
        store.get_tokens("b", "fp", torch.tensor([0]), 1)  # ... "b" only an approximate one
        store.get_tokens("c", "fp", torch.tensor([0]), 1)
        store.put(make_entry("d"))  # needs room
        return {k for k in "abcd" if k in store}

    assert size > 0
    plain = run(protect=0)
    prioritised = run(protect=2)
    assert "a" not in plain and "a" in prioritised and "d" in prioritised


def test_victim_share_keeps_the_entries_with_priors(tmp_path):
    priors = tmp_path / "priors.json"
    priors.write_text('{"popular": 5.0}')
    one = len(blob.encode(make_entry("popular")))
    store = VisMemoStore(device_bytes=0, host_bytes=int(one * 2.5 / 0.5), victim_share=0.5, priors=priors)
    store.put(make_entry("popular"))
    for k in range(8):
        store.put(make_entry(f"filler{k}"))
    assert store.tier_of("popular") == "host" and store.stats()["tiers"]["host"]["victim_entries"] >= 1
    assert store.get("popular", "fp") is not None


def test_a_full_victim_share_displaces_its_lowest_scored_entry_for_a_higher_one(tmp_path):
    """The victim share holds two entries: a higher-prior entry evicted from the host tier displaces the lowest-scored
    one (out: there is no disk tier); a lower-prior one is turned away and the share keeps what it had."""
    priors = tmp_path / "priors.json"
    priors.write_text('{"p1": 1.0, "p2": 2.0, "hi": 5.0, "lo": 0.5}')
    one = len(blob.encode(_entry("p1")))
    store = VisMemoStore(device_bytes=0, host_bytes=4 * one + 1, victim_share=0.5, priors=priors)

    def push_out_of_host(key):  # two fillers after ``key``: the host tier's two places go to them
        assert store.put(_entry(key))
        for i in range(2):
            assert store.put(_entry(f"{key}-filler{i}"))

    for key in ("p1", "p2"):
        push_out_of_host(key)
    assert set(store.victim.lru) == {"p1", "p2"}  # full
    push_out_of_host("hi")
    assert set(store.victim.lru) == {"p2", "hi"} and "p1" not in store
    push_out_of_host("lo")
    assert set(store.victim.lru) == {"p2", "hi"} and "lo" not in store
    assert torch.equal(store.get("hi", "fp").kv, _entry("hi").kv)
    check_invariants(store)


def _corrupt_then_generate(model, processor, image, directory, damage):
    # the entry's blob serves the second request (no prefix blocks in RAM)
    store = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=directory, disk_bytes=None, prefix_bytes=0)
    inputs = build_inputs(processor, [image])
    first = vismemo_hf.VisMemoCache(store=store)
    generate(model, inputs, first, 1)
    store.flush()
    key = first.events[0].key
    damage(store, key)
    cache = vismemo_hf.VisMemoCache(store=store)
    _, scores = generate(model, inputs, cache, 3)
    _, ref = generate(model, inputs, DynamicCache(), 3)
    return cache.events[0], scores, ref, store


def _blob_file(store, key):
    with store.disk.cache.get(key, read=True) as handle:
        return handle.name


def _truncate(store, key):
    path = _blob_file(store, key)
    os.truncate(path, os.path.getsize(path) // 2)


def _flip(store, key):
    path = _blob_file(store, key)
    with open(path, "r+b") as f:
        f.seek(blob.HEADER_SIZE + 40)
        byte = f.read(1)
        f.seek(blob.HEADER_SIZE + 40)
        f.write(bytes([byte[0] ^ 0xFF]))


def _foreign(store, key):
    entry = store.disk.full(key)
    entry.fingerprint = "another-model-fingerprint-000000"
    store.disk.write(key, blob.encode(entry))


class Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/vismemo-pwned",))


def _pickle(store, key):
    import diskcache

    plain = diskcache.Cache(store.disk.directory)  # default Disk: pickles non-bytes values
    plain.set(key, Boom())
    plain.close()


@pytest.mark.parametrize("damage", [_truncate, _flip, _foreign, _pickle])
def test_damaged_blobs_are_misses_and_never_wrong_kv(qwen2, pages, tmp_path, damage):
    if os.path.exists("/tmp/vismemo-pwned"):
        os.remove("/tmp/vismemo-pwned")
    model, processor = qwen2
    event, scores, ref, store = _corrupt_then_generate(model, processor, pages["base"], tmp_path, damage)
    assert event.kind is HitKind.MISS
    assert (scores - ref).abs().max() <= 1e-4
    assert not os.path.exists("/tmp/vismemo-pwned")
    assert store.stats()["corrupt"] >= 1
    store.close()


def test_restart_rebuilds_the_index_and_serves_exact_and_approximate_hits(qwen2, pages, tmp_path):
    model, processor = qwen2
    store = VisMemoStore(device_bytes=None, disk_dir=tmp_path, disk_bytes=None)
    generate(model, build_inputs(processor, [pages["base"]]), vismemo_hf.VisMemoCache(store=store), 1)
    store.close()
    reopened = VisMemoStore(device_bytes=None, disk_dir=tmp_path, disk_bytes=None)
    assert len(reopened) == 1
    cache = vismemo_hf.VisMemoCache(store=reopened)
    generate(model, build_inputs(processor, [pages["base"]]), cache, 1)
    assert cache.events[0].kind is HitKind.EXACT
    cache = vismemo_hf.VisMemoCache(store=reopened)
    generate(model, build_inputs(processor, [pages["edit"]]), cache, 1)
    assert cache.events[0].kind is HitKind.APPROXIMATE
    reopened.close()


def _worker(directory, seed, n_ops, queue):
    import random

    import torch

    from vismemo_hf import VisMemoStore

    rng = random.Random(seed)
    store = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=directory, disk_bytes=20_000)
    errors = 0
    for _ in range(n_ops):
        key = f"shared{rng.randrange(16)}"
        expected = make_entry(key)
        try:
            op = rng.random()
            if op < 0.4:
                store.put(expected)
                store.flush()
            elif op < 0.7:
                got = store.get(key, "fp")
                assert got is None or torch.equal(got.kv.cpu(), expected.kv)
            else:
                got = store.get_tokens(key, "fp", torch.tensor([1]), 1)
                assert got is None or torch.equal(got.cpu(), expected.kv[[1]][:, 1:])
        except Exception as err:  # noqa: BLE001
            errors += 1
            queue.put(repr(err))
    store.close()
    queue.put(("done", errors))


def test_two_processes_share_one_directory(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), seed, 500, queue)) for seed in (1, 2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert results == [("done", 0), ("done", 0)], results


def test_disk_full_and_unusable_directory_keep_serving(qwen2, pages, tmp_path, monkeypatch, caplog):
    model, processor = qwen2
    inputs = build_inputs(processor, [pages["base"]])
    _, ref = generate(model, inputs, DynamicCache(), 2)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    unusable = VisMemoStore(device_bytes=0, disk_dir=blocker / "store", disk_bytes=None)
    assert unusable.disk is None and "unusable" in caplog.text
    full = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path / "full", disk_bytes=None)

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(full.disk, "write", no_space)
    for store in (unusable, full):
        cache = vismemo_hf.VisMemoCache(store=store)
        _, scores = generate(model, inputs, cache, 2)
        store.flush()
        assert cache.events[0].kind is HitKind.MISS and (scores - ref).abs().max() <= 1e-4
        assert len(store) == 0
    assert full.stats()["write_failures"] == 1


def test_from_config_presets(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    store = VisMemoStore.from_config()
    assert store.disk is not None and str(tmp_path) in store.disk.directory
    assert set(store.stats()["tiers"]) == {"device", "host", "disk", "remote"}
    assert all({"bytes", "budget", "entries"} <= set(t) for t in store.stats()["tiers"].values())
    store.close()
    assert VisMemoStore.from_config("memory").disk is None
    with pytest.raises(ValueError):
        VisMemoStore.from_config("no-such-preset")


def test_every_tier_offers_the_tier_interface(tmp_path):
    """The store treats its tiers alike: each one, remote included, has every method of ``Tier``."""
    from vismemo_hf.store.remote import RemoteTier
    from vismemo_hf.store.tiers import Tier

    store = VisMemoStore(device_bytes=10**6, host_bytes=10**6, disk_dir=tmp_path, disk_bytes=10**7,
                         remote_url="redis://127.0.0.1:1/0", remote_options={"timeout_s": 0.05})
    assert [t.name for t in store.tiers] == ["device", "host", "host", "disk", "remote"]
    assert all(isinstance(t, Tier) for t in store.tiers) and isinstance(store.remote, RemoteTier)
    entry = make_entry("k")
    store.put(entry)
    store.flush()
    for tier in store.tiers:
        stats = tier.stats()
        assert {"bytes", "budget", "entries"} <= set(stats) and stats["entries"] == len(tier.lru)
    store.close()


def test_an_entry_moving_down_is_not_forgotten_when_its_disk_copy_is_evicted(tmp_path):
    """Device -> host demotion that pushes another entry to disk, which evicts the moving entry's write-through copy:
    the moving entry stays indexed (found by hypothesis: ops put 0, put 3, put 4)."""
    a, b, c = (make_entry(k) for k in ("key0", "key3", "key4"))
    store = VisMemoStore(device_bytes=c.nbytes, host_bytes=len(blob.encode(a)), disk_dir=tmp_path,
                         disk_bytes=len(blob.encode(a)))
    for e in (a, b, c):
        store.put(e)
        check_invariants(store)
    assert store.tier_of("key3") == "host" and store.get("key3", "fp") is not None


def test_every_device_keeps_its_own_budget():
    """device_bytes per device (a model split over devices): entries fill the first device, move one device down
    when evicted, then to the host tier; budgets hold on each; a hit on any device serves from where it is, and a
    hit from the host tier promotes to the first device with room."""
    size = _entry("x").nbytes
    store = VisMemoStore(device_bytes={"cpu": size, "cpu:0": 2 * size}, host_bytes=10**7)
    for i in range(4):
        assert store.put(_entry(f"k{i}", seed=i))
    per = store.stats()["tiers"]["device"]["devices"]
    assert per["cpu"]["entries"] == 1 and per["cpu:0"]["entries"] == 2
    assert all(d["bytes"] <= d["budget"] for d in per.values())
    assert store.stats()["tiers"]["device"]["budget"] == 3 * size and store.tier_of("k0") == "host"
    assert store.devices[0].lru.keys() == {"k3"} and store.devices[1].lru.keys() == {"k1", "k2"}
    assert torch.equal(store.get("k1", "fp").kv, _entry("k1", seed=1).kv) and "k1" in store.devices[1].lru
    assert torch.equal(store.get("k0", "fp").kv, _entry("k0", seed=0).kv)  # from the host tier: promoted
    assert "k0" in store.devices[0].lru and store.devices[1].lru.keys() == {"k1", "k3"}  # k3 one device down
    assert store.tier_of("k2") == "host"
    with pytest.raises(ValueError, match="device_bytes of cpu"):
        VisMemoStore(device_bytes={"cpu": -1})
    with pytest.raises(ValueError, match="does not exist"):
        VisMemoStore(device_bytes={"cuda:7": 10})

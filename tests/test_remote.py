"""The shared Redis tier, against a real ``redis-server`` on 127.0.0.1 (``.ci/run`` installs it)."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

import vismemo_hf
from vismemo_hf import HitKind, VisMemoStore
from vismemo_hf.core.thresholds import ModelReference
from vismemo_hf.store import blob

from conftest import REDIS_SERVER, build_inputs, generate
from test_store import _entry

redis = pytest.importorskip("redis", reason="the redis client is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not installed (apt-get install redis-server)")


def _store(url, **options):
    store = VisMemoStore(remote_url=url, remote_options={"refresh_s": 0, **options})
    store.set_reference("fp", ModelReference(torch.zeros(8), torch.zeros(8), 0.0))  # raw cosines for these descriptors
    return store


def test_entries_published_by_one_store_are_found_by_another(server):
    a = _store(server.url)
    first = _entry("k1", n=5, layers=4)
    a.put(first)
    a.flush()
    b = _store(server.url, retry_s=0.1)  # starts after the first write: reads the index
    assert b.tier_of("k1") == "remote"
    assert [k for k, _ in b.candidates("fp", (1, 4, 5), first.descriptors, 0.5, 3)] == ["k1"]
    second = _entry("k2", n=5, layers=4, seed=1)
    a.put(second)
    a.flush()  # published while b runs: b's next lookup sees it
    assert [k for k, _ in b.candidates("fp", (1, 4, 5), second.descriptors, 0.5, 3)] == ["k2"]
    assert torch.equal(b.get("k2", "fp").kv, second.kv)
    assert b.get("k2", "other-model") is None and b.peek("k1", "other-model") is None
    assert b.stats()["hits_by_tier"]["remote"] == 1
    assert b.tier_of("k2") == "device"  # promoted by the exact hit; still on the server for others
    assert server.client().exists("vismemo:blob:k2")


def test_sparse_remote_read_moves_only_the_token_ranges(server):
    a = _store(server.url)
    entry = _entry("k", n=64, layers=8)
    a.put(entry)
    a.flush()
    b = _store(server.url)
    client = server.client()
    info = lambda: client.info("stats")["total_net_output_bytes"]  # noqa: E731
    base0 = info()
    base1 = info()
    empty = info() - base1  # what INFO's own reply adds between two readings
    assert empty == base1 - base0
    tokens = torch.tensor([3, 17, 40])
    before = info()
    got = b.get_tokens("k", "fp", tokens, 5)
    moved = info() - before - empty
    assert torch.equal(got, entry.kv[tokens][:, 5:])
    header = blob.parse_header(client.getrange("vismemo:blob:k", 0, blob.HEADER_SIZE - 1))
    expected = blob.HEADER_SIZE + sum(header.token_range(int(t), 5)[1] for t in tokens)
    assert b.stats()["tiers"]["remote"]["bytes_read"] == expected
    assert b.stats()["tiers"]["remote"]["range_reads"] == len(tokens)
    # the server sent the ranges plus RESP framing (a few bytes per reply), far below the blob
    assert expected <= moved <= expected + 32 * (len(tokens) + 1)
    assert moved < header.total_bytes / 10


def test_two_processes_share_exact_and_approximate_hits(server):
    worker = [sys.executable, str(Path(__file__).with_name("remote_worker.py")), server.url]
    run = lambda role: json.loads(subprocess.run(worker + [role], capture_output=True, text=True,  # noqa: E731
                                                 check=True, timeout=300).stdout.strip().splitlines()[-1])
    writer = run("writer")
    assert writer["base"]["kind"] == "miss" and writer["stats"]["tiers"]["remote"]["writes"] == 1
    reader = run("reader")
    assert reader["base"]["kind"] == "exact" and reader["edit"]["kind"] == "approximate"
    assert reader["stats"]["hits_by_tier"]["remote"] == 2
    assert reader["base"]["tokens"] == reader["full_base"]["tokens"]
    assert torch.allclose(torch.tensor(reader["base"]["scores"]), torch.tensor(reader["full_base"]["scores"]), atol=1e-4)
    # the approximate hit through Redis is the reader's own approximate run without Redis ...
    assert reader["edit"]["tokens"] == reader["local_edit"]["tokens"]
    assert torch.allclose(torch.tensor(reader["edit"]["scores"]), torch.tensor(reader["local_edit"]["scores"]), atol=1e-5)
    # ... which really reused K/V: it is not the full prefill of the edited page
    assert (torch.tensor(reader["edit"]["scores"]) - torch.tensor(reader["full_edit"]["scores"])).abs().max() > 1e-3


def test_killing_redis_mid_stream_loses_no_request(qwen2, pages, server):
    model, processor = qwen2
    opts = dict(policy="vismemo", reuse_ratio=0.5, entropy_threshold=1.0)
    other = _store(server.url)  # another process that saw the base page and the noise image
    for name in ("base", "noise"):
        generate(model, build_inputs(processor, [pages[name]]), vismemo_hf.VisMemoCache(store=other, **opts), 1)
    other.flush()
    stream = ["base", "noise", "shift", "shift", "edit", "base"]

    def serve(store, kill=None):
        out = []
        for i, name in enumerate(stream):
            cache = vismemo_hf.VisMemoCache(store=store, **opts)
            out.append((cache, generate(model, build_inputs(processor, [pages[name]]), cache, 3)))
            store.flush()  # an approximate hit's image completed into an entry of its own before the next request,
            # in both streams alike (else the repeat's kind depends on when the background completion ran)
            if kill is not None and i == 0:
                kill()
        return out

    with_remote = serve(_store(server.url, retry_s=0.2), kill=server.kill)
    without = serve(VisMemoStore())
    kinds = [c.events[0].kind for c, _ in with_remote]
    # base came from Redis (exact); after the kill, noise (only on the server) is a miss, like without Redis
    assert kinds[0] is HitKind.EXACT and [c.events[0].kind for c, _ in without][0] is HitKind.MISS
    assert kinds[1:] == [c.events[0].kind for c, _ in without][1:]
    for (_, (tok_r, sc_r)), (_, (tok_l, sc_l)) in zip(with_remote, without):
        assert torch.equal(tok_r, tok_l) and (sc_r - sc_l).abs().max() <= 1e-4
    remote = with_remote[-1][0].store.stats()["tiers"]["remote"]
    assert remote["errors"] >= 1 and not remote["connected"]


def test_remote_tier_survives_a_server_down_at_start_and_reconnects(server):
    server.kill()
    store = _store(server.url, retry_s=0.2)  # no server: a warning, then local serving
    assert store.put(_entry("a")) and store.get("a", "fp") is not None
    assert store.stats()["tiers"]["remote"]["errors"] >= 1
    server.start()
    time.sleep(0.3)
    assert store.put(_entry("b", seed=1))
    store.flush()
    assert server.client().exists("vismemo:blob:b") and store.stats()["tiers"]["remote"]["connected"]
    slow = _store("redis://10.255.255.1:6379/0", timeout_s=0.2)  # unroutable: every call times out fast
    t0 = time.perf_counter()
    assert slow.put(_entry("c")) and slow.get("c", "fp") is not None
    assert time.perf_counter() - t0 < 2.0


def _flip_bytes(client, name, where):
    """Flip one byte of each (token, layer) block ``where(header)`` names, in place on the server."""
    header = blob.parse_header(client.getrange(name, 0, blob.HEADER_SIZE - 1))
    for t, layer in where(header):
        start, _ = header.token_range(t, layer)
        pos = start + header.layer_bytes - 1
        client.setrange(name, pos, bytes([client.getrange(name, pos, pos)[0] ^ 0xFF]))


def test_corrupt_remote_blob_is_a_miss_and_is_deleted(qwen2, pages, server):
    model, processor = qwen2
    opts = dict(policy="vismemo", reuse_ratio=0.5, entropy_threshold=1.0)
    client = server.client()
    for page, where in (("edit", lambda h: [(t, h.n_layers - 1) for t in range(h.n_tokens)]),  # sparse read
                        ("base", lambda h: [(0, 0)])):  # an exact hit's full read
        publisher = _store(server.url)
        generate(model, build_inputs(processor, [pages["base"]]), vismemo_hf.VisMemoCache(store=publisher, **opts), 1)
        publisher.close()
        (name,) = client.keys("vismemo:blob:*")
        _flip_bytes(client, name, where)
        inputs = build_inputs(processor, [pages[page]])
        _, ref = generate(model, inputs, DynamicCache(), 3)
        store = _store(server.url)
        cache = vismemo_hf.VisMemoCache(store=store, **opts)
        _, scores = generate(model, inputs, cache, 3)
        assert cache.events[0].kind is HitKind.MISS, page
        assert (scores - ref).abs().max() <= 1e-4, page
        assert store.stats()["corrupt"] == 1, page
        store.close()
        if page == "edit":  # the damaged blob and its record are gone from the server
            key = name[len("vismemo:blob:"):].decode()
            shard = publisher.remote._index_key(publisher.remote._shard(key))
            assert not client.exists(name) and not client.hexists(shard, key)
        checker = _store(server.url)  # what the server holds now (the miss published its page) is sound
        assert checker.remote.lru and all(checker.get(k, checker.remote.fingerprints[k]) is not None
                                            for k in list(checker.remote.lru)), page
        assert checker.stats()["corrupt"] == 0
        client.flushdb()


def test_bench_store_times_the_remote_tier_against_disk(server, tmp_path):
    from vismemo_hf.cli import main

    args = ["bench", "store", "--tokens", "32", "--layers", "4", "--kv-heads", "2", "--head-dim", "8",
            "--embed-dim", "16", "--repeats", "1", "--trace-requests", "100", "--capacities", "5",
            "--remote", server.url, "--out", str(tmp_path)]
    assert main(args) == 0
    rows = {r["tier"]: r for r in json.loads((tmp_path / "store.json").read_text())["remote"]}
    remote = rows["remote (one server)"]
    assert remote["sparse_bytes"] == rows["disk"]["sparse_bytes"] > 0
    assert remote["sparse_bytes"] <= remote["sparse_server_bytes"] < remote["full_server_bytes"]
    assert remote["full_server_bytes"] >= remote["blob_bytes"]
    assert "Shared remote tier (Redis)" in (tmp_path / "store.md").read_text()
    assert not server.client().keys("vismemo-bench-*")  # the benchmark cleans up after itself


def test_shared_redis_preset(server, monkeypatch, tmp_path):
    monkeypatch.delenv("VISMEMO_REDIS_URL", raising=False)
    with pytest.raises(ValueError, match="VISMEMO_REDIS_URL"):
        VisMemoStore.from_config("shared-redis")
    monkeypatch.setenv("VISMEMO_REDIS_URL", server.url)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    store = VisMemoStore.from_config("shared-redis")
    assert store.remote is not None and store.remote.ttl_s == 604800
    with pytest.raises(ValueError):
        VisMemoStore(remote_url="http://not-redis")


def test_exact_lookup_asks_the_server_before_the_index_sync(server):
    a = _store(server.url)
    b = _store(server.url, refresh_s=3600)  # its index sync will not run again in this test
    entry = _entry("late", n=5, layers=4)
    a.put(entry)
    a.flush()
    assert b.tier_of("late") is None  # not announced to b yet ...
    got = b.get("late", "fp")  # ... but an exact lookup finds it with one GET
    assert got is not None and torch.equal(got.kv, entry.kv)
    assert [k for k, _ in b.candidates("fp", (1, 4, 5), entry.descriptors, 0.5, 3)] == ["late"]
    assert b.get("never-stored", "fp") is None and b.stats()["corrupt"] == 0


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PASSWORD_CHARS = "abcXYZ019@:/?#%&=+!$*()[]~ é"


def test_generated_passwords_never_leak(caplog):
    """Any password, in any URL form, stays out of logs, errors, stats and the store's reports."""
    import logging
    import random as rnd

    from vismemo_hf.store.remote import safe_url

    rng = rnd.Random(0)
    port = _closed_port()
    caplog.set_level(logging.WARNING)
    for i in range(60):
        password = "".join(rng.choice(PASSWORD_CHARS) for _ in range(rng.randint(6, 24))) + "@Q" + str(i)
        user = "u" + "".join(rng.choice("abc@:") for _ in range(5))
        urls = [f"redis://:{password}@127.0.0.1:{port}/0", f"redis://{user}:{password}@127.0.0.1:{port}/0",
                f"rediss://{user}:{password}@127.0.0.1:{port}", f"redis://127.0.0.1:{port}/0?password={password}"]
        for url in urls:
            caplog.clear()
            try:
                store = VisMemoStore(remote_url=url, remote_options={"timeout_s": 0.05, "retry_s": 0})
            except ValueError as err:  # an unparseable URL: a clear error that shows no credential
                assert password not in str(err), url
                continue
            store.put(_entry("k"))
            store.flush()
            store.get("k", "fp")
            seen = caplog.text + repr(store.stats()) + safe_url(url) + repr(store.remote.url)
            assert password not in seen and password.split("@")[-1] not in seen, (url, seen)
            assert store.stats()["tiers"]["remote"]["errors"] >= 1
            store.close()


def test_a_refused_write_degrades_writes_only(server):
    """Under maxmemory with noeviction the server refuses writes (OOM); reads of what it holds go on."""
    small = _entry("small", n=4, layers=2)
    a = _store(server.url)
    a.put(small)
    a.flush()
    client = server.client()
    used = client.info("memory")["used_memory"]
    client.config_set("maxmemory", used + 64 * 1024)
    client.config_set("maxmemory-policy", "noeviction")
    b = _store(server.url, retry_s=0.1)
    assert b.put(_entry("big", n=400, layers=16, seed=1))  # stored locally; the remote write is refused
    b.flush()
    stats = b.stats()["tiers"]["remote"]
    assert stats["writes_refused"] == 1 and stats["connected"] and stats["errors"] == 0
    fresh = _store(server.url)  # a third process reads what the server holds
    assert fresh.get("small", "fp") is not None and fresh.stats()["hits_by_tier"]["remote"] == 1
    assert fresh.tier_of("big") is None


def test_a_header_naming_a_huge_size_is_a_miss_without_a_buffer_for_it(server, monkeypatch):
    """A planted header with valid checksums that claims 1 TB: refused by the value's length, nothing allocated."""
    writer = _store(server.url)
    entry = _entry("big", n=5, layers=2)
    writer.put(entry)
    writer.flush()
    client = server.client()
    data = bytearray(client.get("vismemo:blob:big"))
    header = blob.parse_header(bytes(data[: blob.HEADER_SIZE]))
    forged = blob._FIELDS.unpack(bytes(data[: blob._FIELDS.size]))
    fields = list(forged)
    fields[22] += 10**12  # total bytes (and the metadata size with it, so the header's sizes agree)
    fields[21] += 10**12
    raw = blob._FIELDS.pack(*fields)
    import zlib

    data[: blob.HEADER_SIZE] = raw + blob._HEADER_CRC.pack(zlib.crc32(raw))
    assert blob.parse_header(bytes(data[: blob.HEADER_SIZE])).total_bytes == header.total_bytes + 10**12
    client.set("vismemo:blob:big", bytes(data))
    from vismemo_hf.store import ranges

    asked = []
    real = ranges.read_buffer
    monkeypatch.setattr(ranges, "read_buffer", lambda size: asked.append(size) or real(size))
    reader = _store(server.url)
    assert reader.get("big", "fp") is None and reader.stats()["corrupt"] == 1
    assert not asked  # refused before any buffer was made


def test_a_write_the_cluster_cannot_route_is_a_fault_of_the_link_not_a_refusal(server, monkeypatch):
    """Found by ``vismemo bench soak``: CLUSTERDOWN / TRYAGAIN replies to a write were counted as refusals (a full
    server), so the down node was asked again at every write instead of being left alone for ``retry_s``."""
    import redis

    store = _store(server.url, retry_s=30.0)
    real = redis.client.Pipeline.execute

    def down(self, *args, **kwargs):
        raise redis.exceptions.ResponseError("CLUSTERDOWN The cluster is down")

    monkeypatch.setattr(redis.client.Pipeline, "execute", down)
    assert store.put(_entry("first", n=4, layers=2))
    store.flush()
    stats = store.stats()["tiers"]["remote"]
    assert stats["writes_refused"] == 0 and stats["write_failures"] == 1 and stats["errors"] == 1
    monkeypatch.setattr(redis.client.Pipeline, "execute", real)
    assert store.put(_entry("second", n=4, layers=2, seed=1))  # within retry_s: not sent at all
    store.flush()
    assert store.stats()["tiers"]["remote"]["writes_skipped"] == 1
    assert store.tier_of("second") is not None  # stored locally all the same


@pytest.mark.parametrize("which", ["index", "published"])
def test_a_shard_key_of_another_type_costs_that_shard_only(server, caplog, which):
    """Another program's value under the prefix (a string at one shard's index or stream key) made every sync fail:
    the whole tier went down and up again at every retry and published nothing. Now that shard is skipped (logged
    once) and every other shard serves."""
    client = server.client()
    client.set(f"vismemo:{which}:3", b"another program's value")
    a = _store(server.url, shards=8, retry_s=0.1)
    entries = [_entry(f"k{i}", n=5, layers=4, seed=i) for i in range(12)]
    for entry in entries:
        a.put(entry)
    a.flush()
    b = _store(server.url, shards=8, retry_s=0.1)
    shard3 = {e.key for e in entries if b.remote._shard(e.key) == 3}
    assert len(shard3) < len(entries)
    for entry in entries:
        b.candidates("fp", (1, 4, 5), entry.descriptors, 0.5, 3)  # syncs, as lookups do
    stats = b.stats()["tiers"]["remote"]
    assert stats["connected"] and stats["errors"] == 0 and stats["bad_shards"] == 1
    assert a.stats()["tiers"]["remote"]["writes"] >= len(entries) - len(shard3)
    for entry in entries:
        if entry.key not in shard3:
            assert b.tier_of(entry.key) == "remote" and torch.equal(b.get(entry.key, "fp").kv, entry.kv)
    assert caplog.text.count("shard 3's keys hold values of another type") <= 2  # once per store

"""The shared remote tier on a real local Redis Cluster (three masters on loopback ports, ``redis-cli --cluster
create``; ``.ci/run`` installs redis-server and redis-cli)."""

import json
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

from conftest import build_inputs, generate
from test_remote import _flip_bytes
from test_store import _entry

pytest.importorskip("redis", reason="the redis client is not installed (pip install -e '.[test]')")
OPTS = dict(policy="vismemo", reuse_ratio=0.5, entropy_threshold=1.0)


def _store(url, **options):
    store = VisMemoStore(remote_url=url, remote_options={"refresh_s": 0, "retry_s": 0.3, **options})
    store.set_reference("fp", ModelReference(torch.zeros(8), torch.zeros(8), 0.0))
    return store


def _remote_only(url, **options):
    store = VisMemoStore(device_bytes=0, host_bytes=0, remote_url=url,
                         remote_options={"refresh_s": 0, "retry_s": 0.3, **options})
    store.set_reference("fp", ModelReference(torch.zeros(8), torch.zeros(8), 0.0))
    return store


def _published(url, n: int = 24):
    """A store that put ``n`` small entries into the cluster, and the entries."""
    store = _store(url)
    entries = [_entry(f"key{i}", n=5, layers=2, seed=i) for i in range(n)]
    for e in entries:
        store.put(e)
    store.flush()
    return store, entries


def test_a_cluster_is_found_and_its_keys_spread_over_every_node(cluster):
    a, entries = _published(cluster.url)
    remote = a.stats()["tiers"]["remote"]
    assert remote["cluster"] and remote["writes"] == 24 and remote["write_failures"] == 0
    names = [a.remote._blob_key(e.key) for e in entries]
    shards = [a.remote._index_key(s) for s in range(a.remote.shards)]
    assert {cluster.node_of(n) for n in names} == {0, 1, 2}  # blobs on every node ...
    assert {cluster.node_of(n) for n in shards} == {0, 1, 2}  # ... and the index too
    client = cluster.client()
    assert max(client.hlen(n) for n in shards) < len(entries)  # no key holds every record
    b = _store(cluster.url)  # another process: sees every entry, exact and approximate
    assert len(b) == 24 and all(b.tier_of(e.key) == "remote" for e in entries)
    assert [k for k, _ in b.candidates("fp", (1, 4, 5), entries[7].descriptors, 0.5, 1)] == ["key7"]
    assert torch.equal(b.get("key7", "fp").kv, entries[7].kv)
    assert torch.equal(b.get_tokens("key9", "fp", torch.tensor([1, 4]), 1), entries[9].kv[[1, 4], 1:])


def test_two_processes_share_exact_and_approximate_hits_through_a_cluster(cluster):
    worker = [sys.executable, str(Path(__file__).with_name("remote_worker.py")), cluster.url]
    run = lambda role: json.loads(subprocess.run(worker + [role], capture_output=True, text=True,  # noqa: E731
                                                 check=True, timeout=300).stdout.strip().splitlines()[-1])
    writer = run("writer")
    assert writer["base"]["kind"] == "miss" and writer["stats"]["tiers"]["remote"]["cluster"]
    reader = run("reader")
    assert reader["base"]["kind"] == "exact" and reader["edit"]["kind"] == "approximate"
    assert reader["stats"]["hits_by_tier"]["remote"] == 2
    assert torch.allclose(torch.tensor(reader["base"]["scores"]), torch.tensor(reader["full_base"]["scores"]), atol=1e-4)
    assert torch.allclose(torch.tensor(reader["edit"]["scores"]), torch.tensor(reader["local_edit"]["scores"]), atol=1e-5)


def test_a_killed_node_costs_the_misses_of_its_slots_only(cluster):
    _, entries = _published(cluster.url)
    reader = _remote_only(cluster.url, retry_s=2.0)
    assert len(reader) == 24
    cluster.kill(1)
    on_dead = {e.key for e in entries if cluster.node_of(reader.remote._blob_key(e.key)) == 1}
    assert on_dead and len(on_dead) < len(entries)
    got = {e.key: reader.get(e.key, "fp") for e in entries}
    # a dead node is left alone after its first failure (retry_s), and no read waits in the client's own retries
    assert reader.stats()["tiers"]["remote"]["errors"] == 1, reader.stats()["tiers"]["remote"]
    assert {k for k, v in got.items() if v is None} == on_dead  # every other entry still served
    assert all(torch.equal(got[e.key].kv, e.kv) for e in entries if e.key not in on_dead)
    assert reader.stats()["tiers"]["remote"]["nodes_down"] == 1 and reader.stats()["corrupt"] == 0
    cluster.start(1)  # back, empty: its entries are misses, new writes to it land again (after retry_s)
    time.sleep(2.1)
    for i in range(100):  # a key that lives on the restarted node
        fresh = _entry(f"after{i}", n=5, layers=2, seed=99)
        if cluster.node_of(reader.remote._blob_key(fresh.key)) == 1:
            break
    reader.put(fresh)
    reader.flush()
    assert _remote_only(cluster.url).get(fresh.key, "fp") is not None


def test_generate_through_a_node_kill_and_restart_loses_no_answer(qwen2, pages, cluster):
    model, processor = qwen2
    stream = ["base", "noise", "edit", "shift", "base", "noise", "edit"]
    refs = {name: generate(model, build_inputs(processor, [pages[name]]), DynamicCache(), 3) for name in set(stream)}
    store = _store(cluster.url)
    for i, name in enumerate(stream):
        if i == 2:
            cluster.kill(0)  # the node the URL names
        if i == 4:
            cluster.start(0)
        cache = vismemo_hf.VisMemoCache(store=store, **OPTS)
        tokens, scores = generate(model, build_inputs(processor, [pages[name]]), cache, 3)
        if cache.events[0].kind is not HitKind.APPROXIMATE:  # misses and exact hits equal a full prefill
            assert torch.equal(tokens, refs[name][0]) and (scores - refs[name][1]).abs().max() <= 1e-4, (i, name)
    store.flush()
    assert store.stats()["tiers"]["remote"]["errors"] >= 1


def test_corrupt_and_foreign_values_in_the_cluster_are_misses(cluster):
    writer = _store(cluster.url)
    for i in range(3):
        writer.put(_entry(f"key{i}", n=5, layers=2, seed=i))
    writer.flush()
    client = cluster.client()
    _flip_bytes(client, writer.remote._blob_key("key0"), lambda h: [(2, 1)])
    client.set(writer.remote._blob_key("key1"), b"not a blob at all")
    client.hset(writer.remote._index_key(0), "junk", b"\x00" * 40)  # a foreign record: skipped
    reader = _remote_only(cluster.url)
    assert reader.get("key0", "fp") is None and reader.get("key1", "fp") is None
    assert reader.stats()["corrupt"] == 2
    assert torch.equal(reader.get("key2", "fp").kv, _entry("key2", n=5, layers=2, seed=2).kv)


def test_resharding_moves_an_entry_and_reads_follow_it(cluster):
    store = _remote_only(cluster.url)
    entry = _entry("moving", n=5, layers=2)
    store.put(entry)
    store.flush()
    name = store.remote._blob_key("moving")
    source = cluster.node_of(name)
    cluster.move_slot(name, (source + 1) % 3)  # the client's slot map is stale now: MOVED, then the new node
    assert cluster.node_of(name) == (source + 1) % 3
    assert torch.equal(store.get("moving", "fp").kv, entry.kv)
    assert torch.equal(store.get_tokens("moving", "fp", torch.tensor([0, 3]), 1), entry.kv[[0, 3], 1:])
    assert store.stats()["tiers"]["remote"]["errors"] == 0


def test_bench_store_puts_one_server_and_a_cluster_side_by_side(server, cluster, tmp_path):
    from vismemo_hf.cli import main

    args = ["bench", "store", "--tokens", "32", "--layers", "4", "--kv-heads", "2", "--head-dim", "8",
            "--embed-dim", "16", "--repeats", "1", "--trace-requests", "50", "--capacities", "5",
            "--remote", server.url, "--remote", cluster.url, "--out", str(tmp_path)]
    assert main(args) == 0
    rows = {r["tier"]: r for r in json.loads((tmp_path / "store.json").read_text())["remote"]}
    assert set(rows) == {"disk", "remote (one server)", "remote (cluster)"}
    both = rows["remote (one server)"], rows["remote (cluster)"]
    assert all(r["sparse_bytes"] == rows["disk"]["sparse_bytes"] and r["full_server_bytes"] >= r["blob_bytes"]
               for r in both)
    assert not list(cluster.client().scan_iter("vismemo-bench-*"))


def _cluster_down_in_pipeline():
    """What redis-py raises for a pipelined command a cluster cannot serve now (a node down or just restarted, the
    cluster failing over): a ``ClusterDownError`` whose text names the command first, not ``CLUSTERDOWN``."""
    from redis.exceptions import ClusterDownError

    return ClusterDownError("Command # 1 (GETRANGE vismemo:blob:k 0 279) of pipeline caused error: The cluster is down")


def test_a_cluster_that_is_down_in_a_pipeline_is_unavailability_not_a_bad_entry():
    from vismemo_hf.store.remote import RedisLink, RemoteUnavailable

    link = RedisLink("redis://127.0.0.1:1/0", 0.1, 0.3, None, [], on_back=lambda: None)

    def down():
        raise _cluster_down_in_pipeline()

    with pytest.raises(RemoteUnavailable):
        link.call(down, "vismemo:blob:k")
    assert link.counters["errors"] == 1


def test_a_read_that_meets_a_down_cluster_keeps_the_entry(server, monkeypatch):
    """Found by ``vismemo bench soak``: a GETRANGE pipeline meeting a restarting node raised ClusterDownError, which
    the store took for a corrupt blob: counted corrupt, forgotten and deleted from the server (blob and index
    record). It is the server's fault, not the entry's: a miss now, the entry kept and read once the server is
    back."""
    writer = _store(server.url)
    entry = _entry("kept", n=5, layers=2)
    writer.put(entry)
    writer.flush()
    reader = _remote_only(server.url)
    assert reader.tier_of("kept") == "remote"
    from vismemo_hf.store import remote as remote_module

    real = remote_module.RemoteTier.ranges

    def down(self, key, spans):
        raise _cluster_down_in_pipeline()

    monkeypatch.setattr(remote_module.RemoteTier, "ranges", lambda self, key, spans: reader.remote.link.call(
        lambda: down(self, key, spans), self._blob_key(key)))
    assert reader.get("kept", "fp") is None
    assert reader.stats()["corrupt"] == 0
    monkeypatch.setattr(remote_module.RemoteTier, "ranges", real)
    assert server.client().exists(reader.remote._blob_key("kept"))  # not deleted from the server
    time.sleep(0.35)  # retry_s
    assert torch.equal(reader.get("kept", "fp").kv, entry.kv)

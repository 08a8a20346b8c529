"""An approximate hit's alias K/V arrive layer by layer (``runtime/stream.py``): the consumer waits for the layer it
reads, not for the whole read, and the accelerator's schedule (staged copies on a side stream, an event per layer,
the consumer's stream waiting for it) runs here on the CPU through ``StreamOps``, with the answers of the read that
arrives at once."""

import threading
from types import SimpleNamespace

import pytest
import torch

import vismemo_hf
from vismemo_hf import HitKind
from vismemo_hf.runtime import alias, stream
from vismemo_hf.runtime.stream import LayerArrival, StreamOps, stream_layers

from conftest import build_inputs, generate


class RecordingStreams(StreamOps):
    """The accelerator's schedule on the CPU: every layer copied (staged), an event per layer, the consumer's waits
    and the side-stream sections logged; ``gates`` hold a layer's copy until released."""

    def __init__(self, gates=None, fail_at=None) -> None:
        self.log, self.gates, self.fail_at, self.sections = [], gates or {}, fail_at, 0
        self._lock = threading.Lock()

    def brings(self, source, device) -> bool:
        return True  # as from the host to an accelerator

    def side(self):
        self.sections += 1
        return super().side()

    def stage(self, host, device):
        at = len([e for e in self.log if e[0] == "stage"]) // 2  # keys and values of each layer
        gate = self.gates.get(at)
        if gate is not None:
            gate.wait(5)
        if self.fail_at == at:
            raise RuntimeError("copy failed")
        with self._lock:
            self.log.append(("stage", at))
        return host.to(device).clone()

    def record(self):
        event = ("event", sum(e[0] == "stage" for e in self.log) // 2 - 1)
        self.log.append(("record", event))
        return event

    def wait(self, event) -> None:
        with self._lock:
            self.log.append(("wait", event))


def _layers(n=4):
    keys, values = torch.randn(n, 2, 5, 3), torch.randn(n, 2, 5, 3)
    return keys, values, torch.empty_like(keys), torch.empty_like(values)


def test_a_consumer_waits_for_its_layer_only_and_its_stream_waits_for_that_layers_event():
    gates = {2: threading.Event()}
    ops = RecordingStreams(gates)
    keys, values, keys_out, values_out = _layers()
    arrival = LayerArrival(4, ops)
    worker = threading.Thread(target=stream_layers, args=(keys, values, torch.device("cpu"), lambda k: k + 1, arrival,
                                                         keys_out, values_out))
    worker.start()
    assert arrival.wait(0) and arrival.wait(1)  # the first layers, while layer 2's copy is held
    assert not arrival.ready(2) and not arrival.ready(3)
    gates[2].set()
    assert arrival.wait(3)
    worker.join()
    torch.testing.assert_close(keys_out, keys + 1)  # the keys moved, the values as read
    torch.testing.assert_close(values_out, values)
    waits = [e[1] for e in ops.log if e[0] == "wait"]
    assert waits == [("event", 0), ("event", 1), ("event", 3)]  # each on its own layer's event
    assert arrival.waited_ms > 0  # layer 3 was waited for
    assert ops.sections == 4  # every layer's copies in the side stream's section


def test_a_copy_that_fails_fails_its_layer_and_the_later_ones_not_the_earlier():
    keys, values, keys_out, values_out = _layers()
    arrival = LayerArrival(4, RecordingStreams(fail_at=2))
    with pytest.raises(RuntimeError, match="copy failed"):
        stream_layers(keys, values, torch.device("cpu"), lambda k: k, arrival, keys_out, values_out)
    assert arrival.wait(1) and not arrival.wait(2) and not arrival.wait(3)
    fetched = alias.FetchedKV(torch.arange(5), 0, keys_out, values_out, arrival)
    torch.testing.assert_close(fetched.layer(0)[1], values[0])
    with pytest.raises(RuntimeError, match="layer 2"):
        fetched.layer(2)


def _hit(model, processor, pages, store, streamed: bool, monkeypatch, ops=None):
    with monkeypatch.context() as m:
        if not streamed:
            m.setattr(alias.AliasReader, "_one_device", lambda self, first: None)  # one read, all layers at once
        elif ops is not None:
            m.setattr(alias, "streams_for", lambda device: ops)
        cache = vismemo_hf.VisMemoCache(store=store, policy="cacheblend", store_misses=False)  # stays approximate
        _, scores = generate(model, build_inputs(processor, [pages["edit"]], prefix="Look: "), cache, 3)
    return cache.events[0], scores


def test_a_hit_read_layer_by_layer_answers_as_one_read_at_once(tiny, pages, monkeypatch):
    """The alias is stored after another text (its keys move to this request's positions on the fetch thread); the
    streamed reads, on the host's schedule and on the accelerator's, give the logits of the read that arrives at
    once, and the accelerator's consumer waited on each layer's event before reading it."""
    model, processor = tiny
    store = vismemo_hf.VisMemoStore()
    generate(model, build_inputs(processor, [pages["base"]]), vismemo_hf.VisMemoCache(store=store), 1)
    store.flush()
    once, expected = _hit(model, processor, pages, store, False, monkeypatch)
    host, got = _hit(model, processor, pages, store, True, monkeypatch)
    ops = RecordingStreams()
    device, on_device = _hit(model, processor, pages, store, True, monkeypatch, ops)
    assert once.kind is HitKind.APPROXIMATE and once.reused > 0 and once.fallback is None
    for event in (host, device):
        assert (event.kind, event.reused, event.recomputed) == (once.kind, once.reused, once.recomputed)
        assert "fetch_wait" in event.timings and "fetch" in event.timings
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(on_device, expected, rtol=0, atol=0)
    staged = {e[1] for e in ops.log if e[0] == "stage"}
    assert staged == set(range(len(staged))) and len(staged) >= model.config.text_config.num_hidden_layers - 1
    waited = [e[1][1] for e in ops.log if e[0] == "wait"]
    assert waited and set(waited) <= staged  # the consumer waited on the events of layers it read


def test_streams_for_picks_the_host_schedule_without_an_accelerator():
    assert type(stream.streams_for(torch.device("cpu"))) is StreamOps


def test_the_latency_benchmarks_disk_store_serves_hits_from_the_disk_tier_and_is_removed_with_the_store(qwen2, pages):
    """``vismemo bench latency --store-device disk``: the alias is read from the disk tier alone (what its
    ``fetch_wait`` measures), and the temporary folder goes with the store."""
    import gc
    import os

    from vismemo_hf.bench.latency import new_store

    model, processor = qwen2
    store = new_store("disk")
    folder = store.bench_folder.name
    generate(model, build_inputs(processor, [pages["base"]]), vismemo_hf.VisMemoCache(store=store), 1)
    store.flush()
    cache = vismemo_hf.VisMemoCache(store=store, policy="cacheblend")
    generate(model, build_inputs(processor, [pages["edit"]]), cache, 1)
    assert cache.events[0].kind is HitKind.APPROXIMATE and "fetch_wait" in cache.events[0].timings
    hits = store.stats()["hits_by_tier"]
    assert hits["disk"] >= 1 and sum(hits.values()) == hits["disk"], hits
    store.flush()  # a write still in flight (the edited page's completed entry) holds its store until it lands
    del store, cache
    gc.collect()
    assert not os.path.exists(folder)


class _Store:
    """A store whose entry holds K/V value ``100 * layer + token`` for each (token, layer); ``None`` reads nothing."""

    def __init__(self, layers: int, empty: bool = False) -> None:
        self.layers, self.empty, self.reads = layers, empty, []

    def get_tokens(self, key, owner, rows, first_layer):
        self.reads.append((rows.tolist(), first_layer))
        if self.empty:
            return None
        layer = torch.arange(first_layer, self.layers, dtype=torch.float32)
        kv = 100 * layer[None, :] + rows.float()[:, None]  # (T, L')
        return kv[:, :, None, None, None].expand(-1, -1, 2, 1, 2).clone()  # (T, L', 2, H=1, D=2)


def _reader(store, layers=4):
    adapter = SimpleNamespace(num_layers=layers, layer_device=lambda layer: "cpu",
                              move_keys=lambda keys, delta, shift: keys)
    match = SimpleNamespace(kind=HitKind.APPROXIMATE, alias_offset=0,
                            alias=SimpleNamespace(key="k", shift=(0, 0), stored_rows=lambda tokens: tokens))
    return alias.AliasReader(adapter, store, [match], "owner")


def _plan(reuse, first):
    reuse = torch.tensor(reuse)
    return SimpleNamespace(reuse=reuse, reuse_from=torch.full_like(reuse, first))


@pytest.mark.parametrize("prefetch, plan", [
    (([0, 1, 2], 2), ([0, 1], 1)),  # read from a later layer than the plan reuses from
    (([0, 1], 1), ([0, 1, 3], 2)),  # read for fewer tokens than the plan reuses
])
def test_a_prefetch_that_does_not_cover_the_plan_is_read_again_for_it(prefetch, plan):
    """``AliasReader.bind``: the plan reuses tokens from layers the prefetch did not read, or tokens it did not
    read; the alias is read again for the plan, and each reused token's K/V at every layer are that token's at that
    layer (not another layer's through a negative index, nor another token's)."""
    store = _Store(4)
    reader = _reader(store)
    assert reader.fetch(0, torch.tensor(prefetch[0]), prefetch[1], offset=0)
    reuse, first = plan
    assert reader.bind(0, _plan(reuse, first), offset=0)
    assert store.reads == [(prefetch[0], prefetch[1]), (reuse, first)]
    reads = reader._reads[0]
    fetched = reads.fetched
    for layer in range(first, 4):
        keys, values = fetched.layer(layer - fetched.first_layer)
        picked = keys[:, reads.reuse_index]  # (H, reused, D)
        assert torch.equal(picked[0, :, 0], 100.0 * layer + torch.tensor(reuse, dtype=torch.float32))
        assert torch.equal(values[:, reads.reuse_index], picked)


def test_a_prefetch_that_covers_the_plan_is_not_read_again():
    store = _Store(4)
    reader = _reader(store)
    assert reader.fetch(0, torch.tensor([0, 1, 2, 3]), 1, offset=0)
    assert reader.bind(0, _plan([1, 3], 2), offset=0)
    assert store.reads == [([0, 1, 2, 3], 1)]
    assert torch.equal(reader._reads[0].reuse_index, torch.tensor([1, 3]))


def test_an_alias_that_reads_nothing_cannot_be_bound():
    """A read that gives nothing (a store fault, an entry gone) makes ``fetch`` and ``bind`` say so: the image is
    then computed, never bound to K/V that are not there."""
    store = _Store(4, empty=True)
    reader = _reader(store)
    assert not reader.fetch(0, torch.tensor([0, 1]), 1, offset=0)
    assert not reader.bind(0, _plan([0, 1], 1), offset=0)
    assert not reader.wait(0)

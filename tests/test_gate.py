"""The approximate-lookup gate (``runtime.gate``, ``VisMemoCache(approximate="auto")``): approximate lookups go on
while what their hits save outweighs what their misses lose on the model's own requests, and stop (but for a
request now and then, ever more rarely) where they do not; exact hits never depend on it."""

import pytest
import torch

import vismemo_hf
from vismemo_hf import HitKind
from vismemo_hf.runtime.gate import ApproximateGate, Sample, gate_for

from conftest import build_inputs, generate, noise_image, page_set, stored


def _miss(ms=100.0, tokens=1000, lookup_ms=10.0, looked=True):
    return Sample(looked=looked, hit=False, tokens=tokens, ms=ms, lookup_ms=lookup_ms)


def _hit(ms, tokens=1000, lookup_ms=10.0):
    return Sample(looked=True, hit=True, tokens=tokens, ms=ms, lookup_ms=lookup_ms)


def _looks(gate, n):
    return [gate.looks() for _ in range(n)]


def test_open_until_enough_is_measured():
    gate = ApproximateGate()
    assert gate.is_open() and gate.gain_ms() is None
    for _ in range(gate.MIN_LOOKED - 1):
        gate.record(_miss(lookup_ms=90.0))  # every miss lost most of its time to the lookup
    assert gate.is_open(), "fewer than MIN_LOOKED looking requests decide nothing"


def test_hits_that_save_keep_it_open():
    gate = ApproximateGate()
    for _ in range(4):
        gate.record(_miss(ms=100.0, lookup_ms=10.0))  # 0.09 ms a token of prefill
    for _ in range(4):
        gate.record(_hit(ms=30.0))  # a hit saves 60 of the miss's 90 ms
    assert gate.gain_ms() > 0 and gate.is_open()
    assert all(_looks(gate, 20))


def test_hits_slower_than_a_miss_close_it_and_it_explores():
    gate = ApproximateGate()
    for _ in range(3):
        gate.record(_miss(ms=20.0, lookup_ms=8.0))
    for _ in range(5):
        gate.record(_hit(ms=30.0))  # a hit takes longer than the prefill it replaces
    assert gate.gain_ms() < 0 and not gate.is_open()
    looks = _looks(gate, 2 * gate.MAX_EXPLORE + gate.EXPLORE * 7)
    at = [i + 1 for i, looked in enumerate(looks) if looked]
    gaps = [b - a for a, b in zip([0, *at], at)]
    assert gaps[:4] == [gate.EXPLORE, 2 * gate.EXPLORE, 4 * gate.EXPLORE, gate.MAX_EXPLORE], \
        "a closed gate explores after EXPLORE requests, then ever more rarely, up to MAX_EXPLORE"
    assert all(gap == gate.MAX_EXPLORE for gap in gaps[3:])


def test_an_opened_gate_explores_often_again():
    gate = ApproximateGate()
    for _ in range(3):
        gate.record(_miss(ms=20.0, lookup_ms=8.0))
    for _ in range(5):
        gate.record(_hit(ms=30.0))
    _looks(gate, 4 * gate.MAX_EXPLORE)  # explored ever more rarely
    assert gate.interval == gate.MAX_EXPLORE
    for _ in range(gate.WINDOW):
        gate.record(_hit(ms=1.0))  # the traffic changed: hits pay
    assert all(_looks(gate, 3)) and gate.interval == 0
    for _ in range(gate.WINDOW):
        gate.record(_hit(ms=30.0))  # and changed back
    looks = _looks(gate, gate.EXPLORE)
    assert looks[-1] and not any(looks[:-1]), "closed again, it explores after EXPLORE requests first"


def test_misses_that_lose_their_lookup_close_it():
    gate = ApproximateGate()
    for _ in range(gate.MIN_LOOKED + 2):
        gate.record(_miss(ms=20.0, tokens=256, lookup_ms=12.0))  # a cheap prefill: the lookup is most of it
    assert not gate.is_open()


def test_misses_of_an_expensive_prefill_leave_it_open():
    gate = ApproximateGate()
    for _ in range(gate.MIN_LOOKED + 2):
        gate.record(_miss(ms=5000.0, tokens=1024, lookup_ms=12.0))  # half a prefill saved pays many lookups
    assert gate.is_open()


def test_evidence_follows_the_traffic():
    """The window forgets: a gate closed by cheap misses opens again once hits that pay fill it."""
    gate = ApproximateGate()
    for _ in range(gate.WINDOW):
        gate.record(_miss(ms=20.0, tokens=256, lookup_ms=12.0))
    assert not gate.is_open()
    for _ in range(gate.WINDOW):
        gate.record(_hit(ms=2.0, tokens=256))
    assert gate.is_open()


def test_unlooked_requests_only_measure_the_rate():
    gate = ApproximateGate()
    for _ in range(10):
        gate.record(_miss(looked=False))
    assert len(gate.looked) == 0 and len(gate.rates) == 10 and gate.is_open()


def _closed_gate():
    gate = ApproximateGate()
    for _ in range(gate.MIN_LOOKED):
        gate.record(_hit(ms=1e6, tokens=16))  # hits far slower than any prefill
    for _ in range(gate.MIN_MISSES):
        gate.record(_miss(ms=1.0, tokens=16, lookup_ms=0.5))
    assert not gate.is_open()
    return gate


@pytest.mark.parametrize("mode", ["auto", "always", "never"])
def test_modes_on_an_edited_page(mode):
    """A closed gate (``auto``) and ``never`` serve an edited page of a stored one as a miss, with plain's answer;
    ``always`` serves it approximately. The same page again is an exact hit in every mode."""
    model, processor = _fresh_tiny()
    pages = page_set()
    store = stored(model, processor, pages["base"], approximate="always")
    cache = vismemo_hf.VisMemoCache(store=store, approximate=mode)
    if mode == "auto":
        adapter = model._vismemo
        adapter.__dict__.setdefault("_approximate_gates", {})[repr(cache.policy)] = gate = _closed_gate()
        gate.requests = 0  # the next request (1) is not an exploring one
    inputs = build_inputs(processor, [pages["edit"]])
    tokens, _ = generate(model, inputs, cache)
    want = HitKind.APPROXIMATE if mode == "always" else HitKind.MISS
    assert cache.events[0].kind is want
    if want is HitKind.MISS:
        plain_tokens, _ = generate(model, inputs, vismemo_hf.VisMemoCache(store=vismemo_hf.VisMemoStore()))
        assert torch.equal(tokens, plain_tokens)
    again = vismemo_hf.VisMemoCache(store=store, approximate=mode)
    generate(model, build_inputs(processor, [pages["base"]]), again)
    assert again.events[0].kind is HitKind.EXACT


def test_a_prefill_is_measured_once():
    model, processor = _fresh_tiny()
    cache = vismemo_hf.VisMemoCache(store=vismemo_hf.VisMemoStore(), approximate="auto")
    generate(model, build_inputs(processor, [page_set()["base"]]), cache, new_tokens=4)
    gate = gate_for(model._vismemo, repr(cache.policy))
    assert gate.requests == 1 and len(gate.looked) == 1 and len(gate.rates) == 1
    sample = gate.looked[0]
    assert sample.looked and not sample.hit and sample.ms > 0 and 0 <= sample.lookup_ms <= sample.ms
    assert sample.tokens == build_inputs(processor, [page_set()["base"]])["input_ids"].numel()


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="approximate"):
        vismemo_hf.VisMemoCache(approximate="sometimes")


def _fresh_tiny():
    """A tiny model of its own, enabled, and its processor (the gates live on the enabled model: a shared one would
    carry other tests' evidence)."""
    from vismemo_hf.testing import tiny_model

    model, processor = tiny_model("qwen2_vl", seed=0)
    return vismemo_hf.enable(model), processor


def test_a_hit_computed_in_full_saved_nothing():
    """Approximate hits that the routing computes in full (another context before each: an agent's next screen after
    the last one) save nothing: they count as misses that looked, and the gate closes."""
    gate = ApproximateGate()
    for _ in range(gate.MIN_MISSES):
        gate.record(_miss(ms=20.0, tokens=256, lookup_ms=0.0, looked=False))
    for _ in range(gate.MIN_LOOKED):
        gate.record(Sample(looked=True, hit=False, tokens=512, ms=30.0, lookup_ms=5.0, exact=True))
    assert not gate.is_open()
    assert len(gate.rates) == gate.MIN_MISSES, "a request with an exact hit says nothing of a miss's prefill rate"


def test_requests_with_an_exact_hit_and_a_looked_up_image_are_evidence():
    """An agent's window: the first screen an exact hit, the next one looked up. The gate hears of it (with its
    exact hit marked), and a hit computed in full is no hit."""
    model, processor = _fresh_tiny()
    pages = page_set()
    store = stored(model, processor, pages["base"], approximate="always")
    cache = vismemo_hf.VisMemoCache(store=store, approximate="auto")
    generate(model, build_inputs(processor, [pages["base"], noise_image(3)]), cache, new_tokens=1)
    assert [e.kind for e in cache.events][0] is HitKind.EXACT
    gate = gate_for(model._vismemo, repr(cache.policy))
    sample = gate.looked[-1]
    assert sample.looked and sample.exact and not sample.hit

"""Reused K/V is really read, moved to the new offset, and only ever from the same model."""

import pytest
import torch
from transformers import DynamicCache

import vismemo_hf
from vismemo_hf import HitKind

from conftest import _enabled_tiny, build_inputs, generate, noise_image, stored


def _layer0_visual_keys(model, inputs):
    cache = DynamicCache()
    with torch.no_grad():
        model(**inputs, cache=cache, use_cache=True)
    visual = (inputs["input_ids"][0] == model.config.image_token_id).nonzero().flatten()
    return cache.layers[0].keys[0][:, visual]  # (H, N, D)


def test_rerotated_keys_equal_fresh_keys_at_another_offset(tiny, pages):
    model, processor = tiny
    store = vismemo_hf.VisMemoStore()
    short = build_inputs(processor, [pages["base"]])
    cache = vismemo_hf.VisMemoCache(store=store)
    generate(model, short, cache, 1)
    entry = store.get(cache.events[0].key, model._vismemo.fingerprint)
    for prefix in ["a much longer text before the image, " * 3, "x"]:
        longer = build_inputs(processor, [pages["base"]], prefix=prefix)
        fresh = _layer0_visual_keys(model, longer)
        start = (longer["input_ids"][0] == model.config.image_token_id).nonzero()[0, 0]
        if hasattr(model.model, "get_rope_index"):  # M-RoPE: the image's t coordinate
            positions, _ = model.model.get_rope_index(longer["input_ids"], longer["mm_token_type_ids"],
                                                      image_grid_thw=longer["image_grid_thw"])
            delta = int(positions[0, 0, start]) - entry.offset
        else:  # 1-D positions: its column
            delta = int(start) - entry.offset
        assert delta != 0
        moved = model._vismemo.move_keys(entry.kv[:, 0, 0].transpose(0, 1), delta)  # the family's own rotation
        assert (moved - fresh).abs().max() <= 1e-5
        assert (entry.kv[:, 0, 0].transpose(0, 1) - fresh).abs().max() > 1e-3  # the rotation mattered


def test_exact_hit_with_other_prefix_is_flagged_and_checked(tiny, pages):
    """After another text the stored K/V carry the old context: `vismemo` reuses them as they are, the default
    recomputes the deviating tokens and lands much closer to a full prefill."""
    model, processor = tiny
    store = stored(model, processor, pages["base"])
    inputs = build_inputs(processor, [pages["base"]], prefix="Please look carefully. ")
    _, ref = generate(model, inputs, DynamicCache(), 1)
    errors = {}
    for policy in ("vismemo", "attend-deviate"):
        cache = vismemo_hf.VisMemoCache(store=store, policy=policy)
        _, scores = generate(model, inputs, cache, 1)
        event = cache.events[0]
        assert event.kind is HitKind.EXACT and event.prefix_changed
        assert (event.recomputed == 0) == (policy == "vismemo")
        errors[policy] = float((scores - ref).abs().max())
    assert errors["vismemo"] > 1e-4  # the old context shows
    assert errors["attend-deviate"] < 0.1 * errors["vismemo"], errors


def test_perturbing_the_stored_alias_changes_the_output(qwen2, pages):
    model, processor = qwen2
    store = vismemo_hf.VisMemoStore(prefix_bytes=0)  # the image's entry serves it, not a prefix
    inputs = build_inputs(processor, [pages["base"]])
    first = vismemo_hf.VisMemoCache(store=store)
    generate(model, inputs, first, 1)
    _, clean = generate(model, inputs, vismemo_hf.VisMemoCache(store=store), 1)
    entry = store.get(first.events[0].key, model._vismemo.fingerprint)
    entry.kv[:, 3:] += 0.5 * torch.randn_like(entry.kv[:, 3:])
    cache = vismemo_hf.VisMemoCache(store=store)
    _, dirty = generate(model, inputs, cache, 1)
    assert cache.events[0].kind is HitKind.EXACT
    assert (dirty - clean).abs().max() > 1e-3


def test_approximate_hit_reads_reused_tokens(qwen2, pages):
    model, processor = qwen2
    store = vismemo_hf.VisMemoStore()
    first = vismemo_hf.VisMemoCache(store=store)
    generate(model, build_inputs(processor, [pages["base"]]), first, 1)
    inputs = build_inputs(processor, [pages["edit"]])
    opts = dict(store=store, policy="vismemo", recompute_ratio=0.0, reuse_ratio=0.5, entropy_threshold=1.0,
                guard_cosine=None, store_misses=False)  # the edited page never becomes an entry of its own
    c1 = vismemo_hf.VisMemoCache(**opts)
    _, clean = generate(model, inputs, c1, 1)
    assert c1.events[0].reused > 0
    before = store.stats()["bytes_read_sparse"]
    entry = store.get(first.events[0].key, model._vismemo.fingerprint)
    entry.kv[:, 3:] += 0.5 * torch.randn_like(entry.kv[:, 3:])
    c2 = vismemo_hf.VisMemoCache(**opts)
    _, dirty = generate(model, inputs, c2, 1)
    assert c2.events[0].kind is HitKind.APPROXIMATE and c2.events[0].alias == first.events[0].key
    assert store.stats()["bytes_read_sparse"] > before
    assert (dirty - clean).abs().max() > 1e-3


def test_miss_then_same_request_is_exact_and_other_weights_never_hit(pages):
    model, processor = _enabled_tiny("qwen2_vl")
    other, _ = _enabled_tiny("qwen2_vl", seed=1)
    assert other._vismemo.fingerprint != model._vismemo.fingerprint
    store = vismemo_hf.VisMemoStore()
    inputs = build_inputs(processor, [pages["base"]])
    kinds = []
    for m in (model, model, other, other):
        cache = vismemo_hf.VisMemoCache(store=store)
        generate(m, inputs, cache, 1)
        kinds.append(cache.events[0].kind)
    assert kinds == [HitKind.MISS, HitKind.EXACT, HitKind.MISS, HitKind.EXACT]
    # the edited page is approximate for each model only against its own entry
    cache = vismemo_hf.VisMemoCache(store=store)
    generate(other, build_inputs(processor, [pages["edit"]]), cache, 1)
    assert cache.events[0].kind is HitKind.APPROXIMATE
    alias = store.peek(cache.events[0].alias, other._vismemo.fingerprint)
    assert alias is not None and store.peek(alias.key, model._vismemo.fingerprint) is None


@pytest.mark.approximate
def test_an_image_served_approximately_is_an_exact_hit_the_next_time(tiny, pages):
    """An approximate hit's image becomes an entry of its own, completed off the request's path (its tokens computed
    in full over the context before it): the next request with it is an exact hit, and its answer and first-token
    scores are plain transformers'."""
    from transformers import DynamicCache

    model, processor = tiny
    store = stored(model, processor, pages["base"])
    inputs = build_inputs(processor, [pages["edit"]], prefix="Read the form.")
    first = vismemo_hf.VisMemoCache(store=store)
    generate(model, inputs, first, 1)
    assert first.events[0].kind is HitKind.APPROXIMATE
    store.flush()
    again = vismemo_hf.VisMemoCache(store=store)
    tokens, scores = generate(model, inputs, again, 3)
    assert again.events[0].kind is HitKind.EXACT and again.events[0].found_by in ("key", "prefix")
    plain_tokens, plain_scores = generate(model, inputs, DynamicCache(), 3)
    assert torch.equal(tokens, plain_tokens) and (scores - plain_scores).abs().max() <= 1e-4
    other = vismemo_hf.VisMemoCache(store=store)
    generate(model, build_inputs(processor, [pages["edit"]], question="Which row holds 9999?"), other, 1)
    assert other.events[0].kind is HitKind.EXACT


def test_an_image_whose_entry_is_still_being_written_does_not_wait_for_it(tiny, pages):
    """An agent keeping two screens: the last request's screen, its entry still being written, comes after another
    screen now. The routing computes it in full (another context), so the request takes its encoder output from
    the announcement and does not wait for the write; the same image in its own context is an exact hit on the
    announcement's K/V, again without waiting, and equal to plain transformers."""
    import threading
    import time

    model, processor = tiny
    store = vismemo_hf.VisMemoStore(prefix_bytes=0)
    release = threading.Event()
    store.writer.submit(lambda: release.wait(20))  # every write after it stays pending until released
    try:
        first = vismemo_hf.VisMemoCache(store=store, approximate="never")
        generate(model, build_inputs(processor, [pages["base"]]), first, 1)
        assert store.pending_image(first.events[0].key) is not None  # announced, not written yet
        moved = build_inputs(processor, [pages["noise"], pages["base"]])
        cache = vismemo_hf.VisMemoCache(store=store, approximate="never")
        waited, t0 = store.writer.wait_ms, time.perf_counter()
        tokens, scores = generate(model, moved, cache, 2)
        assert time.perf_counter() - t0 < 10 and store.writer.wait_ms == waited, "waited for the write"
        assert [e.kind for e in cache.events] == [HitKind.MISS, HitKind.EXACT]
        assert cache.events[1].fallback == "context" and cache.events[1].reused == 0
        plain_tokens, plain_scores = generate(model, moved, DynamicCache(), 2)
        assert torch.equal(tokens, plain_tokens) and (scores - plain_scores).abs().max() <= 1e-4
        same = build_inputs(processor, [pages["base"]], question="What is the value of row 2?")
        again = vismemo_hf.VisMemoCache(store=store, approximate="never")
        t0 = time.perf_counter()
        tokens, scores = generate(model, same, again, 2)
        assert time.perf_counter() - t0 < 10 and store.writer.wait_ms == waited, "waited for the write"
        assert store.pending_image(first.events[0].key) is not None  # still not written
        assert again.events[0].kind is HitKind.EXACT and again.events[0].reused == again.events[0].n_tokens
        plain_tokens, plain_scores = generate(model, same, DynamicCache(), 2)
        assert torch.equal(tokens, plain_tokens) and (scores - plain_scores).abs().max() <= 1e-4
        release.set()
        store.flush()  # once written, the entry serves the same hit
        stored = vismemo_hf.VisMemoCache(store=store, approximate="never")
        assert torch.equal(generate(model, same, stored, 2)[0], plain_tokens)
        assert stored.events[0].kind is HitKind.EXACT and stored.events[0].reused == stored.events[0].n_tokens
    finally:
        release.set()
        store.flush()


def test_an_entry_with_non_finite_k_v_is_not_served_before_its_write(tiny, pages, monkeypatch):
    """An announced entry whose K/V are not finite is never an exact hit's: the request reads as usual (and the
    write, which refuses them, leaves a miss)."""
    from vismemo_hf.runtime import writeback

    model, processor = tiny
    store = vismemo_hf.VisMemoStore(prefix_bytes=0)
    gather = writeback.image_kv
    monkeypatch.setattr(writeback, "image_kv", lambda layers, match: gather(layers, match) * float("nan"))
    inputs = build_inputs(processor, [pages["base"]])
    generate(model, inputs, vismemo_hf.VisMemoCache(store=store, approximate="never"), 1)
    again = vismemo_hf.VisMemoCache(store=store, approximate="never")
    tokens, _ = generate(model, inputs, again, 2)
    assert again.events[0].kind is HitKind.MISS
    assert torch.equal(tokens, generate(model, inputs, DynamicCache(), 2)[0])
    store.flush()


@pytest.mark.approximate
def test_a_candidate_still_being_written_is_passed_over_where_it_could_give_nothing(tiny, pages):
    """The next screen of an agent keeping two, the last one's entry still being written: an approximate hit on it
    after another context would be computed in full, so the lookup does not wait to read it and the screen is a
    miss with plain's answer; once written, the same request finds it (and computes it in full after the change)."""
    import threading
    import time

    model, processor = tiny
    store = vismemo_hf.VisMemoStore(prefix_bytes=0)
    release = threading.Event()
    store.writer.submit(lambda: release.wait(20))
    other = noise_image(1, size=(112, 112))  # another grid: never a candidate of the stored page
    moved = build_inputs(processor, [other, pages["edit"]])
    try:
        generate(model, build_inputs(processor, [pages["base"]]), vismemo_hf.VisMemoCache(store=store), 1)
        cache = vismemo_hf.VisMemoCache(store=store, approximate="always", store_misses=False)
        waited, t0 = store.writer.wait_ms, time.perf_counter()
        tokens, scores = generate(model, moved, cache, 2)
        assert time.perf_counter() - t0 < 10 and store.writer.wait_ms == waited, "waited for the write"
        assert [e.kind for e in cache.events] == [HitKind.MISS, HitKind.MISS]
        plain_tokens, plain_scores = generate(model, moved, DynamicCache(), 2)
        assert torch.equal(tokens, plain_tokens) and (scores - plain_scores).abs().max() <= 1e-4
    finally:
        release.set()
        store.flush()
    written = vismemo_hf.VisMemoCache(store=store, approximate="always", store_misses=False)
    generate(model, moved, written, 1)
    assert written.events[1].kind is HitKind.APPROXIMATE and written.events[1].fallback == "context"


def test_a_prefill_that_reuses_nothing_runs_as_the_model_runs_it(tiny, pages, monkeypatch):
    """A screen that moved in an agent's window (another image before it now) is an exact hit the routing computes in
    full: nothing of the prefill is reused, so the model's own forward runs it as a miss's (no prefill runner), its
    event says why it was computed in full, and the answer is plain transformers'."""
    from vismemo_hf.runtime import hooks

    model, processor = tiny
    store = vismemo_hf.VisMemoStore(prefix_bytes=0)
    generate(model, build_inputs(processor, [pages["base"]]), vismemo_hf.VisMemoCache(store=store), 1)
    store.flush()

    def runner(*args, **kwargs):
        raise AssertionError("the prefill runner ran a prefill that reuses nothing")

    monkeypatch.setattr(hooks, "run_prefill", runner)
    moved = build_inputs(processor, [pages["noise"], pages["base"]])
    cache = vismemo_hf.VisMemoCache(store=store, approximate="never")
    tokens, scores = generate(model, moved, cache, 3)
    assert [e.kind for e in cache.events] == [HitKind.MISS, HitKind.EXACT]
    assert cache.events[1].fallback == "context" and cache.events[1].recomputed == cache.events[1].n_tokens
    plain_tokens, plain_scores = generate(model, moved, DynamicCache(), 3)
    assert torch.equal(tokens, plain_tokens) and (scores - plain_scores).abs().max() <= 1e-4
    assert store.stats()["fallbacks"]["context"] == 1  # counted as every fallback is

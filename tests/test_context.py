"""Reuse whatever came before the image and however little the page changed (docs/METHOD.md §3, §8.7-8.9): the
context check on approximate hits, its probes and the rewind to a full computation, the reading-order dependents of a
local edit, warped copies computed in full, and ``vismemo report context``'s rows."""

import math
import random

import pytest
import torch
from transformers import DynamicCache

import vismemo_hf
from vismemo_hf.core.context import SIZE, SPAN, context_change, context_sketch
from vismemo_hf.core.features import thumb_per_token, thumbnail, token_grid
from vismemo_hf.core.plan import HitKind, ImageFeatures, ImagePlan, WarmupSignals
from vismemo_hf.core.thresholds import MAX_DRIFT, local_drift
from vismemo_hf.eval import context, docpage, docqa_base
from vismemo_hf.policies.attend_deviate import AttendDeviatePolicy
from vismemo_hf.policies.base import MIN_PROBES, reading_dependents
from vismemo_hf.runtime.verify import checkpoints


@pytest.fixture(scope="module")
def base_reader():
    from vismemo_hf.eval.loading import load_model

    model, processor = load_model(docqa_base.MODEL_NAME)
    plain, _ = load_model(docqa_base.MODEL_NAME)  # never enabled
    vismemo_hf.enable(model)
    return model, plain, processor


def _signals(check: torch.Tensor, prefix_changed=True, warmup=None) -> WarmupSignals:
    """Signals whose check-layer K + V relative deviation is ``check`` (N,) (K and V each half of it)."""
    n = check.numel()
    cached = torch.ones(1, n, 1)
    fresh = cached + (check / 2).sqrt().reshape(1, n, 1)
    zeros = torch.zeros(1, n) if warmup is None else warmup[None]
    return WarmupSignals(key_deviation=zeros / 2, value_deviation=zeros / 2, fresh_kv=(fresh, fresh.clone()),
                         cached_kv=(cached, cached.clone()), prefix_changed=prefix_changed)


def test_the_context_check_recomputes_what_moved_and_spreads_probes_over_the_rest():
    policy = AttendDeviatePolicy()
    n = 100
    check = torch.linspace(0.0, 0.004, n)  # below context.tolerance everywhere
    check[[5, 50, 93]] = torch.tensor([0.5, 0.02, 0.01])  # past it
    recompute, probes = policy.context_recompute(_signals(check), n)
    top = set(torch.sort(check, descending=True).indices[: math.ceil(0.15 * n)].tolist())
    assert top <= set(recompute.tolist()) and {5, 50, 93} <= top
    assert probes.numel() == max(MIN_PROBES, math.ceil(policy.context.probe_share * n))
    assert not set(probes.tolist()) & top and set(probes.tolist()) <= set(recompute.tolist())
    rest = torch.sort(check, descending=True).indices[len(top):]
    assert int(rest[0]) in probes.tolist() and int(rest[-1]) in probes.tolist()  # the rest's every rank
    many = torch.full((n,), 0.02)  # the context moved every token: compute the image in full
    assert policy.context_recompute(_signals(many), n) is None
    assert AttendDeviatePolicy(context={"miss_ratio": 1.0}).context_recompute(_signals(many), n)[0].numel() == n


def test_a_context_sketch_counts_the_tokens_two_texts_differ_in():
    ids = torch.arange(100, 140)
    stored = context_sketch(ids, [], b"key")

    def change(new, earlier=(), key=b"key"):
        return context_change(stored, context_sketch(new, list(earlier), key))

    assert change(torch.cat([ids[:10], torch.tensor([7, 8, 9]), ids[10:]])) == 3  # three inserted
    replaced = ids.clone()
    replaced[20] = 5
    assert change(replaced) == 1
    assert change(ids[:-2]) == 2 and change(torch.cat([ids, torch.tensor([1])])) == 1  # next to the image
    assert change(torch.tensor([1, 2, 3])) == 40 and change(torch.zeros(0, dtype=torch.long)) == 40
    assert change(ids, ["another image"]) is None  # other images before: not a count of text tokens
    assert change(replaced, key=b"other") == 40  # another key shares no run: nothing known in common
    assert context_change(None, stored) is None and context_change(stored, stored) is None
    long = torch.arange(1000, 1000 + 3 * SPAN)
    middle = long.clone()
    middle[SPAN + 5] = 1  # beyond both spans: every token between them counts (an upper bound)
    assert context_change(context_sketch(long, []), context_sketch(middle, [])) == SPAN
    assert stored.shape == (SIZE,) and not set(ids.tolist()) & set(stored[2:].tolist())  # hashes, not the ids


def test_a_small_context_change_recomputes_the_top_share_and_verifies_the_rest_loosely():
    """A change of a few tokens lifts the check layer's deviation of most tokens: it is not a reason to compute
    the image in full, the probes and the confidence guard judge it; a larger or unknown change still is."""
    policy = AttendDeviatePolicy()
    n = 100
    signals = _signals(torch.full((n,), 0.02))  # every token past context.tolerance
    signals.context_change = 3
    recompute, probes = policy.context_recompute(signals, n)
    assert recompute.numel() - probes.numel() == math.ceil(policy.context.recompute_ratio * n) and probes.numel()
    image = ImageFeatures("a", (1, 20, 20), torch.randn(n, 8), torch.zeros(n))
    plan = policy.context_plan(image, "a", signals)
    assert plan.fallback is None and plan.verify_tolerance == policy.context.small_tolerance
    for larger in (policy.context.small_change + 1, None):
        signals.context_change = larger
        assert policy.context_recompute(signals, n) is None
        assert policy.context_plan(image, "a", signals).fallback == "context"
    with pytest.raises(ValueError, match="small_change"):
        AttendDeviatePolicy(context={"small_change": -1})


def test_an_approximate_plan_after_another_context_adds_the_check_and_its_probes():
    policy = AttendDeviatePolicy()
    n = 64
    image = ImageFeatures("a", (1, 16, 16), torch.randn(n, 8), torch.zeros(n), torch.arange(n))
    alias = ImageFeatures("b", (1, 16, 16), torch.randn(n, 8), torch.zeros(n), torch.arange(n))
    check = torch.full((n,), 1e-4)
    check[7] = 0.3
    plan = policy.plan(image, alias, torch.arange(n), _signals(check))
    assert 7 in plan.recompute.tolist() and plan.verify is not None and plan.verify.numel() >= MIN_PROBES
    assert plan.verify_tolerance == policy.context.probe_tolerance and plan.verify_confidence == 0.8
    same = policy.plan(image, alias, torch.arange(n), _signals(check, prefix_changed=False))
    assert same.verify is None
    assert policy.plan(image, alias, torch.arange(n), _signals(torch.full((n,), 0.02))).fallback == "context"
    with pytest.raises(ValueError, match="verify"):
        ImagePlan(HitKind.EXACT, 4, 1, [0], [1, 2, 3], [], "a", verify=[2])


def test_a_larger_or_unknown_context_change_is_computed_in_full_before_any_layer():
    """More than ``context.small_change`` tokens of other text, or other images before (unknown): the check layer does
    not see how far the deep layers moved, so the image is computed in full from the start, unless asked to check."""
    from vismemo_hf.policies.vismemo import VisMemoPolicy

    policy = AttendDeviatePolicy()
    n = 64
    image = ImageFeatures("a", (1, 16, 16), torch.randn(n, 8), torch.zeros(n), torch.arange(n))
    alias = ImageFeatures("b", (1, 16, 16), torch.randn(n, 8), torch.zeros(n), torch.arange(n))
    for kind in (HitKind.EXACT, HitKind.APPROXIMATE):
        for change in (policy.context.small_change + 1, None):
            plan = policy.early_plan(kind, image, alias, True, 4, change)
            assert plan.kind is kind and plan.fallback == "context" and plan.recompute.numel() == n
            assert not plan.reuse.numel() and plan.alias == "b"
            assert AttendDeviatePolicy(context={"check_large": True}).early_plan(kind, image, alias, True, 4, change) is None
        assert policy.early_plan(kind, image, alias, True, 4, policy.context.small_change) is None  # checked later
    assert policy.early_plan(HitKind.EXACT, image, alias, False, 4, None).fallback is None  # the same context
    assert VisMemoPolicy().early_plan(HitKind.APPROXIMATE, image, alias, True, 4, None) is None  # METHOD §2 reuses


def test_a_region_changed_beside_identical_tokens_recomputes_everything_from_its_first_token():
    """An inserted row: the rows above it identical, everything below shifted. Tokens before the first change read
    nothing that changed; every token after it, changed or not, read the old page (more than ``full_ratio`` of the
    image here: the default computes it in full)."""
    policy = AttendDeviatePolicy(full_ratio=None)
    n = 16 * 16
    hashes = torch.arange(n)
    alias = ImageFeatures("b", (1, 32, 32), torch.randn(n, 8), torch.zeros(n), hashes)
    inserted = hashes.clone()
    inserted[6 * 16:] = hashes[5 * 16:-16]  # the rows below move down one
    inserted[5 * 16:6 * 16] = -1 - torch.arange(16)  # the new row 5
    image = ImageFeatures("a", (1, 32, 32), torch.randn(n, 8), torch.zeros(n), inserted)
    plan = policy.plan(image, alias, torch.arange(n), _signals(torch.zeros(n), False))
    assert plan.recompute.tolist() == list(range(5 * 16, n)) and plan.reuse.tolist() == list(range(5 * 16))
    assert AttendDeviatePolicy().plan(image, alias, torch.arange(n), _signals(torch.zeros(n), False)).complete
    noise = ImageFeatures("a", (1, 32, 32), torch.randn(n, 8), torch.zeros(n), -hashes - 1)  # a rescan: all changed
    assert policy.plan(noise, alias, torch.arange(n), _signals(torch.zeros(n), False)).recompute.numel() == 0


def test_an_approximate_plan_carries_a_confidence_guard_and_a_watch_when_asked():
    n = 64
    image = ImageFeatures("a", (1, 16, 16), torch.randn(n, 8), torch.zeros(n), torch.arange(n))
    alias = ImageFeatures("b", (1, 16, 16), torch.randn(n, 8), torch.zeros(n), torch.arange(n))
    plan = AttendDeviatePolicy(min_confidence=0.5).plan(image, alias, torch.arange(n), _signals(torch.zeros(n), False))
    assert plan.verify is None and plan.verify_confidence == 0.5 and plan.verify_watch == 16
    off = AttendDeviatePolicy().plan(image, alias, torch.arange(n), _signals(torch.zeros(n), False))  # the default
    assert off.verify_confidence == 0.0 and off.verify_watch == 0
    with pytest.raises(ValueError, match="min_confidence"):
        AttendDeviatePolicy(min_confidence=1.5)


def test_reading_dependents_are_the_tokens_after_a_change_in_its_row():
    changed = torch.zeros(12, dtype=torch.bool)
    changed[5] = True  # row 1, column 1 of a 3 x 4 grid
    grid = torch.arange(12) // 4
    assert torch.nonzero(reading_dependents(changed, grid, "row")).flatten().tolist() == [5, 6, 7]
    assert torch.nonzero(reading_dependents(changed, grid, 1)).flatten().tolist() == [5, 6]
    changed[3] = True  # the end of row 0: nothing after it in its row
    assert torch.nonzero(reading_dependents(changed, grid, "row")).flatten().tolist() == [3, 5, 6, 7]
    # rows of other lengths (LLaVA-OneVision: a 2 x 2 base view, then rows of 3 tokens and a newline)
    packed = torch.tensor([0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])
    changed = torch.zeros(12, dtype=torch.bool)
    changed[[2, 5]] = True
    assert torch.nonzero(reading_dependents(changed, packed, "row")).flatten().tolist() == [2, 3, 5, 6, 7]
    assert torch.nonzero(reading_dependents(changed, packed, 1)).flatten().tolist() == [2, 3, 5, 6]
    assert torch.nonzero(reading_dependents(changed, packed, 0)).flatten().tolist() == [2, 5]


def test_a_local_edit_recomputes_its_rows_rest_and_a_change_everywhere_has_no_dependents():
    policy = AttendDeviatePolicy()
    n = 16 * 16
    hashes = torch.arange(n)
    alias = ImageFeatures("b", (1, 32, 32), torch.randn(n, 8), torch.zeros(n), hashes)
    edited = hashes.clone()
    edited[3 * 16 + 5] = -7  # one token of row 3 changed its pixels
    warmup = torch.zeros(n)
    warmup[3 * 16 + 5] = 0.2
    image = ImageFeatures("a", (1, 32, 32), torch.randn(n, 8), torch.zeros(n), edited)
    assert image.token_hw == (16, 16)
    plan = policy.plan(image, alias, torch.arange(n), _signals(torch.zeros(n), False, warmup))
    assert set(range(3 * 16 + 5, 4 * 16)) <= set(plan.recompute.tolist())
    assert AttendDeviatePolicy(dependents=0).plan(image, alias, torch.arange(n), _signals(
        torch.zeros(n), False, warmup)).recompute.tolist() == [3 * 16 + 5]
    moved = ImageFeatures("a", (1, 32, 32), torch.randn(n, 8), torch.zeros(n), -hashes - 1)  # every token changed
    plan = policy.plan(moved, alias, torch.arange(n), _signals(torch.zeros(n), False, warmup))
    assert plan.recompute.tolist() == [3 * 16 + 5]
    with pytest.raises(ValueError, match="dependents"):
        AttendDeviatePolicy(dependents="word")


def test_probes_are_judged_at_a_few_checkpoints_the_last_layer_included():
    assert checkpoints(1, 8) == {2, 4, 6, 7}
    assert checkpoints(1, 36) == {9, 18, 27, 35}
    assert checkpoints(1, 2) == {1} and checkpoints(3, 3) == set()


def _ask(model, processor, parts, question, cache, new_tokens=6):
    messages, images = context.chat(parts, question)
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, cache=cache, max_new_tokens=new_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    answer = processor.tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return answer, torch.log_softmax(out.scores[0][0].float(), -1)


def test_an_approximate_hit_after_another_text_is_flagged_checked_and_answers_like_plain(base_reader):
    model, plain, processor = base_reader
    rng = random.Random(2)
    page = docpage.random_page(2**31 + 71_000, layout="table")
    edited = docpage.edit_cells(page, [(1, 0)], rng)
    question = docpage.ask(edited, "cell", 1, 0).text
    store = vismemo_hf.VisMemoStore()
    _ask(model, processor, [("image", docpage.render(page))], question, vismemo_hf.VisMemoCache(store=store))
    # written: a candidate still being written that the image would be computed in full against is passed over (a
    # miss, the same computation; tests/test_reuse.py), and this test looks at how the hit itself is flagged
    store.flush()
    asked = [("text", "Check it."), ("image", docpage.render(edited))]
    cache = vismemo_hf.VisMemoCache(store=store, store_misses=False)
    answer, _ = _ask(model, processor, asked, question, cache)
    event = cache.events[0]
    assert event.kind is HitKind.APPROXIMATE and event.prefix_changed
    assert store.stats()["approximate_prefix_changed"] == 1
    assert event.fallback is not None or event.plan.verify is not None  # checked: computed in full, or verified
    assert answer == _ask(plain, processor, asked, question, DynamicCache())[0]
    paper = vismemo_hf.VisMemoCache(store=store, store_misses=False, policy="vismemo")  # METHOD §2: no check
    _ask(model, processor, asked, question, paper, 1)
    assert paper.events[0].prefix_changed and paper.events[0].plan.verify is None and paper.events[0].fallback is None


def _seen_after_another_text(model, processor):
    """(store, question, parts): an invoice page stored after one text, and the same page asked after another."""
    page = docpage.random_page(2**31 + 72_000, layout="invoice")
    question = docpage.ask(page, "key", 2, 1).text
    image = docpage.render(page)
    store = vismemo_hf.VisMemoStore()
    _ask(model, processor, [("text", "See:"), ("image", image)], question, vismemo_hf.VisMemoCache(store=store))
    return store, question, [("text", "Page 7:"), ("image", image)]


@pytest.mark.parametrize("options, reason", [({"probe_tolerance": 0.0, "small_tolerance": 0.0}, "context"),
                                             ({"probe_tolerance": 10.0, "small_tolerance": 10.0,
                                               "min_confidence": 1.0}, "uncertain")])
def test_a_failed_verification_computes_the_image_in_full_exactly_as_plain(base_reader, options, reason):
    """The probes (or the confidence guard) fail after the layers ran: they run again from the decision layer with
    the image computed in full, and the answer and first-token probabilities are plain transformers'."""
    model, plain, processor = base_reader
    store, question, asked = _seen_after_another_text(model, processor)
    cache = vismemo_hf.VisMemoCache(store=store, store_misses=False, context=options)
    answer, logprobs = _ask(model, processor, asked, question, cache)
    event = cache.events[0]
    assert event.kind is HitKind.EXACT and event.prefix_changed
    assert event.fallback == reason and event.recomputed == event.n_tokens and event.timings["rewind"] > 0
    assert store.stats()["fallbacks"] == {reason: 1}
    ref, ref_logprobs = _ask(plain, processor, asked, question, DynamicCache())
    assert answer == ref
    assert float((logprobs.exp() - ref_logprobs.exp()).abs().max()) <= 1e-4
    kept = vismemo_hf.VisMemoCache(store=store, store_misses=False,
                                   context={"probe_tolerance": 10.0, "small_tolerance": 10.0, "min_confidence": 0.0})
    _ask(model, processor, asked, question, kept, 1)
    assert kept.events[0].fallback is None and kept.events[0].verify_estimate is not None
    assert kept.events[0].recomputed < kept.events[0].n_tokens


def test_a_rewound_prefill_compresses_from_one_window_statistic_per_layer(base_reader):
    """A plan that fails verification runs the layers again from the decision layer; the window statistics those
    layers recorded in the failed run are dropped with them, so that compression (VL-Cache's budget per layer) reads
    exactly one per layer, each from the run that produced the layer's K/V."""
    from vismemo_hf.runtime.compress import VLCacheCompression

    seen = []

    class Recording(VLCacheCompression):
        def keep(self, stats, is_visual_column):
            seen.append([s.columns.shape for s in stats])
            return super().keep(stats, is_visual_column)

    model, _, processor = base_reader
    store, question, asked = _seen_after_another_text(model, processor)
    cache = vismemo_hf.VisMemoCache(store=store, store_misses=False,
                                    context={"probe_tolerance": 0.0, "small_tolerance": 0.0}, compress=Recording(0.5))
    _ask(model, processor, asked, question, cache, 1)
    event = cache.events[0]
    assert event.fallback == "context" and event.timings["rewind"] > 0
    (shapes,) = seen
    assert len(shapes) == model.config.text_config.num_hidden_layers


def test_an_unsure_approximate_hit_is_computed_in_full_exactly_as_plain(base_reader):
    """The same context, one cell edited: with a guard no answer passes (``min_confidence=1``), the image is computed
    in full after the layers ran, and the answer and first-token probabilities are plain transformers'."""
    model, plain, processor = base_reader
    page = docpage.random_page(2**31 + 73_000, layout="table")
    edited = docpage.edit_cells(page, [(2, 1)], random.Random(5))
    question = docpage.ask(edited, "cell", 2, 1).text
    store = vismemo_hf.VisMemoStore()
    _ask(model, processor, [("image", docpage.render(page))], question, vismemo_hf.VisMemoCache(store=store))
    asked = [("image", docpage.render(edited))]
    ref, ref_logprobs = _ask(plain, processor, asked, question, DynamicCache())
    for reuse_encoder in (False, True):  # with encoder reuse the unchanged tokens keep the alias's encoder output
        cache = vismemo_hf.VisMemoCache(store=store, store_misses=False, min_confidence=1.0,
                                        reuse_encoder=reuse_encoder)
        answer, logprobs = _ask(model, processor, asked, question, cache)
        event = cache.events[0]
        assert event.kind is HitKind.APPROXIMATE and not event.prefix_changed
        assert event.fallback == "uncertain" and event.recomputed == event.n_tokens
        assert answer == ref
        assert float((logprobs.exp() - ref_logprobs.exp()).abs().max()) <= (0.05 if reuse_encoder else 1e-4)
    sure = vismemo_hf.VisMemoCache(store=store, store_misses=False, min_confidence=0.0)
    _ask(model, processor, asked, question, sure, 1)
    assert sure.events[0].fallback is None and sure.events[0].recomputed < sure.events[0].n_tokens


def _text_change(processor, image_token, old_parts, new_parts, question) -> int:
    """The tokens of text by which two requests' contexts before their (last) image differ, counted directly."""
    def before(parts):
        messages, images = context.chat(parts, question)
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        ids = processor(text=[text], images=images, return_tensors="pt")["input_ids"][0].tolist()
        return ids[: ids.index(image_token)]

    old, new = before(old_parts), before(new_parts)
    head = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    tail = next((i for i, (a, b) in enumerate(zip(old[::-1], new[::-1])) if a != b), min(len(old), len(new)))
    return max(len(old), len(new)) - min(head + tail, len(old), len(new))


@pytest.mark.parametrize("secret", [False, "a store secret of 32 bytes......"])
def test_an_exact_hit_after_a_few_other_tokens_counts_them_and_checks_them_as_a_small_change(base_reader, secret):
    model, plain, processor = base_reader
    page = docpage.random_page(2**31 + 77_000, layout="form")
    question = docpage.ask(page, "key", 1, 0).text
    image = docpage.render(page)
    store = vismemo_hf.VisMemoStore(secret=secret)
    stored = [("text", "Scan:"), ("image", image)]
    _ask(model, processor, stored, question, vismemo_hf.VisMemoCache(store=store))
    for text, small in [("Scan 2:", True), ("User: " + "please read the total of this page and the date " * 3, False)]:
        asked = [("text", text), ("image", image)]
        cache = vismemo_hf.VisMemoCache(store=store, store_misses=False)
        answer, _ = _ask(model, processor, asked, question, cache)
        event, policy = cache.events[0], cache.policy
        assert event.kind is HitKind.EXACT and event.prefix_changed
        assert event.context_change == _text_change(processor, model.config.image_token_id, stored, asked, question), text
        assert (event.context_change <= policy.context.small_change) == small
        if small and event.fallback is None:
            assert event.plan.verify_tolerance == policy.context.small_tolerance and event.recomputed < event.n_tokens
        if not small:  # a larger change: computed in full from the start, nothing of the alias read
            assert event.fallback == "context" and event.recomputed == event.n_tokens
        assert answer == _ask(plain, processor, asked, question, DynamicCache())[0]
        checked = vismemo_hf.VisMemoCache(store=store, store_misses=False, context={"check_large": True})
        assert _ask(model, processor, asked, question, checked)[0] == answer
        if not small and checked.events[0].fallback is None:  # the check of a larger change, when asked for
            assert checked.events[0].plan.verify_tolerance == policy.context.probe_tolerance


def test_a_one_letter_key_edit_recomputes_the_rest_of_the_record(base_reader):
    """Two glyphs share a visual token: the value tokens later in the key's row read the key through it, so they
    are recomputed with it, and the key answered is the new one."""
    model, plain, processor = base_reader
    rng = random.Random(4)
    for i in range(3):
        page = docpage.random_page(2**31 + 73_000 + i, layout=docpage.LAYOUTS[i])
        row = rng.randrange(page.n_rows)
        edited = docpage.edit_key_char(page, row, rng)
        question = docpage.ask(edited, "key", row, 0).text
        store = vismemo_hf.VisMemoStore()
        _ask(model, processor, [("image", docpage.render(page))], question, vismemo_hf.VisMemoCache(store=store))
        cache = vismemo_hf.VisMemoCache(store=store, store_misses=False)
        answer, _ = _ask(model, processor, [("image", docpage.render(edited))], question, cache)
        plan = cache.events[0].plan
        key = next(t for t in docpage.cell_texts(edited) if t.kind == "key" and t.row == row)
        value = next(t for t in docpage.cell_texts(edited) if t.kind == "value" and t.row == row and t.column == 0)
        assert set(docpage.text_tokens(edited, value)) <= set(plan.recompute.tolist()), i
        assert set(docpage.text_tokens(edited, key)) & set(plan.recompute.tolist())
        assert answer == _ask(plain, processor, [("image", docpage.render(edited))], question, DynamicCache())[0]
        assert answer != page.keys[row]


def _thumb(adapter, processor, image):
    inputs = processor.image_processor(images=[image], return_tensors="pt")
    grid = tuple(int(x) for x in inputs["image_grid_thw"][0])
    return thumbnail(inputs["pixel_values"], grid, **adapter.entropy_kwargs()), thumb_per_token(
        token_grid(grid, adapter.merge)[1:])


def test_local_drift_finds_turned_and_zoomed_copies_not_moved_or_edited_ones(base_reader):
    model, _, processor = base_reader
    adapter = model._vismemo
    rng = random.Random(6)
    for i in range(4):
        page = docpage.random_page(2**31 + 74_000 + i, layout=docpage.LAYOUTS[i])
        cached, per = _thumb(adapter, processor, docpage.render(page))
        warped = [docpage.rotate(page, rng.choice([-1.0, 1.0])), docpage.rescale(page, rng.choice([0.98, 1.02]))]
        kept = [docpage.shift(page, 2, -2), docpage.edit_cells(page, [(0, 0)], rng), page]
        for copy in warped:
            assert local_drift(_thumb(adapter, processor, docpage.render(copy))[0], cached, per) > MAX_DRIFT, (i, copy)
        for copy in kept:
            assert local_drift(_thumb(adapter, processor, docpage.render(copy))[0], cached, per) < MAX_DRIFT, i
        assert local_drift(cached, cached, per) == 0.0  # the same content: exactly no move
    blank = torch.full((112, 112), 200, dtype=torch.uint8)
    assert local_drift(blank, blank, 7) == 0.0  # no detail: nothing to judge
    from vismemo_hf.eval import synthdoc
    from vismemo_hf.eval.loading import load_model

    tiny, tiny_processor = load_model("vismemo-docqa-tiny")
    tiny_adapter = vismemo_hf.families.ModelAdapter.for_model(tiny)
    for i in range(3):  # 8 x 6 tokens
        form = synthdoc.random_form(76_500 + i, style=synthdoc.STYLES[i])
        cached, per = _thumb(tiny_adapter, tiny_processor, synthdoc.render(form))
        turned = _thumb(tiny_adapter, tiny_processor, synthdoc.render(synthdoc.rotate(form, 1.0)))[0]
        moved = _thumb(tiny_adapter, tiny_processor, synthdoc.render(synthdoc.shift(form, 2, 1)))[0]
        assert local_drift(turned, cached, per) > MAX_DRIFT > local_drift(moved, cached, per), i


def test_a_turned_page_is_computed_in_full(base_reader):
    model, plain, processor = base_reader
    page = docpage.random_page(2**31 + 75_000, layout="form")
    turned = docpage.rotate(page, 1.0)
    question = docpage.ask(turned, "key", 1, 0).text
    store = vismemo_hf.VisMemoStore()
    _ask(model, processor, [("image", docpage.render(page))], question, vismemo_hf.VisMemoCache(store=store))
    cache = vismemo_hf.VisMemoCache(store=store, store_misses=False)
    answer, logprobs = _ask(model, processor, [("image", docpage.render(turned))], question, cache)
    event = cache.events[0]  # its thumbnail does not align with the page's (no turn is searched): a miss, or
    # found by its tokens and computed in full as warped
    assert event.kind is HitKind.MISS or (event.kind is HitKind.APPROXIMATE and event.fallback == "warp"
                                          and event.drift > MAX_DRIFT), event
    assert event.recomputed == event.n_tokens
    ref, ref_logprobs = _ask(plain, processor, [("image", docpage.render(turned))], question, DynamicCache())
    assert answer == ref and float((logprobs.exp() - ref_logprobs.exp()).abs().max()) <= 1e-4


def test_context_cases_cover_every_class_with_three_questions_and_a_stale_answer_where_something_changed():
    for pages in ("docpage", "synthdoc"):
        cases = context.cases(pages, 11, 1)
        assert [c.cls for c in cases] == list(context.CLASSES)
        for case in cases:
            assert len(case.questions) == 3 and case.intended in ("exact", "approximate")
            if case.cls.startswith("text-"):
                lo, hi = (int(x) for x in case.cls.split("-")[2:])
                assert lo <= len(case.asked[0][1]) <= hi and case.asked[0][1] != case.stored[0][1]
            if case.cls in ("digit-edit", "text-approx-1-10", "image-approx", "agent-2", "agent-3") or (
                    case.cls == "key-edit" and pages == "docpage"):
                assert case.questions[0].stale is not None and case.questions[0].stale not in case.questions[0].answers
    again = context.cases("docpage", 11, 1)
    assert [c.questions for c in again] == [c.questions for c in context.cases("docpage", 11, 1)]
    assert [c.questions for c in again] != [c.questions for c in context.cases("docpage", 12, 1)]


def test_multi_image_cases_slide_an_agents_window_or_put_other_pages_first():
    """``agent-K``: the asked window is the stored one without its first screen, plus a new screen that differs from
    the one before it (a typed value, asked about first, stale its old value); ``images-K``: the stored page comes
    after K other pages, each followed by a text."""
    import numpy as np

    def images(parts):
        return [np.asarray(x) for kind, x in parts if kind == "image"]

    for pages in ("docpage", "synthdoc"):
        for k in (2, 3):
            (case,) = context.cases(pages, 21, 1, (f"agent-{k}",))
            stored, asked = images(case.stored), images(case.asked)
            assert len(stored) == len(asked) == k
            assert all(np.array_equal(a, b) for a, b in zip(stored[1:], asked[:-1]))
            assert not np.array_equal(asked[-1], asked[-2]) and case.intended == "approximate"
            assert [x for kind, x in case.asked if kind == "text"] == [context.ACTION.format(i) for i in range(2, k + 1)]
            assert case.questions[0].stale not in (None, *case.questions[0].answers)
            (case,) = context.cases(pages, 21, 1, (f"images-{k}",))
            stored, asked = images(case.stored), images(case.asked)
            assert len(stored) == 1 and len(asked) == k + 1 and np.array_equal(stored[0], asked[-1])
            assert not any(np.array_equal(stored[0], a) for a in asked[:-1]) and case.intended == "exact"
            assert case.asked[-2] == ("text", context.NEXT_PAGE.format(k))


def test_a_selected_or_highlighted_row_changes_the_pixels_of_that_row_alone():
    """``select-row`` / ``highlight-row``: the stored page shown with one record's band inverted or highlighted; the
    text is the same (no stale answer), the pixels change in one band of rows only, and the first question is about
    the painted record."""
    import numpy as np

    for pages in ("docpage", "synthdoc"):
        for cls in ("select-row", "highlight-row"):
            for seed in (5, 6):
                (case,) = context.cases(pages, seed, 1, (cls,))
                stored, shown = np.asarray(case.stored[0][1]), np.asarray(case.asked[0][1])
                rows = np.nonzero((stored != shown).any(axis=(1, 2)))[0]
                assert rows.size and rows.max() - rows.min() < stored.shape[0] / 6, (pages, cls, rows)
                assert all(q.stale is None for q in case.questions) and case.intended == "approximate"


def test_the_context_report_compares_each_answer_with_plain_transformers(base_reader):
    from vismemo_hf.bench import context as report

    model, plain, processor = base_reader
    case = context.cases("docpage", 13, 1, ("digit-edit",))[0]
    rows = report.run_case(model, plain, processor, case, {"default": {}}, max_new_tokens=6)
    assert len(rows) == 3 and {r["policy"] for r in rows} == {"default"}
    for row in rows:
        assert row["agree"] == (row["prediction"] == row["plain"]) and row["kind"] in ("approximate", "miss")
        assert 0.0 <= row["recomputed_share"] <= 1.0 and row["ttft_ms"] > 0
        assert row["encoded_share"] >= 0.0 and (row["kind"] != "miss" or row["encoded_share"] == 1.0)
    summary = report.summarise(rows)["digit-edit"]["default"]
    assert summary["n"] == 3 and summary["stale"] == sum(r["stale"] for r in rows)
    assert summary["encoded_share"] == sum(r["encoded_share"] for r in rows) / 3


def test_pages_after_other_pages_and_a_slid_agent_window_are_computed_in_full_by_default(base_reader):
    """On the base reader (whose calibrated tolerance is the default): an exact hit after other pages and an agent's
    new screen after the screens before it are computed in full, counted as context fallbacks, the exact hit still
    without its vision tower; every answer is plain transformers'."""
    from vismemo_hf.bench import context as report

    model, plain, processor = base_reader
    for cls, kind, encoded in (("images-2", "exact", 0.0), ("agent-2", "approximate", None)):
        (case,) = context.cases("docpage", 17, 1, (cls,))
        rows = report.run_case(model, plain, processor, case, {"default": {}}, max_new_tokens=6)
        assert all(r["agree"] and r["kind"] == kind and r["fallback"] == "context" for r in rows), rows
        assert all(r["recomputed_share"] == 1.0 and r["prefix_changed"] for r in rows)
        assert encoded is None or all(r["encoded_share"] == encoded for r in rows)


@pytest.mark.parametrize("beams", [1, 2])
def test_an_unsure_answer_after_a_reuse_is_computed_in_full_at_that_token(base_reader, monkeypatch, beams):
    """The prefill's reuse passes its checks (forced here), but the model is unsure of a later token: the sequence so
    far is computed again by the model's own forward, and the answer and every step's scores are plain's."""
    from vismemo_hf.runtime.runner import PrefillRunner

    model, plain, processor = base_reader
    page = docpage.random_page(2**31 + 76_000, layout="table")
    question = docpage.ask(page, "cell", 2, 1).text
    image = docpage.render(page)
    store = vismemo_hf.VisMemoStore()
    _ask(model, processor, [("text", "Doc A."), ("image", image)], question, vismemo_hf.VisMemoCache(store=store))
    asked = [("text", "Scan 2."), ("image", image)]
    messages, images = context.chat(asked, question)
    inputs = processor(text=[processor.apply_chat_template(messages, add_generation_prompt=True)], images=images,
                       return_tensors="pt")
    options = dict(max_new_tokens=5, do_sample=False, num_beams=beams, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = plain.generate(**inputs, **options)
    monkeypatch.setattr(PrefillRunner, "_uncertain", lambda self, states: [])  # the prefill's own check passes
    cache = vismemo_hf.VisMemoCache(store=store, store_misses=False,
                                    context={"probe_tolerance": 10.0, "small_tolerance": 10.0, "min_confidence": 1.0})
    with torch.no_grad():
        out = model.generate(**inputs, cache=cache, **options)
    event = cache.events[0]
    assert event.kind is HitKind.EXACT and event.repaired_at == 1 and event.fallback == "uncertain"
    assert cache.watch is None and torch.equal(out.sequences, ref.sequences)
    for mine, theirs in zip(out.scores[1:], ref.scores[1:]):  # the steps after the repair: plain's, to rounding
        assert float((mine.float().softmax(-1) - theirs.float().softmax(-1)).abs().max()) <= 1e-4


def test_the_context_report_takes_its_front_from_an_earlier_run_only_when_it_holds_every_point(tmp_path):
    import argparse
    import json

    from vismemo_hf.bench import context as report

    point = {"agreement": 1.0, "recomputed_share": 0.5, "stale": 0}
    earlier = {"command": "vismemo report context --front-pairs 10",
               "front": {"vismemo-docqa-tiny": {c: {**{n: point for n in report.FRONT}, "small <= 8 (default)": point}
                                                 for c in report.FRONT_CLASSES}}}
    del earlier["front"]["vismemo-docqa-tiny"][report.FRONT_CLASSES[0]]["small <= 8, larger checked"]  # an older label
    path = tmp_path / "context.json"
    path.write_text(json.dumps(earlier))
    args = argparse.Namespace(front_from=str(path), front_pairs=10, seed=9000, max_new_tokens=6, quiet=True)
    front, note = report._front(args, ["vismemo-docqa-tiny"])
    assert set(front["vismemo-docqa-tiny"][report.FRONT_CLASSES[0]]) >= set(report.FRONT)
    assert earlier["command"] in note and any("small <= 8, larger checked" in line for line in
                                              report._front_lines(front, args, note))
    del earlier["front"]["vismemo-docqa-tiny"][report.FRONT_CLASSES[1]]["every token (full)"]
    path.write_text(json.dumps(earlier))
    with pytest.raises(ValueError, match="lacks front points"):
        report._front(args, ["vismemo-docqa-tiny"])


def test_the_context_report_tells_the_defaults_worst_agreement_over_held_out_seeds():
    from vismemo_hf.bench import context as report

    def point(agreement, stale=0):
        return {"default": {"agreement": agreement, "recomputed_share": 0.25, "stale": stale}}

    heldout = {"vismemo-docqa-tiny": {9002: {"digit-edit": point(1.0), "insert-row": point(0.95, 1)},
                                      9003: {"digit-edit": point(0.983), "insert-row": point(1.0)}}}
    lines = report._heldout_lines(heldout, ("digit-edit", "insert-row"), 20)
    assert "| digit-edit | 1.000 / 0.25 | 0.983 / 0.25 | 0.983 | 0 |" in lines
    assert "| insert-row | 0.950 / 0.25 | 1.000 / 0.25 | 0.950 | 1 |" in lines

"""Routing on the packaged reader, where answers depend on the cells: every registered policy, the default's
quality bar on streams and perturbations it was not designed on, signals, restored masks and prefix-aware hits."""

import functools

import pytest
import torch
from transformers import DynamicCache

import vismemo_hf
from vismemo_hf.bench.prefix import first_token
from vismemo_hf.core.plan import HitKind
from vismemo_hf.eval import docqa, synthdoc
from vismemo_hf.eval.quality import answer, evaluate, summarise

from conftest import docqa_reader

pytestmark = pytest.mark.skipif(not (docqa.PACKAGED / "config.json").is_file(), reason="no packaged checkpoint")


@functools.cache
def _edited_pairs(n: int = 10):
    """(base request, follow-up asking the edited value) pairs, seeds no design choice used."""
    import random

    out = []
    for i in range(n):
        base = synthdoc.random_form(60_000 + i, style=synthdoc.STYLES[i % len(synthdoc.STYLES)])
        row = i % synthdoc.ROWS
        edited = synthdoc.edit_value(base, row, random.Random(i))
        key = base.rows[row][0]
        out.append((synthdoc.Request(f"b{i}", base, synthdoc.question_for(key), [base.answer(key)], "miss", "base"),
                    synthdoc.Request(f"e{i}", edited, synthdoc.question_for(key), [edited.answer(key)],
                                     "approximate", "edit_asked", True, base.answer(key))))
    return out


def _stream():
    return [r for pair in _edited_pairs() for r in pair]


@pytest.mark.parametrize("policy", vismemo_hf.available_policies())
def test_every_policy_routes_edited_pages_on_the_reader(policy):
    """Each registered routing gets approximate hits on edited pages and answers them with 4-digit values;
    policies that recompute what deviates never answer the stale value."""
    model, processor = docqa_reader()
    scored = evaluate(model, processor, _stream(), policy=policy, max_new_tokens=6)
    edited = [s for s in scored if s.request.about_edit]
    assert all(s.kind == "approximate" for s in edited), [s.kind for s in edited]
    assert all(len(s.prediction) == 4 and s.prediction.isdigit() for s in edited), [s.prediction for s in edited]
    summary = summarise(scored)
    if policy in ("full", "attend-deviate", "cacheblend", "pixel-patch"):
        assert summary["anls_edited_value"] == 1.0 and summary["stale_rate"] == 0.0, summary
    if policy == "naive":
        assert summary["stale_rate"] == 1.0


def test_default_policy_matches_full_prefill_on_unseen_streams():
    """The default's bar on seeds and perturbation kinds that informed no design choice."""
    model, processor = docqa_reader()
    requests = synthdoc.stream(61_000, n_bases=8) + synthdoc.perturbation_stream(62_000, n_bases=7)
    ref = evaluate(model, processor, requests, policy="full", max_new_tokens=6)
    ours = evaluate(model, processor, requests, max_new_tokens=6)  # VisMemoCache's default routing
    s, f = summarise(ours, ref), summarise(ref)
    assert s["n_approximate"] >= 25
    assert s["anls_approximate"] >= f["anls_approximate"] - 0.01, (s, f)
    assert s["anls_edited_value"] >= 0.99 and s["stale_rate"] == 0.0


def test_signals_report_deviation_where_the_page_changed():
    """The public signals: per-layer K/V deviation is largest at the edited cells, zero-ish elsewhere at layer 0."""
    from dataclasses import dataclass
    from typing import ClassVar

    from vismemo_hf.policies.attend_deviate import AttendDeviatePolicy
    from vismemo_hf.policies.base import register_policy

    seen = []

    @register_policy
    @dataclass
    class Recording(AttendDeviatePolicy):
        name: ClassVar[str] = "test-recording-deviation"

        def plan(self, image, alias, prefetched, signals):
            seen.append(signals)
            return super().plan(image, alias, prefetched, signals)

    model, processor = docqa_reader()
    base, follow = _edited_pairs()[0]
    store = vismemo_hf.VisMemoStore()
    answer(model, processor, base, vismemo_hf.VisMemoCache(store=store))
    cache = vismemo_hf.VisMemoCache(store=store, policy="test-recording-deviation", warmup_layers=2)
    answer(model, processor, follow, cache)
    (signals,) = seen
    n = cache.events[0].n_tokens
    assert signals.key_deviation.shape == signals.value_deviation.shape == (2, n)
    changed = [i for i, (a, b) in enumerate(zip(base.page.cell_text(), follow.page.cell_text())) if a != b]
    assert len(changed) == synthdoc.VALUE_LEN
    layer0 = signals.key_deviation[0] + signals.value_deviation[0]
    assert set(torch.topk(layer0, len(changed)).indices.tolist()) == set(changed)
    unchanged = torch.ones(n, dtype=torch.bool)
    unchanged[changed] = False
    assert float(layer0[unchanged].max()) < 0.05 * float(layer0[changed].min()), (layer0[unchanged].max(), layer0[changed])
    start, end = signals.span
    assert end - start == n and bool((signals.window >= end).all()) and signals.window.numel() > 0
    assert cache.events[0].bytes_read > 0


def test_restored_masked_tokens_are_attended_in_decoding():
    """With ``restore_masked`` the masked tokens' cached K/V join the late layers for decoding; without, they don't."""
    model, processor = docqa_reader()
    base, follow = _edited_pairs()[1]
    store = vismemo_hf.VisMemoStore()
    answer(model, processor, base, vismemo_hf.VisMemoCache(store=store))
    layers = {}
    for restore in (True, False):
        cache = vismemo_hf.VisMemoCache(store=store, mask_below=10.0, max_mask_ratio=0.5, restore_masked=restore)
        answer(model, processor, follow, cache, max_new_tokens=2)
        plan = cache.events[0].plan
        assert plan.mask.numel() == 24 and plan.restore_masked is restore
        layers[restore] = cache.layers[plan.warmup_layers].slot_columns()[0].tolist()
    masked_columns = set((plan.mask + _image_start(processor, follow)).tolist())
    assert masked_columns <= set(layers[True]) and not masked_columns & set(layers[False])


def _image_start(processor, request) -> int:
    text = processor.apply_chat_template(docqa.messages(request.question, request.prefix), add_generation_prompt=True)
    ids = processor(text=[text], images=[synthdoc.render(request.page)], return_tensors="pt")["input_ids"][0]
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return int((ids == image_token).nonzero()[0])


def test_exact_hit_after_another_text_is_reported_and_checked():
    """The entry remembers the text before the image: an exact hit after another text is flagged on the event and
    in stats; the default routes it through a check layer, METHOD §2's vismemo reuses everything."""
    model, processor = docqa_reader()
    page = synthdoc.random_form(63_000)
    key = page.rows[2][0]
    question = synthdoc.question_for(key)
    store = vismemo_hf.VisMemoStore()
    first_token(model, processor, page, question, "Scan 2.", vismemo_hf.VisMemoCache(store=store))
    same = vismemo_hf.VisMemoCache(store=store)
    first_token(model, processor, page, question, "Scan 2.", same)
    assert same.events[0].kind is HitKind.EXACT and not same.events[0].prefix_changed
    assert same.events[0].recomputed == 0
    ref = first_token(model, processor, page, question, "Doc A.", DynamicCache())
    # the check layer's routing alone (its probes never fail here; tests/test_verify.py tests them)
    checked = vismemo_hf.VisMemoCache(store=store, context={"probe_tolerance": 10.0, "min_confidence": 0.0})
    hit = first_token(model, processor, page, question, "Doc A.", checked)
    event = checked.events[0]
    assert event.kind is HitKind.EXACT and event.prefix_changed
    assert event.plan.warmup_layers == 1 and 0 < event.recomputed < event.n_tokens and event.plan.verify.numel() >= 4
    assert int(hit.argmax()) == int(ref.argmax())
    paper = vismemo_hf.VisMemoCache(store=store, policy="vismemo")
    first_token(model, processor, page, question, "Doc A.", paper)
    assert paper.events[0].prefix_changed and paper.events[0].recomputed == 0
    assert store.stats()["exact_prefix_changed"] == 2


def test_left_padding_does_not_change_the_prefix_hash():
    from vismemo_hf.runtime.lookup import prefix_digest

    ids = torch.tensor([5, 6, 7, 8, 9])
    padded = torch.tensor([0, 0, 5, 6, 7, 8, 9])
    valid = torch.tensor([False, False, True, True, True, True, True])
    assert prefix_digest(ids, None, 3, []) == prefix_digest(padded, valid, 5, [])
    assert prefix_digest(ids, None, 3, []) != prefix_digest(ids, None, 3, ["earlier-image"])
    assert prefix_digest(ids, None, 3, []) != prefix_digest(ids, None, 2, [])

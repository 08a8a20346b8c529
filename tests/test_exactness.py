"""Reuse that should change nothing changes nothing (fp32, all three families)."""

import pytest
import torch
from transformers import DynamicCache

import vismemo_hf
from vismemo_hf import HitKind

from conftest import build_inputs, generate, stored


def test_exact_hit_identical_prompt_equals_full_prefill(tiny, pages):
    model, processor = tiny
    store = vismemo_hf.VisMemoStore()
    inputs = build_inputs(processor, [pages["base"]])
    _, ref = generate(model, inputs, DynamicCache(), new_tokens=3)
    first = vismemo_hf.VisMemoCache(store=store)
    _, miss_scores = generate(model, inputs, first, new_tokens=3)
    assert [e.kind for e in first.events] == [HitKind.MISS]
    torch.testing.assert_close(miss_scores, ref, atol=1e-4, rtol=0)

    cache = vismemo_hf.VisMemoCache(store=store)
    _, scores = generate(model, inputs, cache, new_tokens=3)
    event = cache.events[0]
    assert event.kind is HitKind.EXACT and event.alias == first.events[0].key
    assert event.reused == event.n_tokens and event.recomputed == 0 and event.masked == 0
    assert (scores - ref).abs().max() <= 1e-4


@pytest.mark.approximate
def test_full_recompute_equals_plain_run_on_new_image(tiny, pages):
    model, processor = tiny
    store = stored(model, processor, pages["base"])
    inputs = build_inputs(processor, [pages["edit"]])
    _, ref = generate(model, inputs, DynamicCache(), new_tokens=3)
    cache = vismemo_hf.VisMemoCache(store=store, recompute_ratio=1.0, reuse_ratio=0.0)
    _, scores = generate(model, inputs, cache, new_tokens=3)
    assert cache.events[0].kind is HitKind.APPROXIMATE
    assert cache.events[0].recomputed == cache.events[0].n_tokens
    assert (scores - ref).abs().max() <= 1e-4


def test_text_only_request_behaves_like_dynamic_cache(tiny):
    model, processor = tiny
    text = processor.apply_chat_template([{"role": "user", "content": "hello there"}], add_generation_prompt=True)
    inputs = processor.tokenizer([text], return_tensors="pt")
    ref_tokens, ref = generate(model, inputs, DynamicCache(), new_tokens=4)
    cache = vismemo_hf.VisMemoCache(store=vismemo_hf.VisMemoStore())
    tokens, scores = generate(model, inputs, cache, new_tokens=4)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(scores, ref)
    assert cache.events == []

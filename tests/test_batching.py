"""Several images per request and several requests per batch give the tokens of running each alone."""

import pytest
import torch

import vismemo_hf
from vismemo_hf import HitKind
from vismemo_hf.eval import synthetic

from conftest import build_inputs, generate


def _seed_store(model, processor):
    store = vismemo_hf.VisMemoStore()
    for img in (synthetic.page(1), synthetic.page(2)):
        generate(model, build_inputs(processor, [img]), vismemo_hf.VisMemoCache(store=store, tau=1.0), 1)
    return store


def _copy(store):
    store.flush()
    clone = vismemo_hf.VisMemoStore()
    for entry in store.device.lru.values():
        clone.put(entry)
    return clone


@pytest.mark.approximate
def test_batch_with_mixed_hit_kinds_equals_each_request_alone(tiny):
    model, processor = tiny
    store = _seed_store(model, processor)
    requests = [
        ([synthetic.page(1)], "What is the value of row 2?", ""),  # exact
        ([synthetic.edited(2, row=1, value="0000")], "Which value changed?", "Here is a form. "),  # approximate
        ([synthetic.page(1), synthetic.edited(1, row=3, value="1111")], "Compare them.", ""),  # exact + approx
        ([], "No image here, just text.", ""),  # text only
    ]
    opts = dict(recompute_ratio=0.3, reuse_ratio=0.2, warmup_layers=2)
    alone_tokens, alone_kinds = [], []
    for imgs, q, pre in requests:
        cache = vismemo_hf.VisMemoCache(store=_copy(store), **opts)
        tokens, _ = generate(model, build_inputs(processor, imgs, q, pre), cache, 4)
        alone_tokens.append(tokens[0])
        alone_kinds.append([e.kind for e in cache.events])
    assert alone_kinds == [[HitKind.EXACT], [HitKind.APPROXIMATE], [HitKind.EXACT, HitKind.APPROXIMATE], []]

    batch_cache = vismemo_hf.VisMemoCache(store=_copy(store), **opts)
    inputs = build_inputs(processor, None, batch=requests)
    tokens, _ = generate(model, inputs, batch_cache, 4)
    assert [e.kind for e in batch_cache.events] == [k for kinds in alone_kinds for k in kinds]
    for row, expected in enumerate(alone_tokens):
        assert torch.equal(tokens[row], expected), f"request {row}"


def test_two_misses_in_one_request_are_both_stored_and_then_exact(qwen2):
    model, processor = qwen2
    store = vismemo_hf.VisMemoStore()
    images = [synthetic.page(3), synthetic.page(4)]
    inputs = build_inputs(processor, images, "Compare them.")
    first = vismemo_hf.VisMemoCache(store=store, tau=1.0)
    generate(model, inputs, first, 1)
    assert [e.kind for e in first.events] == [HitKind.MISS, HitKind.MISS] and len(store) == 2
    again = vismemo_hf.VisMemoCache(store=store)
    _, scores = generate(model, inputs, again, 2)
    assert [e.kind for e in again.events] == [HitKind.EXACT, HitKind.EXACT]
    _, ref = generate(model, inputs, vismemo_hf.VisMemoCache(store=vismemo_hf.VisMemoStore()), 2)
    assert (scores - ref).abs().max() <= 1e-4

"""VL-Cache compression: budgets, text kept, ratio 1 is a no-op, smaller decoding KV, correct decoding."""

import pytest
import torch

import vismemo_hf
from vismemo_hf import VLCacheCompression
from vismemo_hf.runtime.compress import allocate

from conftest import build_inputs, generate, stored
from reference import extend, masked_logits


def test_allocate_is_proportional_capped_and_exact():
    w = torch.tensor([1.0, 2.0, 4.0, 0.0, 1.0])
    cap = torch.tensor([10, 10, 3, 10, 10])
    b = allocate(w, cap, 12)
    assert int(b.sum()) == 12 and torch.all(b <= cap) and b[2] == 3
    assert b[1] >= b[0] and b[3] <= 1
    assert int(allocate(w, cap, 1000).sum()) == int(cap.sum())


def _kv_bytes(cache):
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)


def _visual_slots(cache, inputs, image_token_id):
    visual = (inputs["input_ids"][0] == image_token_id).nonzero().flatten()
    return [int(torch.isin(layer.slot_columns()[0], visual).sum()) for layer in cache.layers]


@pytest.mark.parametrize("ratio", [0.1, 0.35])
def test_budgets_sum_to_the_ratio_and_text_is_kept(tiny, pages, ratio):
    model, processor = tiny
    inputs = build_inputs(processor, [pages["base"]])
    cache = vismemo_hf.VisMemoCache(store=vismemo_hf.VisMemoStore(), compress=VLCacheCompression(ratio))
    generate(model, inputs, cache, 1)
    n_vis = int((inputs["input_ids"][0] == model.config.image_token_id).sum())
    kept = _visual_slots(cache, inputs, model.config.image_token_id)
    n_layers = len(cache.layers)
    assert abs(sum(kept) - ratio * n_vis * n_layers) <= n_layers
    assert all(0 <= k <= n_vis for k in kept)
    text = (inputs["input_ids"][0] != model.config.image_token_id).nonzero().flatten()
    for layer in cache.layers:
        assert torch.isin(text, layer.slot_columns()[0]).all()


@pytest.mark.approximate
def test_ratio_one_is_identical_to_no_compression(tiny, pages):
    model, processor = tiny
    # nothing stored meanwhile (store_misses=False): both requests of a pair meet the same store
    store = stored(model, processor, pages["base"], store=vismemo_hf.VisMemoStore(prefix_bytes=0))
    for image in (pages["base"], pages["edit"]):
        inputs = build_inputs(processor, [image])
        a_tok, a = generate(model, inputs, vismemo_hf.VisMemoCache(store=store, store_misses=False), 4)
        b_tok, b = generate(model, inputs, vismemo_hf.VisMemoCache(store=store, store_misses=False,
                                                                   compress=VLCacheCompression(1.0)), 4)
        assert torch.equal(a_tok, b_tok) and torch.equal(a, b)


def test_decoding_memory_falls_with_the_ratio(qwen2, pages):
    model, processor = qwen2
    inputs = build_inputs(processor, [pages["base"]])
    sizes = []
    for ratio in (0.1, 0.5, 1.0):
        cache = vismemo_hf.VisMemoCache(store=vismemo_hf.VisMemoStore(), compress=VLCacheCompression(ratio))
        generate(model, inputs, cache, 3)
        sizes.append(_kv_bytes(cache))
    assert sizes[0] < sizes[1] < sizes[2]


def test_decoding_attends_only_the_kept_tokens(qwen2, pages):
    model, processor = qwen2
    inputs = build_inputs(processor, [pages["base"]])
    cache = vismemo_hf.VisMemoCache(store=vismemo_hf.VisMemoStore(), compress=VLCacheCompression(0.2))
    tokens, scores = generate(model, inputs, cache, 3)
    n = inputs["input_ids"].shape[1]
    visual = inputs["input_ids"][0] == model.config.image_token_id
    hides = []
    for layer in cache.layers:
        cols = layer.slot_columns()[0]
        hide = visual.clone()
        hide[cols[(cols >= 0) & (cols < n)]] = False
        hides.append(hide[None])
    for step in range(tokens.shape[1]):
        ext = extend(inputs, tokens[:, :step])
        pad = torch.zeros(1, step, dtype=torch.bool)
        ref = masked_logits(model, ext, [torch.cat([h, pad], 1) for h in hides], query_from=n)
        assert (scores[:, step] - ref).abs().max() <= 1e-4, step

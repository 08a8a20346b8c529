"""Masked tokens are out of attention from layer W on, in prefill and in every decoding step."""

import torch

import vismemo_hf
from vismemo_hf import HitKind

from conftest import build_inputs, generate, stored
from reference import extend, late_layers, masked_logits


def test_mask_everything_equals_reference_in_prefill_and_decoding(tiny, pages):
    model, processor = tiny
    store = stored(model, processor, pages["base"])
    inputs = build_inputs(processor, [pages["edit"]])
    cache = vismemo_hf.VisMemoCache(store=store, recompute_ratio=0.0, reuse_ratio=0.0, warmup_layers=2)
    tokens, scores = generate(model, inputs, cache, new_tokens=4)
    event = cache.events[0]
    assert event.kind is HitKind.APPROXIMATE and event.masked == event.n_tokens
    visual = inputs["input_ids"] == model.config.image_token_id
    for step in range(tokens.shape[1]):
        ext = extend(inputs, tokens[:, :step])
        hide = torch.cat([visual, torch.zeros(1, step, dtype=torch.bool)], 1)
        ref = masked_logits(model, ext, late_layers(model, 2, hide))
        assert (scores[:, step] - ref).abs().max() <= 1e-4, f"decoding step {step}"
    # and the masked tokens are not simply ignored by accident: without the mask the logits differ
    unmasked = masked_logits(model, inputs, late_layers(model, 2, torch.zeros_like(visual)))
    assert (scores[:, 0] - unmasked).abs().max() > 1e-3


def test_late_layers_hold_only_text_recomputed_and_reused_tokens(qwen2, pages):
    model, processor = qwen2
    store = stored(model, processor, pages["base"])
    inputs = build_inputs(processor, [pages["edit"]])
    cache = vismemo_hf.VisMemoCache(store=store, warmup_layers=2, recompute_ratio=0.25, reuse_ratio=0.25)
    generate(model, inputs, cache, new_tokens=3)
    event = cache.events[0]
    length = inputs["input_ids"].shape[1] + 2  # two decoding steps appended K/V
    assert event.kind is HitKind.APPROXIMATE and event.masked > 0
    for i, layer in enumerate(cache.layers):
        if i < 2:
            assert layer.keys.shape[-2] == length
        else:
            assert layer.keys.shape[-2] == length - event.masked
            assert layer.columns.shape[1] == length - event.masked


def test_partial_recompute_equals_reference_that_hides_the_mask_set(tiny, pages):
    """From layer W only R (and text) is computed and M is hidden; with beta = 0 nothing is reused, so a
    full forward that hides M's keys from layer W on must agree (Qwen3-VL: deepstack reaches R at layer 1)."""
    model, processor = tiny
    store = stored(model, processor, pages["base"])
    inputs = build_inputs(processor, [pages["edit"]])
    cache = vismemo_hf.VisMemoCache(store=store, recompute_ratio=0.5, reuse_ratio=0.0, warmup_layers=1)
    tokens, scores = generate(model, inputs, cache, 3)
    plan = cache.events[0].plan
    assert plan.recompute.numel() == (plan.n_tokens + 1) // 2 and plan.mask.numel() == plan.n_tokens // 2
    start = int((inputs["input_ids"][0] == model.config.image_token_id).nonzero()[0, 0])
    hide = torch.zeros_like(inputs["input_ids"], dtype=torch.bool)
    hide[0, start + plan.mask] = True
    for step in range(tokens.shape[1]):
        ext = extend(inputs, tokens[:, :step])
        ref = masked_logits(model, ext, late_layers(model, 1, torch.cat([hide, torch.zeros(1, step, dtype=torch.bool)], 1)))
        assert (scores[:, step] - ref).abs().max() <= 1e-4, f"decoding step {step}"

"""Masked tokens are out of attention from layer W on, in prefill and in every decoding step."""

import pytest
import torch

import vismemo_hf
from vismemo_hf import HitKind

from conftest import build_inputs, generate, stored
from reference import extend, late_layers, masked_logits


@pytest.mark.approximate
def test_mask_everything_equals_reference_in_prefill_and_decoding(tiny, pages):
    model, processor = tiny
    store = stored(model, processor, pages["base"])
    inputs = build_inputs(processor, [pages["edit"]])
    cache = vismemo_hf.VisMemoCache(store=store, policy="vismemo", recompute_ratio=0.0, reuse_ratio=0.0, warmup_layers=2)
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
    cache = vismemo_hf.VisMemoCache(store=store, policy="vismemo", warmup_layers=2, recompute_ratio=0.25, reuse_ratio=0.25)
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


@pytest.mark.approximate
def test_partial_recompute_equals_reference_that_hides_the_mask_set(tiny, pages):
    """From layer W only R (and text) is computed and M is hidden; with beta = 0 nothing is reused, so a
    full forward that hides M's keys from layer W on must agree (Qwen3-VL: deepstack reaches R at layer 1)."""
    model, processor = tiny
    store = stored(model, processor, pages["base"])
    inputs = build_inputs(processor, [pages["edit"]])
    cache = vismemo_hf.VisMemoCache(store=store, policy="vismemo", recompute_ratio=0.5, reuse_ratio=0.0, warmup_layers=1)
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


@pytest.mark.parametrize("masked_gqa", [True, False])
def test_blocked_attention_equals_one_dense_call(monkeypatch, masked_gqa):
    """The prefill's query blocks see only their visible key prefix: same output as one SDPA call, with grouped K/V
    heads read in place (the CPU kernel's ``enable_gqa``) or repeated (what CUDA's fused kernels need)."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from vismemo_hf.runtime import attention, schedule

    g = torch.Generator().manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    reused = torch.tensor([[3, 5, 6, 9, 20, 21], [2, 4, -1, -1, -1, -1]])  # a padded second row
    active = torch.tensor([[0, 1, 2, 4, 7, 8, 10, 11, 12, 22, 23, 24, 25, 26],
                           [0, 1, 3, 5, 6, 7, 8, 9, 10, 11, 12, -1, -1, -1]])
    slots = torch.cat([reused, active], 1)
    mask = schedule.slot_mask(slots, active, None)
    q = torch.randn(2, 4, active.shape[1], 8, generator=g)
    k, v = (torch.randn(2, 2, slots.shape[1], 8, generator=g) for _ in range(2))
    dense, _ = sdpa_attention_forward(module, q, k, v, mask)
    monkeypatch.setattr(schedule, "MIN_BLOCK_ROWS", 2)
    monkeypatch.setattr(attention, "_MASKED_GQA_ON_CPU", masked_gqa)
    for most in (2, 3, 5):
        monkeypatch.setattr(schedule, "MAX_BLOCKS", most)
        blocks = schedule.query_blocks(mask)
        assert len(blocks) == most and blocks[0][2] < slots.shape[1]  # the first block skips later slots
        out, _ = attention.blocked_sdpa(module, q, k, v, mask, blocks)
        assert out.shape == dense.shape and (out - dense).abs().max() <= 1e-6


def test_blocked_attention_in_the_runner_changes_nothing(tiny, pages, monkeypatch):
    from vismemo_hf.runtime import attention, schedule

    model, processor = tiny
    store = stored(model, processor, pages["base"])
    inputs = build_inputs(processor, [pages["edit"]])
    opts = dict(store=store, policy="vismemo", recompute_ratio=0.5, reuse_ratio=0.2, warmup_layers=1)
    _, dense = generate(model, inputs, vismemo_hf.VisMemoCache(**opts), 3)
    calls = []
    real = attention.blocked_sdpa
    monkeypatch.setattr(schedule, "MIN_BLOCK_ROWS", 4)
    monkeypatch.setattr(attention, "blocked_sdpa", lambda *a, **k: calls.append(len(a[5])) or real(*a, **k))
    _, blocked = generate(model, inputs, vismemo_hf.VisMemoCache(**opts), 3)
    assert max(calls) > 1  # the late layers' prefill ran in blocks
    assert (blocked - dense).abs().max() <= 1e-5


def _same_with_nan_buffers(model, cases, make_cache, monkeypatch):
    """Each request of ``cases`` gives the same tokens and scores when every uninitialised floating buffer
    (``new_empty``) is full of NaN: nothing reads memory it did not write."""
    expected = [generate(model, inputs, make_cache(), 3) for inputs in cases]
    real = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty",
                        lambda self, *a, **k: real(self, *a, **k).fill_(float("nan")) if self.is_floating_point()
                        else real(self, *a, **k))
    for inputs, (tokens, scores) in zip(cases, expected):
        got_tokens, got_scores = generate(model, inputs, make_cache(), 3)
        assert torch.equal(got_tokens, tokens) and torch.isfinite(got_scores).all()
        torch.testing.assert_close(got_scores, scores)


@pytest.mark.parametrize("policy", ["attend-deviate", "vismemo", "cacheblend"])
def test_no_prefill_reads_a_slot_it_did_not_write(tiny, pages, monkeypatch, policy):
    """A layer whose layout every write fills allocates its K/V without zeroing them (``SlotWriter.filled``): with
    every uninitialised buffer full of NaN, exact and approximate hits, alone and in a padded batch, give the tokens
    and scores they give otherwise."""
    model, processor = tiny
    store = stored(model, processor, pages["base"])
    opts = dict(store=store, policy=policy, store_misses=False)
    cases = [build_inputs(processor, [pages["base"]]), build_inputs(processor, [pages["edit"]]),
             build_inputs(processor, None, batch=[([pages["edit"]], "Which value changed?", "Here is a form. "),
                                                  ([pages["base"]], "What is row 2?", "")])]
    _same_with_nan_buffers(model, cases, lambda: vismemo_hf.VisMemoCache(**opts), monkeypatch)


@pytest.mark.parametrize("setting", ["compressed entries", "another text before the image"])
def test_no_prefill_reads_a_slot_it_did_not_write_from_a_compressed_alias_or_after_another_text(tiny, pages,
                                                                                                  monkeypatch, setting):
    """As above, where an alias lacks tokens (a store keeping half of each entry's K/V) or the text before the image
    changed (the verified reuse of an exact or approximate hit, recomputed in full when its probes disagree)."""
    model, processor = tiny
    store = vismemo_hf.VisMemoStore(keep_ratio=0.5) if setting == "compressed entries" else None
    store = stored(model, processor, pages["base"], store=store)
    prefix = "Here is a form to read carefully. " if setting != "compressed entries" else ""
    cases = [build_inputs(processor, [pages["base"]], prefix=prefix),
             build_inputs(processor, [pages["edit"]], prefix=prefix)]
    _same_with_nan_buffers(model, cases, lambda: vismemo_hf.VisMemoCache(store=store, store_misses=False), monkeypatch)

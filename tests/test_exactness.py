"""Reuse that should change nothing changes nothing (fp32, all three families)."""

import copy

import pytest
import torch
from transformers import DynamicCache

import vismemo_hf
from vismemo_hf import HitKind

from conftest import build_inputs, generate, page_set, stored


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


def _bf16_pair(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two float32 pixel tensors that differ wherever a pixel is not 0 yet cast to the same bf16 values: ``a`` holds
    bf16 values exactly, ``b`` each moved by a sixteenth of its half-ulp (2^-12 of it against 2^-8)."""
    a = pixels.to(torch.bfloat16).float()
    return a, a * (1 + 2.0 ** -12)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision"])
def test_exact_key_reads_the_pixels_as_the_tower_does(family):
    """A bf16 tower reads float32 pixels cast to bf16 (every family's ``get_image_features``): pixels equal in bf16
    are one image for the model, and one exact key (half the bytes to copy and hash); a float32 tower tells them
    apart. Whatever the key, an exact hit answers as plain transformers do on its own pixels."""
    from vismemo_hf.testing import tiny_model

    model, processor = tiny_model(family, seed=0)
    model = model.to(torch.bfloat16)
    plain = copy.deepcopy(model)
    vismemo_hf.enable(model)
    inputs = build_inputs(processor, [page_set()["base"]])
    a, b = _bf16_pair(inputs["pixel_values"])
    assert not torch.equal(a, b) and torch.equal(a.to(torch.bfloat16), b.to(torch.bfloat16))
    first, second = {**inputs, "pixel_values": a}, {**inputs, "pixel_values": b}
    ref_tokens, ref = generate(plain, second, DynamicCache(), new_tokens=3)
    assert torch.equal(ref, generate(plain, first, DynamicCache(), new_tokens=3)[1])  # one image for the model
    store = vismemo_hf.VisMemoStore()
    miss = vismemo_hf.VisMemoCache(store=store)
    generate(model, first, miss, new_tokens=1)
    store.flush()
    hit = vismemo_hf.VisMemoCache(store=store)
    tokens, scores = generate(model, second, hit, new_tokens=3)
    assert hit.events[0].kind is HitKind.EXACT and hit.events[0].alias == miss.events[0].key
    assert torch.equal(tokens, ref_tokens) and (scores.float() - ref.float()).abs().max() <= 0.05
    edited = b.clone()
    edited.view(-1)[: edited.numel() // 2] += 0.5  # half the image changed: another image in bf16 too
    other = vismemo_hf.VisMemoCache(store=store)
    generate(model, {**inputs, "pixel_values": edited}, other, new_tokens=1)
    assert other.events[0].kind is not HitKind.EXACT
    # the other stages read the same cast pixels: an edited page is found by them (a failure there would be a miss)
    edit = vismemo_hf.VisMemoCache(store=store)
    generate(model, build_inputs(processor, [page_set()["edit"]]), edit, new_tokens=1)
    assert edit.events[0].kind is HitKind.APPROXIMATE and edit.events[0].alias == miss.events[0].key

    model32, processor32 = tiny_model(family, seed=0)
    vismemo_hf.enable(model32)
    store32 = vismemo_hf.VisMemoStore()
    generate(model32, first, vismemo_hf.VisMemoCache(store=store32), new_tokens=1)
    store32.flush()
    cache32 = vismemo_hf.VisMemoCache(store=store32)
    generate(model32, second, cache32, new_tokens=1)
    assert cache32.events[0].kind is not HitKind.EXACT

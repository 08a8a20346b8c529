"""generate() paths beyond greedy decoding: beam search and several returned sequences look images up like any
request (no silent bypass), use_cache=False and a reused cache are clear errors that say what to do."""

import pytest
import torch
from transformers import DynamicCache

import vismemo_hf
from vismemo_hf.core.plan import HitKind

from conftest import build_inputs, stored


def _beams(model, inputs, cache, **kw):
    with torch.no_grad():
        out = model.generate(**inputs, cache=cache, max_new_tokens=4, output_scores=True,
                             return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.scores, 1)


@pytest.mark.parametrize("options", [dict(num_beams=3, num_return_sequences=2), dict(num_beams=2, do_sample=False)])
def test_beam_search_looks_up_and_matches_a_dynamic_cache(tiny, pages, options):
    model, processor = tiny
    inputs = build_inputs(processor, [pages["base"]])
    ref_seq, ref_scores = _beams(model, inputs, DynamicCache(), **options)
    store = vismemo_hf.VisMemoStore()
    miss = vismemo_hf.VisMemoCache(store=store)
    seq, scores = _beams(model, inputs, miss, **options)
    beams = options["num_beams"]
    assert [e.kind for e in miss.events] == [HitKind.MISS] * beams and len(store) == 1
    assert torch.equal(seq, ref_seq) and torch.allclose(scores, ref_scores, atol=1e-4)
    exact = vismemo_hf.VisMemoCache(store=store)
    seq, scores = _beams(model, inputs, exact, **options)
    assert [e.kind for e in exact.events] == [HitKind.EXACT] * beams
    assert torch.equal(seq, ref_seq) and torch.allclose(scores, ref_scores, atol=1e-4)


def test_several_sampled_sequences_look_up_every_copy(qwen2, pages):
    model, processor = qwen2
    store = stored(model, processor, pages["base"])
    inputs = build_inputs(processor, [pages["edit"]])
    cache = vismemo_hf.VisMemoCache(store=store, recompute_ratio=1.0, mask_below=0.0)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**inputs, cache=cache, max_new_tokens=3, do_sample=True,
                             num_return_sequences=3)
    assert out.shape[0] == 3
    assert [e.kind for e in cache.events] == [HitKind.APPROXIMATE] * 3 and [e.row for e in cache.events] == [0, 1, 2]


def test_use_cache_false_is_a_clear_error(qwen2, pages):
    model, processor = qwen2
    inputs = build_inputs(processor, [pages["base"]])
    with pytest.raises(ValueError, match="use_cache=True"), torch.no_grad():
        model.generate(**inputs, cache=vismemo_hf.VisMemoCache(), use_cache=False, max_new_tokens=2)


@pytest.mark.parametrize("hit", ["miss", "exact"])
def test_continuing_from_a_returned_cache_equals_one_generate(qwen2, pages, hit):
    """A second turn continues the first's cache (text only; the image is in the cache already), as with a
    DynamicCache: 3 + 2 new tokens equal 5 in one call."""
    model, processor = qwen2
    inputs = build_inputs(processor, [pages["base"]])
    store = stored(model, processor, pages["base"]) if hit == "exact" else vismemo_hf.VisMemoStore()
    options = dict(do_sample=False, return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        whole = model.generate(**inputs, max_new_tokens=5, **options)
        first = model.generate(**inputs, cache=vismemo_hf.VisMemoCache(store=store), max_new_tokens=3, **options)
        cache = first.past_key_values
        assert isinstance(cache, vismemo_hf.VisMemoCache) and cache.events[0].kind is HitKind(hit)
        follow = {k: v for k, v in inputs.items() if "pixel" not in k}
        follow["input_ids"] = first.sequences
        follow["attention_mask"] = torch.ones_like(first.sequences)
        second = model.generate(**follow, cache=cache, max_new_tokens=2, **options)
    assert torch.equal(second.sequences, whole.sequences)
    assert (torch.stack(first.scores + second.scores) - torch.stack(whole.scores)).abs().max() <= 1e-4

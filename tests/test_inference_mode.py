"""``torch.inference_mode()``, which serving code wraps ``generate`` in: every tensor made there is an inference
tensor (no version counter, no in-place update outside the mode). A miss is stored, an exact hit gives plain
transformers' tokens and scores (within ``tests/test_exactness.py``'s 1e-4), and approximate hits are found by the
pixel stage and the pixel-first stage, as under ``no_grad``."""

import torch

import vismemo_hf
from vismemo_hf.core.plan import HitKind
from vismemo_hf.eval import synthdoc

from conftest import _enabled_tiny, build_inputs


def _generate(model, inputs, cache):
    with torch.inference_mode():
        out = model.generate(**inputs, cache=cache, max_new_tokens=3, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    return out.sequences[:, inputs["input_ids"].shape[1]:], torch.stack(out.scores, 1)


def test_a_miss_an_exact_and_an_approximate_hit_under_inference_mode():
    from transformers import DynamicCache

    model, processor = _enabled_tiny("glm4v")
    page = synthdoc.random_form(2001, style=synthdoc.STYLES[1])
    inputs = build_inputs(processor, [synthdoc.render(page)])
    plain_tokens, plain_scores = _generate(model, inputs, DynamicCache())
    store = vismemo_hf.VisMemoStore()
    for kind in (HitKind.MISS, HitKind.EXACT):  # the exact hit reads what the store's writer thread made
        cache = vismemo_hf.VisMemoCache(store=store)
        tokens, scores = _generate(model, inputs, cache)
        assert cache.events[0].kind is kind, cache.events[0]
        assert torch.equal(tokens, plain_tokens), kind
        torch.testing.assert_close(scores, plain_scores, atol=1e-4, rtol=0)  # as tests/test_exactness.py
    for _ in range(2):  # the second time the pixel stage's prepared thumbnails are the first time's
        cache = vismemo_hf.VisMemoCache(store=store, store_misses=False)
        _generate(model, build_inputs(processor, [synthdoc.render(synthdoc.shift(page, 3, 0))]), cache)
        event = cache.events[0]
        assert event.kind is HitKind.APPROXIMATE and event.found_by == "thumbnail", event
    import random

    cache = vismemo_hf.VisMemoCache(store=store, store_misses=False)  # an edited value: the pixel-first stage and
    _generate(model, build_inputs(processor, [synthdoc.render(synthdoc.edit_value(page, 2, random.Random(0)))]), cache)
    event = cache.events[0]  # the tower for the changed tokens only, lent the stored tower K/V
    assert event.kind is HitKind.APPROXIMATE and event.found_by == "pixels", event
    assert 0 < event.encoded_tokens < event.n_tokens, event
    store.flush()
    assert len(store) == 1  # the miss's entry; the hits stored nothing


def test_entries_written_under_inference_mode_reach_disk_and_serve_another_store(tmp_path):
    """The disk tier's writer thread, which runs outside the mode, writes an entry made of inference tensors; a store
    opened on the directory afterwards serves an exact hit with plain transformers' tokens and scores."""
    from transformers import DynamicCache

    model, processor = _enabled_tiny("qwen2_vl")
    inputs = build_inputs(processor, [synthdoc.render(synthdoc.random_form(2002, style=synthdoc.STYLES[2]))])
    plain = _generate(model, inputs, DynamicCache())
    store = vismemo_hf.VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=2**30)
    _generate(model, inputs, vismemo_hf.VisMemoCache(store=store))
    store.flush()
    reopened = vismemo_hf.VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, disk_bytes=2**30)
    cache = vismemo_hf.VisMemoCache(store=reopened)
    tokens, scores = _generate(model, inputs, cache)
    assert cache.events[0].kind is HitKind.EXACT, cache.events[0]
    assert torch.equal(tokens, plain[0])
    torch.testing.assert_close(scores, plain[1], atol=1e-4, rtol=0)


def test_generate_modes_under_inference_mode_give_plain_tokens(family):
    """Greedy, beam search, sampled ``num_return_sequences`` and a left-padded batch of two pages under
    ``inference_mode``: the tokens of a miss and of the exact hit after it are plain transformers'."""
    from transformers import DynamicCache

    model, processor = _enabled_tiny(family)
    a = synthdoc.render(synthdoc.random_form(2003, style=synthdoc.STYLES[0]))
    b = synthdoc.render(synthdoc.random_form(2004, style=synthdoc.STYLES[0]))
    single = build_inputs(processor, [a])
    batch = build_inputs(processor, None, batch=[([a], "What is row 1?", ""), ([b], "What is the total?", "")])
    store = vismemo_hf.VisMemoStore()
    modes = {"greedy": (single, {}), "beam": (single, {"num_beams": 2}),
             "sampled": (single, {"do_sample": True, "num_return_sequences": 2}), "batch": (batch, {})}
    for name, (inputs, options) in modes.items():
        outputs, caches = [], (DynamicCache(), vismemo_hf.VisMemoCache(store=store), vismemo_hf.VisMemoCache(store=store))
        for cache in caches:
            torch.manual_seed(0)
            with torch.inference_mode():
                outputs.append(model.generate(**inputs, cache=cache, max_new_tokens=4, **({"do_sample": False} | options)))
        assert torch.equal(outputs[1], outputs[0]) and torch.equal(outputs[2], outputs[0]), (family, name)
        assert caches[2].events and all(e.kind is HitKind.EXACT for e in caches[2].events), (family, name)

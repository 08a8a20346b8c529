"""Prefix reuse (``runtime.prefix``): a request that starts as an earlier one did reuses that prefix's K/V whole and
computes the rest, with the answers of plain transformers."""

import pytest
import torch

import vismemo_hf
from vismemo_hf import HitKind
from vismemo_hf.store.prefixes import BLOCK, block_ends, block_hashes

from conftest import generate


def _chat_inputs(processor, turns):
    """Processor inputs of a chat whose user turns are ``turns`` ((images, text) each), with fixed answers."""
    messages, images = [], []
    for k, (imgs, text) in enumerate(turns):
        content = [{"type": "image"} for _ in imgs] + [{"type": "text", "text": text}]
        messages.append({"role": "user", "content": content})
        images.extend(imgs)
        if k < len(turns) - 1:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": f"Answer {k} is 12{k}."}]})
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor(text=[text], images=images or None, return_tensors="pt")


def _plain(model, inputs, n=3):
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    return out.sequences[:, inputs["input_ids"].shape[1]:], torch.stack(out.scores, 1)


def test_a_chat_reuses_its_history_and_answers_as_plain_transformers(family, pages):
    """Every turn re-sends the conversation: from the second turn on the history's K/V are reused whole (its images
    neither looked up nor encoded, counted as exact hits found by the prefix) and only the new tokens computed; a new
    page in a later turn is computed in full. Every answer and first-token score equals plain transformers'."""
    from vismemo_hf.testing import tiny_model

    model, processor = tiny_model(family, seed=2)
    twin, _ = tiny_model(family, seed=2)
    vismemo_hf.enable(model)
    store = vismemo_hf.VisMemoStore()
    turns = [([pages["base"]], "What is the value of row 1?"), ([], "And of row 2?"),
             ([pages["noise"]], "What is on this one?"), ([], "Compare both.")]
    calls = []
    for t in range(1, len(turns) + 1):
        inputs = _chat_inputs(processor, turns[:t])
        cache = vismemo_hf.VisMemoCache(store=store)
        tokens, scores = generate(model, inputs, cache, 3)
        plain_tokens, plain_scores = _plain(twin, inputs)
        assert torch.equal(tokens, plain_tokens)
        assert (scores - plain_scores).abs().max() <= 1e-4
        found = [e.found_by for e in cache.events]
        calls.append(found)
        if t > 1:
            assert found[0] == "prefix" and cache.events[0].kind is HitKind.EXACT
    assert calls[2] == ["prefix", None] and calls[3] == ["prefix", "prefix"]
    assert store.prefixes.reused_blocks > 0


def test_a_second_question_about_the_same_page_reuses_the_page(qwen2, pages):
    """Another question after the same page: the page and the text before it come from the first request's blocks."""
    from conftest import build_inputs

    model, processor = qwen2
    store = vismemo_hf.VisMemoStore()
    generate(model, build_inputs(processor, [pages["edit"]], question="What is the value of row 1?"),
             vismemo_hf.VisMemoCache(store=store), 1)
    cache = vismemo_hf.VisMemoCache(store=store)
    inputs = build_inputs(processor, [pages["edit"]], question="Which row holds 9999?")
    tokens, scores = generate(model, inputs, cache, 3)
    assert cache.events[0].found_by == "prefix"
    plain_tokens, plain_scores = _plain_without(model, inputs)
    assert torch.equal(tokens, plain_tokens) and (scores - plain_scores).abs().max() <= 1e-4


def _plain_without(model, inputs):
    """Plain transformers' answer on the same weights: the model with the library taken off for the call."""
    vismemo_hf.disable(model)
    try:
        return _plain(model, inputs)
    finally:
        vismemo_hf.enable(model)


def test_blocks_after_an_approximate_hit_are_not_kept(qwen2, pages):
    """An approximate hit's K/V are not a full prefill's: the request's blocks are kept only before its image, so a
    later request with the same start finds the text before the image and computes the image again."""
    from conftest import build_inputs, stored

    model, processor = qwen2
    store = stored(model, processor, pages["base"], store=vismemo_hf.VisMemoStore(prefix_bytes=None))
    before = len(store.prefixes)
    inputs = build_inputs(processor, [pages["edit"]])
    cache = vismemo_hf.VisMemoCache(store=store)
    generate(model, inputs, cache, 1)
    assert cache.events[0].kind is HitKind.APPROXIMATE
    store.flush()
    image_start = int((inputs["input_ids"][0] == model.config.image_token_id).nonzero()[0])
    ids = inputs["input_ids"][0].tolist()
    owner = cache.owner(model._vismemo.fingerprint)
    images = [(image_start, cache.events[0].n_tokens, cache.events[0].key)]
    kept = store.prefixes.longest(block_hashes(owner, ids, images))
    assert (block_ends(len(ids), images)[kept - 1] if kept else 0) <= image_start and len(store.prefixes) >= before
    again = vismemo_hf.VisMemoCache(store=store)
    generate(model, inputs, again, 1)
    assert again.events[0].found_by != "prefix"


def _served_once(model, processor, image):
    """A store that served one request about ``image`` (its entry and blocks written), and that request's inputs."""
    from conftest import build_inputs

    store = vismemo_hf.VisMemoStore()
    inputs = build_inputs(processor, [image])
    generate(model, inputs, vismemo_hf.VisMemoCache(store=store), 1)
    store.flush()
    return store, inputs


def test_a_direct_forward_never_skips_a_prefix(qwen2, pages):
    """A forward outside ``generate`` returns logits at every position: it never skips a reused prefix's tokens
    (its image is an exact hit, whose text positions are computed)."""
    from transformers import DynamicCache

    model, processor = qwen2
    store, inputs = _served_once(model, processor, pages["base"])
    cache = vismemo_hf.VisMemoCache(store=store)
    with torch.no_grad():
        out = model(**inputs, cache=cache, use_cache=True)
        ref = model(**inputs, cache=DynamicCache(), use_cache=True)
    assert cache.events[0].found_by == "key" and out.logits.shape == ref.logits.shape
    text = inputs["input_ids"][0] != model.config.image_token_id
    assert (out.logits[0, text] - ref.logits[0, text]).abs().max() <= 1e-4


@pytest.mark.parametrize("mode", [dict(num_beams=2), dict(num_return_sequences=2, do_sample=True, top_k=3)])
def test_expanded_requests_do_not_reuse_a_prefix_and_answer_as_plain(qwen2, pages, mode):
    model, processor = qwen2
    store, inputs = _served_once(model, processor, pages["base"])
    cache = vismemo_hf.VisMemoCache(store=store)
    torch.manual_seed(0)
    with torch.no_grad():
        ours = model.generate(**inputs, cache=cache, max_new_tokens=3, **mode)
    assert all(e.found_by != "prefix" for e in cache.events)
    vismemo_hf.disable(model)
    try:
        torch.manual_seed(0)
        with torch.no_grad():
            plain = model.generate(**inputs, max_new_tokens=3, **mode)
    finally:
        vismemo_hf.enable(model)
    assert torch.equal(ours, plain)


def test_prefix_bytes_zero_keeps_no_prefix(qwen2, pages):
    from conftest import build_inputs

    model, processor = qwen2
    store = vismemo_hf.VisMemoStore(prefix_bytes=0)
    assert store.prefixes is None
    for _ in range(2):
        cache = vismemo_hf.VisMemoCache(store=store)
        generate(model, build_inputs(processor, [pages["base"]]), cache, 1)
    assert cache.events[0].kind is HitKind.EXACT and cache.events[0].found_by == "key"


def test_block_hashes_name_the_images_not_only_their_placeholders():
    ids = list(range(3 * BLOCK))
    a = block_hashes("m", ids, [(5, 10, "image-a")])
    b = block_hashes("m", ids, [(5, 10, "image-b")])
    assert len(a) == 4 and all(x != y for x, y in zip(a, b))  # a block ends at the image's end (15) too
    assert block_ends(len(ids), [(5, 10, "image-a")]) == [15, BLOCK, 2 * BLOCK, 3 * BLOCK]
    assert block_hashes("m", ids, []) != block_hashes("other model", ids, [])
    longer = block_hashes("m", ids + [7] * BLOCK, [(5, 10, "image-a")])
    assert longer[:4] == a
    assert block_ends(2 * BLOCK, [(0, BLOCK, "x")]) == [BLOCK, 2 * BLOCK]  # an image ending on a block's end: once


def test_a_block_ends_at_every_image_end_so_another_question_reuses_the_page(tiny, pages):
    """The same page with a question that differs from its first token: the requests share everything up to the
    page's end, which is not a multiple of ``BLOCK``. A block ends there, so the page and the text before it are
    reused (an exact hit found by the prefix) and only the question is computed, with plain transformers' answer."""
    from conftest import build_inputs

    model, processor = tiny
    store = vismemo_hf.VisMemoStore()
    first = build_inputs(processor, [pages["base"]], question="Read row 1.")
    generate(model, first, vismemo_hf.VisMemoCache(store=store), 1)
    inputs = build_inputs(processor, [pages["base"]], question="Which row holds 9999?")
    ids = inputs["input_ids"][0]
    image = (ids == model.config.image_token_id).nonzero().flatten()
    end = int(image[-1]) + 1
    common = int((first["input_ids"][0][:len(ids)] != ids[:first["input_ids"].shape[1]]).nonzero()[0])
    assert end <= common < end + BLOCK and end % BLOCK, "the requests share the page and a few tokens after it"
    cache = vismemo_hf.VisMemoCache(store=store)
    tokens, scores = generate(model, inputs, cache, 3)
    assert [e.found_by for e in cache.events] == ["prefix"] and cache.events[0].kind is HitKind.EXACT
    plain_tokens, plain_scores = _plain_without(model, inputs)
    assert torch.equal(tokens, plain_tokens) and (scores - plain_scores).abs().max() <= 1e-4


def test_an_agent_keeping_its_last_screens_reuses_them_as_a_prefix(family):
    """An agent's loop keeping its last three screenshots: once the window slides (a request's first screenshot came
    after another in an earlier one), the same request without its first screenshot is computed while no request
    runs and kept as prefix blocks, and the next step reuses its first two screenshots whole. Every answer and
    first-token score equals plain transformers'."""
    from vismemo_hf.eval import workload
    from vismemo_hf.testing import tiny_model

    model, processor = tiny_model(family, seed=2)
    twin, _ = tiny_model(family, seed=2)
    vismemo_hf.enable(model)
    store = vismemo_hf.VisMemoStore()
    found = []
    for request in workload.agent((112, 112), 3, seed=1, steps=6):
        text = processor.apply_chat_template(request.messages, add_generation_prompt=True)
        inputs = processor(text=[text], images=request.images, return_tensors="pt")
        cache = vismemo_hf.VisMemoCache(store=store)
        tokens, scores = generate(model, inputs, cache, 3)
        plain_tokens, plain_scores = _plain(twin, inputs)
        assert torch.equal(tokens, plain_tokens)
        assert (scores - plain_scores).abs().max() <= 1e-4
        found.append([e.found_by for e in cache.events])
        store.flush()  # the time an agent takes to act: the speculation runs
    assert found[4][:2] == ["prefix", "prefix"] and found[5][:2] == ["prefix", "prefix"]
    assert store.prefixes.speculations["read"] >= 2


def test_a_request_never_waits_for_a_speculation():
    """A request that needs blocks a speculation has not written yet does not wait for it: the speculation is called
    off (one not started never runs, one running stops at its next layer) and the blocks count as missing; the
    blocks of one that is done are reused."""
    from concurrent.futures import Future

    from vismemo_hf.store.prefixes import PrefixBlocks, Speculation

    blocks, hashes = PrefixBlocks(None), ["a", "b"]
    blocks.add(["a"], [torch.zeros(1, 2, 1, BLOCK, 4)])
    waiting = Speculation()
    blocks.announce(["b"], Future(), claim=waiting.claim)
    assert blocks.held(hashes) == 2  # counted as coming by a writer that does not claim it
    assert blocks.longest(hashes) == 1 and not waiting.start()  # called off: it never runs
    running = Speculation()
    blocks.announce(["c"], Future(), claim=running.claim)
    assert running.start() and running.running
    assert blocks.longest(["a", "c"]) == 1 and not running.running  # stops at its next layer
    done = Speculation()
    blocks.announce(["d"], Future(), claim=done.claim)
    assert done.start()
    blocks.add(["d"], [torch.zeros(1, 2, 1, BLOCK, 4)])
    done.done()
    assert blocks.longest(["a", "d"]) == 2


def test_window_slid_declines_after_speculations_nobody_read():
    """``PrefixBlocks.window_slid``: a request whose first image came after another image in an earlier request slides;
    after ``UNREAD`` speculations in a row that no request read it declines, but for one in ``RETRY``."""
    from vismemo_hf.store import prefixes

    blocks = prefixes.PrefixBlocks(None)
    assert not blocks.window_slid(["s0", "s1"])
    assert blocks.window_slid(["s1", "s2"])
    blocks.speculating("x1")
    assert blocks.window_slid(["s2", "s3"])  # the first unread
    blocks.speculating("x2")
    answers = [blocks.window_slid([f"s{k}", f"s{k + 1}"]) for k in range(3, 3 + prefixes.RETRY)]
    assert answers.count(True) == 1 and blocks.speculations["declined"] == prefixes.RETRY - 1


def test_the_workload_benchmark_measures_an_agents_window_reused_between_its_steps():
    """``bench workload``'s stream runner with time between the requests (``--idle-ms``): an agent keeping its last
    three screenshots reuses its earlier screenshots from the fifth step on (the speculation ran while it acted,
    ``ahead_ms``), and every answer equals plain transformers'."""
    import copy

    from vismemo_hf.bench.workload import run_stream, summary
    from vismemo_hf.eval import workload
    from vismemo_hf.testing import tiny_model

    model, processor = tiny_model("qwen2_vl", seed=2)
    plain = copy.deepcopy(model)
    vismemo_hf.enable(model)
    requests = workload.agent((112, 112), 3, seed=1, steps=6)
    stream = run_stream(model, plain, processor, requests, 1, 2, first=False, idle_ms=100)
    result = summary(stream)
    assert result["same_answers"] == result["requests"] == 6 and result["ahead_ms"] > 0
    for step in stream.requests[4:]:  # three screens, the first two reused whole
        assert step.reused == 2 * step.visual // 3

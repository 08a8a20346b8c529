"""Moved hits: a page scrolled or moved by whole visual tokens is found at its shift by the fine stage and reuses the
cached K/V at the moved positions (keys turned by the M-RoPE delta of each section); tokens moved into view are
computed."""

import random

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import vismemo_hf.families
from vismemo_hf.core.plan import HitKind, ImageFeatures, ImagePlan
from vismemo_hf.core.thresholds import best_shift
from vismemo_hf.eval import docpage, docqa_base, docstream


def _features(n, kv_tokens=None):
    return ImageFeatures("k" * 64, (1, 8, 8), torch.randn(n, 8), entropy=torch.rand(n),
                         patch_hashes=torch.arange(n), kv_tokens=kv_tokens)


def test_best_shift_finds_the_shift_of_a_moved_grid_and_prefers_none_on_ties():
    h, w = 6, 7
    grid = F.normalize(torch.randn(h + 2, w + 2, 16), dim=-1)
    a = grid[1 : h + 1, 1 : w + 1].reshape(-1, 16)  # a's token (r, c) is b's (r + 1, c)
    b = grid[0:h, 1 : w + 1].reshape(-1, 16)
    score, shift = best_shift(a, b, (h, w))
    assert shift == (1, 0) and score == pytest.approx(1.0)
    same = F.normalize(torch.ones(h * w, 16), dim=-1)
    assert best_shift(same, same, (h, w)) == (pytest.approx(1.0), (0, 0))
    tiny = F.normalize(torch.randn(4, 16), dim=-1)  # a 2 x 2 grid: no shift overlaps 75 % of it
    assert best_shift(tiny, torch.roll(tiny, 2, 0), (2, 2))[1] == (0, 0)


def test_a_moved_alias_maps_every_token_and_leaves_the_ones_moved_into_view_without_kv():
    cached = _features(64)
    moved = cached.moved((1, -1), (8, 8))  # request (r, c) shows cached (r + 1, c - 1)
    outside = set(moved.outside.tolist())
    assert outside == {r * 8 + c for r in range(8) for c in range(8) if r == 7 or c == 0}
    inside = torch.tensor([t for t in range(64) if t not in outside])
    source = inside + 8 - 1
    assert torch.equal(moved.stored_rows(inside), source)
    assert torch.equal(moved.embeds[inside], cached.embeds[source])
    assert torch.equal(moved.patch_hashes[inside], cached.patch_hashes[source])
    assert not bool(moved.stored(moved.outside).any())
    with pytest.raises(ValueError):
        moved.stored_rows(moved.outside[:1])
    compressed = _features(64, kv_tokens=torch.arange(0, 64, 2)).moved((0, 1), (8, 8))
    held = torch.nonzero(compressed.stored(torch.arange(64))).flatten()
    assert torch.equal(compressed.stored_rows(held), (held + 1) // 2)  # rows of the compressed entry


@pytest.mark.parametrize("missing", ["mask", "recompute"])
def test_tokens_moved_into_view_are_recomputed_whether_the_plan_reused_or_masked_them(missing):
    alias = _features(64).moved((1, 0), (8, 8))  # the last row is new
    plan = ImagePlan(HitKind.APPROXIMATE, 64, 1, torch.arange(4), torch.arange(4, 60), torch.arange(60, 64), alias.key)
    limited = plan.limited_to(alias, missing)
    assert set(alias.outside.tolist()) <= set(limited.recompute.tolist())
    assert not set(alias.outside.tolist()) & (set(limited.reuse.tolist()) | set(limited.mask.tolist()))


@pytest.mark.approximate
def test_a_key_turned_by_the_moved_position_delta_equals_the_key_computed_there(family):
    """M-RoPE sections (Qwen2-VL's contiguous, Qwen3-VL's interleaved, GLM-4V's over a partial rotary dimension):
    a key computed at (t, h, w) and moved by d positions and (dy, dx) tokens is the key computed at
    (t + d, h + d - dy, w + d - dx), in every family."""
    from conftest import _enabled_tiny

    if not vismemo_hf.families.FAMILIES[family].movable:
        pytest.skip(f"{family}: a copy is never matched moved (its tokens are a packed run, not a grid)")
    model, _ = _enabled_tiny(family)
    adapter = model._vismemo
    hidden = torch.randn(5, model.config.text_config.hidden_size)
    old = torch.tensor([[7, 9, 7, 8, 10], [7, 11, 12, 9, 8], [7, 8, 10, 13, 9]]).view(3, 1, 5)
    delta = (4, 3, 6)  # an image 4 positions later, moved by dy = 1 row and dx = -2 columns
    new = old + torch.tensor(delta).view(3, 1, 1)
    with torch.no_grad():
        keys_old, _ = adapter.fresh_kv(0, hidden, *(x[0] for x in adapter.rope(hidden[None], old)))
        keys_new, _ = adapter.fresh_kv(0, hidden, *(x[0] for x in adapter.rope(hidden[None], new)))
        turned = adapter.move_keys(keys_old, 4, (1, -2))
    assert (turned - keys_new).abs().max() <= 1e-4 * keys_new.abs().max()


@pytest.mark.skipif(not (docqa_base.PACKAGED / "config.json").is_file(), reason="no packaged checkpoint")
def test_a_page_scrolled_by_a_token_row_is_a_moved_hit_that_answers_like_a_full_prefill():
    import vismemo_hf
    from vismemo_hf.eval.loading import load_model
    from vismemo_hf.eval.quality import answer

    model, processor = load_model(docqa_base.MODEL_NAME)
    vismemo_hf.enable(model)
    rng = random.Random(3)
    for i, dy in enumerate((28, -28, 28)):  # one token row (28 px) up or down
        base = docpage.random_page(2**31 + 61_000 + i, layout=docpage.LAYOUTS[i])
        page = docpage.scroll(base, dy)
        store = vismemo_hf.VisMemoStore()
        first = docstream.request("a", base, docpage.random_question(rng, base, instruct=0.0), "miss", "a")
        answer(model, processor, first, vismemo_hf.VisMemoCache(store=store), 1)
        request = docstream.request("b", page, docpage.random_question(rng, page, instruct=0.0), "approximate", "b")
        cache = vismemo_hf.VisMemoCache(store=store, thresholds="vismemo-docqa-base")  # its calibrated preset
        prediction, _, logprobs, _, _ = answer(model, processor, request, cache, 6)
        plain, _, plain_logprobs, _, _ = answer(model, processor, request, DynamicCache(), 6)
        event = cache.events[0]
        assert event.kind is HitKind.APPROXIMATE and event.shift == (dy // 28, 0), (i, event)
        new_row = set(range(240, 256)) if dy > 0 else set(range(16))
        assert new_row <= set(event.plan.recompute.tolist())
        assert event.reused >= 128  # most of the page is reused at its moved position
        assert prediction == plain, (i, prediction, plain)
        assert float((logprobs.exp() - plain_logprobs.exp()).abs().max()) <= 0.05

"""Every policy x every tiny family x every hit kind runs generate and keeps its plan invariants."""

import math

import pytest
import torch
from transformers import DynamicCache

import vismemo_hf
from vismemo_hf import HitKind, ImageFeatures, WarmupSignals, get_policy
from vismemo_hf.eval import synthetic
from vismemo_hf.presets import config_dir

from conftest import build_inputs, generate, stored

#: every registered policy and every preset of configs/policies/
POLICIES = vismemo_hf.available_policies() + sorted(p.stem for p in (config_dir() / "policies").glob("*.yaml"))


def _check_plan(plan, policy, kind, n_layers):
    n = plan.n_tokens
    sets = [set(x.tolist()) for x in (plan.recompute, plan.reuse, plan.mask)]
    assert sum(map(len, sets)) == n and set.union(*sets) == set(range(n))
    computed = [set(plan.computed_at(layer).tolist()) for layer in range(n_layers)]
    assert all(a >= b for a, b in zip(computed, computed[1:])), "computed sets must nest"
    for layer in range(n_layers):
        assert not computed[layer] & set(plan.reused_at(layer).tolist())
    name = policy.name
    if kind is HitKind.MISS or name == "full":
        assert plan.complete
        return
    if kind is HitKind.EXACT:
        assert plan.reuse.numel() == n and plan.computed_at(0).numel() == 0
        return
    if name == "naive":
        assert plan.reuse.numel() == n and plan.warmup_layers == 0
    elif name in ("cacheblend", "attention-only"):
        assert plan.recompute.numel() == math.ceil(policy.recompute_ratio * n - 1e-9) and plan.mask.numel() == 0
    elif name == "vlcache":
        assert plan.mask.numel() == 0 and plan.recompute.tolist() == list(range(plan.recompute.numel()))
    elif name == "attend-deviate":
        assert plan.recompute.numel() >= math.ceil(policy.recompute_ratio * n - 1e-9)
        assert plan.mask.numel() <= math.ceil(policy.max_mask_ratio * n - 1e-9)
        assert plan.restore_masked == policy.restore_masked
    elif name == "vismemo":
        budget_b, budget_r = (math.ceil(r * n - 1e-9) for r in (policy.reuse_ratio, policy.recompute_ratio))
        if policy.use_mask:
            assert plan.reuse.numel() <= budget_b
            assert plan.recompute.numel() == min(budget_r, n - plan.reuse.numel())
        else:
            assert plan.mask.numel() == 0 and plan.recompute.numel() == budget_r


@pytest.mark.approximate
@pytest.mark.parametrize("policy", POLICIES)
def test_policy_matrix(tiny, pages, policy):
    model, processor = tiny
    store = stored(model, processor, pages["base"])
    n_layers = model.config.text_config.num_hidden_layers
    for image, kind in ((pages["base"], HitKind.EXACT), (pages["edit"], HitKind.APPROXIMATE),
                        (pages["noise"], HitKind.MISS)):
        cache = vismemo_hf.VisMemoCache(store=store, policy=policy, store_misses=False)
        tokens, scores = generate(model, build_inputs(processor, [image]), cache, 2)
        assert torch.isfinite(scores).all() and tokens.shape == (1, 2)
        (event,) = cache.events
        assert event.kind is kind, (policy, kind)
        _check_plan(event.plan, cache.policy, kind, n_layers)
        assert (event.recomputed, event.reused, event.masked) == tuple(
            x.numel() for x in (event.plan.recompute, event.plan.reuse, event.plan.mask))


def test_full_equals_plain_dynamic_cache_exactly(tiny, pages):
    model, processor = tiny
    store = stored(model, processor, pages["base"])
    for image in (pages["base"], pages["edit"], pages["noise"]):
        inputs = build_inputs(processor, [image])
        ref_tokens, ref = generate(model, inputs, DynamicCache(), 3)
        tokens, scores = generate(model, inputs, vismemo_hf.VisMemoCache(store=store, policy="full"), 3)
        assert torch.equal(tokens, ref_tokens) and torch.equal(scores, ref)


def test_full_stores_its_approximate_hits(qwen2, pages):
    model, processor = qwen2
    store = stored(model, processor, pages["base"])
    cache = vismemo_hf.VisMemoCache(store=store, policy="full")
    generate(model, build_inputs(processor, [pages["edit"]]), cache, 1)
    assert cache.events[0].kind is HitKind.APPROXIMATE and cache.events[0].key in store


def test_naive_exact_hit_with_identical_prompt_equals_plain_run(tiny, pages):
    model, processor = tiny
    store = stored(model, processor, pages["base"])
    inputs = build_inputs(processor, [pages["base"]])
    _, ref = generate(model, inputs, DynamicCache(), 3)
    cache = vismemo_hf.VisMemoCache(store=store, policy="naive")
    _, scores = generate(model, inputs, cache, 3)
    assert cache.events[0].kind is HitKind.EXACT and (scores - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("use_keys", [False, True])
def test_cacheblend_recomputes_the_tokens_whose_stored_kv_was_perturbed(qwen2, pages, use_keys):
    model, processor = qwen2
    store = stored(model, processor, pages["base"])
    (entry,) = store.device.lru.values()
    perturbed = torch.tensor([3, 11, 20, 31, 40])
    torch.manual_seed(0)
    entry.kv[perturbed, 1, 0 if use_keys else 1] += 5.0 * torch.randn_like(entry.kv[perturbed, 1, 0])
    cache = vismemo_hf.VisMemoCache(store=store, policy="cacheblend", use_keys=use_keys)
    generate(model, build_inputs(processor, [pages["edit"]]), cache, 1)
    plan = cache.events[0].plan
    assert plan.warmup_layers == 1 and plan.recompute.numel() == math.ceil(0.15 * plan.n_tokens)
    assert set(perturbed.tolist()) <= set(plan.recompute.tolist())


def test_vlcache_recomputes_the_earliest_tokens_with_nested_per_layer_budgets(qwen2, pages):
    model, processor = qwen2
    store = stored(model, processor, pages["base"])
    ratios = [1.0, 0.9, 0.5, 0.5, 0.2, 0.1]
    cache = vismemo_hf.VisMemoCache(store=store, policy="vlcache", layer_recompute_ratios=ratios)
    _, scores = generate(model, build_inputs(processor, [pages["edit"]]), cache, 2)
    plan = cache.events[0].plan
    n = plan.n_tokens
    for layer, r in enumerate(ratios):
        assert plan.computed_at(layer).tolist() == list(range(math.ceil(r * n)))
    assert torch.isfinite(scores).all()


def test_vlcache_profile_ratios_nest_and_keep_the_mean():
    from vismemo_hf.policies.vlcache import layer_ratios

    r = layer_ratios([0.2, 0.9, 0.4, 0.1, 0.3, 0.05], 0.3)
    assert all(a >= b for a, b in zip(r, r[1:])) and abs(sum(r) / len(r) - 0.3) < 1e-6
    assert all(0 <= x <= 1 for x in r)


def test_pixel_patch_recomputes_exactly_the_edited_patches(qwen2):
    model, processor = qwen2
    base = synthetic.page(1)
    edited = synthetic.edited(1, row=2, value="9999")
    store = stored(model, processor, base)
    cache = vismemo_hf.VisMemoCache(store=store, policy="pixel-patch")
    generate(model, build_inputs(processor, [edited]), cache, 1)
    plan = cache.events[0].plan
    # ground truth from the processed pixels: tokens (28x28 px cells) where any pixel differs
    a = processor.image_processor(images=[base], return_tensors="pt").pixel_values
    b = processor.image_processor(images=[edited], return_tensors="pt").pixel_values
    differs = (a != b).reshape(-1, 4, a.shape[-1]).any(-1).any(-1)
    assert 0 < int(differs.sum()) < plan.n_tokens
    assert plan.recompute.tolist() == torch.nonzero(differs).flatten().tolist()
    assert plan.reuse.tolist() == torch.nonzero(~differs).flatten().tolist()


def test_attention_only_picks_the_highest_raw_attention_tokens():
    n = 20
    feats = ImageFeatures("x", (1, 8, 10), torch.randn(n, 4), torch.zeros(n))
    attention = torch.full((2, 2, 3, n), 0.01)
    attention[:, 0, :, 0] = 50.0
    attention[:, 0, :, 3] = 0.5
    attention[:, 1, :, 7] = 0.05
    policy = get_policy("attention-only", recompute_ratio=0.15)
    plan = policy.plan(feats, ImageFeatures("y", (1, 8, 10), torch.randn(n, 4), torch.zeros(n)), None,
                       WarmupSignals(attention))
    assert plan.recompute.tolist() == [0, 3, 7] and plan.mask.numel() == 0 and plan.reuse.numel() == n - 3


def test_an_edit_across_a_token_row_is_not_lent_encoder_output():
    """``row_share``: the largest share of one token row an edit changed; a local edit past ``lend_row_share`` (a
    selected or highlighted row) has the default encode the image whole, another local edit is lent the alias's
    encoder output, and so is a change of most of the image (a row inserted near the top)."""
    from vismemo_hf.core.pixel_first import row_share

    rows = torch.arange(16) // 4  # four rows of four tokens
    local = torch.zeros(16, dtype=torch.bool)
    local[5] = True
    band = torch.zeros(16, dtype=torch.bool)
    band[8:12] = True
    assert row_share(local, rows) == 0.25 and row_share(band, rows) == 1.0
    assert row_share(torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.long)) == 0.0
    policy = get_policy("attend-deviate")
    assert policy.lends_encoder(False, None, local, rows)
    assert not policy.lends_encoder(False, None, band, rows)
    assert get_policy("attend-deviate", lend_row_share=1.0).lends_encoder(False, None, band, rows)
    moved = torch.zeros(16, dtype=torch.bool)
    moved[4:] = True  # a row inserted at the top: every row below changed, not a local edit (recomputed anyway)
    assert policy.lends_encoder(False, None, moved, rows)

"""The analytic FLOPs the benchmarks' floors rest on (issue R): the vision encoder's count against what torch counts
running it, the real models' published figures, and stand-ins that keep the real encoder's share of a miss."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vismemo_hf.bench.flops import encoder_flops, encoder_share, miss_flops, patches_of
from vismemo_hf.families import preset_config


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v"])
def test_the_encoder_count_matches_torchs_count_of_the_tower(family):
    from vismemo_hf.testing import tiny_model

    model, processor = tiny_model(family)
    model.set_attn_implementation("eager")  # attention as matrix products, which torch counts (SDPA on a CPU: not)
    v = model.config.vision_config
    side = 2 * v.patch_size * 8  # 16 x 16 patches: several windows of Qwen2.5-VL's tower
    from PIL import Image

    image = Image.new("RGB", (side, side), (200, 30, 90))
    inputs = processor.image_processor(images=[image], return_tensors="pt")
    grid = inputs["image_grid_thw"]
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.model.visual(inputs["pixel_values"], grid_thw=grid)
    counted = counter.get_total_flops()
    analytic = encoder_flops(model.config, int(grid.prod()))
    assert counted > 0 and abs(analytic - counted) / counted < 0.1, (analytic, counted)


def test_the_llava_onevision_count_matches_torchs_count_of_its_tower_and_projector():
    from vismemo_hf.testing import tiny_model

    model, _ = tiny_model("llava_onevision")
    model.set_attn_implementation("eager")
    v = model.config.vision_config
    tiles = torch.randn(3, v.num_channels, v.image_size, v.image_size)  # each tile attends within itself
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        features = model.model.vision_tower(tiles).last_hidden_state
        model.model.multi_modal_projector(features)
    counted = counter.get_total_flops()
    analytic = encoder_flops(model.config, patches_of(model.config, features.shape[0] * features.shape[1]))
    assert counted > 0 and abs(analytic - counted) / counted < 0.1, (analytic, counted)


def test_the_real_geometries_give_their_published_encoder_costs_and_shares():
    q3 = preset_config("qwen3-vl-8b")
    assert encoder_flops(q3, patches_of(q3, 1024)) == pytest.approx(5.8e12, rel=0.05)
    assert encoder_flops(q3, patches_of(q3, 4096)) == pytest.approx(48.2e12, rel=0.05)
    q25 = preset_config("qwen2.5-vl-7b")
    assert encoder_flops(q25, patches_of(q25, 4096)) == pytest.approx(26.7e12, rel=0.05)  # windowed layers
    assert encoder_share(q3, 4126, 15, 4096) > encoder_share(q3, 1054, 15, 1024) > 0.25
    ov = preset_config("llava-onevision-7b")  # SigLIP-so400m attends within each tile of 729 patches
    assert encoder_flops(ov, patches_of(ov, 1458)) == pytest.approx(2 * encoder_flops(ov, patches_of(ov, 729)))
    assert encoder_share(ov, 4126, 15, 4096) < 0.1


@pytest.mark.parametrize(("real_name", "stand_in_name"), [
    ("qwen3-vl-8b", "qwen3-vl-8b-narrow"), ("qwen2.5-vl-7b", "qwen2.5-vl-7b-narrow"),
    ("glm-4.6v-flash", "glm-4.6v-flash-narrow"), ("llava-onevision-7b", "llava-onevision-7b-narrow"),
    ("qwen3-vl-8b", "qwen3-vl-8b-hd128")])
@pytest.mark.parametrize("tokens", [1024, 4096])
def test_the_stand_ins_keep_the_real_encoder_share(real_name, stand_in_name, tokens):
    real, stand_in = preset_config(real_name), preset_config(stand_in_name)
    length, start = tokens + 30, 15
    assert abs(encoder_share(stand_in, length, start, tokens) - encoder_share(real, length, start, tokens)) < 0.05
    enc, llm = miss_flops(stand_in, length, start, tokens)
    assert enc > 0 and llm > 0


@pytest.mark.parametrize(("name", "family", "layers"), [("qwen2.5-vl-7b-narrow", "qwen2_5_vl", 28),
                                                      ("glm-4.6v-flash-narrow", "glm4v", 40),
                                                      ("llava-onevision-7b-narrow", "llava_onevision", 28)])
def test_the_stand_ins_build_and_answer(name, family, layers):
    from vismemo_hf.eval.loading import load_model

    model, processor = load_model(name)
    assert model.config.model_type == family and model.config.text_config.num_hidden_layers == layers
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=[Image.new("RGB", (112, 112), (9, 9, 9))], return_tensors="pt")
    with torch.no_grad():
        assert model(**inputs).logits.isfinite().all()


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_a_lent_partial_encode_costs_what_the_floor_counts_and_keeps_what_the_entry_size_counts(family):
    """``partial_encoder_flops`` (the encoded patches through the tower, their queries over the lent K/V of the
    others) against torch's count of the partial encode, and ``tower_kv_values`` against the captured tower K/V."""
    from PIL import Image

    from vismemo_hf import enable
    from vismemo_hf.bench.flops import partial_encoder_flops
    from vismemo_hf.core.pixel_first import encoder_tokens
    from vismemo_hf.families import FAMILIES
    from vismemo_hf.runtime.hooks import _own
    from vismemo_hf.testing import tiny_model

    model, processor = tiny_model(family)
    model.set_attn_implementation("eager")
    enable(model)
    adapter = model._vismemo
    side = 2 * model.config.vision_config.patch_size * 8
    inputs = processor.image_processor(images=[Image.new("RGB", (side, side), (200, 30, 90))], return_tensors="pt")
    pixels, grid = inputs["pixel_values"], tuple(int(x) for x in inputs["image_grid_thw"][0])
    encoder = _own(adapter.base, "get_image_features")
    changed = torch.zeros(grid[1] * grid[2] // adapter.merge**2, dtype=torch.bool)
    changed[[3, 9]] = True
    tokens = encoder_tokens(changed, (grid[1] // adapter.merge, grid[2] // adapter.merge), halo=0,
                            window=adapter.encoder_window)
    with torch.no_grad():
        _, kvs = adapter.encode_capturing(encoder, pixels, torch.tensor([grid]))
        kvs = [kv() for kv in kvs]  # laid out when called
        with FlopCounterMode(display=False) as counter:
            adapter.encode_tokens(encoder, [(pixels, grid, tokens)], lent=kvs)
    unit = adapter.merge**2
    counted = counter.get_total_flops()
    analytic = partial_encoder_flops(model.config, tokens.numel() * unit, pixels.shape[0])
    assert tokens.numel() < changed.numel() and abs(analytic - counted) / counted < 0.15, (analytic, counted)
    assert kvs[0].numel() == FAMILIES[family].tower_kv_values(model.config.vision_config, pixels.shape[0])


def test_entry_sizes_at_the_real_geometries():
    from vismemo_hf.bench.flops import entry_bytes, real_configs

    sizes = {name: entry_bytes(config, 4096) for name, config in real_configs().items()}
    assert sizes["qwen3-vl-8b"] == (36 * 2 * 8 * 128 * 4096 * 2, 27 * 2 * 4096 * 4 * 1152 * 2)
    assert sizes["qwen2.5-vl-7b"][1] == 4 * 2 * 4096 * 4 * 1280 * 2  # its 4 full-attention blocks only
    assert sizes["glm-4.6v-flash"][1] == 24 * 2 * 4096 * 4 * 1536 * 2  # its 24 blocks, all full attention
    assert sizes["llava-onevision-7b"][1] == 0  # no encoder reuse there


def test_the_head_faithful_stand_in_keeps_the_real_head_geometry():
    """Issue S's floors are measured where attention runs the real head dimension's kernels."""
    real, stand_in = preset_config("qwen3-vl-8b").text_config, preset_config("qwen3-vl-8b-hd128").text_config
    assert stand_in.head_dim == real.head_dim == 128
    assert stand_in.num_hidden_layers == real.num_hidden_layers
    assert (stand_in.num_attention_heads // stand_in.num_key_value_heads ==
            real.num_attention_heads // real.num_key_value_heads)
    assert stand_in.intermediate_size / stand_in.hidden_size == pytest.approx(real.intermediate_size / real.hidden_size)


def test_the_benchmarks_pages_give_about_the_visual_lengths_asked_for_in_every_family(family):
    """``bench latency`` sizes its pages by the family (``ModelAdapter.bench_image_size``): merged patch grids, or
    LLaVA-OneVision's tiles (whose processor must keep its tile size: a free size broke it)."""
    from vismemo_hf.bench.latency import any_size, page_pair, request_inputs
    from vismemo_hf.testing import tiny_model

    model, processor = tiny_model(family)
    any_size(processor, model)
    for asked in (64, 144):
        page, edited = page_pair(asked, model)
        assert page.size == edited.size
        got = int((request_inputs(processor, page)["input_ids"] == model.config.image_token_id).sum())
        assert asked / 2 <= got <= 2 * asked, (asked, got)


def test_plan_layouts_count_each_layers_queries_and_keys():
    """``plan_layouts``: every decoder layer once, with the text and computed tokens as queries and those plus the
    reused tokens as keys (masked tokens are neither)."""
    from vismemo_hf.bench.flops import plan_layouts
    from vismemo_hf.core.plan import HitKind, ImagePlan

    config = preset_config("qwen3-vl-8b-narrow")
    layers = config.text_config.num_hidden_layers
    length, start, n = 40, 5, 16  # 24 text tokens around 16 visual ones
    assert plan_layouts(config, length, start, ImagePlan.full(HitKind.MISS, n)) == {(length, length): layers}
    assert plan_layouts(config, length, start, ImagePlan.exact(n, "k")) == {(length - n, length): layers}
    routed = ImagePlan(HitKind.APPROXIMATE, n, warmup_layers=1, recompute=torch.arange(4), reuse=torch.arange(4, 12),
                       mask=torch.arange(12, 16), alias="k")
    assert plan_layouts(config, length, start, routed) == {(length, length): 1,
                                                           (length - n + 4, length - 4): layers - 1}


def test_plain_kernels_time_plain_transformers_layers_for_each_layout_once():
    """``bench.latency.plain_kernels_ms``: each (queries, keys) layout timed once on plain transformers' language
    model and counted for its share of the layers; a few queries over a long cache cost less than a full prefill."""
    from vismemo_hf.bench.latency import plain_kernels_ms
    from vismemo_hf.eval.loading import load_model

    plain, _ = load_model("tiny")
    layers = plain.config.text_config.num_hidden_layers
    memo: dict = {}
    full = plain_kernels_ms(plain, {(300, 300): layers}, repeats=2, memo=memo)
    few = plain_kernels_ms(plain, {(8, 300): layers}, repeats=2, memo=memo)
    assert set(memo) == {(300, 300), (8, 300)} and 0 < few < full
    mixed = plain_kernels_ms(plain, {(300, 300): 1, (8, 300): layers - 1}, memo=memo)
    assert mixed == pytest.approx((memo[(300, 300)] + (layers - 1) * memo[(8, 300)]) / layers)

"""An enabled model is a transformers model: every generate mode, model operation and input transformers accepts
gives the outputs of the same model without the library on misses and exact hits (measured against a never-enabled
twin with the same weights)."""

import copy

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import DynamicCache, TextIteratorStreamer

import vismemo_hf
from vismemo_hf import HitKind, VisMemoStore
from vismemo_hf.eval import synthetic
from vismemo_hf.testing import tiny_model

from conftest import build_inputs, noise_image

OUT = dict(do_sample=False, output_scores=True, return_dict_in_generate=True)
#: the families model operations are checked on: one Qwen-VL, one GLM-4V (partial RoPE, a shared placeholder for
#: images and videos) and LLaVA-OneVision (1-D RoPE, tiles); every family passes transformers' own tests with the
#: library in the loop (``make compat``)
OPERATED = ["qwen2_vl", "glm4v", "llava_onevision"]


def _pair(family="qwen2_vl", attn=None, **config):
    """An enabled tiny model and its never-enabled twin."""
    model, processor = tiny_model(family, seed=5)
    twin, _ = tiny_model(family, seed=5)
    if attn is not None:
        model.set_attn_implementation(attn)
        twin.set_attn_implementation(attn)
    vismemo_hf.enable(model)
    return model, twin, processor


def _close(a, b, atol=1e-4):
    assert torch.equal(a.sequences, b.sequences)
    for name in ("scores", "logits"):
        x, y = getattr(a, name, None), getattr(b, name, None)
        if x is not None and y is not None:
            torch.testing.assert_close(torch.stack(x), torch.stack(y), atol=atol, rtol=0, msg=name)


def _hit_store(model, processor, image):
    store = VisMemoStore()
    with torch.no_grad():
        model.generate(**build_inputs(processor, [image]), cache=vismemo_hf.VisMemoCache(store=store), max_new_tokens=1)
    return store


MODES = {
    "greedy": dict(),
    "beam": dict(num_beams=2),
    "sample": dict(do_sample=True, top_k=4),
    "beam_sample": dict(do_sample=True, num_beams=2),
    "returns": dict(num_beams=2, num_return_sequences=2),
    "prompt_lookup": dict(prompt_lookup_num_tokens=2),
    "dict_outputs": dict(output_logits=True, output_attentions=True, output_hidden_states=True),
}


@pytest.mark.parametrize("family", OPERATED)
@pytest.mark.parametrize("hit", ["miss", "exact"])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_generate_mode_equals_the_model_without_the_library(mode, hit, family):
    model, twin, processor = _pair(family, attn="eager" if mode == "dict_outputs" else None)
    inputs = build_inputs(processor, [synthetic.page(1)], "row 1 row 1 row 1")
    store = _hit_store(model, processor, synthetic.page(1)) if hit == "exact" else VisMemoStore()
    options = {**OUT, **MODES[mode], "max_new_tokens": 5}
    cache = vismemo_hf.VisMemoCache(store=store)
    with torch.no_grad():
        torch.manual_seed(0)
        try:
            plain = twin.generate(**inputs, **options)
        except ValueError as err:  # GLM-4V: prompt lookup proposes image placeholders; transformers refuses them
            with pytest.raises(ValueError, match=str(err)[:40]):
                model.generate(**inputs, cache=cache, **options)
            return
        torch.manual_seed(0)
        ours = model.generate(**inputs, cache=cache, **options)
    _close(ours, plain)
    if mode == "dict_outputs":  # every layer's outputs were asked for: computed in full, all of them returned
        assert len(ours.attentions) == len(plain.attentions) and ours.attentions[0][0].shape == plain.attentions[0][0].shape
        assert all((a - b).abs().max() <= 1e-4 for a, b in zip(ours.hidden_states[0], plain.hidden_states[0]))
    elif mode not in ("prompt_lookup",):
        assert cache.events and all(e.kind is HitKind(hit) for e in cache.events)


@pytest.mark.parametrize("hit", ["miss", "exact"])
def test_assisted_decoding_with_an_enabled_assistant_equals_greedy(hit):
    model, twin, processor = _pair()
    assistant, _ = tiny_model("qwen2_vl", seed=6)
    vismemo_hf.enable(assistant)
    inputs = build_inputs(processor, [synthetic.page(2)])
    store = _hit_store(model, processor, synthetic.page(2)) if hit == "exact" else VisMemoStore()
    with torch.no_grad():
        ours = model.generate(**inputs, cache=vismemo_hf.VisMemoCache(store=store), assistant_model=assistant,
                              max_new_tokens=5, **OUT)
        plain = twin.generate(**inputs, max_new_tokens=5, **OUT)
    _close(ours, plain)


def test_a_streamer_sees_the_tokens_of_a_hit():
    model, twin, processor = _pair()
    inputs = build_inputs(processor, [synthetic.page(3)])
    store = _hit_store(model, processor, synthetic.page(3))
    streamer = TextIteratorStreamer(processor.tokenizer, skip_prompt=True)
    with torch.no_grad():
        ours = model.generate(**inputs, cache=vismemo_hf.VisMemoCache(store=store), streamer=streamer,
                              max_new_tokens=4, do_sample=False)
    streamed = "".join(streamer)
    assert streamed == processor.tokenizer.decode(ours[0, inputs["input_ids"].shape[1]:])


@pytest.mark.parametrize("family", OPERATED)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_model_keeps_its_attention_implementation_and_hits_equal_it(attn, family):
    model, twin, processor = _pair(family, attn=attn)
    assert model.config.text_config._attn_implementation == attn
    inputs = build_inputs(processor, [synthetic.page(4)])
    store = _hit_store(model, processor, synthetic.page(4))
    with torch.no_grad():
        out = model(**inputs, output_attentions=attn == "eager")
        if attn == "eager":
            assert out.attentions and out.attentions[0] is not None
        cache = vismemo_hf.VisMemoCache(store=store)
        ours = model.generate(**inputs, cache=cache, max_new_tokens=4, **OUT)
        plain = twin.generate(**inputs, max_new_tokens=4, **OUT)
    assert cache.events[0].kind is HitKind.EXACT
    _close(ours, plain)
    assert model.config.text_config._attn_implementation == attn


@pytest.mark.parametrize("family", OPERATED)
def test_set_attn_implementation_after_enable_stays_correct(family):
    model, twin, processor = _pair(family)
    inputs = build_inputs(processor, [synthetic.page(5)])
    store = _hit_store(model, processor, synthetic.page(5))
    for attn in ("eager", "sdpa"):
        model.set_attn_implementation(attn)
        twin.set_attn_implementation(attn)
        cache = vismemo_hf.VisMemoCache(store=store)
        with torch.no_grad():
            ours = model.generate(**inputs, cache=cache, max_new_tokens=4, **OUT)
            plain = twin.generate(**inputs, max_new_tokens=4, **OUT)
        assert cache.events[0].kind is HitKind.EXACT
        _close(ours, plain)


def test_weights_edited_in_place_between_requests_are_seen_and_checked_once_per_forward(monkeypatch):
    """The weights are checked as a forward begins (one pass over the parameters, not one per lookup, read and write
    of the request), and an in-place edit before the next request makes its entries another model's."""
    from vismemo_hf.families import base

    model, twin, processor = _pair()
    inputs = build_inputs(processor, [synthetic.page(6)])
    store = _hit_store(model, processor, synthetic.page(6))
    checks = []
    signature = base._weights_signature
    monkeypatch.setattr(base, "_weights_signature", lambda params: checks.append(1) or signature(params))
    with torch.no_grad():
        hit = vismemo_hf.VisMemoCache(store=store)
        model(**inputs, cache=hit, use_cache=True)
        assert hit.events[0].kind is HitKind.EXACT and len(checks) == 1
        for p in list(model.parameters())[-1:]:
            p.mul_(0.5)
        edited = vismemo_hf.VisMemoCache(store=store)
        model(**inputs, cache=edited, use_cache=True)
    assert edited.events[0].kind is HitKind.MISS  # other weights: other fingerprint


@pytest.mark.parametrize("family", OPERATED)
def test_a_deepcopy_computes_with_its_own_weights_and_never_hits_the_originals_entries(family):
    model, twin, processor = _pair(family)
    inputs = build_inputs(processor, [synthetic.page(6)])
    store = _hit_store(model, processor, synthetic.page(6))
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(0.5)
        for p in twin.parameters():
            p.mul_(0.5)
        cache = vismemo_hf.VisMemoCache(store=store)
        ours = clone.generate(**inputs, cache=cache, max_new_tokens=3, **OUT)
        plain = twin.generate(**inputs, max_new_tokens=3, **OUT)
        again = vismemo_hf.VisMemoCache(store=store)
        model.generate(**inputs, cache=again, max_new_tokens=1)
    assert cache.events[0].kind is HitKind.MISS  # other weights: other fingerprint
    _close(ours, plain)
    assert again.events[0].kind is HitKind.EXACT  # the original still serves its own entry


@pytest.mark.parametrize("family", OPERATED)
def test_save_reload_to_disable_and_compile(tmp_path, family):
    model, twin, processor = _pair(family)
    inputs = build_inputs(processor, [synthetic.page(7)])
    model.save_pretrained(tmp_path / "m")
    assert "vismemo" not in (tmp_path / "m" / "config.json").read_text()
    reloaded = type(model).from_pretrained(tmp_path / "m").eval()
    vismemo_hf.enable(reloaded.to("cpu"))
    store = _hit_store(model, processor, synthetic.page(7))
    cache = vismemo_hf.VisMemoCache(store=store)
    with torch.no_grad():
        ours = reloaded.generate(**inputs, cache=cache, max_new_tokens=3, **OUT)
        plain = twin.generate(**inputs, max_new_tokens=3, **OUT)
    assert cache.events[0].kind is HitKind.EXACT  # same weights from another folder: the same store entries
    _close(ours, plain)
    compiled = torch.compile(model.forward, backend="eager")
    with torch.no_grad():
        assert (compiled(**inputs).logits - twin(**inputs).logits).abs().max() <= 1e-5
    vismemo_hf.disable(model)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, twin(**inputs).logits)


def _video(seed):
    return [Image.fromarray((np.random.RandomState(seed * 10 + i).rand(112, 112, 3) * 255).astype("uint8"))
            for i in range(4)]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_an_image_after_another_video_is_flagged_as_a_changed_context(family):
    model, twin, processor = _pair(family)
    content = [{"type": "video"}, {"type": "image"}, {"type": "text", "text": "What changed?"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    store = VisMemoStore()
    seen = []
    for seed in (0, 0, 1):
        inputs = processor(text=[text], images=[synthetic.page(1)], videos=[_video(seed)], return_tensors="pt",
                           do_sample_frames=False)
        cache = vismemo_hf.VisMemoCache(store=store, policy="full")
        with torch.no_grad():
            ours = model.generate(**inputs, cache=cache, max_new_tokens=3, **OUT)
            plain = twin.generate(**inputs, max_new_tokens=3, **OUT)
        seen.append((cache.events[0].kind, cache.events[0].prefix_changed))
        if seed == 0:
            _close(ours, plain)
    assert seen == [(HitKind.MISS, False), (HitKind.EXACT, False), (HitKind.EXACT, True)]


@pytest.mark.parametrize("family", ["glm4v", "glm4v_moe"])
def test_glm_videos_share_the_image_placeholder_and_are_not_taken_for_images(family):
    """GLM-4V writes a video as frames of image placeholders (``mm_token_type_ids`` says which are video): a video
    request equals the model; a video with an image is refused by transformers itself (its placeholder check counts
    the frames as image tokens), and so by the enabled model, with the same error."""
    model, twin, processor = _pair(family)
    store = VisMemoStore()
    for content, images in (([{"type": "video"}, {"type": "text", "text": "What moves?"}], None),
                            ([{"type": "video"}, {"type": "image"}, {"type": "text", "text": "What changed?"}],
                             [synthetic.page(1)])):
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        inputs = processor(text=[text], images=images, videos=[_video(0)], return_tensors="pt", do_sample_frames=False)
        assert int((inputs["mm_token_type_ids"] == 2).sum()) > 0
        cache = vismemo_hf.VisMemoCache(store=store)
        with torch.no_grad():
            try:
                plain = twin.generate(**inputs, max_new_tokens=3, **OUT)
            except ValueError as err:
                assert images is not None
                with pytest.raises(ValueError, match=str(err)[:40]):
                    model.generate(**inputs, cache=cache, max_new_tokens=3, **OUT)
                continue
            ours = model.generate(**inputs, cache=cache, max_new_tokens=3, **OUT)
        _close(ours, plain)
        assert not cache.events  # no image in the request


@pytest.mark.parametrize("family", OPERATED)
def test_inputs_embeds_with_input_ids_and_pixels_equal_the_model(family):
    model, twin, processor = _pair(family)
    inputs = build_inputs(processor, [synthetic.page(8)])
    embeds = model.get_input_embeddings()(inputs["input_ids"])
    with torch.no_grad():
        ours = model.generate(**inputs, inputs_embeds=embeds, cache=vismemo_hf.VisMemoCache(store=VisMemoStore()),
                              max_new_tokens=3, **OUT)
        plain = twin.generate(**inputs, inputs_embeds=embeds, max_new_tokens=3, **OUT)
    _close(ours, plain)


@pytest.mark.parametrize("family", OPERATED)
def test_after_a_hit_the_cache_reads_like_a_dynamic_cache(family):
    model, twin, processor = _pair(family)
    inputs = build_inputs(processor, [synthetic.page(9)])
    store = _hit_store(model, processor, synthetic.page(9))
    ours, plain = vismemo_hf.VisMemoCache(store=store), DynamicCache()
    with torch.no_grad():
        model(**inputs, cache=ours, use_cache=True)
        twin(**inputs, cache=plain, use_cache=True)
    assert ours.events[0].kind is HitKind.EXACT and not ours.mapped
    for a, b in zip(ours.layers, plain.layers):
        assert a.keys.shape == b.keys.shape and (a.keys - b.keys).abs().max() <= 1e-5
        assert (a.values - b.values).abs().max() <= 1e-5


def test_a_model_shallower_than_the_routing_serves_every_hit_kind():
    model, processor = tiny_model("qwen2_vl", seed=5, num_hidden_layers=1)
    vismemo_hf.enable(model)
    store = _hit_store(model, processor, synthetic.page(1))
    for image, prefix in ((synthetic.page(1), "Another text. "), (synthetic.edited(1, row=2, value="9999"), "")):
        cache = vismemo_hf.VisMemoCache(store=store)  # attend-deviate checks at layer 1, which this model lacks
        with torch.no_grad():
            out = model.generate(**build_inputs(processor, [image], prefix=prefix), cache=cache, max_new_tokens=2)
        assert out.shape[1] > 0 and cache.events


@pytest.mark.parametrize("family", OPERATED)
def test_accelerate_dispatch_with_layers_on_cpu_and_disk_serves_every_hit_kind(tmp_path, family):
    from accelerate import dispatch_model

    model, twin, processor = _pair(family)
    vismemo_hf.disable(model)
    layers = model.config.text_config.num_hidden_layers
    vision = {f"model.{name}": "cpu" for name, _ in model.model.named_children() if name != "language_model"}
    vision.update({f"model.{name}": "cpu" for name, _ in model.model.named_parameters(recurse=False)})
    device_map = {**vision, "model.language_model.embed_tokens": "cpu", "lm_head": "cpu",
                  "model.language_model.norm": "cpu", "model.language_model.rotary_emb": "cpu",
                  **{f"model.language_model.layers.{i}": "cpu" if i == 0 else "disk" for i in range(layers)}}
    model = dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path / "offload"))
    assert next(model.model.language_model.layers[1].parameters()).device.type == "meta"
    vismemo_hf.enable(model)
    store = VisMemoStore()
    kinds = []
    for image in (synthetic.page(1), synthetic.page(1), synthetic.edited(1, row=2, value="9999")):
        inputs = build_inputs(processor, [image])
        cache = vismemo_hf.VisMemoCache(store=store)
        with torch.no_grad():
            ours = model.generate(**inputs, cache=cache, max_new_tokens=3, **OUT)
            plain = twin.generate(**inputs, max_new_tokens=3, **OUT)
        kinds.append(cache.events[0].kind)
        if kinds[-1] is not HitKind.APPROXIMATE:
            _close(ours, plain)
    edited = HitKind.APPROXIMATE if vismemo_hf.families.FAMILIES[family].approximate else HitKind.MISS
    assert kinds == [HitKind.MISS, HitKind.EXACT, edited]


def test_a_read_only_store_directory_keeps_serving_its_entries(tmp_path, monkeypatch):
    import os

    from vismemo_hf.store.tiers import disk as disk_tier

    model, twin, processor = _pair()
    directory = tmp_path / "shared"
    writer = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=directory)
    with torch.no_grad():
        model.generate(**build_inputs(processor, [synthetic.page(1)]), cache=vismemo_hf.VisMemoCache(store=writer),
                       max_new_tokens=1)
    writer.close()
    if os.geteuid() != 0:
        for path in [directory, *directory.rglob("*")]:
            path.chmod(path.stat().st_mode & ~0o222)
    else:  # root writes anywhere: the directory refuses writes as a read-only mount would
        def refuse(*args, **kwargs):
            raise PermissionError(f"[Errno 30] Read-only file system: {directory}")

        monkeypatch.setattr(disk_tier.diskcache, "Cache", refuse)
    reader = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=directory)
    assert reader.disk is not None and reader.disk.read_only and len(reader) == 1
    for image, kind in ((synthetic.page(1), HitKind.EXACT), (noise_image(4), HitKind.MISS)):
        inputs = build_inputs(processor, [image])
        cache = vismemo_hf.VisMemoCache(store=reader)
        with torch.no_grad():
            ours = model.generate(**inputs, cache=cache, max_new_tokens=3, **OUT)
            plain = twin.generate(**inputs, max_new_tokens=3, **OUT)
        assert cache.events[0].kind is kind
        _close(ours, plain)
    assert reader.stats()["writes_read_only"] == 1 and len(reader) == 1


def test_arguments_are_checked_when_given():
    with pytest.raises(TypeError, match="from_config"):
        vismemo_hf.VisMemoCache(store="memory")
    with pytest.raises(ValueError, match="does not exist"):
        VisMemoStore(device="cuda:7")
    with pytest.raises(ValueError, match="not a torch device"):
        VisMemoStore(device="gpu")


def test_past_key_values_works_like_cache():
    model, twin, processor = _pair()
    inputs = build_inputs(processor, [synthetic.page(1)])
    cache = vismemo_hf.VisMemoCache(store=VisMemoStore())
    with torch.no_grad():
        ours = model.generate(**inputs, past_key_values=cache, max_new_tokens=3, **OUT)
        plain = twin.generate(**inputs, max_new_tokens=3, **OUT)
    assert cache.events[0].kind is HitKind.MISS
    _close(ours, plain)


def test_report_metrics_load_as_evaluate_modules_offline():
    import vismemo_hf.metrics

    anls = vismemo_hf.metrics.load("anls")
    assert anls.compute(predictions=["4821", "abc"], references=[["4821"], ["abd", "x"]])["anls"] == pytest.approx(5 / 6)
    exact = vismemo_hf.metrics.load("exact_match")
    assert exact.compute(predictions=[" 4821", "abc"], references=[["4821"], ["abd"]])["exact_match"] == 0.5

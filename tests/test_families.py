"""The family seam (issue V): one adapter file per family, found by ``model_type``; what a family file declares is
all the runtime needs from it."""

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

import vismemo_hf
from vismemo_hf.defaults import FAMILY_MODULES
from vismemo_hf.families import FAMILIES, build_model, model_family, preset_config
from vismemo_hf.testing import tiny_model

from conftest import build_inputs


def test_every_model_type_has_one_adapter_in_its_own_file():
    for model_type, module in FAMILY_MODULES.items():
        adapter = FAMILIES[model_type]
        assert adapter.__module__ == f"vismemo_hf.families.{module}" and model_type in adapter.model_types


def test_an_unsupported_model_is_refused_with_the_supported_families_named():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with pytest.raises(ValueError, match="GLM-4.1V.*glm4v_moe"):
        model_family(Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=64)))


def test_a_preset_written_for_full_rotation_gets_sections_over_glms_rotary_half():
    tokenizer = tiny_model("glm4v")[1].tokenizer
    config = preset_config("medium", "glm4v", tokenizer=tokenizer)
    rope, text = config.text_config.rope_parameters, config.text_config
    head_dim = text.hidden_size // text.num_attention_heads
    assert rope["partial_rotary_factor"] == 0.5 and sum(rope["mrope_section"]) == head_dim // 4
    model = build_model("medium", "glm4v", tokenizer=tokenizer, num_hidden_layers=2)
    with torch.no_grad():
        assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.isfinite().all()


def test_the_adapters_keys_are_the_keys_the_model_caches(family):
    """``fresh_kv`` (the family's norm, projections, key norm and its own RoPE) gives the layer-0 K/V the model's
    forward writes to its cache, for every family: what the context check compares against stored K/V."""
    model, processor = tiny_model(family, seed=3)
    vismemo_hf.enable(model)
    adapter = model._vismemo
    inputs = build_inputs(processor, [], "a text only request")
    cache = DynamicCache()
    with torch.no_grad():
        model(**inputs, cache=cache, use_cache=True)
        hidden = model.get_input_embeddings()(inputs["input_ids"])[0]
        length = inputs["input_ids"].shape[1]
        positions = torch.arange(length).view(1, 1, -1).expand(3, 1, -1)
        cos, sin = adapter.rope(hidden[None], positions)
        keys, values = adapter.fresh_kv(0, hidden, cos[0], sin[0])
    torch.testing.assert_close(keys, cache.layers[0].keys[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(values, cache.layers[0].values[0], atol=1e-5, rtol=0)


def test_glm46v_misses_and_exact_hits_equal_the_model_without_the_library():
    """GLM-4.6V (GLM-4.1V's text and vision classes under its own model, processor and config): a miss, an exact hit
    and an exact hit after another text answer as a never-enabled twin does."""
    from vismemo_hf import HitKind, VisMemoCache, VisMemoStore
    from vismemo_hf.eval import synthetic

    model, processor = tiny_model("glm46v", seed=4)
    twin, _ = tiny_model("glm46v", seed=4)
    vismemo_hf.enable(model)
    store = VisMemoStore()
    kinds = []
    for prefix in ("", "", "Another text first. "):
        inputs = build_inputs(processor, [synthetic.page(2)], prefix=prefix)
        cache = VisMemoCache(store=store)
        with torch.no_grad():
            ours = model.generate(**inputs, cache=cache, max_new_tokens=4, do_sample=False)
            plain = twin.generate(**inputs, max_new_tokens=4, do_sample=False)
        kinds.append(cache.events[0].kind)
        assert torch.equal(ours, plain)
    assert kinds == [HitKind.MISS, HitKind.EXACT, HitKind.EXACT]


def _llava_images(adapter, images):
    processor = adapter.image_processor()
    return [adapter.processed_images(processor(images=[im], return_tensors="pt"))[0] for im in images]


def test_llava_token_hashes_follow_the_models_own_packing_of_each_patch():
    """A LLaVA-OneVision token's pixel hash changes exactly where the model's packed patch embeddings (each a
    function of one patch's pixels: base view, unpadded tile rows, newlines) change, and its rows end at newlines."""
    from PIL import ImageDraw

    from vismemo_hf.eval import synthetic
    from vismemo_hf.families import ModelAdapter
    from vismemo_hf.families.llava_onevision import NEWLINE

    model, _ = tiny_model("llava_onevision")
    adapter = ModelAdapter.for_model(model)
    page = synthetic.page(3)
    edited = page.copy()
    ImageDraw.Draw(edited).rectangle((150, 100, 170, 112), fill=(0, 0, 0))
    patch_embedding = model.model.vision_tower.embeddings.patch_embedding
    hashes, packed = [], []
    for pixels, grid, extra in _llava_images(adapter, [page, edited]):
        with torch.no_grad():
            embedded = patch_embedding(pixels).flatten(2).transpose(1, 2)  # (tiles, patches, d)
            packs, _ = model.model.pack_image_features([embedded], torch.tensor([extra[0]]),
                                                       image_newline=torch.zeros(embedded.shape[-1]))
        hashes.append(adapter.patch_hashes(pixels, grid, extra))
        packed.append(packs[0])
        assert hashes[-1].shape == (grid[2],) == (packs[0].shape[0],)
    changed = hashes[0] != hashes[1]
    moved = (packed[0] - packed[1]).abs().amax(-1) > 0
    assert 0 < int(changed.sum()) < changed.numel() // 4 and torch.equal(changed, moved)
    newline = hashes[0] == NEWLINE
    assert torch.equal(newline, packed[0].abs().amax(-1) == 0) and int(newline.sum()) > 1
    from vismemo_hf.core.plan import ImageFeatures

    rows = ImageFeatures("k", (1, 1, hashes[0].numel()), torch.zeros(hashes[0].numel(), 4), patch_hashes=hashes[0],
                         rows=adapter.token_rows).token_rows
    assert bool((rows[1:] >= rows[:-1]).all()) and bool((rows[1:][newline[:-1]] > rows[:-1][newline[:-1]]).all())
    # a tile whose side is no multiple of the patch (384 / 14): the pixels no patch reads change no hash
    tile = torch.randn(1, 3, 60, 60)
    rows_of = adapter._patch_rows(tile)
    spill = tile.clone()
    spill[:, :, 56:, :] = 5.0
    assert rows_of.shape == (16, 3 * 14 * 14) and torch.equal(rows_of, adapter._patch_rows(spill))


def test_llava_images_of_as_many_tokens_in_other_rows_are_never_aliased():
    """Two sizes whose packings have as many tokens but their newlines elsewhere (token i at other places) are
    never each other's alias, even with every threshold at 0; a copy of the same packing is (a darker one: its
    thumbnail agrees, as a match of the tokens alone needs)."""
    from PIL import ImageEnhance

    from vismemo_hf import HitKind, VisMemoCache, VisMemoStore
    from vismemo_hf.eval import synthetic
    from vismemo_hf.families import ModelAdapter

    model, processor = tiny_model("llava_onevision")
    vismemo_hf.enable(model)
    adapter = ModelAdapter.for_model(model)
    page = synthetic.page(1)
    tall, wide = page.resize((60, 260)), page.resize((100, 60))
    (a, ga, xa), (b, gb, xb) = _llava_images(adapter, [tall, wide])
    assert ga == gb and not adapter.same_layout(SimpleNamespace(patch_hashes=adapter.patch_hashes(a, ga, xa)),
                                          SimpleNamespace(patch_hashes=adapter.patch_hashes(b, gb, xb)))
    store = VisMemoStore()
    events = []
    for image in (tall, wide, ImageEnhance.Brightness(tall).enhance(0.9)):
        cache = VisMemoCache(store=store, tau=0.0, tau_fine=0.0)
        with torch.no_grad():
            model.generate(**build_inputs(processor, [image]), cache=cache, max_new_tokens=1, do_sample=False)
        events.append(cache.events[0])
    assert [e.kind for e in events] == [HitKind.MISS, HitKind.MISS, HitKind.APPROXIMATE]
    assert events[2].alias == events[0].key


def test_llava_copies_changed_everywhere_a_little_are_found_by_their_thumbnail():
    """LLaVA-OneVision's thumbnail is its base view's (the whole image at the tile size), or its tiles' where they
    give a larger one at the same pixels per token (the tiny tower's 56-pixel tiles): a darker copy, whose every
    token hash changed, is an approximate hit found by the pixel stage with the default thresholds; another page of
    the same kind and size is not."""
    from PIL import ImageEnhance

    from vismemo_hf import HitKind, VisMemoCache, VisMemoStore
    from vismemo_hf.core.features import thumbnail_shape
    from vismemo_hf.core.images import synthetic_image
    from vismemo_hf.families import ModelAdapter

    model, processor = tiny_model("llava_onevision")
    vismemo_hf.enable(model)
    adapter = ModelAdapter.for_model(model)
    image = synthetic_image("screen", 3)
    (pixels, grid, extra), = _llava_images(adapter, [image])
    thumb = adapter.thumbnail_of(pixels, grid, extra)()
    rows, cols = adapter._tile_grid(pixels.shape[0], extra)
    base = thumbnail_shape(adapter.thumbnail_hw(grid))
    assert thumb.dtype == torch.uint8 and tuple(thumb.shape) == (rows * base[0], cols * base[1])
    assert adapter.thumbnail_fits(tuple(thumb.shape), grid) and adapter.thumbnail_fits(base, grid)
    assert not adapter.thumbnail_fits((base[0] + 1, base[1]), grid)
    events = {}
    for name, other in (("darker", ImageEnhance.Brightness(image).enhance(0.9)), ("other", synthetic_image("screen", 4))):
        store = VisMemoStore()
        for shown in (image, other):
            cache = VisMemoCache(store=store)
            with torch.no_grad():
                model.generate(**build_inputs(processor, [shown]), cache=cache, max_new_tokens=1, do_sample=False)
        events[name] = cache.events[0]
    assert events["darker"].kind is HitKind.APPROXIMATE and events["darker"].found_by == "thumbnail"
    assert events["other"].kind is HitKind.MISS


def test_every_family_module_imports_under_a_meta_device():
    """transformers' own tests build models under ``torch.device("meta")``; the registry may be imported first there
    (``tests/compat/vismemo_compat.py``), so no family module computes a tensor value at import (a fresh process)."""
    import subprocess
    import sys

    code = ("import torch\nwith torch.device('meta'):\n    import vismemo_hf.families\n"
            "print(len(vismemo_hf.families.FAMILIES))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert int(run.stdout.split()[-1]) == len(FAMILIES)

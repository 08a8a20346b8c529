"""Public surface and clear errors."""

import inspect

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

import vismemo_hf
from vismemo_hf import HitKind
from vismemo_hf.families import model_fingerprint
from vismemo_hf.families.routing import ConfigView
from vismemo_hf.runtime.forward import current as current_forward
from vismemo_hf.testing import tiny_model

from conftest import build_inputs, generate, stored


def test_forgetting_enable_is_a_clear_error(pages):
    model, processor = tiny_model("qwen2_vl", seed=3)
    inputs = build_inputs(processor, [pages["base"]])
    with pytest.raises(RuntimeError, match=r"vismemo_hf\.enable\(model\)"):
        model.generate(**inputs, past_key_values=vismemo_hf.VisMemoCache(store=vismemo_hf.VisMemoStore()),
                       max_new_tokens=1)


def test_unsupported_model_names_the_families():
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, GLM-4.1V.*LLaVA-OneVision"):
        vismemo_hf.enable(model)


def test_enable_is_idempotent_and_plain_caches_still_work(qwen2, pages):
    """An enabled model (enabled twice) serves a plain DynamicCache exactly like a model never enabled."""
    from transformers import DynamicCache

    from vismemo_hf.testing import tiny_model

    model, processor = qwen2
    assert vismemo_hf.enable(model) is model
    inputs = build_inputs(processor, [pages["base"]])
    tokens, scores = generate(model, inputs, DynamicCache(), 2)
    twin, _ = tiny_model("qwen2_vl")
    ref_tokens, ref_scores = generate(twin, inputs, DynamicCache(), 2)
    assert torch.equal(tokens, ref_tokens) and torch.allclose(scores, ref_scores, atol=1e-6)


def test_events_record_kinds_counts_and_timings(qwen2, pages):
    model, processor = qwen2
    store = stored(model, processor, pages["base"])
    cache = vismemo_hf.VisMemoCache(store=store)
    generate(model, build_inputs(processor, [pages["edit"]]), cache, 1)
    (event,) = cache.events
    assert event.kind is HitKind.APPROXIMATE and event.alias is not None
    assert event.recomputed + event.reused + event.masked == event.n_tokens
    assert set(event.timings) >= {"lookup", "encoder", "warmup", "fetch", "plan", "recompute"}
    assert all(v >= 0 for v in event.timings.values())
    assert event.as_dict()["kind"] == "approximate"
    stats = store.stats()
    assert stats["hits"] == {"exact": 0, "approximate": 1, "miss": 1}
    # the approximate hit's image became an entry of its own (completed off the request's path)
    assert stats["tiers"]["device"]["entries"] == 2 == stats["entries"]


def test_bad_options_are_rejected():
    with pytest.raises(ValueError):
        vismemo_hf.VisMemoCache(tau=1.5)
    with pytest.raises(TypeError):
        vismemo_hf.VisMemoCache(not_an_option=1)
    with pytest.raises(ValueError):
        vismemo_hf.VisMemoStore(device_bytes=-1)


@pytest.mark.parametrize(("options", "error"), [
    ({"warmup_layers": 1.5}, TypeError), ({"policy": "cacheblend", "warmup_layers": 1.5}, TypeError),
    ({"context": {"check_layer": 1.5, "routing": "check"}}, TypeError), ({"context": {"watch_tokens": 2.0}}, TypeError),
    ({"context": 5}, TypeError), ({"context": {"no_such_field": 1}}, TypeError), ({"context": {"routing": "x"}}, ValueError),
    ({"warmup_layers": True}, TypeError), ({"recompute_ratio": "0.3"}, TypeError),
    ({"recompute_ratio": float("nan")}, ValueError), ({"top_k": 2.5}, TypeError), ({"compress": 0.5}, TypeError),
    ({"compress": "x"}, TypeError), ({"thresholds": 123}, TypeError), ({"policy": None}, TypeError),
    ({"policy": 123}, TypeError), ({"store_misses": "yes"}, TypeError)])
def test_options_of_the_wrong_type_are_an_error_when_the_cache_is_built(options, error):
    """Not a failure inside generate (a layer count of 1.5 indexes nothing), and never a stored entry taken for
    corrupt because a read was asked with it."""
    with pytest.raises(error, match=next(iter(options)) if error is TypeError else None):
        vismemo_hf.VisMemoCache(store=vismemo_hf.VisMemoStore(), **options)


def test_a_read_that_fails_for_its_arguments_keeps_the_entry(caplog, monkeypatch):
    """A read failing for a reason that is not the stored bytes (a bug of the library) is a miss outside strict mode
    and an error in it; the entry is never removed as corrupt."""
    from conftest import forget_bugs
    from test_store import _entry

    store = vismemo_hf.VisMemoStore(device_bytes=None, host_bytes=0)
    assert store.put(_entry("kept"))
    with pytest.raises(TypeError):
        store.get_tokens("kept", "fp", torch.tensor([0]), 1.5)
    tier = store.tiers[0]
    real = tier.tokens
    tier.tokens = lambda *a: (_ for _ in ()).throw(TypeError("a bug, not the blob"))
    with pytest.raises(TypeError, match="a bug, not the blob"):  # strict mode (the suite's): the bug propagates
        store.get_tokens("kept", "fp", torch.tensor([0]), 1)
    monkeypatch.setenv("VISMEMO_STRICT", "0")
    assert store.get_tokens("kept", "fp", torch.tensor([0]), 1) is None
    assert "entry kept" in caplog.text
    forget_bugs()
    tier.tokens = real
    assert "kept" in store and store.stats()["corrupt"] == 0
    assert store.get_tokens("kept", "fp", torch.tensor([0]), 1) is not None


def test_a_routing_deeper_than_the_model_degrades_to_a_full_prefill(qwen2, pages):
    model, processor = qwen2
    store = stored(model, processor, pages["base"])
    inputs = build_inputs(processor, [pages["edit"]])
    cache = vismemo_hf.VisMemoCache(store=store, warmup_layers=99)
    _, scores = generate(model, inputs, cache, 2)
    assert cache.events[0].kind is HitKind.MISS
    _, plain = generate(model, inputs, DynamicCache(), 2)
    assert (scores - plain).abs().max() <= 1e-4
    assert current_forward() is None


def test_inputs_embeds_without_ids_compute_like_the_model(qwen2, pages):
    model, processor = qwen2
    inputs = build_inputs(processor, [pages["base"]])
    embeds = model.get_input_embeddings()(inputs["input_ids"])
    kwargs = {k: v for k, v in inputs.items() if k != "input_ids"}
    with torch.no_grad():
        out = model(**kwargs, inputs_embeds=embeds, cache=vismemo_hf.VisMemoCache(), use_cache=True)
        ref = model(**kwargs, inputs_embeds=embeds, cache=DynamicCache(), use_cache=True)
    assert current_forward() is None
    assert (out.logits - ref.logits).abs().max() <= 1e-5


def test_exact_hits_skip_the_vision_tower(qwen2, pages):
    model, processor = qwen2
    store = vismemo_hf.VisMemoStore()
    calls = []
    hook = model.model.visual.register_forward_hook(lambda *a: calls.append(1))
    try:
        inputs = build_inputs(processor, [pages["base"]])
        generate(model, inputs, vismemo_hf.VisMemoCache(store=store), 1)
        assert len(calls) in (1, 2)  # the image, and once per process and model the lookup's reference images
        assert store.reference(model_fingerprint(model)) is not None
        calls.clear()
        cache = vismemo_hf.VisMemoCache(store=store)
        generate(model, inputs, cache, 1)
        assert cache.events[0].kind is HitKind.EXACT and len(calls) == 0
        with torch.no_grad():  # a direct forward (no generate) takes the same path
            model(**inputs, cache=vismemo_hf.VisMemoCache(store=store), use_cache=True)
        assert len(calls) == 0
    finally:
        hook.remove()


def _forward_source(cls) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def test_disable_restores_the_model_exactly(family, pages):
    """enable then disable: outputs equal a never-enabled twin's, no hook, attribute or attention setting left."""
    from vismemo_hf.testing import tiny_model

    model, processor = tiny_model(family, seed=3)
    twin, _ = tiny_model(family, seed=3)
    inputs = build_inputs(processor, [pages["base"]])
    forward_before = model.model.language_model.forward
    with vismemo_hf.enabled(model):
        # every module that looks its attention implementation up at call time reads it through a view
        # (of the text model and of a tower that lends its K/V: a forward routes those)
        roots = [model.model.language_model] + [v for v in [getattr(model.model, "visual", None)] if v is not None]
        readers = [m for root in roots for m in root.modules() if "_attn_implementation" in _forward_source(type(m))
                   and hasattr(m, "config") and not isinstance(m, PreTrainedModel)]
        assert readers and all(isinstance(m.config, ConfigView) for m in readers)
        assert model.config.text_config._attn_implementation == twin.config.text_config._attn_implementation
        generate(model, inputs, vismemo_hf.VisMemoCache(store=vismemo_hf.VisMemoStore()), 2)
    assert model.config.text_config._attn_implementation == twin.config.text_config._attn_implementation
    assert not hasattr(model, "_vismemo") and not model.model._forward_pre_hooks and not model.model._forward_hooks
    assert "forward" not in model.model.language_model.__dict__ and "get_image_features" not in model.model.__dict__
    assert not any(name.startswith("_vismemo") or name == "_prepare_multimodal_encoder_kwargs_for_generation"
                   for m in model.modules() for name in m.__dict__)
    assert model.model.language_model.forward == forward_before
    assert all(not isinstance(getattr(m, "config", None), ConfigView) for m in model.modules())
    with torch.no_grad():
        a = model.generate(**inputs, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
        b = twin.generate(**inputs, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(torch.stack(a.scores), torch.stack(b.scores))
    with pytest.raises(RuntimeError, match="enable"):
        generate(model, inputs, vismemo_hf.VisMemoCache(store=vismemo_hf.VisMemoStore()), 1)
    vismemo_hf.enable(model)  # and it can be enabled again
    _, scores = generate(model, inputs, vismemo_hf.VisMemoCache(store=vismemo_hf.VisMemoStore()), 2)
    assert torch.isfinite(scores).all()
    vismemo_hf.disable(model)

"""Production scale: the projected faiss index against the exact rule, centred lookup, sketches, 8-bit entries."""

import pytest
import torch
import torch.nn.functional as F
import yaml

import vismemo_hf
from vismemo_hf import HitKind, LookupThresholds
from vismemo_hf.bench.lookup import ClusteredDescriptors, run_size
from vismemo_hf.cli import main
from vismemo_hf.core.features import sketch_cosine, token_sketch
from vismemo_hf.core.images import synthetic_image
from vismemo_hf.core.thresholds import ModelReference
from vismemo_hf.eval import synthdoc
from vismemo_hf.families import model_fingerprint
from vismemo_hf.store import blob
from vismemo_hf.store.index import DescriptorIndex

from conftest import build_inputs, generate
from test_store import _entry


def _exact(index_desc: dict, query: torch.Tensor, mean: torch.Tensor, tau: float, top_k: int) -> list[str]:
    scores = {}
    for key, d in index_desc.items():
        cos = F.cosine_similarity(d - mean, query - mean, dim=-1)
        if bool((cos > tau).all()):
            scores[key] = float(cos.mean())
    return sorted(scores, key=scores.get, reverse=True)[:top_k]


@pytest.mark.parametrize("ivf_from", [10_000, 256])
def test_index_returns_the_exact_rules_answers(ivf_from):
    """Clustered 1,024-d descriptors, exhaustive and inverted-file groups: every exact answer comes back."""
    data = ClusteredDescriptors(1024, seed=3)
    mean = data.reference_mean(128)
    index = DescriptorIndex(ivf_from=ivf_from)
    index.set_center("fp", mean)
    pages, desc = data.chunk(0, 300)
    keys = [f"p{p}c{j % 4}" for j, p in enumerate(pages.tolist())]
    index.add_many("fp", (1, 8, 8), keys, desc)
    assert len(index) == 1200 and index.nbytes / len(index) <= 2048
    stored = dict(zip(keys, desc))
    g = torch.Generator().manual_seed(0)
    wanted = found = 0
    for _ in range(60):
        query = data.page(int(torch.randint(0, 300, (1,), generator=g)), g)
        exact = _exact(stored, query, mean, 0.8, 5)
        got = [k for k, _ in index.search("fp", (1, 8, 8), query, 0.8, 5)]
        wanted += len(exact)
        found += len(set(exact) & set(got))
    assert wanted > 20 and found == wanted
    unrelated = data.unrelated(g)
    assert _exact(stored, unrelated, mean, 0.8, 5) == [] and index.search("fp", (1, 8, 8), unrelated, 0.8, 5) == []


def test_index_waits_for_the_models_center_and_forgets_removed_keys():
    index = DescriptorIndex(ivf_from=64)
    d = F.normalize(torch.randn(100, 4, 256), dim=-1)
    index.add_many("fp", (1, 4, 4), [f"k{i}" for i in range(100)], d)
    assert len(index) == 100 and index.search("fp", (1, 4, 4), d[7], 0.8, 3) == []  # no center yet
    index.set_center("fp", torch.zeros(256))
    assert index.search("fp", (1, 4, 4), d[7], 0.8, 3)[0][0] == "k7"
    index.remove("fp", (1, 4, 4), "k7")
    assert "k7" not in [k for k, _ in index.search("fp", (1, 4, 4), d[7], -1.0, 100)] and len(index) == 99
    index.add_many("fp", (1, 4, 4), ["dup", "dup"], d[:2])  # a key given twice is indexed once
    index.remove("fp", (1, 4, 4), "dup")
    assert "dup" not in [k for k, _ in index.search("fp", (1, 4, 4), d[0], -1.0, 200)] and len(index) == 99


def test_lookup_bench_reports_recall_memory_and_latency():
    record = run_size(2000, 512, queries=20, recall_queries=40, tau=0.8, top_k=5, groups=1)
    assert record["entries"] == 2000 and record["median_ms"] > 0 and record["index_bytes_per_entry"] <= 2048
    assert record["exact_answers"] > 0 and record["recall"] == 1.0


def test_sketches_estimate_centred_token_cosines():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(256, 1024, generator=g) + 3.0  # anisotropic: a shared component
    b = a + 0.5 * torch.randn(256, 1024, generator=g)
    mean = F.normalize(a, dim=-1).mean(0)
    exact = F.cosine_similarity(F.normalize(a, dim=-1) - mean, F.normalize(b, dim=-1) - mean, dim=-1).mean()
    estimate = sketch_cosine(token_sketch(a), token_sketch(b), mean).mean()
    assert abs(float(exact) - float(estimate)) < 0.03
    assert token_sketch(a).dtype == torch.float16 and token_sketch(a).shape == (256, 32)


@pytest.mark.approximate
def test_unrelated_images_never_alias_on_a_random_tower(family):
    """Raw cosines of a random tower pass 0.8 for unrelated images; the centred lookup misses them, and still finds
    a near-duplicate."""
    from vismemo_hf.testing import tiny_model

    model, processor = tiny_model(family)
    vismemo_hf.enable(model)
    store = vismemo_hf.VisMemoStore()
    kinds = ("text", "screen", "photo", "texture")
    for i, kind in enumerate(kinds):
        cache = vismemo_hf.VisMemoCache(store=store)
        generate(model, build_inputs(processor, [synthetic_image(kind, 7000 + i)]), cache, 1)
    for i, kind in enumerate(kinds):
        cache = vismemo_hf.VisMemoCache(store=store, store_misses=False)
        generate(model, build_inputs(processor, [synthetic_image(kind, 8000 + i)]), cache, 1)
        assert cache.events[0].kind is HitKind.MISS, kind
    cache = vismemo_hf.VisMemoCache(store=store)
    generate(model, build_inputs(processor, [synthdoc.reencode_image(synthetic_image("screen", 7001), 70)]), cache, 1)
    event = cache.events[0]
    assert event.kind is HitKind.APPROXIMATE and 0 < event.lookup_bytes < event.n_tokens * 64 + 4 * 4 * 4096


def test_thresholds_presets_and_model_check(tmp_path, qwen2, pages):
    model, processor = qwen2
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"tau": 0.7, "tau_fine": 0.9, "fingerprint": "0" * 32}))
    loaded = LookupThresholds.load(str(path))
    assert (loaded.tau, loaded.tau_fine, loaded.adaptive) == (0.7, 0.9, False)
    cache = vismemo_hf.VisMemoCache(store=vismemo_hf.VisMemoStore(), thresholds=str(path))
    with pytest.raises(ValueError, match="calibrate"):
        generate(model, build_inputs(processor, [pages["base"]]), cache, 1)
    path.write_text(yaml.safe_dump({"tau": 0.7, "tau_fine": 0.9, "fingerprint": model_fingerprint(model)}))
    store = vismemo_hf.VisMemoStore()
    generate(model, build_inputs(processor, [pages["base"]]), vismemo_hf.VisMemoCache(store=store, thresholds=str(path)), 1)
    with pytest.raises(ValueError, match="unknown lookup option"):
        path.write_text(yaml.safe_dump({"tau": 0.7, "tau_fine": 0.9, "tua": 1}))
        LookupThresholds.load(str(path))
    with pytest.raises(ValueError, match="cosine"):
        LookupThresholds(tau=2.0)
    floor = ModelReference(torch.zeros(4), torch.zeros(4), unrelated_fine=0.93)
    assert LookupThresholds().fine_for(floor) == pytest.approx(0.96)
    blind = ModelReference(torch.zeros(4), torch.zeros(4), unrelated_fine=0.999)  # a tower that tells nothing apart
    assert LookupThresholds().fine_for(blind) == 1.0 and LookupThresholds().for_model(blind).tau_fine == 1.0
    assert vismemo_hf.VisMemoCache(store=store, tau_fine=0.5).lookup_thresholds("x").fine_for(floor) == 0.5


def test_calibrate_writes_a_preset_the_cache_takes(tmp_path, capsys):
    out = tmp_path / "tiny.yaml"
    assert main(["calibrate", "--model", "tiny", "--family", "qwen2_vl", "--pairs-per-kind", "2", "--out", str(out),
                 "--report-dir", str(tmp_path / "report")]) == 0
    preset = yaml.safe_load(out.read_text())
    assert -1 <= preset["tau"] <= preset["tau_fine"] <= 1 and len(preset["fingerprint"]) == 32
    assert preset["calibration"]["heldout_fpr"] == 0.0
    assert "recall" in (tmp_path / "report" / "tiny-qwen2_vl.md").read_text()
    assert vismemo_hf.VisMemoCache(store=vismemo_hf.VisMemoStore(), thresholds=str(out)).thresholds.tau_fine == \
        preset["tau_fine"]
    # a store given the preset serves it to every cache of that model; other models keep the defaults
    store = vismemo_hf.VisMemoStore(thresholds=[str(out)])
    cache = vismemo_hf.VisMemoCache(store=store, tau=0.5)
    got = cache.lookup_thresholds(preset["fingerprint"])
    assert (got.tau, got.tau_fine, got.adaptive) == (0.5, preset["tau_fine"], False)
    assert (got.tau_pixel, got.tau_near) == (preset.get("tau_pixel"), preset.get("tau_near"))  # the pixel stage too
    assert cache.lookup_thresholds("another-model") == vismemo_hf.LookupThresholds(tau=0.5)
    with pytest.raises(ValueError, match="fingerprint"):
        vismemo_hf.VisMemoStore(thresholds=[vismemo_hf.LookupThresholds()])


@pytest.mark.parametrize("kv_format", ["int8", "fp8"])
def test_8bit_entries_serve_the_same_kv_from_every_tier(tmp_path, kv_format):
    e = _entry("a", n=6, layers=3)
    e.kv = (torch.randn(6, 3, 2, 2, 64) * 3).to(torch.bfloat16)
    full = len(blob.encode(e))
    small = len(blob.encode(e, kv_format))
    assert small < 0.6 * full
    served = []
    for options in ({}, {"device_bytes": 0, "host_bytes": None},
                    {"device_bytes": 0, "host_bytes": 0, "disk_dir": tmp_path / kv_format}):
        store = vismemo_hf.VisMemoStore(kv_format=kv_format, **options)
        store.put(e)
        store.flush()
        got = store.get("a", "fp")
        assert got.kv.dtype == torch.bfloat16
        assert torch.equal(store.get_tokens("a", "fp", torch.tensor([1, 4]), 1), got.kv[[1, 4], 1:])
        served.append(got.kv)
    assert all(torch.equal(served[0], kv) for kv in served[1:])
    error = float((served[0].float() - e.kv.float()).norm() / e.kv.float().norm())
    assert error < (0.01 if kv_format == "int8" else 0.05)
    with pytest.raises(ValueError, match="kv_format"):
        vismemo_hf.VisMemoStore(kv_format="int4")


def test_a_corrupt_8bit_blob_is_a_miss(tmp_path):
    e = _entry("a", n=4, layers=2)
    data = bytearray(blob.encode(e, "int8"))
    header = blob.parse_header(bytes(data[: blob.HEADER_SIZE]))
    data[blob.HEADER_SIZE + header.layer_bytes - 1] ^= 0xFF  # a scale byte of token 0, layer 0
    with pytest.raises(blob.BlobError):
        blob.decode_entry(header, torch.frombuffer(data, dtype=torch.uint8))


def test_compressed_entries_keep_vlcache_ranked_tokens_and_serve_exact_hits(family, pages):
    """A compressed store keeps half of each image's tokens; an exact hit masks the rest (METHOD §4) or, with
    ``missing="recompute"``, recomputes them and then equals a full prefill."""
    from transformers import DynamicCache

    from vismemo_hf.testing import tiny_model

    model, processor = tiny_model(family)
    vismemo_hf.enable(model)
    inputs = build_inputs(processor, [pages["base"]])
    _, ref = generate(model, inputs, DynamicCache(), 2)
    store = vismemo_hf.VisMemoStore(keep_ratio=0.5)
    miss = vismemo_hf.VisMemoCache(store=store)
    generate(model, inputs, miss, 1)
    key, n = miss.events[0].key, miss.events[0].n_tokens
    entry = store.get(key, model_fingerprint(model))
    assert entry.kv_count == (n + 1) // 2 and entry.kv.shape[0] == entry.kv_count
    missing = sorted(set(range(n)) - set(entry.kv_tokens.tolist()))
    masked = vismemo_hf.VisMemoCache(store=store)
    _, scores = generate(model, inputs, masked, 2)
    plan = masked.events[0].plan
    assert masked.events[0].kind is HitKind.EXACT and plan.mask.tolist() == missing and torch.isfinite(scores).all()
    recomputed = vismemo_hf.VisMemoCache(store=store, missing="recompute")
    _, scores = generate(model, inputs, recomputed, 2)
    plan = recomputed.events[0].plan
    assert plan.recompute.tolist() == missing and plan.mask.numel() == 0
    assert (scores - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("missing", ["mask", "recompute"])
def test_approximate_hits_on_compressed_entries_never_read_missing_tokens(qwen2, pages, missing):
    model, processor = qwen2
    store = vismemo_hf.VisMemoStore(keep_ratio=0.3, device_bytes=0, host_bytes=None)  # sparse reads of blobs
    generate(model, build_inputs(processor, [pages["base"]]), vismemo_hf.VisMemoCache(store=store), 1)
    for policy in ("attend-deviate", "vismemo", "cacheblend"):
        cache = vismemo_hf.VisMemoCache(store=store, policy=policy, missing=missing, store_misses=False)
        _, scores = generate(model, build_inputs(processor, [pages["edit"]]), cache, 2)
        event = cache.events[0]
        assert event.kind is HitKind.APPROXIMATE and torch.isfinite(scores).all(), policy
        stored = store.peek(event.alias, model_fingerprint(model)).kv_tokens
        assert bool(torch.isin(event.plan.reuse, stored).all()), policy
        assert event.plan.reuse.numel() <= stored.numel()


def test_compressed_blobs_round_trip_and_options_are_checked(tmp_path):
    e = _entry("a", n=8, layers=2)
    small = e.compressed(torch.tensor([6, 1, 3]))
    assert small.kv_tokens.tolist() == [1, 3, 6] and torch.equal(small.kv, e.kv[[1, 3, 6]])
    data = blob.encode(small)
    assert len(data) < len(blob.encode(e))
    header = blob.parse_header(data[: blob.HEADER_SIZE])
    back = blob.decode_entry(header, torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert back.kv_tokens.tolist() == [1, 3, 6] and torch.equal(back.kv, small.kv)
    store = vismemo_hf.VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path, keep_ratio=0.5)
    store.put(e, importance=torch.arange(8.0))  # the four highest scores: tokens 4-7
    store.flush()
    assert store.get("a", "fp").kv_tokens.tolist() == [4, 5, 6, 7]
    assert torch.equal(store.get_tokens("a", "fp", torch.tensor([0, 3]), 1), e.kv[[4, 7], 1:])  # rows, not tokens
    with pytest.raises(ValueError, match="keep_ratio"):
        vismemo_hf.VisMemoStore(keep_ratio=0.0)
    with pytest.raises(ValueError, match="missing"):
        vismemo_hf.VisMemoCache(store=store, missing="drop")


def test_a_reopened_store_indexes_its_entries_once_the_model_reference_is_known(tmp_path):
    first = vismemo_hf.VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path)
    entries = [_entry(f"k{i}", seed=i) for i in range(5)]
    for e in entries:
        first.put(e)
    first.close()
    again = vismemo_hf.VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=tmp_path)
    assert len(again) == 5 and again.candidates("fp", (1, 4, 4), entries[2].descriptors, 0.9, 3) == []
    again.set_reference("fp", ModelReference(torch.zeros(8), torch.zeros(8), 0.0))
    assert again.candidates("fp", (1, 4, 4), entries[2].descriptors, 0.9, 3)[0][0] == "k2"


def test_a_corrupt_lookup_section_is_never_scored(tmp_path):
    """A flipped byte in a candidate's descriptors or sketches: the fine stage reads nothing, the entry is removed."""
    for options in ({"device_bytes": 0, "host_bytes": None}, {"device_bytes": 0, "host_bytes": 0, "disk_dir": tmp_path}):
        store = vismemo_hf.VisMemoStore(**options)
        e = _entry("a", n=6)
        store.put(e)
        store.flush()
        assert store.lookup_section("a", "fp") is not None and store.stats()["bytes_read_lookup"] > 0
        header = blob.parse_header(blob.encode(e)[: blob.HEADER_SIZE])
        where = header.meta_start + header.lookup_bytes - 3  # inside the sketches
        if "disk_dir" in options:
            path = next(p for p in tmp_path.rglob("*.val"))
            data = bytearray(path.read_bytes())
            data[where] ^= 0x40
            path.write_bytes(bytes(data))
        else:
            store.host.lru["a"][1][where] ^= 0x40
        assert store.lookup_section("a", "fp") is None and "a" not in store and store.stats()["corrupt"] == 1


def test_the_packaged_readers_calibration_is_its_own():
    from vismemo_hf.testing import docqa_model

    model, _ = docqa_model()
    preset = LookupThresholds.load("vismemo-docqa-tiny")
    assert preset.fingerprint == model_fingerprint(model) and not preset.adaptive


def test_the_model_reference_is_computed_once_per_process(qwen2, pages):
    model, processor = qwen2
    calls = []
    hook = model.model.visual.register_forward_hook(lambda *a: calls.append(1))
    try:
        for _ in range(2):
            store = vismemo_hf.VisMemoStore()
            generate(model, build_inputs(processor, [pages["base"]]), vismemo_hf.VisMemoCache(store=store), 1)
            assert store.reference(model_fingerprint(model)) is not None
        assert len(calls) <= 3  # two images, and the reference images at most once
    finally:
        hook.remove()


def test_the_lookup_setup_runs_at_enable_not_in_the_first_request(pages):
    """``enable`` encodes the reference images (the lookup's one-time setup): the process's first request runs the
    tower for its own image only."""
    from vismemo_hf.runtime.reference import _REFERENCES
    from vismemo_hf.testing import tiny_model

    model, processor = tiny_model("qwen2_vl", seed=11)
    vismemo_hf.enable(model)
    assert model_fingerprint(model) in _REFERENCES
    calls = []
    hook = model.model.visual.register_forward_hook(lambda *a: calls.append(1))
    try:
        store = vismemo_hf.VisMemoStore()
        generate(model, build_inputs(processor, [pages["base"]]), vismemo_hf.VisMemoCache(store=store), 1)
        generate(model, build_inputs(processor, [pages["noise"]]), vismemo_hf.VisMemoCache(store=store), 1)
        assert len(calls) == 2 and store.reference(model_fingerprint(model)) is not None
    finally:
        hook.remove()


@pytest.mark.parametrize("bad, match", [({"tau": 0.7}, "lack"), ({"tau": "high", "tau_fine": 0.9}, "cosine"),
                                        ({"tau": 0.7, "tau_fine": 1.5}, "cosine"),
                                        ({"tau": 0.7, "tau_fine": 0.9, "fingerprint": 12}, "string"),
                                        (["tau", 0.7], "mapping")])
def test_malformed_threshold_presets_are_clear_errors(tmp_path, bad, match):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match=match):
        LookupThresholds.load(str(path))
    with pytest.raises(ValueError, match="unknown lookup thresholds preset"):
        LookupThresholds.load("no-such-model")


def test_fingerprints_name_the_weights_not_the_folder(tmp_path):
    """The same checkpoint from two folders (two machines sharing a store) has one fingerprint; other weights not."""
    import shutil

    from transformers import AutoModelForImageTextToText

    from vismemo_hf.eval.docqa import PACKAGED
    from vismemo_hf.testing import tiny_model

    shutil.copytree(PACKAGED, tmp_path / "copy")
    here = AutoModelForImageTextToText.from_pretrained(PACKAGED)
    there = AutoModelForImageTextToText.from_pretrained(tmp_path / "copy")
    there.set_attn_implementation("eager")
    assert model_fingerprint(here) == model_fingerprint(there)
    assert model_fingerprint(tiny_model("qwen2_vl", seed=0)[0]) != model_fingerprint(tiny_model("qwen2_vl", seed=1)[0])

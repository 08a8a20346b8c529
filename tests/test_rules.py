"""Rules of the lookup, the store, the cache and the default routing, each held by a test named after it."""

import diskcache
import pytest
import torch
from PIL import Image
from transformers import DynamicCache

import vismemo_hf
from vismemo_hf import HitKind, VisMemoStore
from vismemo_hf.core import features
from vismemo_hf.core.features import exact_key, region_descriptors
from vismemo_hf.core.plan import ImageFeatures, WarmupSignals
from vismemo_hf.core.thresholds import regional_cosines
from vismemo_hf.eval import synthetic
from vismemo_hf.policies.attend_deviate import AttendDeviatePolicy
from vismemo_hf.runtime import lookup
from vismemo_hf.runtime.reference import _REFERENCES
from vismemo_hf.store import blob
from vismemo_hf.store.remote import _record
from vismemo_hf.store.tiers import SafeDisk

from conftest import build_inputs, generate, noise_image
from test_store import _entry


def _embeds(model, processor, image):
    inputs = processor.image_processor(images=[image], return_tensors="pt")
    grid = tuple(int(x) for x in inputs["image_grid_thw"][0])
    adapter = model._vismemo
    with torch.no_grad():
        ((embeds, _),) = adapter.encode(adapter.base.get_image_features, inputs["pixel_values"], inputs["image_grid_thw"])
    return embeds, grid, adapter.merge


# 1. the coarse rule: every region, not any -------------------------------------------------------------
def test_a_candidate_with_three_matching_regions_and_one_unrelated_region_is_not_an_alias(qwen2, monkeypatch):
    model, processor = qwen2
    base = synthetic.page(1)
    patched = base.copy()
    w, h = base.size
    patched.paste(noise_image(3, (w // 2, h // 2)), (w // 2, h // 2))  # the bottom-right region is unrelated
    store = VisMemoStore()
    generate(model, build_inputs(processor, [base]), vismemo_hf.VisMemoCache(store=store), 1)
    reference = store.reference(model._vismemo.fingerprint) or _REFERENCES[model._vismemo.fingerprint]
    (e0, grid, merge), (e1, _, _) = _embeds(model, processor, base), _embeds(model, processor, patched)
    cos = regional_cosines(region_descriptors(e1, grid, merge), region_descriptors(e0, grid, merge),
                           reference.descriptor_mean)
    low, high = float(cos[3]), float(cos[:3].min())
    assert low < high, "premise: the patched region is the least similar one"
    tau = (low + high) / 2  # three regions pass it, one does not
    # the index is not asked (every stored key is a candidate) and the fine stage accepts anything:
    # only the exact coarse rule can refuse the alias (the pixel-first stage, which finds a page with one quadrant
    # changed by its untouched rows, is off)
    monkeypatch.setattr(store, "candidates", lambda fp, grid, d, tau, k: [(key, 1.0) for key in store.catalog.where])
    cache = vismemo_hf.VisMemoCache(store=store, tau=tau, tau_fine=-1.0, store_misses=False, same_pixels=None)
    generate(model, build_inputs(processor, [patched]), cache, 1)
    assert cache.events[0].kind is HitKind.MISS
    # control: with a tau every region passes, the same candidate is an alias (the thumbnail check, which turns
    # down a page with a quadrant of noise, off: the coarse rule alone is under test)
    with monkeypatch.context() as patch:
        patch.setattr(lookup, "_thumbnails_agree", lambda *args: True)
        cache = vismemo_hf.VisMemoCache(store=store, tau=low - 1e-3, tau_fine=-1.0, store_misses=False,
                                        same_pixels=None)
        generate(model, build_inputs(processor, [patched]), cache, 1)
        assert cache.events[0].kind is HitKind.APPROXIMATE
    cache = vismemo_hf.VisMemoCache(store=store, tau=low - 1e-3, tau_fine=-1.0, store_misses=False, same_pixels=None)
    generate(model, build_inputs(processor, [patched]), cache, 1)
    assert cache.events[0].kind is HitKind.MISS  # with it, the thumbnails disagree
    found = vismemo_hf.VisMemoCache(store=store, store_misses=False)  # the default finds it by its pixels
    generate(model, build_inputs(processor, [patched]), found, 1)
    assert found.events[0].found_by == "pixels"


# 2. an entry is checked against the model by its own bytes ------------------------------------------------
def _foreign(entry):
    """The entry as a blob of another model (a valid blob: every checksum matches)."""
    entry.fingerprint = "other-model"
    return blob.encode(entry)


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_an_entry_whose_blob_names_another_model_is_a_miss_even_when_the_index_says_otherwise(tmp_path, tier):
    store = VisMemoStore(device_bytes=None if tier == "device" else 0, host_bytes=None if tier == "host" else 0,
                         disk_dir=tmp_path / "d" if tier == "disk" else None)
    store.put(_entry("a", n=4, layers=3))
    store.flush()
    assert store.tier_of("a") == tier and store.catalog.where["a"][0] == "fp"  # the index says: model "fp"
    if tier == "device":
        foreign = _entry("a", n=4, layers=3)
        foreign.fingerprint = "other-model"
        store.device.lru["a"] = foreign
    elif tier == "host":
        store.host.pop("a")
        store.host.put("a", _foreign(_entry("a", n=4, layers=3)))
    else:
        store.disk.write("a", _foreign(_entry("a", n=4, layers=3)))
    before = store.stats()["corrupt"]
    assert store.get_tokens("a", "fp", torch.tensor([0, 2]), 1) is None
    assert store.lookup_section("a", "fp") is None and store.peek("a", "fp") is None and store.get("a", "fp") is None
    assert store.stats()["corrupt"] > before and "a" not in store


# 3. the exact key holds the grid ------------------------------------------------------------------------
def test_two_images_with_the_same_pixel_bytes_under_different_grids_never_share_an_entry(qwen2):
    model, processor = qwen2
    wide, tall = Image.new("RGB", (224, 112), "white"), Image.new("RGB", (112, 224), "white")
    a, b = (processor.image_processor(images=[im], return_tensors="pt") for im in (wide, tall))
    assert torch.equal(a["pixel_values"], b["pixel_values"]), "premise: a solid image gives the same patch bytes"
    assert not torch.equal(a["image_grid_thw"], b["image_grid_thw"])
    fp = model._vismemo.fingerprint
    assert exact_key(fp, a["pixel_values"], a["image_grid_thw"][0].tolist()) != \
        exact_key(fp, b["pixel_values"], b["image_grid_thw"][0].tolist())
    assert model._vismemo.image_key(fp, a["pixel_values"], a["image_grid_thw"][0]) != \
        model._vismemo.image_key(fp, b["pixel_values"], b["image_grid_thw"][0])
    store = VisMemoStore()
    generate(model, build_inputs(processor, [wide]), vismemo_hf.VisMemoCache(store=store), 1)
    cache = vismemo_hf.VisMemoCache(store=store, top_k=0)
    inputs = build_inputs(processor, [tall])
    _, scores = generate(model, inputs, cache, 2)
    assert cache.events[0].kind is HitKind.MISS and len(store) == 2
    _, plain = generate(model, inputs, DynamicCache(), 2)
    assert (scores - plain).abs().max() <= 1e-4


# 4, 5. the default routing's mask threshold and recompute cap ------------------------------------------
def _features(n):
    return ImageFeatures("k", (1, 2, 2 * n), torch.randn(n, 8), torch.zeros(n))


@pytest.mark.parametrize("n", [40, 160])
def test_the_mask_threshold_follows_the_images_token_count(n):
    """Masked: normalised attention below ``mask_below`` x uniform (1/N), whatever N is."""
    policy = AttendDeviatePolicy(recompute_ratio=0.0, mask_below=0.1, max_mask_ratio=1.0)
    low, mid = torch.arange(0, n // 4), torch.arange(n // 4, n // 2)
    p = torch.empty(n)
    p[low], p[mid] = 0.05 / n, 0.3 / n  # below and above 0.1 / N
    p[n // 2 :] = (1 - p[: n // 2].sum()) / (n - n // 2)
    signals = WarmupSignals(attention=p.view(1, 1, 1, n), key_deviation=torch.zeros(1, n),
                            value_deviation=torch.zeros(1, n))
    plan = policy.plan(_features(n), _features(n), torch.arange(n), signals)
    assert torch.equal(plan.mask, low)
    assert plan.recompute.numel() == 0 and plan.reuse.numel() == n - low.numel()


def test_deviation_outliers_beyond_max_recompute_ratio_are_not_recomputed():
    n = 100
    policy = AttendDeviatePolicy(recompute_ratio=0.2, deviation_share=1.0, max_recompute_ratio=0.3, mask_below=0.0,
                                 drift_deviation=None, drift_min_deviation=None)
    deviation = torch.full((n,), 0.1)
    outliers = torch.arange(0, n, 2)[:45]  # 45 % of the tokens deviate 100x the median
    deviation[outliers] = 10.0 + torch.arange(45).float()  # distinct, so the cap keeps the largest
    signals = WarmupSignals(attention=torch.full((1, 1, 1, n), 1 / n), key_deviation=deviation[None],
                            value_deviation=torch.zeros(1, n))
    plan = policy.plan(_features(n), _features(n), torch.arange(n), signals)
    assert plan.recompute.numel() == 30  # the cap, not the 45 outliers
    assert set(plan.recompute.tolist()) == set(outliers[-30:].tolist())  # the 30 largest deviations



@pytest.mark.parametrize("pixels, full", [(30, False), (40, True)])
def test_an_approximate_hit_that_would_recompute_much_of_the_image_is_computed_in_full(pixels, full):
    """``full_ratio`` (0.35): a plan that recomputes more of the image than that (its changed pixels and what reads
    them) reuses K/V next to a large change: it is computed in full (``fallback="changed"``); ``full_ratio=None``
    keeps the plan."""
    n = 100
    deviation = torch.zeros(n)
    signals = WarmupSignals(attention=torch.full((1, 1, 1, n), 1 / n), key_deviation=deviation[None],
                            value_deviation=torch.zeros(1, n))
    alias = _hashed(n, torch.arange(n))
    region = _hashed(n, torch.cat([torch.arange(n - pixels), torch.arange(n - pixels, n) + 1000]))  # the bottom
    plan = AttendDeviatePolicy(mask_below=0.0, dependents=0).plan(region, alias, torch.arange(n), signals)
    assert plan.complete is full and plan.fallback == ("changed" if full else None)
    kept = AttendDeviatePolicy(mask_below=0.0, dependents=0, full_ratio=None).plan(region, alias, torch.arange(n),
                                                                                   signals)
    assert not kept.complete and kept.recompute.numel() == pixels
    with pytest.raises(ValueError, match="full_ratio"):
        AttendDeviatePolicy(full_ratio=1.5)


# 9. an early miss when the page changed everywhere --------------------------------------------------------
@pytest.mark.parametrize("median, full", [(0.6, True), (0.1, False)])
def test_an_image_whose_median_deviation_passes_miss_deviation_is_computed_in_full(median, full):
    """Outliers are measured against the image's median; when the median itself is high (another image altogether)
    the default computes every token instead of reusing what is not an outlier."""
    n = 100
    policy = AttendDeviatePolicy(mask_below=0.0, drift_deviation=None, drift_min_deviation=None)
    deviation = torch.full((n,), median)
    deviation[:10] = 10.0  # a few tokens deviate far more
    signals = WarmupSignals(attention=torch.full((1, 1, 1, n), 1 / n), key_deviation=deviation[None],
                            value_deviation=torch.zeros(1, n))
    plan = policy.plan(_features(n), _features(n), torch.arange(n), signals)
    assert plan.complete is full and (full or plan.recompute.numel() == 10)
    never = AttendDeviatePolicy(mask_below=0.0, miss_deviation=None, drift_deviation=None, drift_min_deviation=None).plan(
        _features(n), _features(n), torch.arange(n), signals)
    assert never.recompute.numel() == 10


def _hashed(n, hashes):
    return ImageFeatures("k", (1, 2, 2 * n), torch.randn(n, 8), torch.zeros(n), patch_hashes=hashes)


@pytest.mark.parametrize("median", [0.001, 0.05, 0.2])
def test_a_copy_changed_everywhere_recomputes_every_deviating_token_or_is_computed_in_full(median):
    """A copy whose every token shows other pixels (moved by part of a token, rescanned, blurred) is computed in full
    when its median deviation passes ``drift_deviation``; below it, every token deviating past ``drift_min_deviation``
    is recomputed (its median measures how much its content changed, not a noise floor), and the copy is computed in
    full when those pass ``max_recompute_ratio``. A local edit with the same deviations takes outliers against the
    median as before, and unknown pixels count as changed everywhere."""
    n = 100
    deviation = torch.full((n,), median)
    deviation[:5] = 10.0
    deviation[5:35] = 3.5 * median  # past drift_min_deviation at every median, within outlier_factor x the median
    signals = WarmupSignals(attention=torch.full((1, 1, 1, n), 1 / n), key_deviation=deviation[None],
                            value_deviation=torch.zeros(1, n))
    alias = _hashed(n, torch.arange(n))
    moved = _hashed(n, torch.arange(n) + 1000)
    edited = _hashed(n, torch.cat([torch.arange(5) + 1000, torch.arange(5, n)]))
    policy = AttendDeviatePolicy(mask_below=0.0, dependents=0)
    for image in (moved, _features(n)):
        plan = policy.plan(image, alias, torch.arange(n), signals)
        assert plan.complete is (median > policy.drift_min_deviation)
        assert plan.complete or plan.recompute.tolist() == list(range(35))
        assert plan.fallback == ("changed" if plan.complete else None)
    local = policy.plan(edited, alias, torch.arange(n), signals)
    assert not local.complete and local.recompute.tolist() == list(range(5))
    relative = AttendDeviatePolicy(mask_below=0.0, dependents=0, drift_min_deviation=None).plan(
        moved, alias, torch.arange(n), signals)
    assert relative.complete is (median > policy.drift_deviation)
    assert relative.complete or relative.recompute.tolist() == list(range(5))
    off = AttendDeviatePolicy(mask_below=0.0, drift_deviation=None, drift_min_deviation=None).plan(
        moved, alias, torch.arange(n), signals)
    assert not off.complete and off.recompute.numel() == 5
    with pytest.raises(ValueError, match="drift_min_deviation"):
        AttendDeviatePolicy(drift_min_deviation=-1.0)
    with pytest.raises(ValueError, match="drift_deviation"):
        AttendDeviatePolicy(drift_deviation=-1.0)

# 6. padding in a prefill that reuses nothing --------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_each_row_of_a_left_padded_batch_of_cold_misses_equals_that_request_alone(family):
    from conftest import _enabled_tiny

    model, processor = _enabled_tiny(family)
    requests = [([synthetic.page(11)], "Which row?", ""),
                ([synthetic.page(12)], "What is the value of the third row of this form, please?", "Look here. ")]
    batch = build_inputs(processor, None, batch=requests)
    assert not bool(batch["attention_mask"].all()), "premise: the first row is left-padded"
    cache = vismemo_hf.VisMemoCache(store=VisMemoStore())
    tokens, scores = generate(model, batch, cache, 3)
    assert [e.kind for e in cache.events] == [HitKind.MISS, HitKind.MISS]
    for row, request in enumerate(requests):
        alone_tokens, alone = generate(model, build_inputs(processor, None, batch=[request]),
                                       vismemo_hf.VisMemoCache(store=VisMemoStore()), 3)
        assert (scores[row] - alone[0]).abs().max() <= 1e-4, f"row {row}"
        assert torch.equal(tokens[row], alone_tokens[0])


# 7. crop shortens the cache ------------------------------------------------------------------------------
def test_after_crop_the_cache_is_shorter_and_prompt_lookup_decoding_equals_greedy(qwen2, pages):
    model, processor = qwen2
    store = VisMemoStore()
    generate(model, build_inputs(processor, [pages["base"]]), vismemo_hf.VisMemoCache(store=store), 1)
    inputs = build_inputs(processor, [pages["edit"]], "row 1 row 1 row 1 row 1")
    options = dict(store=store, policy="vismemo", store_misses=False)  # masks tokens for decoding too
    cache = vismemo_hf.VisMemoCache(**options)
    generate(model, inputs, cache, 4)
    assert cache.events[0].kind is HitKind.APPROXIMATE and cache.events[0].masked
    assert cache.layers[-1].mapped  # a layer whose slots are not the plain sequence
    length = cache.get_seq_length()
    slots = [layer.keys.shape[-2] for layer in cache.layers]
    cache.crop(-3)
    assert cache.get_seq_length() == length - 3
    assert [layer.keys.shape[-2] for layer in cache.layers] == [s - 3 for s in slots]
    assert all(layer.columns.shape[-1] == layer.keys.shape[-2] for layer in cache.layers if layer.mapped)
    greedy, _ = generate(model, inputs, vismemo_hf.VisMemoCache(**options), 8)
    with torch.no_grad():
        out = model.generate(**inputs, cache=vismemo_hf.VisMemoCache(**options), max_new_tokens=8,
                             do_sample=False, prompt_lookup_num_tokens=3)
    assert torch.equal(out[:, inputs["input_ids"].shape[1]:], greedy)


# 8. a blob holds the key it is stored under ---------------------------------------------------------------
def _plant(store, tier, key, data):
    """Put blob ``data`` under ``key`` in ``tier`` as another writer would (bytes only, no index)."""
    if tier == "host":
        store.host.put(key, data)
    elif tier == "disk":
        store.disk.put(key, data)
    else:
        record = _record(data, _entry("a").descriptors)
        client = store.remote.client
        client.set(store.remote._blob_key(key), data)
        client.hset(f"{store.remote.prefix}:index", key, record)
    store.catalog.where[key] = ("fp", (1, 4, 4))


@pytest.mark.parametrize("tier", ["host", "disk", "remote"])
def test_a_blob_written_under_another_key_is_a_counted_miss_on_every_tier(tmp_path, tier, request):
    options = {"device_bytes": 0, "host_bytes": None if tier == "host" else 0}
    if tier == "disk":
        options["disk_dir"] = tmp_path / "d"
    if tier == "remote":
        pytest.importorskip("redis")
        server = request.getfixturevalue("server")
        options["remote_url"], options["remote_options"] = server.url, {"refresh_s": 0}
    store = VisMemoStore(**options)
    data = blob.encode(_entry("a", n=4, layers=3))
    try:
        _plant(store, tier, "b", data)
    except blob.BlobError:
        return  # refused at the door: never served
    before = store.stats()["corrupt"]
    assert store.get("b", "fp") is None
    assert store.get_tokens("b", "fp", torch.tensor([0]), 1) is None and store.peek("b", "fp") is None
    assert store.stats()["corrupt"] > before and "b" not in store


def test_a_shared_directory_never_serves_another_images_kv_as_an_exact_hit(qwen2, pages, tmp_path):
    model, processor = qwen2
    directory = tmp_path / "shared"
    store = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=directory)
    generate(model, build_inputs(processor, [pages["noise"]]), vismemo_hf.VisMemoCache(store=store, top_k=0), 1)
    store.close()
    (noise_key,) = list(diskcache.Cache(str(directory), disk=SafeDisk).iterkeys())
    inputs = build_inputs(processor, [pages["base"]])
    base_key = model._vismemo.image_key(model._vismemo.fingerprint, inputs["pixel_values"], inputs["image_grid_thw"][0])
    with diskcache.Cache(str(directory), disk=SafeDisk) as raw:  # a writer copies the noise blob under the base key
        raw.set(base_key, raw.get(noise_key, read=True), read=True)
    reader = VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=directory)
    cache = vismemo_hf.VisMemoCache(store=reader, top_k=0)
    _, scores = generate(model, inputs, cache, 2)
    assert cache.events[0].kind is HitKind.MISS
    _, plain = generate(model, inputs, DynamicCache(), 2)
    assert (scores - plain).abs().max() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_key_tells_every_byte_apart_and_is_the_same_on_any_number_of_threads(dtype, monkeypatch):
    """The key hashes every byte of the pixels (a change anywhere, by a sign bit even, gives another key), with the
    fingerprint, grid, dtype and shape; BLAKE3's digest does not depend on its threads, so a machine with another
    number of cores computes the same key for a shared store."""
    monkeypatch.setattr(features, "PARALLEL_BYTES", 1 << 16)  # several threads from 64 KB on
    rows = 3000
    pixels = torch.randn(rows, 96).to(dtype)
    grid = (1, 50, 60)
    key = exact_key("fp", pixels, grid)
    assert key == exact_key("fp", pixels.clone(), grid)
    assert key not in (exact_key("fp2", pixels, grid), exact_key("fp", pixels, (1, 60, 50)),
                       exact_key("fp", pixels.reshape(rows * 2, 48), grid),
                       exact_key("fp", pixels.view(torch.int16 if dtype == torch.bfloat16 else torch.int32), grid))
    zeros = torch.zeros(rows, 96, dtype=dtype)
    signed = zeros.clone()
    signed[rows - 1, 95] = -0.0  # equal as numbers, not as bytes
    assert exact_key("fp", zeros, grid) != exact_key("fp", signed, grid)
    for row in (0, rows // 2, rows - 1):
        for column in (0, 47, 95):
            edited = pixels.clone()
            edited[row, column] += 1
            assert exact_key("fp", edited, grid) != key, (row, column)
    assert exact_key("fp", pixels.t(), grid) == exact_key("fp", pixels.t().contiguous(), grid)  # bytes in order
    monkeypatch.setattr(features, "_threads", lambda: 1)
    assert exact_key("fp", pixels, grid) == key


def _key_in_child(queue, pixels) -> None:
    queue.put(exact_key("fp", pixels, (1, 50, 60)))


def test_a_forked_child_computes_the_same_exact_key_after_its_parent_hashed_on_threads(monkeypatch):
    """The key's threads are a pool of each hasher's own (not a process-wide pool, whose threads a forked child would
    lack and wait for): a child forked after its parent hashed on several threads hashes too, to the same key."""
    import multiprocessing

    monkeypatch.setattr(features, "PARALLEL_BYTES", 1 << 16)
    monkeypatch.setattr(features, "_threads", lambda: 2)
    pixels = torch.randn(3000, 96)
    key = exact_key("fp", pixels, (1, 50, 60))
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_key_in_child, args=(queue, pixels))
    child.start()
    child.join(60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0
    assert queue.get(timeout=5) == key

"""The lookup's pixel stage: a page moved by part of a visual token or zoomed by a few percent changes every token
but not its pixels; its thumbnail, aligned across zooms and sub-token moves, finds it where the token rule cannot,
and nothing else."""

import random
from dataclasses import replace

import pytest
import torch
from PIL import Image

from vismemo_hf.core.features import THUMB_MAX, thumb_per_token, thumbnail, thumbnail_shape
from vismemo_hf.core.thresholds import LookupThresholds, aligned_similarity, zoom_drift
from vismemo_hf.eval import docpage
from vismemo_hf.store import blob

from conftest import build_inputs, generate
from test_store import _entry

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def _processed(image: Image.Image, patch: int):
    from transformers import Qwen2VLImageProcessor

    token = 2 * patch
    processor = Qwen2VLImageProcessor(size={"shortest_edge": 4 * token**2, "longest_edge": 4096 * token**2},
                                      patch_size=patch, temporal_patch_size=2, merge_size=2, image_mean=list(MEAN),
                                      image_std=list(STD))
    out = processor(images=[image.convert("RGB")], return_tensors="pt")
    return out["pixel_values"], tuple(int(x) for x in out["image_grid_thw"][0])


def _thumb(image: Image.Image, patch: int = 14) -> torch.Tensor:
    pixels, grid = _processed(image, patch)
    return thumbnail(pixels, grid, channels=3, temporal_patch=2, patch=patch, merge=2, image_mean=MEAN,
                     image_std=STD)


@pytest.mark.parametrize("patch", [14, 16])  # Qwen2-VL / Qwen2.5-VL and Qwen3-VL patches
def test_the_thumbnail_is_the_image_itself_averaged_down(patch):
    """Patches put back in place: a smooth image's thumbnail equals the image averaged down (a wrong patch order
    or merge window scrambles it), seven pixels per visual token."""
    side = 16 * 2 * patch
    y, x = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    rgb = torch.stack([x * 255 // (side - 1), y * 255 // (side - 1), (x + y) * 255 // (2 * side - 2)], -1)
    image = Image.fromarray(rgb.to(torch.uint8).numpy())
    thumb = _thumb(image, patch)
    assert thumb.shape == (16 * 7, 16 * 7) and thumb.dtype == torch.uint8
    luma = torch.from_numpy(__import__("numpy").asarray(image.convert("L"), dtype="float32"))
    expected = torch.nn.functional.adaptive_avg_pool2d(luma[None, None], thumb.shape)[0, 0]
    inner = (slice(4, -4), slice(4, -4))  # the blur replicates the edges
    assert float((thumb.float() - expected)[inner].abs().max()) <= 3.0


def test_a_large_image_keeps_a_small_thumbnail():
    assert thumb_per_token((16, 16)) == 7 and thumb_per_token((80, 40)) == THUMB_MAX // 80
    pixels, grid = _processed(Image.new("RGB", (28 * 60, 28 * 30), (200, 200, 200)), 14)
    thumb = thumbnail(pixels, grid, channels=3, temporal_patch=2, patch=14, merge=2, image_mean=MEAN, image_std=STD)
    assert max(thumb.shape) <= THUMB_MAX and thumb.shape == (30 * thumb_per_token((30, 60)), 60 * thumb_per_token((30, 60)))


def test_a_photo_moved_by_a_few_pixels_aligns_despite_the_border_it_shows():
    """A smooth photo moved by 1-3 px shows a white strip its original has not; the high pass makes that edge its
    strongest detail, so the alignment scores the interior only: the moved photo aligns (>= 0.97, above the derived
    stage's floor), another photo of the kind does not come near."""
    from vismemo_hf.core.images import synthetic_image
    from vismemo_hf.core.thresholds import PIXEL_FLOOR
    from vismemo_hf.eval import synthdoc

    per = thumb_per_token((8, 8))
    for seed in range(4):
        photo = synthetic_image("photo", 900 + seed, size=(224, 224))
        mine = _thumb(photo)
        for dx in (1, 3):
            assert aligned_similarity(_thumb(synthdoc.shift_image(photo, dx)), mine, per)[0] >= max(0.97, PIXEL_FLOOR)
        other = synthetic_image("photo", 950 + seed, size=(224, 224))
        assert aligned_similarity(_thumb(other), mine, per)[0] <= 0.6


def test_aligned_similarity_finds_pages_moved_by_part_of_a_token_or_zoomed_and_not_other_pages():
    """A 2-3 px shift and 2.7 % / 4.7 % zooms (crops) of a page align (>= 0.85) at the zoom they were made with;
    another page of the same layout does not come near (<= 0.8); thumbnails of other shapes compare at -1."""
    rng = random.Random(0)
    per = thumb_per_token((16, 16))
    for i, layout in enumerate(docpage.LAYOUTS):
        page = docpage.random_page(2**31 + 77_000 + i, layout=layout)
        mine = _thumb(docpage.render(page))
        for changed, zoom in ((docpage.shift(page, rng.choice([-3, 3]), 2), 1.0),
                              (docpage.crop(page, 6), (docpage.SIZE - 12) / docpage.SIZE),  # x shows the page's zoom * x
                              (docpage.crop(page, 10), (docpage.SIZE - 20) / docpage.SIZE)):
            score, found = aligned_similarity(_thumb(docpage.render(changed)), mine, per)
            assert score >= 0.85 and found == pytest.approx(zoom, abs=0.006), (layout, changed, score, found)
        other = docpage.random_page(2**31 + 78_000 + i, layout=layout)
        assert aligned_similarity(_thumb(docpage.render(other)), mine, per)[0] <= 0.8, layout
    assert aligned_similarity(mine, mine[:, :-7], 7) == (-1.0, 1.0)
    assert zoom_drift(1.0, (16, 16)) == 0 and zoom_drift(1.05, (16, 32)) == pytest.approx(0.8)


def test_a_search_asked_for_a_decision_decides_as_the_full_search_and_stops_early(monkeypatch):
    """``aligned_similarity(..., hopeless_below=T, enough=T)`` is on the same side of T as the full search for
    copies moved by part of a pixel, zoomed, turned, rescanned and for other pages of the layout, at the thresholds
    the lookup asks (the derived pixel stage's floor, the encoder stage's agreement) and around them; without them it
    is the full search; a hopeless candidate is not refined. FFTs take lengths of small prime factors."""
    from PIL import ImageFilter

    from vismemo_hf.core.thresholds import ENCODER_PIXEL_AGREE, PIXEL_FLOOR, fast_size

    assert [fast_size(n) for n in (1, 7, 119, 120, 121, 167)] == [1, 8, 120, 120, 125, 180]
    per = thumb_per_token((16, 16))
    page = docpage.random_page(2**31 + 79_000, layout="form")
    image = docpage.render(page).convert("RGB")
    mine = _thumb(image)
    w, h = image.size
    changed = [docpage.render(docpage.shift(page, 3, 2)), docpage.render(docpage.rotate(page, 1.0)),
               docpage.render(docpage.rescale(page, 1.02)), image.filter(ImageFilter.GaussianBlur(1.0)),
               image.transform(image.size, Image.AFFINE, (1, 0, 2, 0, 1, 1), fillcolor=(255, 255, 255)),
               docpage.render(docpage.random_page(2**31 + 79_001, layout="form")),
               docpage.render(docpage.random_page(2**31 + 79_002, layout="table"))]
    for other in changed:
        theirs = _thumb(other)
        full = aligned_similarity(theirs, mine, per)[0]
        for t in (ENCODER_PIXEL_AGREE, PIXEL_FLOOR, 0.6, 0.8, 0.97, full - 0.002, full + 0.002):
            quick = aligned_similarity(theirs, mine, per, hopeless_below=t, enough=t)[0]
            assert (quick >= t) == (full >= t), (t, full, quick)
            assert aligned_similarity(theirs, mine, per, hopeless_below=t)[0] == full or full < t
    from vismemo_hf.core import thresholds

    warps = []
    original = thresholds._warps
    monkeypatch.setattr(thresholds, "_warps", lambda hb, params: warps.append(len(params)) or original(hb, params))
    aligned_similarity(_thumb(changed[-2]), mine, per)
    full, warps[:] = sum(warps), []
    assert aligned_similarity(_thumb(changed[-2]), mine, per, hopeless_below=PIXEL_FLOOR)[0] < PIXEL_FLOOR
    assert sum(warps) * 4 < full  # the zoom search and the lattice's three alignments, no refinement


def test_pixel_thresholds_go_together_and_the_pixel_stage_runs_only_just_below_tau_fine(tmp_path):
    with pytest.raises(ValueError, match="go together"):
        LookupThresholds(tau_pixel=0.9)
    with pytest.raises(ValueError, match="tau_near"):
        LookupThresholds(tau_pixel=0.9, tau_near=1.5)
    plain = LookupThresholds(0.5, 0.9, adaptive=False)
    t = LookupThresholds(0.5, 0.9, adaptive=False, tau_pixel=0.93, tau_near=0.6)

    def never():
        raise AssertionError("the pixel stage ran")

    assert not plain.pixel_stage and not plain.matches(0.89, 0.9, never) and plain.matches(0.9, 0.9, never)
    assert t.matches(0.95, 0.9, never) and not t.matches(0.59, 0.9, never)  # above tau_fine / below tau_near
    assert t.matches(0.7, 0.9, lambda: 0.93) and not t.matches(0.7, 0.9, lambda: 0.92)
    preset = tmp_path / "p.yaml"
    preset.write_text("tau: 0.5\ntau_fine: 0.9\ntau_pixel: 0.93\ntau_near: 0.6\n")
    assert LookupThresholds.load(str(preset)) == t
    preset.write_text("tau: 0.5\ntau_fine: 0.9\ntau_pixel: 0.93\n")
    with pytest.raises(ValueError, match="go together"):
        LookupThresholds.load(str(preset))


@pytest.mark.parametrize("sealed", [False, True])
def test_the_thumbnail_travels_in_the_checked_lookup_section(sealed):
    """Written with the entry, read back with the lookup section alone, and covered by its digest (its MAC in a
    sealed store): a changed thumbnail byte is a corrupt (or forged) blob, never a thumbnail the lookup trusts."""
    entry = _entry("k", n=4, layers=2)
    entry.thumbnail = torch.randint(0, 256, (14, 14), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    seal = blob.Seal("s" * 32) if sealed else None
    data = blob.encode(entry, seal=seal)
    header = blob.parse_header(data[: blob.HEADER_SIZE], seal)
    section = data[header.meta_start : header.meta_start + header.lookup_bytes]
    descriptors, sketch, thumb = blob.decode_lookup(header, section)
    assert torch.equal(thumb, entry.thumbnail) and torch.equal(descriptors, entry.descriptors.float())
    meta = blob.decode_meta(header, data[header.meta_start :])
    assert torch.equal(meta.thumbnail, entry.thumbnail) and torch.equal(meta.sketch, sketch)
    bad = bytearray(section)
    bad[4 * entry.embeds.shape[-1] * 4 + 20] ^= 1  # inside the thumbnail
    with pytest.raises(blob.ForgedBlob if sealed else blob.BlobError):
        blob.decode_lookup(header, bytes(bad))
    entry.thumbnail = None
    header = blob.parse_header(blob.encode(entry)[: blob.HEADER_SIZE])
    assert header.thumb == (0, 0)


def test_on_the_base_reader_shifted_and_zoomed_pages_are_found_and_a_zoomed_one_is_computed_in_full():
    """Through the reader's calibrated preset: a page moved by 3 px is a hit that reuses the tokens that did not
    deviate (or, changed everywhere past ``drift_deviation`` or ``max_recompute_ratio``, is computed in full), with
    plain transformers' answer; a page
    zoomed by 4.7 % (a crop), which the token rule misses, is found by the pixel stage and computed in full (its
    answer and first-token probabilities those of plain transformers); another page of the layout is a miss."""
    from transformers import DynamicCache

    import vismemo_hf
    from vismemo_hf.core.plan import HitKind
    from vismemo_hf.eval import docqa_base, docstream
    from vismemo_hf.eval.loading import load_model
    from vismemo_hf.eval.quality import answer

    model, processor = load_model(docqa_base.MODEL_NAME)
    vismemo_hf.enable(model)
    preset = LookupThresholds.load("vismemo-docqa-base")
    rng = random.Random(5)
    pixel_hits = 0
    for i, layout in enumerate(docpage.LAYOUTS):
        base = docpage.random_page(2**31 + 91_000 + i, layout=layout)
        other = docpage.random_page(2**31 + 92_000 + i, layout=layout)
        for name, page in (("shift", docpage.shift(base, 3, 2)), ("zoom", docpage.crop(base, 10)), ("other", other)):
            store = vismemo_hf.VisMemoStore()
            first = docstream.request("a", base, docpage.random_question(rng, base, instruct=0.0), "miss", "a")
            miss = vismemo_hf.VisMemoCache(store=store)
            answer(model, processor, first, miss, 1)
            assert store.peek(miss.events[0].key, miss.owner(vismemo_hf.families.ModelAdapter.for_model(
                model).fingerprint)).thumbnail.shape == (112, 112)  # written with the entry
            # the same (empty) text before the image: another one would make its K/V computed after another context
            request = docstream.request("b", page, docpage.random_question(rng, page, instruct=0.0), "approximate", "b")
            cache = vismemo_hf.VisMemoCache(store=store, thresholds="vismemo-docqa-base")
            prediction, _, logprobs, _, _ = answer(model, processor, request, cache, 6)
            event = cache.events[0]
            if name == "other":
                assert event.kind is HitKind.MISS, (layout, event)
                continue
            assert event.kind is HitKind.APPROXIMATE, (layout, name, event)
            if event.pixel_score is not None:
                pixel_hits += 1
                assert event.pixel_score >= preset.tau_pixel and event.score < preset.tau_fine
            plain, _, plain_logprobs, _, _ = answer(model, processor, request, DynamicCache(), 6)
            assert prediction == plain, (layout, name, prediction, plain)
            if name == "shift":  # reuses what did not deviate, or (changed everywhere past the bounds) is computed
                assert event.reused > 0 or event.fallback == "changed", (layout, event)
                continue
            assert event.pixel_score is not None and event.recomputed == event.n_tokens, (layout, event)
            assert float((logprobs.exp() - plain_logprobs.exp()).abs().max()) <= 1e-3
    assert pixel_hits >= 6  # every zoom and some shifts: what the token rule alone misses


def test_the_pixel_stage_aligns_at_most_two_near_candidates_best_first(monkeypatch):
    """A miss among many pages of one layout pays for at most ``PIXEL_CANDIDATES`` alignments, tried in the order
    of their fine scores; candidates above tau_fine or below tau_near are never aligned."""
    from vismemo_hf.runtime import lookup

    calls, passing = [], {1}

    def align(mine, thumb, per, hopeless_below=None, enough=None):
        calls.append(int(thumb[0, 0]))
        return (0.99 if int(thumb[0, 0]) in passing else 0.5), 1.0

    monkeypatch.setattr(lookup, "aligned_similarity", align)
    t = LookupThresholds(0.0, 0.9, adaptive=False, tau_pixel=0.95, tau_near=0.6)
    thumb = lambda v: torch.full((4, 4), v, dtype=torch.uint8)
    scored = [(0.7, (0, 0), "a", thumb(1)), (0.5, (0, 0), "low", thumb(9)), (0.8, (0, 0), "b", thumb(2)),
              (0.75, (1, 0), "c", thumb(3))]
    assert lookup._fine_stage(scored, t, 0.9, lambda: thumb(0), (4, 4)) is None and calls == [2, 3]  # a: third
    calls.clear()
    passing = {3}
    chosen = lookup._fine_stage(scored, t, 0.9, lambda: thumb(0), (4, 4))
    assert chosen[:5] == ("c", 0.75, (1, 0), 0.99, 1.0) and torch.equal(chosen[5], thumb(3))  # with its thumbnail
    assert calls == [2, 3]
    calls.clear()
    assert lookup._fine_stage([(0.95, (0, 0), "d", thumb(4))] + scored, t, 0.9, lambda: thumb(0), (4, 4))[0] == "d"
    assert lookup._fine_stage(scored, replace(t, tau_pixel=None, tau_near=None), 0.9, None, (4, 4)) is None
    assert calls == []


def test_a_header_claiming_a_huge_thumbnail_is_refused_and_a_misshapen_one_does_not_fit_the_model(qwen2, pages):
    """A planted header with valid checksums naming a 4,000 x 4,000 px thumbnail (sizes made to agree) is refused
    before anything is read for it; a stored entry whose thumbnail has another shape than its grid's does not fit
    the model (a miss, removed), while the entry as written does."""
    import zlib

    import vismemo_hf
    from vismemo_hf.families import ModelAdapter

    entry = _entry("k", n=4, layers=2)
    entry.thumbnail = torch.zeros(14, 14, dtype=torch.uint8)
    fields = list(blob._FIELDS.unpack(blob.encode(entry)[: blob._FIELDS.size]))
    extra = 4000 * 4000 - 14 * 14
    fields[15] = fields[16] = 4000  # thumbnail (H, W)
    fields[21] += extra  # metadata bytes
    fields[22] += extra  # total bytes
    raw = blob._FIELDS.pack(*fields)
    with pytest.raises(blob.BlobError, match="too large"):
        blob.parse_header(raw + blob._HEADER_CRC.pack(zlib.crc32(raw)))

    model, processor = qwen2
    adapter = ModelAdapter.for_model(model)
    store = vismemo_hf.VisMemoStore()
    cache = vismemo_hf.VisMemoCache(store=store)
    generate(model, build_inputs(processor, [pages["base"]]), cache, 1)
    store.flush()
    stored = store.peek(cache.events[0].key, cache.owner(adapter.fingerprint))
    assert tuple(stored.thumbnail.shape) == thumbnail_shape(adapter.thumbnail_hw(stored.grid))
    assert adapter.entry_problem(stored, stored.grid) is None
    w = stored.thumbnail.shape[1]
    assert "thumbnail" in adapter.entry_problem(replace(stored, thumbnail=stored.thumbnail[:, : w - 1]), stored.grid)


def test_calibration_puts_tau_pixel_between_unrelated_and_near_pairs_and_tau_near_under_what_it_lets_through():
    from vismemo_hf.eval.calibrate import choose, rates

    def row(near, fine, pixel, coarse=0.9, what="page x"):
        return {"near": near, "fine": fine, "pixel": pixel, "coarse": coarse, "what": what if near else "page unrelated"}

    rows = [row(True, 0.97, 0.99), row(True, 0.96, 0.98), row(True, 0.70, 0.97, coarse=0.4), row(True, 0.55, 0.96),
            row(True, 0.60, 0.5), row(False, 0.80, 0.90), row(False, 0.50, 0.80), row(False, 0.30, 0.20)]
    t = choose(rows)
    assert t.tau_fine == pytest.approx(0.80 + 0.5 * (0.96 - 0.80))
    assert t.tau_pixel == pytest.approx(0.90 + 0.5 * (0.96 - 0.90)) and t.tau_near == pytest.approx(0.55 - 0.02)
    assert t.tau == pytest.approx(0.4 - 0.02)  # lets through the near pair only the pixel stage finds
    got = rates(rows, t)
    assert got["recall"] == pytest.approx(4 / 5) and got["fpr"] == 0.0  # (0.60, 0.5) is found by neither rule
    assert rates(rows, replace(t, tau_pixel=None, tau_near=None))["recall"] == pytest.approx(2 / 5)
    no_pixel_help = [row(True, 0.97, 0.99), row(True, 0.6, 0.5), row(False, 0.5, 0.9)]
    assert choose(no_pixel_help).tau_pixel is None and choose(no_pixel_help).tau_near is None
    with_pixels = rows + [{**row(True, 0.1, 0.1, coarse=0.0), "pixel_first": True}]
    assert rates(with_pixels, t)["recall"] == pytest.approx(5 / 6)  # found by the pixel-first stage before them
    assert rates(with_pixels, replace(t, same_pixels=None))["recall"] == pytest.approx(4 / 6)


def test_the_default_pixel_stage_is_derived_from_the_models_reference_images():
    """With ``derive_pixel`` (the default) a model without calibration gets a pixel stage above its most similar
    unrelated reference thumbnails (at least ``PIXEL_FLOOR``); calibrated or given values are kept; a reference
    without the score gives none, and ``derive_pixel=False`` none."""
    from vismemo_hf.core.thresholds import ADAPTIVE_TAU, NEAR_FLOOR, PIXEL_FLOOR, PIXEL_MARGIN, ModelReference

    reference = ModelReference(torch.zeros(4), torch.zeros(4), unrelated_fine=0.9, unrelated_pixel=0.93)
    assert LookupThresholds(derive_pixel=False).for_model(reference).tau_pixel is None
    resolved = LookupThresholds().for_model(reference)  # the defaults: a derived pixel stage
    assert not resolved.adaptive and resolved.tau_fine == pytest.approx(0.93) and resolved.tau == ADAPTIVE_TAU
    assert LookupThresholds(tau=0.6).for_model(reference).tau == 0.6  # a tau given is kept
    assert resolved.tau_pixel == pytest.approx(0.93 + PIXEL_MARGIN) and resolved.tau_near == NEAR_FLOOR
    low = LookupThresholds(derive_pixel=True).for_model(replace(reference, unrelated_pixel=0.5))
    assert low.tau_pixel == PIXEL_FLOOR
    assert LookupThresholds(derive_pixel=True).for_model(replace(reference, unrelated_pixel=None)).tau_pixel is None
    given = LookupThresholds(tau_pixel=0.97, tau_near=0.4, derive_pixel=True).for_model(reference)
    assert (given.tau_pixel, given.tau_near) == (0.97, 0.4)
    calibrated = LookupThresholds(0.1, 0.9, adaptive=False)
    assert calibrated.for_model(reference) is calibrated  # a calibrated preset: no pixel stage unless it has one


def test_the_models_reference_measures_its_unrelated_thumbnails(qwen2):
    from vismemo_hf.families import ModelAdapter
    from vismemo_hf.runtime.reference import model_reference

    model, _ = qwen2
    adapter = ModelAdapter.for_model(model)
    with torch.no_grad():
        reference = model_reference(adapter, adapter.base.get_image_features)
    assert reference.unrelated_pixel is not None and -1.0 <= reference.unrelated_pixel < 1.0


def test_the_pixel_stage_does_not_admit_a_partly_changed_copy():
    """A copy whose distinctive tokens show the candidate's pixels on part of the page and differ on more than a
    local edit's share (an inserted row moves everything below it) is not admitted by the pixel stage, however well
    its thumbnail aligns; a moved copy (only its background's pixels unchanged) and a local edit are."""
    from vismemo_hf.core.pixel_first import partly_changed

    t = LookupThresholds(0.0, 0.9, adaptive=False, tau_pixel=0.95, tau_near=0.3)
    assert t.matches(0.5, t.tau_fine, lambda: 0.99) and not t.matches(0.5, t.tau_fine, lambda: 0.99, partly=True)
    assert t.matches(0.95, t.tau_fine, lambda: 0.0, partly=True)  # the fine rule alone still decides above tau_fine
    background = torch.zeros(20, dtype=torch.long)  # 20 blank tokens of one hash, then 40 distinctive ones
    page = torch.cat([background, torch.arange(1, 41)])
    moved = torch.cat([background, torch.arange(101, 141)])  # every distinctive token changed, the blank kept
    inserted = torch.cat([background, torch.arange(201, 221), torch.arange(21, 41)])  # the top half changed
    edited = page.clone()
    edited[25:30] += 1000  # a local edit: 5 of 40
    assert not partly_changed(moved, page) and not partly_changed(edited, page) and partly_changed(inserted, page)
    assert not partly_changed(None, page) and not partly_changed(page[:30], page)


def test_inserted_rows_on_the_tiny_reader_answer_as_a_full_prefill():
    """The context report's insert-row class on the tiny reader with the derived pixel stage (the case it once got
    wrong: a record inserted near the top found by its thumbnail, its digits read from stale K/V): the answers
    equal plain transformers' on every question."""
    from vismemo_hf.bench import context as bench_context

    derived = {"thresholds": LookupThresholds(derive_pixel=True)}
    rows, summary = bench_context.measure("vismemo-docqa-tiny", 9000, 12, {"default": derived}, classes=("insert-row",),
                                          quiet=True)
    assert summary["insert-row"]["default"]["agreement"] == 1.0, [(r["plain"], r["prediction"]) for r in rows
                                                                  if not r["agree"]]


def test_a_match_of_the_tokens_alone_needs_thumbnails_that_agree():
    """The fine stage's match by its tokens is taken only when the thumbnails show one image (a page moved by a
    few pixels or rescanned agrees, another page of its layout does not: the base reader's receipts matched by
    their tokens alone); an image without thumbnails is not judged by them."""
    from types import SimpleNamespace

    from vismemo_hf.runtime.lookup import ENCODER_PIXEL_AGREE, _thumbnails_agree

    assert ENCODER_PIXEL_AGREE <= 0.95
    for i, layout in enumerate(docpage.LAYOUTS):
        page = docpage.random_page(2**31 + 79_000 + i, layout=layout)
        cached = _thumb(docpage.render(page))
        for copy_, same in ((docpage.shift(page, 2, 1), True), (docpage.rescan(page, random.Random(i)), True),
                            (docpage.random_page(2**31 + 79_500 + i, layout=layout), False)):
            request = SimpleNamespace(thumbnail=lambda c=copy_: _thumb(docpage.render(c)))
            assert _thumbnails_agree(request, cached, (16, 16)) is same, (layout, copy_)
    assert _thumbnails_agree(SimpleNamespace(thumbnail=None), cached, (16, 16))
    assert _thumbnails_agree(SimpleNamespace(thumbnail=lambda: cached), None, (16, 16))


def test_prepared_thumbnails_are_kept_by_identity_and_give_the_fresh_search():
    """The pixel stage keeps what it prepared of a thumbnail (the request's, aligned with each candidate; a store's
    candidate, which comes back as the same tensor) while that tensor is unchanged: a warm search gives the cold
    one's answer, a thumbnail changed in place or an equal copy is prepared anew, and the memo keeps its budget."""
    from vismemo_hf.core import thresholds
    from vismemo_hf.core.memo import TensorMemo

    per = thumb_per_token((16, 16))
    mine = _thumb(docpage.render(docpage.random_page(2**31 + 79_010, layout="form")))
    theirs = _thumb(docpage.render(docpage.shift(docpage.random_page(2**31 + 79_010, layout="form"), 3, 2)))
    other = _thumb(docpage.render(docpage.random_page(2**31 + 79_011, layout="form")))
    for kwargs in ({}, {"hopeless_below": 0.95}, {"enough": 0.9, "hopeless_below": 0.9}):
        for b in (theirs, other):
            thresholds._PREPARED.clear()
            cold = aligned_similarity(mine, b, per, **kwargs)
            assert aligned_similarity(mine, b, per, **kwargs) == cold  # both sides prepared before
            assert aligned_similarity(mine.clone(), b.clone(), per, **kwargs) == cold

    calls = []
    memo = TensorMemo(max_bytes=100)
    t = torch.zeros(4)
    assert memo.get(t, "x", lambda: (calls.append(1) or 1, 40)) == 1
    assert memo.get(t, "x", lambda: (calls.append(1) or 2, 40)) == 1 and len(calls) == 1
    assert memo.get(t.clone(), "x", lambda: (calls.append(1) or 3, 40)) == 3  # another tensor, equal values
    t.add_(1)  # changed in place
    assert memo.get(t, "x", lambda: (calls.append(1) or 4, 40)) == 4
    assert memo.get(t, "y", lambda: (5, 40)) == 5 and memo.get(t, "z", lambda: (6, 40)) == 6
    assert memo._bytes <= 100 and memo.get(t, "x", lambda: (7, 40)) == 7  # the oldest dropped for the budget
    assert memo.get(torch.ones(1), "big", lambda: (8, 1000)) == 8 and memo._bytes <= 100  # never kept


def test_the_coarse_stage_only_ranks_a_moved_copy_whose_regions_changed_is_found():
    """On the tiny GLM-4V model a form moved by 3 px changes its 2x2 regions' centred cosines to about 0 (0.07 and
    -0.02 for these two; a coarse threshold of 0.2 turned them away) while its thumbnail aligns at 0.98: with the
    default thresholds both are found by the pixel stage, and another form of the style is a miss."""
    import vismemo_hf
    from vismemo_hf.core.plan import HitKind
    from vismemo_hf.eval import synthdoc

    from conftest import _enabled_tiny

    model, processor = _enabled_tiny("glm4v")
    for i in (1, 6):
        style = synthdoc.STYLES[i % len(synthdoc.STYLES)]
        page = synthdoc.random_form(2000 + i, style=style)
        other = synthdoc.random_form(2500 + i, style=style)
        for copy_, found in ((synthdoc.shift(page, 3, 0), True), (other, False)):
            store = vismemo_hf.VisMemoStore()
            generate(model, build_inputs(processor, [synthdoc.render(page)]), vismemo_hf.VisMemoCache(store=store))
            cache = vismemo_hf.VisMemoCache(store=store)
            generate(model, build_inputs(processor, [synthdoc.render(copy_)]), cache)
            event = cache.events[0]
            assert (event.kind is HitKind.APPROXIMATE) is found, (i, found, event)
            assert not found or event.found_by == "thumbnail", event

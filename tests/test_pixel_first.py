"""Pixel-first lookup and encoder reuse (docs/METHOD.md §1, step 2): an edited page is found by its pixels before the
vision tower runs, and the tower runs only for the tokens whose pixels changed and their context."""

import copy

import pytest
import torch

import vismemo_hf
from vismemo_hf.core.features import token_grid
from vismemo_hf.core.pixel_first import (
    REGION_SAME,
    REGION_SAME_TOP,
    REGION_SAME_TWO,
    distinctive,
    encoder_tokens,
    pixel_changes,
    region_changed,
    region_share,
)
from vismemo_hf.core.plan import HitKind
from vismemo_hf.eval import synthetic
from vismemo_hf.runtime.hooks import _own
from vismemo_hf.store.pixels import CROWDED, SAMPLE, PixelIndex
from vismemo_hf.testing import tiny_model

from conftest import _enabled_tiny, build_inputs, generate, stored

PARTIAL = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm46v", "glm4v_moe"]
SIZE = (336, 252)  # 12 x 9 visual tokens of 28 px


def _image_inputs(processor, image):
    inputs = build_inputs(processor, [image])
    return inputs["pixel_values"], tuple(int(x) for x in inputs["image_grid_thw"][0])


def _event(model, processor, store, image, **opts):
    cache = vismemo_hf.VisMemoCache(store=store, **opts)
    generate(model, build_inputs(processor, [image]), cache, 2)
    return cache.events[0]


# -- the rule ---------------------------------------------------------------------------------------------
def test_distinctive_and_pixel_changes():
    hashes = torch.tensor([7, 7, 7, 1, 2, 3, 4, 5])
    assert distinctive(hashes).tolist() == [False, False, False, True, True, True, True, True]
    edited = hashes.clone()
    edited[4] = 99
    assert pixel_changes(edited, hashes).nonzero().flatten().tolist() == [4]
    other = torch.tensor([7, 7, 7, 11, 12, 13, 14, 5])  # the same background, other content: not an edit
    assert pixel_changes(other, hashes) is None
    assert pixel_changes(edited, hashes[:-1]) is None and pixel_changes(None, hashes) is None
    assert pixel_changes(edited, hashes, min_same=1.0) is None


def test_a_region_changed_in_rows_of_its_own_is_an_edit_another_page_is_not():
    """The region rule: changes in one or two bands of token rows that leave enough of the distinctive tokens outside
    (an inverted row, an inserted one with the rows above it, two rows swapped) are the candidate edited; another page
    of the same background, a moved copy, two bands leaving little between them, three bands, and a band from the top
    leaving little below it are not."""
    rows = torch.arange(10 * 6) // 6  # 10 rows of 6 tokens
    page = torch.arange(1, 61)
    page[rows % 2 == 1] = 0  # every other row blank (not distinctive): 30 distinctive tokens in rows 0, 2, 4, 6, 8
    inverted = page.clone()
    inverted[rows == 2] += 1000  # one row of text changed: 6 of 30 distinctive, other rows untouched
    assert pixel_changes(inverted, page) is not None  # the old rule already: 0.8 of the distinctive tokens kept
    wide = page.clone()
    wide[(rows >= 2) & (rows <= 6)] += 1000  # rows 2-6 (three with text): 0.4 of the distinctive tokens untouched
    assert pixel_changes(wide, page) is None and region_share(wide, page, rows) == 0.4
    assert pixel_changes(wide, page, rows=rows).nonzero().flatten().tolist() == list(range(12, 42))
    assert region_changed(wide, page, rows) and not region_changed(inverted, page, rows)
    inserted = page.clone()
    inserted[rows >= 2] = torch.cat([torch.arange(500, 506), page[rows >= 2][:-6]])  # a row in, the rest moved down
    assert pixel_changes(inserted, page, rows=rows) is not None and region_changed(inserted, page, rows)
    other = page.clone()
    other[page > 0] += 5000  # another page of the same layout: text in every row differs
    moved = torch.roll(page, 1)
    swapped = page.clone()
    swapped[rows == 0], swapped[rows == 8] = page[rows == 8], page[rows == 0]  # two bands, 0.6 of the text between
    assert region_share(swapped, page, rows) == 0.6 and region_changed(swapped, page, rows)
    two = page.clone()
    two[(rows == 0) | (rows >= 4)] += 1000  # rows 0 and 4-8 changed: two bands leaving 0.2 (< REGION_SAME_TWO)
    three = page.clone()
    three[(rows == 0) | (rows == 4) | (rows == 8)] += 1000  # three bands (two rows of text between them)
    top = page.clone()
    top[rows <= 6] += 1000  # a band from the first row leaving 0.2 of the text below it (< REGION_SAME_TOP)
    assert REGION_SAME <= 0.2 < min(REGION_SAME_TOP, REGION_SAME_TWO)
    for copy_ in (other, moved, two, three, top):
        assert region_share(copy_, page, rows) == 0.0
        assert pixel_changes(copy_, page, rows=rows) is None and not region_changed(copy_, page, rows)
    assert region_share(wide, page, None) == 0.0 and region_share(wide, page, rows[:-1]) == 0.0


def test_encoder_tokens_halo_and_windows():
    changed = torch.zeros(6 * 8, dtype=torch.bool)
    changed[2 * 8 + 3] = True
    around = encoder_tokens(changed, (6, 8), halo=1)
    assert sorted((t // 8, t % 8) for t in around.tolist()) == [(r, c) for r in (1, 2, 3) for c in (2, 3, 4)]
    assert encoder_tokens(changed, (6, 8), halo=0).tolist() == [19]
    windows = encoder_tokens(changed, (6, 8), halo=0, window=4)  # the window of rows 0-3, columns 0-3
    assert sorted(windows.tolist()) == [r * 8 + c for r in range(4) for c in range(4)]
    assert encoder_tokens(torch.zeros(48, dtype=torch.bool), (6, 8)).numel() == 0


# -- the index --------------------------------------------------------------------------------------------
def test_pixel_index_finds_edits_not_other_pages():
    index = PixelIndex()
    gen = torch.Generator().manual_seed(0)
    page = torch.randint(0, 2**32, (400,), generator=gen)
    page[:200] = 5  # a background every page shares
    index.add("page", "m", (1, 40, 40), page)
    edited = page.clone()
    edited[300:320] = torch.randint(0, 2**32, (20,), generator=gen)
    assert [k for k, _ in index.candidates("m", (1, 40, 40), edited, 5)] == ["page"]
    other = page.clone()
    other[200:] = torch.randint(0, 2**32, (200,), generator=gen)
    assert index.candidates("m", (1, 40, 40), other, 5) == []
    assert index.candidates("m", (1, 40, 20), edited, 5) == [] and index.candidates("n", (1, 40, 40), edited, 5) == []
    assert index.knows("m", (1, 40, 40)) and not index.knows("m", (1, 20, 20))
    index.remove("page")
    assert len(index) == 0 and not index.knows("m", (1, 40, 40))


def test_pixel_index_ignores_crowded_codes():
    """A code more than CROWDED entries hold (a header every page of a template shows) finds none of them."""
    index = PixelIndex()
    header = torch.arange(1, SAMPLE + 1) * 7919
    for i in range(CROWDED + 1):
        index.add(f"p{i}", "m", (1, 8, 8), torch.cat([header, torch.full((64 - SAMPLE,), 10**6 + i)]))
    assert index.candidates("m", (1, 8, 8), torch.cat([header, torch.zeros(64 - SAMPLE, dtype=torch.long)]), 5) == []


# -- the family seam: a subset of tokens through the tower -------------------------------------------------
@pytest.mark.parametrize("family", PARTIAL)
def test_encode_tokens_of_every_token_is_the_whole_image(family):
    model, processor = _enabled_tiny(family)
    adapter = model._vismemo
    pixels, grid = _image_inputs(processor, synthetic.page(3, SIZE))
    encoder = _own(adapter.base, "get_image_features")
    with torch.no_grad():
        whole = adapter.encode(encoder, pixels, torch.tensor([grid]))[0]
        n = whole[0].shape[0]
        some = torch.tensor([0, 5, 6, n - 1])
        both = adapter.encode_tokens(encoder, [(pixels, grid, torch.arange(n)), (pixels, grid, some)])
        alone = adapter.encode_tokens(encoder, [(pixels, grid, some)])[0]
    assert torch.equal(both[0][0], whole[0])
    assert (whole[1] is None) == (both[0][1] is None) and (whole[1] is None or torch.equal(both[0][1], whole[1]))
    assert torch.allclose(both[1][0], alone[0], atol=1e-5)  # each image attends to its own tokens only


@pytest.mark.parametrize("family", PARTIAL)
def test_tokens_lent_their_images_tower_kv_come_out_as_in_the_whole_image(family):
    """A partial encode lent the image's own tower K/V (``families.tower_kv``) attends as the whole image does:
    its tokens' output equals the whole-image encode's (windowed blocks: whole windows), deepstack included; the
    capture leaves the encode itself unchanged."""
    model, processor = _enabled_tiny(family)
    adapter = model._vismemo
    pixels, grid = _image_inputs(processor, synthetic.page(7, SIZE))
    encoder = _own(adapter.base, "get_image_features")
    hw = token_grid(grid, adapter.merge)[1:]
    changed = torch.zeros(hw[0] * hw[1], dtype=torch.bool)
    changed[[1, hw[1] + 4, 5 * hw[1] + 2]] = True
    tokens = encoder_tokens(changed, hw, halo=0, window=adapter.encoder_window)
    with torch.no_grad():
        plain = adapter.encode(encoder, pixels, torch.tensor([grid]))[0]
        whole, kvs = adapter.encode_capturing(encoder, pixels, torch.tensor([grid]))
        kvs = [kv() for kv in kvs]  # laid out when called
        lent = adapter.encode_tokens(encoder, [(pixels, grid, tokens)], lent=kvs)[0]
        alone = adapter.encode_tokens(encoder, [(pixels, grid, tokens)])[0]
    assert torch.equal(whole[0][0], plain[0])
    layers = len(adapter.base.visual.fullatt_block_indexes) if family == "qwen2_5_vl" else \
        len(adapter.base.visual.blocks)
    assert kvs[0].shape[:3] == (layers, 2, pixels.shape[0])
    assert tokens.numel() < changed.numel()
    torch.testing.assert_close(lent[0], plain[0][tokens], atol=1e-6, rtol=1e-5)
    if plain[1] is not None:
        torch.testing.assert_close(lent[1], plain[1][:, tokens], atol=1e-6, rtol=1e-5)
    error = float((lent[0] - plain[0][tokens]).abs().max())
    assert float((alone[0] - plain[0][tokens]).abs().max()) > 10 * error + 1e-6  # without the rest: another output


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_encode_tokens_keeps_each_tokens_place(family):
    """With attention confined to windows (Qwen2.5-VL's windowed blocks) or no blocks at all (Qwen3-VL: the
    resampled position table and the mergers), the tokens of whole windows come out as in the whole image."""
    model, processor = _enabled_tiny(family)
    model = copy.deepcopy(model)
    adapter = model._vismemo
    visual = adapter.base.visual
    if family == "qwen2_5_vl":
        visual.fullatt_block_indexes = []
    else:
        visual.blocks = torch.nn.ModuleList()
        visual.deepstack_visual_indexes = []
        visual.deepstack_merger_list = torch.nn.ModuleList()
    pixels, grid = _image_inputs(processor, synthetic.page(4, SIZE))
    hw = token_grid(grid, adapter.merge)[1:]
    changed = torch.zeros(hw[0] * hw[1], dtype=torch.bool)
    changed[[hw[1] + 2, 3 * hw[1] + hw[1] - 1]] = True
    tokens = encoder_tokens(changed, hw, halo=0, window=adapter.encoder_window or 1)
    encoder = _own(adapter.base, "get_image_features")
    with torch.no_grad():
        whole = adapter.encode(encoder, pixels, torch.tensor([grid]))[0][0]
        part = adapter.encode_tokens(encoder, [(pixels, grid, tokens)])[0][0]
    assert tokens.numel() < changed.numel()
    torch.testing.assert_close(part, whole[tokens], atol=1e-5, rtol=1e-5)


def test_families_without_a_partial_tower_say_so():
    model, processor = _enabled_tiny("llava_onevision")
    assert not model._vismemo.partial_encoder
    assert model._vismemo.encode_tokens(None, []) is None


# -- end to end -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", PARTIAL)
def test_an_edit_is_found_by_its_pixels_and_encodes_what_changed(family):
    model, processor = _enabled_tiny(family)
    base, edit = synthetic.page(5, SIZE), synthetic.edited(5, row=3, value="7213", size=SIZE)
    store = stored(model, processor, base)
    entry = store.peek(edit_key(model, processor, base), vismemo_hf.VisMemoCache().owner(model._vismemo.fingerprint))
    assert entry.tower_kv is not None  # the default keeps the tower's K/V with the entry
    # nothing stored by these requests (store_misses=False): each meets the same store
    assert _event(model, processor, store, edit, reuse_encoder=False, store_misses=False).encoded_tokens == \
        event_tokens(processor, edit)
    event = _event(model, processor, store, edit, store_misses=False)
    assert event.kind is HitKind.APPROXIMATE and event.found_by == "pixels"
    assert 0 < event.encoded_tokens < event.n_tokens / 2
    pixels, grid = _image_inputs(processor, edit)
    changed = pixel_changes(model._vismemo.patch_hashes(pixels, grid),
                            model._vismemo.patch_hashes(*_image_inputs(processor, base)))
    assert set(torch.nonzero(changed).flatten().tolist()) <= set(event.plan.recompute.tolist())  # always recomputed
    assert edit_key(model, processor, base) in store
    assert edit_key(model, processor, edit) not in store
    again = _event(model, processor, store, edit, store_misses=False)
    assert again.found_by == "pixels" and again.alias == event.alias
    # stored, the edit becomes an entry of its own, completed off the request's path from its own whole encode
    # (never the alias's lent encoder output)
    _event(model, processor, store, edit)
    store.flush()
    owner = vismemo_hf.VisMemoCache().owner(model._vismemo.fingerprint)
    own = store.peek(edit_key(model, processor, edit), owner)
    with torch.no_grad():
        whole = model._vismemo.encode(_own(model._vismemo.base, "get_image_features"), pixels, torch.tensor([grid]))
    torch.testing.assert_close(own.embeds, whole[0][0].to(own.embeds.dtype), atol=1e-5, rtol=1e-5)
    assert _event(model, processor, store, edit).kind is HitKind.EXACT
    bare = stored(model, processor, base, reuse_encoder=False)  # an entry without the tower's K/V: encoded in full
    assert _event(model, processor, bare, edit).encoded_tokens == event_tokens(processor, edit)


def event_tokens(processor, image):
    _, grid = _image_inputs(processor, image)
    return grid[0] * grid[1] * grid[2] // 4


def edit_key(model, processor, image):
    pixels, grid = _image_inputs(processor, image)
    return model._vismemo.image_key(vismemo_hf.VisMemoCache().owner(model._vismemo.fingerprint), pixels, grid)


def test_the_stage_is_every_policys_and_the_encoder_reuse_the_routings(qwen2):
    model, processor = qwen2
    base, edit = synthetic.page(6, SIZE), synthetic.edited(6, row=1, value="4404", size=SIZE)
    store = stored(model, processor, base)
    paper = _event(model, processor, store, edit, policy="vismemo", store_misses=False)
    assert paper.found_by == "pixels" and paper.encoded_tokens == paper.n_tokens  # §2 reads every encoder output
    off = _event(model, processor, store, edit, store_misses=False, reuse_encoder=False)
    assert off.found_by == "pixels" and off.encoded_tokens == off.n_tokens
    on = _event(model, processor, store, edit, store_misses=False)
    assert on.found_by == "pixels" and on.encoded_tokens < on.n_tokens
    assert _event(model, processor, store, edit, policy="pixel-patch", store_misses=False).encoded_tokens == on.n_tokens
    without = _event(model, processor, store, edit, same_pixels=None, store_misses=False)
    assert without.found_by == "encoder" and without.encoded_tokens == without.n_tokens
    with pytest.raises(ValueError, match="same_pixels"):
        vismemo_hf.VisMemoCache(store=store, same_pixels=1.5)


def test_other_pages_of_the_layout_are_not_found_by_pixels(qwen2):
    model, processor = qwen2
    store = stored(model, processor, *[synthetic.page(seed, SIZE) for seed in (10, 11, 12)])
    for seed in (13, 14):
        event = _event(model, processor, store, synthetic.page(seed, SIZE), store_misses=False)
        assert event.found_by != "pixels"


def test_an_inserted_row_is_found_by_its_pixels_and_recomputed_from_its_first_changed_token(qwen2):
    """The region rule at run time: a row inserted into a stored page is found by the pixel-first stage (the
    index's candidates included), and the default recomputes every token from the first changed one; the rows
    above it are reused (``full_ratio=None``: a row inserted high up recomputes more than half the image, which the
    default computes in full instead)."""
    import random

    from vismemo_hf.eval.calibrate import _insert_row

    model, processor = qwen2
    base = synthetic.page(21, SIZE)
    inserted = _insert_row(base, synthetic.page(22, SIZE), random.Random(3))
    store = stored(model, processor, base)
    event = _event(model, processor, store, inserted, store_misses=False, full_ratio=None)
    assert event.kind is HitKind.APPROXIMATE and event.found_by == "pixels"
    hashes = model._vismemo.patch_hashes(*_image_inputs(processor, inserted))
    first = int(torch.nonzero(hashes != model._vismemo.patch_hashes(*_image_inputs(processor, base)))[0])
    assert 0 < first and set(range(first, event.n_tokens)) <= set(event.plan.recompute.tolist())
    assert event.reused > 0 and 0 < event.encoded_tokens < event.n_tokens


def test_a_faulty_pixel_index_is_a_lookup_without_it(qwen2, monkeypatch):
    model, processor = qwen2
    base, edit = synthetic.page(7, SIZE), synthetic.edited(7, row=2, value="1212", size=SIZE)
    store = stored(model, processor, base)

    def broken(*args, **kwargs):
        raise OSError("index gone")

    monkeypatch.setattr(store, "pixel_candidates", broken)
    event = _event(model, processor, store, edit, store_misses=False)
    assert event.found_by != "pixels" and event.encoded_tokens == event.n_tokens


def test_an_evicted_entry_leaves_the_pixel_index(qwen2):
    model, processor = qwen2
    base = synthetic.page(8, SIZE)
    store = stored(model, processor, base)
    assert len(store.catalog.pixel_index()) == 1
    store.clear()
    assert len(store.catalog.pixel_index()) == 0
    event = _event(model, processor, store, synthetic.edited(8, row=0, value="0000", size=SIZE))
    assert event.kind is HitKind.MISS


def test_namespaces_do_not_find_each_others_pixels(qwen2):
    model, processor = qwen2
    base, edit = synthetic.page(9, SIZE), synthetic.edited(9, row=4, value="3131", size=SIZE)
    store = stored(model, processor, base, namespace="alice")
    assert _event(model, processor, store, edit, namespace="bob", store_misses=False).kind is HitKind.MISS
    assert _event(model, processor, store, edit, namespace="alice", store_misses=False).found_by == "pixels"


def test_the_towers_kv_comes_back_from_disk(qwen2, tmp_path):
    """An entry written to the disk tier keeps its tower K/V: a later process (an empty pixel index) finds the
    edit by its encoder output first, then by its pixels, and then encodes only what changed."""
    model, processor = qwen2
    base, edit = synthetic.page(8, SIZE), synthetic.edited(8, row=2, value="5150", size=SIZE)
    memory = stored(model, processor, base)
    stored(model, processor, base, store=vismemo_hf.VisMemoStore(device_bytes=0, disk_dir=str(tmp_path)))
    disk = vismemo_hf.VisMemoStore(device_bytes=0, disk_dir=str(tmp_path))  # a new process: the files only
    owner = vismemo_hf.VisMemoCache().owner(model._vismemo.fingerprint)
    key = edit_key(model, processor, base)
    torch.testing.assert_close(disk.peek(key, owner).tower_kv, memory.peek(key, owner).tower_kv)
    first = _event(model, processor, disk, edit, store_misses=False)
    assert first.found_by == "encoder" and first.encoded_tokens == first.n_tokens
    then = _event(model, processor, disk, edit, store_misses=False)
    assert then.found_by == "pixels" and 0 < then.encoded_tokens < then.n_tokens


@pytest.mark.parametrize("damage", ["nan", "one inf", "shape", "raises"])
def test_a_damaged_tower_kv_is_never_lent(qwen2, damage, monkeypatch):
    """An entry whose tower K/V are not finite or not this tower's shape, or a partial encode that fails, gives an
    approximate hit that encodes the whole image: the same answer as without encoder reuse, no error."""
    model, processor = qwen2
    base, edit = synthetic.page(9, SIZE), synthetic.edited(9, row=4, value="3141", size=SIZE)
    store = stored(model, processor, base)
    entry = store.peek(edit_key(model, processor, base), vismemo_hf.VisMemoCache().owner(model._vismemo.fingerprint))
    if damage == "nan":
        entry.tower_kv = torch.full_like(entry.tower_kv, float("nan"))
    elif damage == "one inf":  # a single value anywhere
        entry.tower_kv = entry.tower_kv.clone()
        entry.tower_kv.view(-1)[entry.tower_kv.numel() // 3] = float("inf")
    elif damage == "shape":
        entry.tower_kv = entry.tower_kv[:, :, :-4]
    else:
        def broken(*args, **kwargs):
            raise RuntimeError("tower broke")
        monkeypatch.setattr(model._vismemo, "encode_tokens", broken)
    event = _event(model, processor, store, edit, store_misses=False)
    assert event.found_by == "pixels" and event.encoded_tokens == event.n_tokens
    whole = vismemo_hf.VisMemoCache(store=store, store_misses=False, reuse_encoder=False)
    expected = generate(model, build_inputs(processor, [edit]), whole, 4)
    got = generate(model, build_inputs(processor, [edit]), vismemo_hf.VisMemoCache(store=store, store_misses=False), 4)
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])


def test_calibrations_local_changes_and_what_the_pixel_first_stage_makes_of_them(qwen2):
    """``vismemo calibrate``'s inverted and tinted rows change one band of tokens (the pixel-first stage finds
    them); an inserted row moves everything below it: not a local edit, but the rows above it are untouched (the
    region rule finds it, and the default recomputes every token from its first changed one)."""
    import random

    from vismemo_hf.eval.calibrate import _insert_row, _invert, _recolour

    model, processor = qwen2
    adapter = model._vismemo
    page, other = synthetic.page(11, SIZE), synthetic.page(12, SIZE)
    mine = adapter.patch_hashes(*_image_inputs(processor, page))
    for change in (_invert(page, random.Random(0)), _recolour(page, random.Random(1))):
        changed = pixel_changes(adapter.patch_hashes(*_image_inputs(processor, change)), mine)
        assert changed is not None and 0 < int(changed.sum()) <= changed.numel() // 4
    inserted = _insert_row(page, other, random.Random(2))
    assert inserted.size == page.size
    hashes = adapter.patch_hashes(*_image_inputs(processor, inserted))
    assert pixel_changes(hashes, mine) is None  # most tokens moved: not a local edit
    rows = adapter.hash_rows(hashes, _image_inputs(processor, inserted)[1])
    changed = pixel_changes(hashes, mine, rows=rows)  # the rows above it untouched: a region changed
    assert changed is not None and not bool(changed[:SIZE[0] // 28].any()) and region_changed(hashes, mine, rows)


def test_after_another_long_text_the_edit_encodes_its_whole_image(qwen2):
    """A pixel-first alias lends its encoder output only under the context it was computed after, or a small change
    of it: after a longer text the context check computes the image in full, from its own whole-image encode."""
    model, processor = qwen2
    base, edit = synthetic.page(13, SIZE), synthetic.edited(13, row=2, value="2718", size=SIZE)
    store = stored(model, processor, base)

    def event(prefix):
        cache = vismemo_hf.VisMemoCache(store=store, store_misses=False)
        generate(model, build_inputs(processor, [edit], prefix=prefix), cache, 2)
        return cache.events[0]

    same = event("")
    assert same.found_by == "pixels" and same.encoded_tokens < same.n_tokens
    longer = event("Here is the scanned form from the second office, please read it carefully: ")
    assert longer.found_by == "pixels" and longer.encoded_tokens == longer.n_tokens


def _lent_runs(family: str, prefix: str = "Step 2:"):
    """(model, processor, store, inputs, run) for an edited page asked after a small change of the text before it:
    ``run(**opts)`` generates with a cache of ``opts`` and gives ((tokens, scores), the image's event)."""
    model, processor = _enabled_tiny(family)
    base, edit = synthetic.page(13, SIZE), synthetic.edited(13, row=2, value="2718", size=SIZE)
    store = stored(model, processor, base)
    inputs = build_inputs(processor, [edit], prefix=prefix)

    def run(store=store, **opts):
        cache = vismemo_hf.VisMemoCache(store=store, **{"store_misses": False, **opts})
        out = generate(model, inputs, cache)
        return out, cache.events[0]

    return model, processor, store, inputs, run


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v"])
def test_after_a_small_change_of_text_the_edit_lends_and_a_fallback_starts_from_its_whole_encode(family):
    """After a small change of the text before it (a chat's or an agent's next step) an edited copy is still lent its
    alias's encoder output. A plan that then computes the image in full (a page changed everywhere, an unsure answer)
    starts the prefill again from the image's own whole encode (deepstack features included): tokens and scores are
    those of a whole encode computed in full, and the tokens plain transformers'."""
    model, processor, store, inputs, run = _lent_runs(family)
    _, lent = run(context={"min_confidence": 0.0})  # a random model is unsure of every answer: no confidence guard here
    assert lent.found_by == "pixels" and lent.prefix_changed and 0 < lent.encoded_tokens != lent.n_tokens
    assert (lent.encoded_tokens < lent.n_tokens) == (lent.fallback is None)  # lent; whole again only after a fallback
    plain, _ = tiny_model(family)
    with torch.no_grad():
        expected = plain.generate(**inputs, max_new_tokens=3, do_sample=False)[:, inputs["input_ids"].shape[1]:]
    for opts in (dict(miss_deviation=0.0), dict(context={"min_confidence": 1.0})):
        (tokens, scores), event = run(**opts)
        assert event.fallback in ("changed", "context", "uncertain") and event.recomputed == event.n_tokens
        assert event.encoded_tokens > event.n_tokens  # the partial encode, then the whole one
        (whole_tokens, whole_scores), whole = run(reuse_encoder=False, **opts)
        assert whole.fallback is not None and whole.encoded_tokens == whole.n_tokens
        assert torch.equal(tokens, whole_tokens) and torch.equal(scores, whole_scores)
        assert torch.equal(tokens, expected)


def test_after_another_text_only_a_verified_routing_lends():
    """After another text the lent output's error adds to the context's: a routing that checks the change but
    verifies nothing (no probes, no confidence guard), or reuses after it unchecked, encodes the edit whole."""
    _, _, _, _, run = _lent_runs("qwen2_vl")
    _, probed = run(context={"min_confidence": 0.0})
    assert probed.encoded_tokens != probed.n_tokens  # lent (and encoded whole again only after a fallback)
    for opts in (dict(context={"probe_share": 0.0, "min_confidence": 0.0}), dict(context={"routing": "reuse"})):
        _, event = run(**opts)
        assert event.found_by == "pixels" and event.prefix_changed and event.encoded_tokens == event.n_tokens
    _, same = _lent_runs("qwen2_vl", prefix="")[4](context={"probe_share": 0.0, "min_confidence": 0.0})
    assert same.encoded_tokens < same.n_tokens  # in the alias's context it lends whatever the routing verifies


def test_a_lent_image_whose_alias_kv_cannot_be_read_is_a_miss_from_its_whole_encode(monkeypatch):
    """The alias K/V of an image lent encoder output cannot be read (a store fault): the image is computed as a miss,
    from its own whole encode, and the answer is plain transformers'."""
    model, processor, store, inputs, run = _lent_runs("qwen3_vl")
    monkeypatch.setattr(store, "get_tokens", lambda *args, **kwargs: None)
    (tokens, scores), event = run(context={"min_confidence": 0.0})
    assert event.kind is HitKind.MISS and event.encoded_tokens > event.n_tokens
    (whole_tokens, whole_scores), whole = run(context={"min_confidence": 0.0}, reuse_encoder=False)
    assert whole.kind is HitKind.MISS and whole.encoded_tokens == whole.n_tokens
    assert torch.equal(tokens, whole_tokens) and torch.equal(scores, whole_scores)


def test_beam_search_over_an_edit_after_a_small_change_computes_it_from_the_whole_encode():
    """Beam search has ``generate`` run the tower before the forward (it expands the encoder output for every beam):
    its copies of the image use that whole encode, nothing is lent, and the beams are those of
    ``reuse_encoder=False``."""
    model, processor, store, inputs, _ = _lent_runs("qwen2_vl")

    def beams(**opts):
        cache = vismemo_hf.VisMemoCache(store=store, store_misses=False, miss_deviation=0.0, **opts)
        with torch.no_grad():
            out = model.generate(**inputs, cache=cache, max_new_tokens=3, do_sample=False, num_beams=2,
                                 num_return_sequences=2)
        return out, cache.events

    out, events = beams()
    assert len(events) == 2 and all(e.fallback == "changed" and e.encoded_tokens == e.n_tokens for e in events)
    whole, _ = beams(reuse_encoder=False)
    assert torch.equal(out, whole)


def test_an_edit_computed_in_full_after_its_partial_encode_is_stored_from_its_whole_encode(qwen2):
    """The entry of an image restarted from its whole encode is a miss's: its encoder output is the whole encode's
    (not the alias's lent one), so an exact hit on it later is plain transformers'."""
    model, processor = qwen2
    _, _, store, inputs, run = _lent_runs("qwen2_vl")
    owner = vismemo_hf.VisMemoCache().owner(model._vismemo.fingerprint)
    key = model._vismemo.image_key(owner, inputs["pixel_values"], inputs["image_grid_thw"][0])
    _, event = run(miss_deviation=0.0, store_misses=True)
    store.flush()
    assert event.fallback == "changed" and event.key == key
    entry = store.peek(key, owner)
    assert entry is not None
    reference = vismemo_hf.VisMemoStore()
    run(store=reference, store_misses=True)  # a miss in a store without the base: encoded whole
    reference.flush()
    assert torch.equal(entry.embeds, reference.peek(key, owner).embeds)


def test_a_watched_answer_repairs_from_the_whole_encode(qwen2):
    """A reuse after another context watches its first generated tokens (``runtime/watch.py``); a repair computes
    the whole sequence in full, so the watch holds, and uses, the whole encode of an image lent encoder output."""
    model, processor = qwen2
    _, _, store, inputs, _ = _lent_runs("qwen2_vl")
    cache = vismemo_hf.VisMemoCache(store=store, store_misses=False, context={"min_confidence": 1e-6})
    generate(model, inputs, cache, 1)
    event = cache.events[0]
    assert event.fallback is None and 0 < event.encoded_tokens < event.n_tokens
    watch = cache.watch
    assert watch is not None and watch.whole is not None
    lent = watch.embeds[0]
    watch._own_encodes()
    image = (inputs["input_ids"][0] == model.config.image_token_id).nonzero().flatten()
    own = model._vismemo.encode(_own(model._vismemo.base, "get_image_features"), inputs["pixel_values"],
                                inputs["image_grid_thw"])[0][0]
    assert torch.equal(watch.embeds[0][0, image], own.to(lent.dtype))
    assert not torch.equal(lent[0, image], own.to(lent.dtype)) and watch.whole is None


def test_one_distinctive_token_kept_is_no_region():
    """A page with few distinctive tokens whose changes leave one of them outside the band (a share that would pass
    REGION_SAME) is not the candidate edited; two kept are."""
    from vismemo_hf.core.pixel_first import REGION_KEPT

    rows = torch.arange(6 * 8) // 8
    page = torch.zeros(48, dtype=torch.long)
    page[[3, 11, 19, 27, 35, 43, 44, 45, 46, 47]] = torch.arange(1, 11)  # 10 distinctive tokens, rows 0-5
    one = page.clone()
    one[rows >= 1] += 100 * (page[rows >= 1] > 0)  # rows 1-5 changed: 1 of 10 kept (row 0)
    assert REGION_KEPT == 2 and region_share(one, page, rows) == 0.0 and pixel_changes(one, page, rows=rows) is None
    two = page.clone()
    two[(rows >= 2) & (page > 0)] += 100  # rows 2-5 changed: 2 of 10 kept
    assert region_share(two, page, rows) == 0.2 and pixel_changes(two, page, rows=rows) is not None


@pytest.mark.parametrize("change", ["insert row", "swap rows"])
def test_llava_onevision_finds_a_changed_region_in_both_its_views_by_its_pixels(change):
    """LLaVA-OneVision's tokens show the image twice (the base view, then the tile rows): its region rule judges
    both on one scale of heights (``hash_rows``), so a row inserted or two rows swapped are one or two bands, found
    by the pixel-first stage and recomputed from the first changed token on, as on the Qwen-VL grids (counted per
    view, two swapped rows were four bands, and such copies missed); another page of the layout is not found."""
    import random

    from vismemo_hf.eval import synthdoc
    from vismemo_hf.eval.calibrate import _insert_row

    model, processor = _enabled_tiny("llava_onevision")
    adapter = model._vismemo
    page = synthdoc.random_form(31, style=synthdoc.STYLES[0])
    base = synthdoc.render(page)
    changed = _insert_row(base, synthdoc.render(synthdoc.random_form(32)), random.Random(3)) \
        if change == "insert row" else synthdoc.render(synthdoc.swap_rows(page, 0, synthdoc.ROWS - 1))
    (old, grid, extra), (new, _, extra_new) = _llava_views(adapter, [base, changed])
    hashes, theirs = adapter.patch_hashes(new, grid, extra_new), adapter.patch_hashes(old, grid, extra)
    heights, rows = adapter.hash_rows(hashes, grid), adapter.token_rows(type("F", (), {"patch_hashes": hashes}))
    side = adapter.thumbnail_hw(grid)[0]
    tiles = rows >= side
    assert torch.equal(heights[~tiles], rows[~tiles]) and int(heights[tiles].min()) == 0
    assert int(heights[tiles].max()) == side - 1 and bool((heights[tiles][1:] >= heights[tiles][:-1]).all())
    assert region_changed(hashes, theirs, heights)
    store = stored(model, processor, base)
    event = _event(model, processor, store, changed, store_misses=False)
    assert event.kind is HitKind.APPROXIMATE and event.found_by == "pixels"
    first = int(torch.nonzero(hashes != theirs)[0])
    assert set(range(first, event.n_tokens)) <= set(event.plan.recompute.tolist())
    other = _event(model, processor, store, synthdoc.render(synthdoc.random_form(33, style=synthdoc.STYLES[0])),
                   store_misses=False)
    assert other.found_by != "pixels"


def _llava_views(adapter, images):
    processor = adapter.image_processor()
    return [adapter.processed_images(processor(images=[im], return_tensors="pt"))[0] for im in images]


def _llava_edit(seed: int = 31):
    import random

    from vismemo_hf.eval import synthdoc

    page = synthdoc.random_form(seed, style=synthdoc.STYLES[0])
    return synthdoc.render(page), synthdoc.render(synthdoc.edit_value(page, 1, random.Random(4)))


def _llava_entry(model, processor, store, image):
    owner = vismemo_hf.VisMemoCache().owner(model._vismemo.fingerprint)
    pixels, grid, _ = _llava_views(model._vismemo, [image])[0]
    return store.peek(model._vismemo.image_key(owner, pixels, grid), owner)


def test_llava_onevision_reencodes_only_the_changed_tiles_as_the_whole_image_would():
    """LLaVA-OneVision encodes each tile alone: an edited copy found by its pixels runs the tower on the tiles whose
    digest changed (the base view and the tiles the edit falls in) and keeps the alias's output of the others,
    which is exactly what encoding the whole copy gives, so its answer is the whole encode's too."""
    model, processor = _enabled_tiny("llava_onevision")
    adapter = model._vismemo
    base, edit = _llava_edit()
    store = stored(model, processor, base)
    entry = _llava_entry(model, processor, store, base)
    (pixels, grid, extra), = _llava_views(adapter, [edit])
    assert entry.tile_digests is not None and entry.tile_digests.shape == (pixels.shape[0],)
    digests = adapter.tile_digests(pixels, grid, extra)
    redo = digests() != entry.tile_digests
    assert bool(redo[0]) and 1 < int(redo.sum()) < redo.numel()  # the base view and some tiles, not all
    changed = adapter.patch_hashes(pixels, grid, extra) != entry.patch_hashes
    encoder = _own(adapter.base, "get_image_features")
    with torch.no_grad():
        whole = adapter.encode_images(encoder, [(pixels, grid, extra)])[0][0]
        (embeds, deepstack, encoded), = adapter.encode_edited(encoder, {0: ((pixels, grid, extra), entry, changed,
                                                                            digests)}).values()
    assert torch.equal(embeds, whole) and deepstack is None and 0 < encoded < grid[2]
    event = _event(model, processor, store, edit, store_misses=False)
    assert event.kind is HitKind.APPROXIMATE and event.found_by == "pixels" and event.encoded_tokens == encoded
    reused = generate(model, build_inputs(processor, [edit]), vismemo_hf.VisMemoCache(store=store, store_misses=False))
    encoded_whole = generate(model, build_inputs(processor, [edit]),
                             vismemo_hf.VisMemoCache(store=store, store_misses=False, reuse_encoder=False))
    assert torch.equal(reused[0], encoded_whole[0]) and torch.equal(reused[1], encoded_whole[1])


def test_llava_onevision_encodes_the_whole_image_when_its_tiles_cannot_be_told_apart():
    """No tile is reused from an alias without digests (an entry written before them), from one whose digests are
    another count, when every tile changed, or when a token whose pixels changed lies in a tile whose digest did
    not (the pixel rule and the digests disagree)."""
    from dataclasses import replace

    model, processor = _enabled_tiny("llava_onevision")
    adapter = model._vismemo
    base, edit = _llava_edit()
    entry = _llava_entry(model, processor, stored(model, processor, base), base)
    (pixels, grid, extra), = _llava_views(adapter, [edit])
    digests = adapter.tile_digests(pixels, grid, extra)
    changed = adapter.patch_hashes(pixels, grid, extra) != entry.patch_hashes
    encoder = _own(adapter.base, "get_image_features")

    def edited(alias, changed=changed, digests=digests):
        with torch.no_grad():
            return adapter.encode_edited(encoder, {0: ((pixels, grid, extra), alias, changed, digests)})

    assert edited(entry) and not edited(replace(entry, tile_digests=None))
    assert not edited(replace(entry, tile_digests=entry.tile_digests[:-1]))
    assert not edited(replace(entry, tile_digests=entry.tile_digests + 1))  # every tile changed
    assert not edited(entry, digests=None)
    kept = torch.nonzero(digests() == entry.tile_digests).flatten()
    assert not edited(entry, changed=changed | adapter._footprints(pixels.shape[0], extra)[:, int(kept[0])])
    single = adapter.tile_digests(pixels[:1], grid, (extra[0], False))
    assert single is None  # an untiled image (one of several in a sample) is one tile: encoded whole


def test_llava_onevision_reuses_tiles_of_a_downsampled_packing_as_the_whole_encode_would(monkeypatch):
    """A tiling past ``anyres_max_N`` is downsampled by the model's packing: a token mixes patches of neighbouring
    tiles. The tokens computed from a changed tile are computed again from every tile they read (the neighbours
    encoded too), the others keep the alias's values: the copy's encoder output is still the whole encode's."""
    from types import SimpleNamespace

    model, processor = _enabled_tiny("llava_onevision")
    adapter = model._vismemo
    base, edit = _llava_edit()
    monkeypatch.setattr(model.config, "vision_aspect_ratio", "anyres_max_2", raising=False)  # 9 tiles: downsampled
    encoder = _own(adapter.base, "get_image_features")
    (old, grid, extra), (new, _, extra_new) = _llava_views(adapter, [base, edit])
    footprints = adapter._footprints(new.shape[0], extra_new)
    n = footprints.shape[0]
    assert int(footprints.sum(1).max()) > 1  # tokens that mix tiles
    grid = (1, 1, n)
    with torch.no_grad():
        whole_old = adapter.encode_images(encoder, [(old, grid, extra)])[0][0]
        whole_new = adapter.encode_images(encoder, [(new, grid, extra_new)])[0][0]
    assert whole_new.shape[0] == n  # the model's own packing downsamples as the footprints say
    alias = SimpleNamespace(tile_digests=adapter.tile_digests(old, grid, extra)(), embeds=whole_old)
    changed = adapter.patch_hashes(new, grid, extra_new) != adapter.patch_hashes(old, grid, extra)
    digests = adapter.tile_digests(new, grid, extra_new)
    redo = digests() != alias.tile_digests
    needed = footprints[(footprints & redo).any(1)].any(0) | redo
    assert bool((needed & ~redo).any()) and not bool(needed.all())  # neighbours read, not every tile
    with torch.no_grad():
        (embeds, _, encoded), = adapter.encode_edited(encoder, {0: ((new, grid, extra_new), alias, changed,
                                                                    digests)}).values()
    assert torch.equal(embeds, whole_new) and 0 < encoded < n


def test_llava_onevision_tile_digests_come_back_from_disk(tmp_path):
    model, processor = _enabled_tiny("llava_onevision")
    base, edit = _llava_edit(37)
    memory = _llava_entry(model, processor, stored(model, processor, base), base)
    stored(model, processor, base, store=vismemo_hf.VisMemoStore(device_bytes=0, disk_dir=str(tmp_path)))
    disk = vismemo_hf.VisMemoStore(device_bytes=0, disk_dir=str(tmp_path))
    assert torch.equal(_llava_entry(model, processor, disk, base).tile_digests, memory.tile_digests)
    _event(model, processor, disk, edit, store_misses=False)  # a new process: found by its encoder output first
    then = _event(model, processor, disk, edit, store_misses=False)
    assert then.found_by == "pixels" and 0 < then.encoded_tokens < then.n_tokens


def test_llava_onevision_finds_an_edited_image_of_the_tile_size_by_its_pixels():
    """An image of the tile size is one tile equal to its base view: its tokens show every patch twice. The tiles'
    hashes are tagged apart from the base view's (``TILE_VIEW``), so its patches stay distinctive and an edit of it
    is found by its pixels (untagged, every hash occurred twice and the pixel-first stage never found it)."""
    from PIL import ImageDraw

    from vismemo_hf.families.llava_onevision import NEWLINE

    model, processor = _enabled_tiny("llava_onevision")
    adapter = model._vismemo
    tile = adapter.vision_config.image_size
    base = synthetic.page(3, size=(tile, tile))
    edit = base.copy()
    ImageDraw.Draw(edit).rectangle([tile - 16, tile - 16, tile - 6, tile - 6], fill=(200, 30, 30))
    (pixels, grid, extra), = _llava_views(adapter, [base])
    hashes = adapter.patch_hashes(pixels, grid, extra)
    per_tile = adapter._per_tile
    assert pixels.shape[0] == 2 and torch.equal(pixels[0], pixels[1])  # the base view and its one tile
    assert bool(distinctive(hashes)[:per_tile].all()) and int((hashes == NEWLINE).sum()) == grid[2] - 2 * per_tile
    event = _event(model, processor, stored(model, processor, base), edit, store_misses=False)
    assert event.kind is HitKind.APPROXIMATE and event.found_by == "pixels"


def test_llava_onevisions_patch_crcs_are_read_once_and_their_memo_counts_the_pixels_it_holds():
    """The tile patches' CRC-32Cs serve both the token hashes and the tiles' digests of a request; the memo that keeps
    them holds the pixels it is keyed by, so it counts their bytes against its budget: a stream of large images
    never keeps more than that alive."""
    from vismemo_hf.families import llava_onevision

    model, _ = _enabled_tiny("llava_onevision")
    adapter = model._vismemo
    base, _ = _llava_edit()
    (pixels, grid, extra), = _llava_views(adapter, [base])
    memo = llava_onevision._CRCS
    memo.clear()
    adapter.patch_hashes(pixels, grid, extra)
    assert memo._bytes >= pixels.numel() * pixels.element_size()
    calls = []
    real = llava_onevision.LlavaOnevisionAdapter._patch_rows
    try:
        llava_onevision.LlavaOnevisionAdapter._patch_rows = lambda self, p: calls.append(1) or real(self, p)
        adapter.tile_digests(pixels, grid, extra)()
        assert not calls  # the digests read the CRCs the hashes computed
        for _ in range(6):  # 6 x 24 MB of pixels against a 128 MB budget
            big = pixels.repeat(1, 1, 8, 8)  # a fresh tensor each time, 64 x the pixels
            adapter._tile_crcs(big)
            assert memo._bytes <= memo.max_bytes
    finally:
        llava_onevision.LlavaOnevisionAdapter._patch_rows = real
        memo.clear()


def test_llava_onevision_reuses_its_tiles_after_another_text_and_answers_as_the_whole_encode():
    """Its tile reuse gives every token what the whole encode gives it, so unlike a partial encode lent the alias's
    tower K/V it needs no equal context: an edited copy after another instruction text (a chat's or an agent's next
    step) re-encodes its changed tiles only, and answers as with the whole image encoded."""
    model, processor = _enabled_tiny("llava_onevision")
    base, edit = _llava_edit()
    store = stored(model, processor, base)
    inputs = build_inputs(processor, [edit], prefix="Step 4 of the task: read the form again.")
    cache = vismemo_hf.VisMemoCache(store=store, store_misses=False)
    reused = generate(model, inputs, cache)
    event = cache.events[0]
    assert event.found_by == "pixels" and event.prefix_changed and 0 < event.encoded_tokens < event.n_tokens
    whole = generate(model, inputs, vismemo_hf.VisMemoCache(store=store, store_misses=False, reuse_encoder=False))
    assert torch.equal(reused[0], whole[0]) and torch.equal(reused[1], whole[1])


@pytest.mark.parametrize("error", [RuntimeError, TypeError, IndexError])
def test_a_failing_tile_reuse_encodes_the_whole_image(error, monkeypatch):
    """Whatever goes wrong in a partial encode, the copy is encoded whole and answered: never an exception out of
    ``generate``."""
    from vismemo_hf.families import llava_onevision

    model, processor = _enabled_tiny("llava_onevision")
    base, edit = _llava_edit()
    store = stored(model, processor, base)

    def broken(self, tiles, extra):
        raise error("a damaged packing")

    monkeypatch.setattr(llava_onevision.LlavaOnevisionAdapter, "_footprints", broken)
    event = _event(model, processor, store, edit, store_misses=False)
    assert event.found_by == "pixels" and event.encoded_tokens == event.n_tokens

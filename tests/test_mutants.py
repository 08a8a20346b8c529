"""Tests pinned by a mutation check: each fails when a one-line bug the rest of the suite let through is put back
(padding in the plain layout's mask, the thumbnail's blur scale, the row in a sealed block's nonce, the model
in a namespace's owner, the disk directory's exclusive lock, placement over several devices)."""

import fcntl
import math
import os
import threading
import time
from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache

import vismemo_hf
from vismemo_hf import HitKind, VisMemoCache, VisMemoStore
from vismemo_hf.core.features import THUMB_BLUR, scoped, thumb_per_token, thumbnail, thumbnail_shape, token_grid
from vismemo_hf.eval import synthetic
from vismemo_hf.store import blob

from conftest import _enabled_tiny, build_inputs, generate, noise_image
from test_store import _entry

SECRET = "correct horse battery staple 42"


# 1. the plain layout's mask keeps padding out ------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_plain_layers_of_a_left_padded_batch_with_a_hit_mask_the_padding(family):
    """A batch with an approximate hit runs the prefill runner; its warmup layers compute every column and reuse
    nothing (the plain layout). The left-padded row (a miss) must not see its padding there: its scores equal
    plain transformers' (a DynamicCache) on the same padded batch, and the hit row equals that request alone."""
    model, processor = _enabled_tiny(family)
    store = VisMemoStore()
    generate(model, build_inputs(processor, [synthetic.page(1)]), VisMemoCache(store=store, tau=1.0), 1)
    store.flush()
    requests = [([noise_image(3)], "Which row?", ""),  # short: left-padded; a miss (noise is like no page)
                ([synthetic.edited(1, row=2, value="0000")], "What is the value of the second row of this form?",
                 "Look at this form, please. ")]  # long: an approximate hit
    batch = build_inputs(processor, None, batch=requests)
    assert not bool(batch["attention_mask"][0].all()) and bool(batch["attention_mask"][1].all()), \
        "premise: the first row is left-padded"
    opts = dict(recompute_ratio=0.3, reuse_ratio=0.2, warmup_layers=2, store_misses=False)
    cache = VisMemoCache(store=store, **opts)
    tokens, scores = generate(model, batch, cache, 3)
    assert [e.kind for e in cache.events] == [HitKind.MISS, HitKind.APPROXIMATE]
    ref_tokens, ref = generate(model, batch, DynamicCache(), 3)
    assert (scores[0] - ref[0]).abs().max() <= 1e-4, "the padded row differs from plain transformers"
    assert torch.equal(tokens[0], ref_tokens[0])
    alone_tokens, alone = generate(model, build_inputs(processor, None, batch=[requests[1]]),
                                   VisMemoCache(store=store, **opts), 3)
    n = alone.shape[1]  # alone, generation may stop at an end token sooner than the batch
    assert (scores[1, :n] - alone[0]).abs().max() <= 1e-4 and torch.equal(tokens[1, :n], alone_tokens[0])


# 2. the thumbnail is band-limited at THUMB_BLUR thumbnail pixels, at any image size ----------------------------
PATCH, MERGE = 14, 2
TOKEN = PATCH * MERGE


def _pixels(luma: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One-channel processor pixels (mean 0, std 1, one temporal frame) of a (H, W) luma image in [0, 1]: the
    inverse of the patch order ``thumbnail`` undoes."""
    bh, bw = luma.shape[0] // TOKEN, luma.shape[1] // TOKEN
    x = luma.reshape(bh, MERGE, PATCH, bw, MERGE, PATCH).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(bh * bw * MERGE * MERGE, PATCH * PATCH).contiguous(), (1, bh * MERGE, bw * MERGE)


def _thumb(luma: torch.Tensor) -> torch.Tensor:
    pixels, grid = _pixels(luma)
    thumb = thumbnail(pixels, grid, channels=1, temporal_patch=1, patch=PATCH, merge=MERGE, image_mean=(0.0,),
                      image_std=(1.0,))
    assert tuple(thumb.shape) == thumbnail_shape(token_grid(grid, MERGE)[1:])
    return thumb.float() / 255


def _edge_profile(sigma: float, n: int, edge: int) -> torch.Tensor:
    """(n,) area average over each thumbnail pixel [i, i + 1) of a unit step at ``edge`` under a Gaussian of
    ``sigma`` thumbnail pixels: what the thumbnail of a step edge is, by its definition."""

    def integral(u):  # the integral of Phi(t / sigma) dt from -inf to u
        return u * 0.5 * (1 + math.erf(u / (sigma * math.sqrt(2)))) + sigma * math.exp(-u * u / (2 * sigma**2)) / \
            math.sqrt(2 * math.pi)

    return torch.tensor([integral(i + 1 - edge) - integral(i - edge) for i in range(n)])


@pytest.mark.parametrize("tokens", [8, 32])  # 7 thumbnail px per token (4 image px each), then 5 (5.6 image px)
def test_a_step_edge_in_the_thumbnail_is_blurred_by_thumb_blur_thumbnail_pixels(tokens):
    """A bright half (its edge on a token boundary): the thumbnail's profile across the edge is the step under
    a Gaussian of THUMB_BLUR thumbnail pixels, area-averaged, for a small and a large image alike (a blur at
    the wrong scale gives a sharper or a wider edge, and one that changes with the image's size)."""
    side = tokens * TOKEN
    luma = torch.zeros(side, side)
    luma[:, side // 2 :] = 1.0
    thumb = _thumb(luma)
    per = thumb_per_token((tokens, tokens))
    assert thumb.shape == (tokens * per, tokens * per)
    expected = _edge_profile(THUMB_BLUR, thumb.shape[1], thumb.shape[1] // 2)
    rows = thumb[thumb.shape[0] // 4 : 3 * thumb.shape[0] // 4]  # away from the top and bottom edges
    assert float((rows - expected).abs().max()) <= 0.035, (rows[0], expected)  # its pre-averaging: ~0.02
    # the pixels next to the edge are neither a hard step nor a wide ramp
    mid = thumb.shape[1] // 2
    assert 0.75 <= float(rows[:, mid].mean()) <= 0.85 and 0.15 <= float(rows[:, mid - 1].mean()) <= 0.25


@pytest.mark.parametrize("tokens", [8, 32])
def test_a_checkerboard_finer_than_a_thumbnail_pixel_is_flat_grey(tokens):
    """Checkerboards of 1 and 3 image px cells (a period below a thumbnail pixel) average to a flat grey,
    without a coarse alias pattern."""
    side = tokens * TOKEN
    y, x = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    for cell in (1, 3):
        board = (((y // cell) + (x // cell)) % 2).float()
        thumb = _thumb(board)
        inner = thumb[2:-2, 2:-2]
        assert abs(float(inner.mean()) - float(board.mean())) <= 2 / 255, cell
        assert float(inner.max() - inner.min()) <= 3 / 255, cell


# 3. a sealed block's MAC binds its token row ------------------------------------------------------------------
def _disk(path, **kw):
    return VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=str(path), **kw)


def test_a_sealed_block_copied_to_another_tokens_place_does_not_verify(tmp_path):
    """Tokens 1 and 3 swap their late-layer blocks (each block with its own MAC, same layers): every block still
    carries a valid tag for its bytes, but not for its row: a sparse read of them is refused (forged), as is a
    full read; the blob module's own read of the ranges raises ForgedBlob."""
    entry = _entry("k", n=6, layers=4)
    store = _disk(tmp_path, secret=SECRET)
    first = 2
    for key in ("k", "whole"):
        store.put(replace(entry, key=key))
        store.flush()
        header = store.disk.header(key)
        with store.disk._open(key) as handle:
            data = bytearray(handle.read())
        (a, length), (b, _) = header.token_range(1, first), header.token_range(3, first)
        data[a : a + length], data[b : b + length] = data[b : b + length], data[a : a + length]
        store.disk.write(key, bytes(data))
        if key == "k":  # the blob module directly: the swapped ranges do not verify under their rows
            seal = blob.Seal(SECRET)
            parsed = blob.parse_header(bytes(data[: blob.HEADER_SIZE]), seal)
            chunks = [bytes(data[s : s + n]) for s, n in (parsed.token_range(1, first), parsed.token_range(3, first))]
            with pytest.raises(blob.ForgedBlob):
                blob.decode_ranges(parsed, chunks, first, [1, 3])
            untouched = [bytes(data[s : s + n]) for s, n in (parsed.token_range(0, first),
                                                             parsed.token_range(5, first))]
            assert torch.equal(blob.decode_ranges(parsed, untouched, first, [0, 5])[0], entry.kv[[0, 5], first:])
    assert torch.equal(store.get_tokens("k", "fp", torch.tensor([0, 5]), first), entry.kv[[0, 5], first:])
    assert store.get_tokens("k", "fp", torch.tensor([1, 3]), first) is None
    assert store.stats()["forged"] == 1 and "k" not in store
    assert store.get("whole", "fp") is None and store.stats()["forged"] == 2
    store.close()


# 4. a namespace's owner is per model ----------------------------------------------------------------------------
def test_a_namespace_scopes_each_model_apart():
    """Two models in one namespace own different entries (and a namespace is not the bare fingerprint)."""
    assert scoped("fp-a", "tenant") != scoped("fp-b", "tenant")
    assert scoped("fp-a", "tenant") != scoped("fp-a", "other") and scoped("fp-a", None) == "fp-a"


def test_two_models_sharing_a_store_and_namespace_never_hit_each_others_entries():
    first, processor = _enabled_tiny("qwen2_vl", 0)
    second, _ = _enabled_tiny("qwen2_vl", 1)
    assert vismemo_hf.families.ModelAdapter.for_model(first).fingerprint != \
        vismemo_hf.families.ModelAdapter.for_model(second).fingerprint, "premise: two different models"
    store = VisMemoStore()
    inputs = build_inputs(processor, [synthetic.page(1)])
    mine = VisMemoCache(store=store, namespace="tenant")
    generate(first, inputs, mine, 1)
    store.flush()
    assert [e.kind for e in mine.events] == [HitKind.MISS] and len(store) == 1
    again = VisMemoCache(store=store, namespace="tenant")
    generate(first, inputs, again, 1)
    assert [e.kind for e in again.events] == [HitKind.EXACT], "premise: the first model hits its own entry"
    theirs = VisMemoCache(store=store, namespace="tenant", store_misses=False)
    _, scores = generate(second, inputs, theirs, 2)
    assert [e.kind for e in theirs.events] == [HitKind.MISS]
    _, ref = generate(second, inputs, DynamicCache(), 2)
    assert (scores - ref).abs().max() <= 1e-4


# 5. the disk directory's writers' lock is exclusive -------------------------------------------------------------
def test_the_disk_directorys_lock_excludes_every_other_holder(tmp_path):
    """While one holder has the directory lock, no other open of the lock file gets it, shared or exclusive,
    and a second ``_directory_lock`` (its own file handle, as another process's) waits until the first lets go."""
    store = _disk(tmp_path)
    disk = store.disk
    path = os.path.join(disk.directory, "vismemo-writers.lock")
    order = []

    def second():
        with disk._directory_lock():
            order.append("second")

    with disk._directory_lock():
        for mode in (fcntl.LOCK_EX, fcntl.LOCK_SH):
            with open(path, "a+b") as other, pytest.raises(BlockingIOError):
                fcntl.flock(other, mode | fcntl.LOCK_NB)
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.3)
        order.append("first")
    thread.join(10)
    assert order == ["first", "second"]
    with open(path, "a+b") as other:  # let go: free for anyone
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_UN)
    store.close()


# 6. per-device placement goes on to the next device ---------------------------------------------------------
def test_an_entry_too_large_for_the_first_device_goes_to_the_next_device_with_room():
    """device_bytes per device: an entry that does not fit the first device's budget is placed on the second
    (not demoted to the host tier), and a hit from the host tier promotes to the first device it fits."""
    small, large = _entry("s", n=2), _entry("big", n=8, seed=1)
    assert small.nbytes < large.nbytes
    store = VisMemoStore(device_bytes={"cpu": small.nbytes, "cpu:0": 2 * large.nbytes}, host_bytes=10**7)
    assert store.put(large)
    assert "big" in store.devices[1].lru and not store.devices[0].lru and store.tier_of("big") == "device"
    assert store.put(small) and "s" in store.devices[0].lru
    assert torch.equal(store.get("big", "fp").kv, large.kv)
    big = {"big": large, "big2": _entry("big2", n=8, seed=2), "big3": _entry("big3", n=8, seed=3)}
    store.put(big["big2"])
    store.put(big["big3"])  # the second device holds two large entries: one of them goes to the host tier
    on_host = [k for k in big if store.tier_of(k) == "host"]
    assert len(on_host) == 1 and len(store.devices[1].lru) == 2 and store.devices[0].lru.keys() == {"s"}
    assert torch.equal(store.get(on_host[0], "fp").kv, big[on_host[0]].kv)  # promoted: to the second device
    assert on_host[0] in store.devices[1].lru and "s" in store.devices[0].lru
    per = store.stats()["tiers"]["device"]["devices"]
    assert all(d["bytes"] <= d["budget"] for d in per.values())

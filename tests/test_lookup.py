"""Two-stage lookup: exact, approximate with the right alias, miss; grid, tau and k respected."""

import pytest
import torch

import vismemo_hf
import vismemo_hf.families
from vismemo_hf import HitKind
from vismemo_hf.core.features import patch_entropy, region_descriptors
from vismemo_hf.eval import synthetic
from vismemo_hf.store.index import DescriptorIndex

from conftest import build_inputs, generate, noise_image


def _kind(model, processor, store, image, **opts):
    cache = vismemo_hf.VisMemoCache(store=store, **opts)
    generate(model, build_inputs(processor, [image]), cache, 1)
    return cache.events[0]


@pytest.mark.approximate
def test_identical_edit_unrelated_and_other_grid(tiny, pages, family):
    model, processor = tiny
    store = vismemo_hf.VisMemoStore()
    base = _kind(model, processor, store, pages["base"])
    # a second, similar form (same layout, other text) stored as a competitor: tau=1 forces a miss
    other_page = _kind(model, processor, store, synthetic.page(5), tau=1.0)
    assert base.kind is HitKind.MISS and other_page.kind is HitKind.MISS and len(store) == 2
    assert _kind(model, processor, store, pages["base"]).kind is HitKind.EXACT
    edit = _kind(model, processor, store, pages["edit"])
    assert edit.kind is HitKind.APPROXIMATE and edit.alias == base.key
    only_base = vismemo_hf.VisMemoStore()
    base_again = _kind(model, processor, only_base, pages["base"])
    # a random tower moves every token of a shifted page, so its fine score falls below the default: a looser tau_fine
    shift = _kind(model, processor, only_base, pages["shift"], tau_fine=0.75)
    if vismemo_hf.families.FAMILIES[family].movable:
        assert shift.kind is HitKind.APPROXIMATE and shift.alias == base_again.key
    else:  # tokens in a packed run (LLaVA-OneVision's tiles): a moved copy is never matched moved
        assert shift.shift == (0, 0)
    assert _kind(model, processor, store, pages["noise"]).kind is HitKind.MISS
    # the same page at another size has another grid: never a candidate, even with tau = 0 (LLaVA-OneVision tiles
    # it into the same packing, the same grid: test_families.py checks its packings of as many tokens in other rows)
    bigger = pages["base"].resize((280, 224))
    if vismemo_hf.families.FAMILIES[family].movable:
        assert _kind(model, processor, store, bigger, tau=0.0, tau_fine=0.0).kind is HitKind.MISS


def test_tau_is_respected(qwen2, pages):
    model, processor = qwen2
    store = vismemo_hf.VisMemoStore()
    _kind(model, processor, store, pages["base"])
    edit = _kind(model, processor, store, pages["edit"], same_pixels=None, store_misses=False)
    assert edit.kind is HitKind.APPROXIMATE and edit.found_by == "encoder"  # the encoder-based stages alone
    strict = _kind(model, processor, store, pages["edit"], tau_fine=min(0.99999, edit.score + 1e-4), store_misses=False,
                   same_pixels=None)
    assert strict.kind is HitKind.MISS  # the fine stage's threshold
    assert _kind(model, processor, store, pages["edit"], tau=0.99999, store_misses=False,
                 same_pixels=None).kind is HitKind.MISS
    assert _kind(model, processor, store, pages["shift"], top_k=0).kind is HitKind.MISS


def test_descriptor_index_all_regions_top_k_and_grid():
    torch.manual_seed(0)
    index = DescriptorIndex()
    for fp in ("fp", "other-model"):
        index.set_center(fp, torch.zeros(8))
    query = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1)
    near = [torch.nn.functional.normalize(query + 0.05 * i * torch.randn(4, 8), dim=-1) for i in range(1, 7)]
    for i, d in enumerate(near):
        index.add("fp", (1, 4, 4), f"k{i}", d)
    one_region_off = query.clone()
    one_region_off[2] = -query[2]
    index.add("fp", (1, 4, 4), "bad", one_region_off)
    index.add("fp", (1, 4, 6), "othergrid", query)
    index.add("other-model", (1, 4, 4), "othermodel", query)
    found = index.search("fp", (1, 4, 4), query, tau=0.8, top_k=3)
    assert len(found) == 3
    assert [k for k, _ in found] == sorted([k for k, _ in found], key=lambda k: -dict(found)[k])
    assert all(k.startswith("k") for k, _ in found)
    everything = [k for k, _ in index.search("fp", (1, 4, 4), query, tau=0.0, top_k=100)]
    assert "bad" not in everything and "othergrid" not in everything and "othermodel" not in everything
    index.remove("fp", (1, 4, 4), "k0")
    assert "k0" not in [k for k, _ in index.search("fp", (1, 4, 4), query, tau=0.0, top_k=100)]


def test_region_descriptors_are_region_means():
    e = torch.zeros(16, 3)
    e[:, 0] = 1.0
    grid = (1, 8, 8)  # 4x4 tokens after a 2x2 merge
    tokens = e.reshape(4, 4, 3)
    tokens[2:, 2:] = torch.tensor([0.0, 1.0, 0.0])  # bottom-right region differs
    d = region_descriptors(tokens.reshape(16, 3), grid, 2)
    assert torch.allclose(d[0], torch.tensor([1.0, 0, 0])) and torch.allclose(d[3], torch.tensor([0, 1.0, 0]))


@pytest.mark.parametrize("merge,patch", [(2, 14), (2, 16)])
def test_patch_entropy_blank_is_zero_and_noise_is_high(merge, patch):
    mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    blank = torch.ones(2 * merge * merge, 3 * 2 * patch * patch)  # white in normalised units
    noise = torch.rand(2 * merge * merge, 3 * 2 * patch * patch) * 2 - 1
    h_blank = patch_entropy(blank, channels=3, temporal_patch=2, patch=patch, merge=merge, image_mean=mean, image_std=std)
    h_noise = patch_entropy(noise, channels=3, temporal_patch=2, patch=patch, merge=merge, image_mean=mean, image_std=std)
    assert h_blank.shape == (2,) and torch.all(h_blank == 0)
    assert torch.all(h_noise > 0.9) and torch.all(h_noise <= 1.0)


def test_document_entropy_separates_blank_from_text(qwen2):
    _, processor = qwen2
    x = processor.image_processor(images=[synthetic.page(1)], return_tensors="pt")
    h = patch_entropy(x.pixel_values, channels=3, temporal_patch=2, patch=14, merge=2,
                      image_mean=processor.image_processor.image_mean, image_std=processor.image_processor.image_std)
    assert h.min() == 0.0 and h.max() > 0.2
    noise = processor.image_processor(images=[noise_image()], return_tensors="pt")
    hn = patch_entropy(noise.pixel_values, channels=3, temporal_patch=2, patch=14, merge=2,
                       image_mean=processor.image_processor.image_mean, image_std=processor.image_processor.image_std)
    assert hn.min() > h.max()


@pytest.mark.parametrize("channels,temporal,patch,merge,mean,std", [
    (3, 2, 16, 2, (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
    (3, 1, 14, 1, 0.5, 0.5),  # one value for every channel
    (1, 2, 14, 2, (0.5,), (0.25,))])
def test_patch_entropy_is_each_tokens_luma_histogram_entropy(channels, temporal, patch, merge, mean, std):
    """Each token's entropy, computed token by token from its first frame's 8-bit luma levels (32 bins), whatever
    the tokens' order: the whole-image arithmetic of ``patch_entropy`` mixes no token with another."""
    g = torch.Generator().manual_seed(channels * 100 + patch)
    tokens = 12
    raw = torch.randint(0, 256, (tokens * merge * merge, channels, temporal, patch, patch), generator=g).float() / 255
    raw[: merge * merge] = 1.0  # a white token: entropy 0
    m = torch.as_tensor(mean, dtype=torch.float32).reshape(-1).expand(channels).reshape(1, -1, 1, 1, 1)
    s = torch.as_tensor(std, dtype=torch.float32).reshape(-1).expand(channels).reshape(1, -1, 1, 1, 1)
    pixels = ((raw - m) / s).reshape(raw.shape[0], -1)
    kwargs = dict(channels=channels, temporal_patch=temporal, patch=patch, merge=merge, image_mean=mean, image_std=std)
    got = patch_entropy(pixels, **kwargs)
    rgb = (pixels.reshape(raw.shape)[:, :, 0] * s[:, :, 0] + m[:, :, 0]).clamp(0, 1)
    weights = torch.tensor([0.299, 0.587, 0.114]) if channels == 3 else torch.ones(1)
    luma = (rgb * weights.view(1, -1, 1, 1)).sum(1)
    levels = (luma * 255).round().clamp(0, 255).long().reshape(tokens, -1)
    for t in range(tokens):
        p = torch.bincount(levels[t] // 8, minlength=32).double()
        p = p[p > 0] / p.sum()
        assert float(got[t]) == pytest.approx(float(-(p * p.log2()).sum() / 5), abs=1e-5)
    assert float(got[0]) == 0.0
    order = torch.randperm(tokens, generator=g)
    shuffled = pixels.reshape(tokens, -1)[order].reshape(pixels.shape)
    assert torch.equal(patch_entropy(shuffled, **kwargs), got[order])


def test_exact_keys_are_hashed_ahead_of_the_lookup(tiny, pages, monkeypatch):
    """``generate`` asks for the images' encoder output before the prefill: from then on a key thread hashes their
    pixels (``runtime.keys``), and the lookup makes each exact key from the digest without hashing the pixels
    again. The keys are the ones hashed at the lookup, for one image and for two; a second request with the same
    images is an exact hit on them."""
    from vismemo_hf.core import features
    from vismemo_hf.runtime import keys, lookup

    model, processor = tiny
    adapter = model._vismemo
    monkeypatch.setattr(keys, "AHEAD_ON_HOST", True)  # on the host too (by default only from an accelerator)
    used: list = []
    digests = keys.KeysAhead.digests

    def spy(self, pixel_values, count):
        out = digests(self, pixel_values, count)
        used.append(out)
        return out

    monkeypatch.setattr(keys.KeysAhead, "digests", spy)
    hashed_here: list = []
    own = lookup.exact_key
    monkeypatch.setattr(lookup, "exact_key", lambda owner, pixels, grid, digest=None:
                        hashed_here.append(digest is None) or own(owner, pixels, grid, digest))
    for images in ([pages["base"]], [pages["noise"], pages["edit"]]):
        inputs = build_inputs(processor, images)
        store = vismemo_hf.VisMemoStore()
        cache = vismemo_hf.VisMemoCache(store=store, approximate="never")
        generate(model, inputs, cache, 1)
        host = adapter.split_images(adapter.tower_pixels(inputs["pixel_values"]).cpu(),
                                    adapter.image_geometry(inputs), None)
        owner = cache.owner(adapter.fingerprint)
        want = [features.exact_key(owner, pixels, grid) for pixels, grid, _ in host]
        assert [e.key for e in cache.events] == want
        again = vismemo_hf.VisMemoCache(store=store, approximate="never")
        generate(model, inputs, again, 1)
        assert all(e.kind is HitKind.EXACT for e in again.events)
    # each lookup either used the digests hashed ahead or (their hashing not started) hashed the pixels itself
    assert used and any(u is not None for u in used) and not all(hashed_here)


def test_a_digest_hashed_from_other_pixels_is_not_used():
    """Digests are only taken for the very tensor they were hashed from."""
    from concurrent.futures import Future

    from vismemo_hf.runtime.keys import KeysAhead

    done: Future = Future()
    done.set_result([b"x" * 32])
    pixels = torch.zeros(4, 3)
    ahead = KeysAhead(pixels, done)
    assert ahead.digests(pixels.clone(), 1) is None
    assert ahead.digests(pixels, 2) is None  # another image count than hashed
    assert ahead.digests(pixels, 1) == [b"x" * 32]

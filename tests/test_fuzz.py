"""Stored bytes cannot give a wrong answer: every byte of a blob flipped, and samples of multi-byte changes, on
each tier, give either a miss equal to a full prefill or exactly the unmodified hit; never an exception."""

import random

import pytest
import torch
from transformers import DynamicCache

import vismemo_hf
from vismemo_hf.core.context import context_sketch
from vismemo_hf.core.plan import HitKind
from vismemo_hf.store import blob

from conftest import build_inputs
from test_store import _entry


@pytest.mark.parametrize("variant", ["plain", "int8", "fp8", "compressed", "int8-compressed"])
def test_every_byte_of_a_blob_is_checked(variant):
    """Decoding a blob with any one byte flipped raises BlobError, or (never, today) gives the same entry; for
    plain, 8-bit and compressed blobs alike. Reading the lookup section alone checks its bytes too."""
    entry = _entry("k", n=3, layers=2)
    entry.patch_hashes = torch.arange(3)
    entry.prefix = "ab" * 16
    entry.thumbnail = torch.randint(0, 256, (3, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    entry.context = context_sketch(torch.arange(70), ["earlier"], b"key")
    entry.tower_kv = torch.randn(2, 2, 12, 4, generator=torch.Generator().manual_seed(1)).to(entry.kv.dtype)
    if "compressed" in variant:
        entry = entry.compressed(torch.tensor([0, 2]))
    kv_format = variant.split("-")[0] if variant.startswith(("int8", "fp8")) else None
    data = blob.encode(entry, kv_format)
    reference = blob.decode_entry(blob.parse_header(data[: blob.HEADER_SIZE]),
                                  torch.frombuffer(bytearray(data), dtype=torch.uint8))
    entry.kv = reference.kv  # what the format gives back
    assert torch.equal(reference.tower_kv, entry.tower_kv)
    for pos in range(len(data)):
        bad = bytearray(data)
        bad[pos] ^= 0x5A
        try:
            header = blob.parse_header(bytes(bad[: blob.HEADER_SIZE]))
            if len(bad) != header.total_bytes:
                raise blob.BlobError("size")
            got = blob.decode_entry(header, torch.frombuffer(bad, dtype=torch.uint8))
        except blob.BlobError:
            continue
        assert torch.equal(got.kv, entry.kv) and torch.equal(got.embeds, entry.embeds), pos
        assert torch.equal(got.thumbnail, entry.thumbnail) and torch.equal(got.context, entry.context), pos
        assert torch.equal(got.tower_kv, entry.tower_kv), pos
        assert (got.key, got.fingerprint, got.grid, got.offset, got.prefix) == (
            entry.key, entry.fingerprint, entry.grid, entry.offset, entry.prefix), pos
    header = blob.parse_header(data[: blob.HEADER_SIZE])
    start = header.meta_start
    for pos in range(start, start + header.lookup_bytes):
        bad = bytearray(data[start : start + header.lookup_bytes])
        bad[pos - start] ^= 0x5A
        with pytest.raises(blob.BlobError):
            blob.decode_lookup(header, bytes(bad))


def _logits(model, inputs, cache):
    with torch.no_grad():
        return model(**inputs, cache=cache, use_cache=True).logits[:, -1]


def _positions(size: int, rng: random.Random, body_samples: int) -> list[list[int]]:
    """Every header byte alone, a sample of other single bytes, and a sample of multi-byte changes."""
    single = [[p] for p in range(blob.HEADER_SIZE)] + [[p] for p in rng.sample(range(blob.HEADER_SIZE, size), body_samples)]
    multi = [sorted(rng.sample(range(size), rng.randint(2, 16))) for _ in range(body_samples // 2)]
    return single + multi


class _Tier:
    """Put the pristine entry back, then change bytes where that tier keeps them (test-only access)."""

    def __init__(self, kind, tmp_path, server=None):
        self.kind = kind
        if kind == "host":
            self.store = vismemo_hf.VisMemoStore(device_bytes=0, host_bytes=2**30)
        elif kind == "disk":
            self.store = vismemo_hf.VisMemoStore(device_bytes=0, disk_dir=str(tmp_path / "disk"), disk_bytes=2**30)
        else:
            self.store = vismemo_hf.VisMemoStore(device_bytes=0, remote_url=server.url,
                                                 remote_options={"refresh_s": 0})
            self.client = server.client()

    def reset(self, entry):
        self.store.discard(entry.key)
        assert self.store.put(entry)
        self.store.flush()
        assert self.store.tier_of(entry.key) == self.kind

    def corrupt(self, key, positions, rng):
        if self.kind == "host":
            data = self.store.host.lru[key][1]
            for p in positions:
                data[p] ^= rng.randint(1, 255)
        elif self.kind == "disk":
            with self.store.disk._open(key) as handle:
                path = handle.name
            with open(path, "r+b") as f:
                for p in positions:
                    f.seek(p)
                    byte = f.read(1)[0]
                    f.seek(p)
                    f.write(bytes([byte ^ rng.randint(1, 255)]))
        else:
            name = f"vismemo:blob:{key}"
            for p in positions:
                byte = self.client.getrange(name, p, p)[0]
                self.client.setrange(name, p, bytes([byte ^ rng.randint(1, 255)]))


def _fuzz(model, processor, pages, tier, body_samples):
    rng = random.Random(0)
    inputs = build_inputs(processor, [pages["base"]])
    full = _logits(model, inputs, DynamicCache())
    first = vismemo_hf.VisMemoCache(store=tier.store)
    _logits(model, inputs, first)
    key = first.events[0].key
    tier.store.flush()  # the remote tier writes in the background
    entry = tier.store.get(key, model._vismemo.fingerprint)
    hit = _logits(model, inputs, vismemo_hf.VisMemoCache(store=tier.store))
    size = len(blob.encode(entry))
    outcomes = {"exact": 0, "miss": 0}
    for positions in _positions(size, rng, body_samples):
        tier.reset(entry)
        tier.corrupt(key, positions, rng)
        cache = vismemo_hf.VisMemoCache(store=tier.store)
        out = _logits(model, inputs, cache)  # never raises
        kind = cache.events[0].kind
        if kind is HitKind.EXACT:
            assert torch.equal(out, hit), positions
        else:
            assert kind is HitKind.MISS and torch.allclose(out, full, atol=1e-5), (positions, kind)
        outcomes[str(kind)] += 1
    assert outcomes["miss"] > 0 and sum(outcomes.values()) == blob.HEADER_SIZE + body_samples + body_samples // 2
    return outcomes


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_corrupted_local_tiers_never_change_an_answer(qwen2, pages, tmp_path, kind):
    model, processor = qwen2
    _fuzz(model, processor, pages, _Tier(kind, tmp_path), body_samples=60)


def test_corrupted_remote_blobs_never_change_an_answer(qwen2, pages, tmp_path, server):
    model, processor = qwen2
    _fuzz(model, processor, pages, _Tier("remote", tmp_path, server), body_samples=40)

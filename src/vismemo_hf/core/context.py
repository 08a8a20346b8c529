"""How far the context before an image moved: a sketch of it kept with each entry, and the tokens two sketches differ in.

An image's K/V depend on what preceded it (the text, earlier images and videos). The lookup's context digest
(``runtime/lookup.prefix_digest``) says only *whether* that changed; routing needs *how much*: one token of a label
or an instruction moves the image's K/V a little, a new chat turn moves them everywhere (docs/METHOD.md §3). The
sketch keeps, for the text before the image, a keyed hash of each of its first and last ``SPAN`` tokens'
cumulative runs, its length, and a hash of the earlier images' and videos' identities; two sketches then give the
length of the common head and tail of the two texts, and so the tokens that differ between them (an upper bound:
an edit in the middle of a long text counts every token between the common head and tail).

The hashes are keyed (``context_sketch(key=...)``: the cache's owner and, with a store secret, a key derived from
it), so a store read without the key does not reveal the text's tokens one by one.
"""

from __future__ import annotations

import hashlib

import torch

#: tokens of the head and of the tail of the text before an image whose runs a sketch hashes
SPAN = 64
#: sketch layout: [length, earlier images' hash, SPAN tail-run hashes, SPAN head-run hashes]
SIZE = 2 + 2 * SPAN


def _h(digest: bytes) -> int:
    """A positive, nonzero int64 of 8 digest bytes (0 marks a run longer than the text)."""
    return (int.from_bytes(digest, "little") >> 1) | 1


def context_sketch(ids: torch.Tensor, earlier: list[str], key: bytes = b"") -> torch.Tensor:
    """(SIZE,) int64 sketch of a context: ``ids`` the real token ids before the image (1-D, host), ``earlier`` the
    identities of the images and videos before it; ``key`` keys the hashes (at most 64 bytes are used)."""
    key = hashlib.blake2b(key, digest_size=32).digest()
    ids = ids.reshape(-1)
    head, tail = ids[:SPAN].tolist(), ids[-SPAN:].tolist() if ids.numel() else []  # only the spans are hashed
    out = [0] * SIZE
    out[0] = ids.numel()
    if earlier:
        h = hashlib.blake2b(key=key, digest_size=8, person=b"vm-earlier")
        for ident in earlier:
            h.update(ident.encode() + b"\0")
        out[1] = _h(h.digest())
    for base, run in ((2, reversed(tail)), (2 + SPAN, iter(head))):
        h = hashlib.blake2b(key=key, digest_size=8, person=b"vm-context")
        for k, token in zip(range(SPAN), run):
            h.update(token.to_bytes(8, "little", signed=True))
            out[base + k] = _h(h.digest())
    return torch.tensor(out, dtype=torch.int64)


def context_change(old: torch.Tensor | None, new: torch.Tensor | None) -> int | None:
    """Tokens by which the context ``new`` differs from ``old`` (two ``context_sketch``es): the longer text's tokens
    outside the two texts' common head and tail; None when it cannot be told (a sketch missing or malformed, other
    images or videos before the image, or a change beyond both spans of texts that agree there)."""
    if old is None or new is None or old.shape != (SIZE,) or new.shape != (SIZE,):
        return None
    if int(old[1]) != int(new[1]):
        return None
    lo, ln = int(old[0]), int(new[0])
    if lo < 0 or ln < 0:
        return None

    def common(part: slice) -> int:
        same = (old[part] == new[part]) & (new[part] != 0)
        return int(torch.cumprod(same.to(torch.int64), 0).sum())

    shared = min(common(slice(2, 2 + SPAN)) + common(slice(2 + SPAN, SIZE)), lo, ln)
    changed = max(lo, ln) - shared
    return changed if changed > 0 else None

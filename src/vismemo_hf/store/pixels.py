"""The pixel-first index (docs/METHOD.md §1, step 2): which stored images show, token for token, the pixels of a new
one, found from the tokens' pixel hashes before the vision tower runs.

Per entry it keeps a sample of its *distinctive* tokens (a pixel hash that occurs once in the image: text, rules,
figures; not the background, which every page of a layout shares): the ``SAMPLE`` (position, hash) codes that are
smallest after mixing, a sample two images that agree on most of their tokens mostly share (a bottom-k sketch). A
query looks every distinctive code of the new image up; an entry scores the share of its sample found. Codes that
more than ``CROWDED`` entries hold are no longer counted (a header every page of a template shows tells them apart
no better than the background). What the index finds is a candidate only: the lookup compares its full hashes
(``core.pixel_first.pixel_changes``).

The index is in memory and holds what this process stored or looked at (a tier's entries from another process
come in when a lookup first finds them by their encoder output or an exact key): a candidate it does not know is
found by the encoder-based stages, as before.
"""

from __future__ import annotations

import numpy as np
import torch

from vismemo_hf.core.pixel_first import distinctive

#: codes sampled per entry
SAMPLE = 48
#: a code more entries than this hold is not counted
CROWDED = 64
#: the least share of an entry's sample a query must show for the entry to be a candidate (below the region rule's
#: ``core.pixel_first.REGION_SAME``: a copy changed in a region shows little more of it)
MIN_SHARE = 0.05

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: codes spread uniformly, so the smallest ones are a fair sample."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
    return x ^ (x >> np.uint64(31))


def codes(hashes: torch.Tensor) -> np.ndarray:
    """The mixed (position, hash) codes of an image's distinctive tokens, sorted."""
    keep = torch.nonzero(distinctive(hashes)).flatten()
    with np.errstate(over="ignore"):
        raw = (hashes[keep].numpy().astype(np.uint64) << np.uint64(24)) ^ keep.numpy().astype(np.uint64)
        return np.sort(_mix(raw))


class PixelIndex:
    """Samples of stored images' distinctive tokens, per (model, grid), and the entries holding each code."""

    def __init__(self) -> None:
        self._postings: dict[tuple, dict[int, set[str]]] = {}
        self._samples: dict[str, tuple[tuple, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self._samples)

    def __contains__(self, key: str) -> bool:
        return key in self._samples

    def knows(self, fingerprint: str, grid) -> bool:
        """Whether any entry of this model and grid is indexed (else a lookup need not hash a new image)."""
        return bool(self._postings.get((fingerprint, tuple(grid))))

    def add(self, key: str, fingerprint: str, grid, hashes: torch.Tensor) -> None:
        if key in self._samples or hashes is None:
            return
        sample = codes(hashes.to(torch.int64).cpu())[:SAMPLE]
        if not sample.size:
            return  # nothing distinctive: no pixel-first lookup finds it
        group = (fingerprint, tuple(grid))
        postings = self._postings.setdefault(group, {})
        for code in sample.tolist():
            postings.setdefault(code, set()).add(key)
        self._samples[key] = (group, sample)

    def remove(self, key: str) -> None:
        known = self._samples.pop(key, None)
        if known is None:
            return
        group, sample = known
        postings = self._postings.get(group, {})
        for code in sample.tolist():
            holders = postings.get(code)
            if holders is not None:
                holders.discard(key)
                if not holders:
                    del postings[code]
        if not postings:
            self._postings.pop(group, None)

    def candidates(self, fingerprint: str, grid, hashes: torch.Tensor, top_k: int) -> list[tuple[str, float]]:
        """(key, share of its sample the image shows) of the best ``top_k`` entries showing at least ``MIN_SHARE``,
        best first."""
        postings = self._postings.get((fingerprint, tuple(grid)))
        if not postings or top_k <= 0:
            return []
        found: dict[str, int] = {}
        for code in codes(hashes.to(torch.int64).cpu()).tolist():
            holders = postings.get(code)
            if holders is None or len(holders) > CROWDED:
                continue
            for key in holders:
                found[key] = found.get(key, 0) + 1
        scored = [(key, count / self._samples[key][1].size) for key, count in found.items()]
        scored = [c for c in scored if c[1] >= MIN_SHARE]
        return sorted(scored, key=lambda c: (-c[1], c[0]))[:top_k]

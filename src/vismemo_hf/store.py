"""Where entries live between requests (METHOD §5).

``VisMemoStore`` is the interface the runtime talks to: put, full get (exact hits),
selected-token get of late layers (approximate hits), the descriptor index (coarse
lookup) and stats. This version keeps entries in one in-memory tier with an optional
byte budget and LRU eviction.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .plan import ImageFeatures

logger = logging.getLogger(__name__)


@dataclass
class Entry:
    """Everything kept for one image under one model.

    ``kv`` is patch-first: (N tokens, L layers, 2 (K, V), KV heads, head dim), so the
    late-layer K/V of one token is one contiguous block. Keys are RoPE-rotated at
    ``offset``, the M-RoPE start position of the image when it was computed.
    """

    key: str
    fingerprint: str
    grid: tuple[int, int, int]
    embeds: torch.Tensor
    deepstack: torch.Tensor | None
    descriptors: torch.Tensor
    entropy: torch.Tensor
    kv: torch.Tensor
    offset: int
    patch_hashes: torch.Tensor | None = None

    @property
    def n_tokens(self) -> int:
        return self.kv.shape[0]

    @property
    def n_layers(self) -> int:
        return self.kv.shape[1]

    @property
    def nbytes(self) -> int:
        tensors = [self.embeds, self.descriptors, self.entropy, self.kv]
        tensors += [t for t in (self.deepstack, self.patch_hashes) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def features(self) -> ImageFeatures:
        return ImageFeatures(self.key, self.grid, self.embeds, self.entropy, self.patch_hashes)

    def check(self) -> None:
        """Raise if the entry is inconsistent with itself (a corrupt entry must never be used)."""
        n = self.kv.shape[0]
        if self.kv.ndim != 5 or self.kv.shape[2] != 2:
            raise ValueError(f"entry {self.key[:12]}: kv must be (N, L, 2, H, D), got {tuple(self.kv.shape)}")
        if self.embeds.shape[0] != n or self.entropy.shape[0] != n or self.descriptors.shape[0] != 4:
            raise ValueError(f"entry {self.key[:12]}: token counts disagree")
        if self.patch_hashes is not None and self.patch_hashes.shape != (n,):
            raise ValueError(f"entry {self.key[:12]}: patch hash count disagrees")
        if self.deepstack is not None and self.deepstack.shape[1] != n:
            raise ValueError(f"entry {self.key[:12]}: deepstack token count disagrees")


class DescriptorIndex:
    """In-memory coarse index: per (fingerprint, grid), a matrix of the four region descriptors."""

    def __init__(self) -> None:
        self._groups: dict[tuple, tuple[list[str], torch.Tensor]] = {}

    def add(self, fingerprint: str, grid, key: str, descriptors: torch.Tensor) -> None:
        group = (fingerprint, tuple(int(g) for g in grid))
        keys, mat = self._groups.get(group, ([], torch.empty(0, *descriptors.shape)))
        if key in keys:
            return
        self._groups[group] = (keys + [key], torch.cat([mat, descriptors.float().cpu()[None]]))

    def remove(self, fingerprint: str, grid, key: str) -> None:
        group = (fingerprint, tuple(int(g) for g in grid))
        keys, mat = self._groups.get(group, ([], None))
        if key not in keys:
            return
        i = keys.index(key)
        keys = keys[:i] + keys[i + 1 :]
        mat = torch.cat([mat[:i], mat[i + 1 :]])
        if keys:
            self._groups[group] = (keys, mat)
        else:
            del self._groups[group]

    def search(self, fingerprint: str, grid, descriptors: torch.Tensor, tau: float, top_k: int) -> list[tuple[str, float]]:
        """Keys whose four regional cosines all exceed ``tau``, best mean first, at most ``top_k``."""
        keys, mat = self._groups.get((fingerprint, tuple(int(g) for g in grid)), ([], None))
        if not keys or top_k <= 0:
            return []
        sims = (mat * descriptors.float().cpu()[None]).sum(-1)  # (n, 4): descriptors are unit norm
        ok = (sims > tau).all(-1)
        mean = sims.mean(-1).masked_fill(~ok, float("-inf"))
        k = min(top_k, int(ok.sum()))
        if k == 0:
            return []
        best = torch.topk(mean, k)
        return [(keys[i], float(v)) for v, i in zip(best.values.tolist(), best.indices.tolist())]

    def __len__(self) -> int:
        return sum(len(k) for k, _ in self._groups.values())


class VisMemoStore:
    """In-memory entry store with an optional byte budget (``device_bytes``; ``None`` = unbounded).

    Every read checks the model fingerprint: an entry of another model is never returned.
    """

    def __init__(self, device_bytes: int | None = None) -> None:
        if device_bytes is not None and device_bytes < 0:
            raise ValueError("device_bytes must be >= 0 or None")
        self.device_bytes = device_bytes
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._bytes = 0
        self._index = DescriptorIndex()
        self._lock = threading.RLock()
        self._stats = {
            "hits": {"exact": 0, "approximate": 0, "miss": 0},
            "puts": 0,
            "evictions": 0,
            "rejected": 0,
            "bytes_read_full": 0,
            "bytes_read_sparse": 0,
        }

    # -- writing -------------------------------------------------------------------------
    def put(self, entry: Entry) -> bool:
        """Store ``entry`` (evicting least recently used ones); False if it cannot fit or is malformed."""
        try:
            entry.check()
        except ValueError as err:
            logger.warning("vismemo: not storing a malformed entry: %s", err)
            self._stats["rejected"] += 1
            return False
        size = entry.nbytes
        with self._lock:
            if self.device_bytes is not None and size > self.device_bytes:
                self._stats["rejected"] += 1
                return False
            if entry.key in self._entries:
                self._drop(entry.key)
            while self.device_bytes is not None and self._bytes + size > self.device_bytes:
                self._drop(next(iter(self._entries)))
                self._stats["evictions"] += 1
            self._entries[entry.key] = entry
            self._bytes += size
            self._index.add(entry.fingerprint, entry.grid, entry.key, entry.descriptors)
            self._stats["puts"] += 1
        return True

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
        self._index.remove(entry.fingerprint, entry.grid, key)

    def clear(self) -> None:
        with self._lock:
            for key in list(self._entries):
                self._drop(key)

    # -- reading -------------------------------------------------------------------------
    def _lookup(self, key: str, fingerprint: str) -> Entry | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.fingerprint != fingerprint:
            logger.warning("vismemo: entry %s belongs to another model; ignored", key[:12])
            return None
        return entry

    def get(self, key: str, fingerprint: str) -> Entry | None:
        """Whole entry (an exact hit's full read); refreshes its recency."""
        with self._lock:
            entry = self._lookup(key, fingerprint)
            if entry is not None:
                self._entries.move_to_end(key)
                self._stats["bytes_read_full"] += entry.nbytes
            return entry

    def peek(self, key: str, fingerprint: str) -> Entry | None:
        """Entry metadata and encoder output for the fine lookup stage; no recency change, no K/V read."""
        with self._lock:
            return self._lookup(key, fingerprint)

    def get_tokens(self, key: str, fingerprint: str, tokens: torch.Tensor, first_layer: int) -> torch.Tensor | None:
        """K/V of ``tokens`` at layers >= ``first_layer``: (|tokens|, L - first_layer, 2, H, D). Sparse read."""
        with self._lock:
            entry = self._lookup(key, fingerprint)
            if entry is None:
                return None
            out = entry.kv[tokens.to(torch.long)][:, first_layer:]
            self._stats["bytes_read_sparse"] += out.numel() * out.element_size()
            return out

    def candidates(self, fingerprint: str, grid, descriptors: torch.Tensor, tau: float, top_k: int):
        """Coarse stage: (key, mean regional cosine) of same-grid entries passing all four regions."""
        with self._lock:
            return self._index.search(fingerprint, grid, descriptors, tau, top_k)

    # -- bookkeeping ---------------------------------------------------------------------
    def record(self, kind: str) -> None:
        with self._lock:
            self._stats["hits"][str(kind)] += 1

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict:
        with self._lock:
            return {
                **{k: (dict(v) if isinstance(v, dict) else v) for k, v in self._stats.items()},
                "entries": len(self._entries),
                "bytes": self._bytes,
                "tiers": {"device": {"bytes": self._bytes, "budget": self.device_bytes, "entries": len(self._entries)}},
            }


_DEFAULT: VisMemoStore | None = None


def default_store() -> VisMemoStore:
    """The process-wide store used by ``VisMemoCache(store=None)``."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = VisMemoStore()
    return _DEFAULT

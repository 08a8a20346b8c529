"""What the store knows about the entries it serves, wherever their bytes are: the model and grid of every key, the
coarse descriptor index over them, and per model its lookup reference and calibrated thresholds."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vismemo_hf.core.thresholds import LookupThresholds, ModelReference
from vismemo_hf.store.index import DescriptorIndex
from vismemo_hf.store.pixels import PixelIndex


class Catalog:
    """Keys (with their model and grid), their descriptors indexed per (model, grid), models' references and
    thresholds. The tiers hold bytes; the catalog says what exists."""

    def __init__(self, thresholds=None) -> None:
        self.where: dict[str, tuple[str, tuple]] = {}  # key -> (fingerprint, grid)
        self.index = DescriptorIndex()
        self.pixels = PixelIndex()  # the pixel-first index: what this process stored or looked at
        #: entries whose token pixel hashes are indexed when a pixel-first lookup first needs them (key -> what
        #: computes them): a miss's request never hashes its image's tokens for an index nobody may read
        self._pixels_later: dict[str, Callable[[], torch.Tensor | None]] = {}
        self._references: dict[str, ModelReference] = {}
        self._thresholds: dict[str, LookupThresholds] = {}
        for preset in [thresholds] if isinstance(thresholds, str) else (thresholds or []):
            self.add_thresholds(preset)

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def __len__(self) -> int:
        return len(self.where)

    def fingerprint_of(self, key: str) -> str | None:
        known = self.where.get(key)
        return None if known is None else known[0]

    def add(self, key: str, fingerprint: str, grid, descriptors: torch.Tensor) -> None:
        if key not in self.where:
            self.where[key] = (fingerprint, tuple(grid))
            self.index.add(fingerprint, tuple(grid), key, descriptors)

    def remove(self, key: str) -> None:
        known = self.where.pop(key, None)
        if known is not None:
            self.index.remove(known[0], known[1], key)
        self.pixels.remove(key)
        self._pixels_later.pop(key, None)

    def add_pixels(self, key: str, hashes: torch.Tensor | Callable[[], torch.Tensor | None] | None) -> None:
        """Index a cataloged entry's token pixel hashes for the pixel-first lookup (``store.pixels``); ``hashes``
        may be what computes them, called when a pixel-first lookup first reads the index (``pixel_index``)."""
        known = self.where.get(key)
        if known is None or hashes is None or key in self.pixels:
            return
        if callable(hashes):
            self._pixels_later[key] = hashes
        else:
            self._pixels_later.pop(key, None)
            self.pixels.add(key, known[0], known[1], hashes)

    def indexes_pixels(self, key: str) -> bool:
        """Whether ``key``'s pixel hashes are indexed, or will be at the next pixel-first lookup."""
        return key in self.pixels or key in self._pixels_later

    def knows_pixels(self, fingerprint: str, grid) -> bool:
        """Whether any entry of this model and grid is (or is about to be) in the pixel-first index."""
        group = (fingerprint, tuple(grid))
        return self.pixels.knows(fingerprint, grid) or any(self.where.get(k) == group for k in self._pixels_later)

    def pixel_index(self) -> PixelIndex:
        """The pixel-first index, every entry whose hashes were left for later indexed first."""
        while self._pixels_later:
            key, hashes = self._pixels_later.popitem()
            known = self.where.get(key)
            computed = hashes()
            if known is not None and computed is not None:
                self.pixels.add(key, known[0], known[1], computed)
        return self.pixels

    def candidates(self, fingerprint: str, grid, descriptors: torch.Tensor, tau: float, top_k: int):
        return self.index.search(fingerprint, grid, descriptors, tau, top_k)

    def reference(self, fingerprint: str) -> ModelReference | None:
        return self._references.get(fingerprint)

    def set_reference(self, fingerprint: str, reference: ModelReference) -> None:
        """The first registration of a model stays (every process computes the same one); its entries waiting
        for it are indexed now."""
        if fingerprint not in self._references:
            self._references[fingerprint] = reference
            self.index.set_center(fingerprint, reference.descriptor_mean)

    def add_thresholds(self, preset) -> None:
        loaded = preset if isinstance(preset, LookupThresholds) else LookupThresholds.load(preset)
        if loaded.fingerprint is None:
            raise ValueError(f"lookup thresholds {preset!r} name no model fingerprint: write them with vismemo calibrate")
        self._thresholds[loaded.fingerprint] = loaded

    def thresholds_for(self, fingerprint: str) -> LookupThresholds | None:
        return self._thresholds.get(fingerprint)

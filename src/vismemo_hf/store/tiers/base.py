"""What the store asks of a tier (``Tier``), and what the RAM tiers share (``_Local``)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol, runtime_checkable

import torch

from vismemo_hf.store import blob
from vismemo_hf.store.entry import Entry


@runtime_checkable
class Tier(Protocol):
    """What the store asks of a tier. ``lru``: its keys, least recently used first (values are the tier's own);
    ``shared``: other processes see it too (a read never removes from it). ``put`` / ``pop`` take and give the
    item in the tier's own form (a decoded ``Entry`` for the device tier, blob bytes for the others). ``identity``:
    the (key, model fingerprint) the stored bytes name (None: only the read itself can tell), checked before a read
    is used, so that bytes stored under another key or of another model are never served."""

    name: str
    budget: int | None
    bytes: int
    shared: bool

    @property
    def lru(self) -> OrderedDict: ...
    def __contains__(self, key: str) -> bool: ...
    def sizeof(self, item) -> int: ...
    def put(self, key: str, item) -> None: ...
    def pop(self, key: str): ...
    def discard(self, key: str) -> None: ...
    def touch(self, key: str) -> None: ...
    def identity(self, key: str) -> tuple[str, str] | None: ...
    def full(self, key: str) -> Entry: ...
    def meta(self, key: str) -> Entry: ...
    def lookup(self, key: str) -> blob.LookupSection: ...
    def tokens(self, key: str, tokens: torch.Tensor, first_layer: int) -> tuple[torch.Tensor, int]: ...
    def stats(self) -> dict: ...


class _Local:
    """What the RAM tiers share: an ``lru`` mapping, touch, discard and stats."""

    shared = False
    lru: OrderedDict

    def __contains__(self, key: str) -> bool:
        return key in self.lru

    def touch(self, key: str) -> None:
        self.lru.move_to_end(key)

    def discard(self, key: str) -> None:
        if key in self.lru:
            self.pop(key)

    def stats(self) -> dict:
        return {"bytes": self.bytes, "budget": self.budget, "entries": len(self.lru)}

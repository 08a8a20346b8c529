"""What the store asks of a tier (``Tier``), and the answers most tiers give alike (``TierBase``).

``VisMemoStore`` and ``Placement`` hold an ordered chain of tiers (``tiers.chain``) and use each one only through
``Tier``: what it holds, how entries come into it, whether other processes see it, and a few hooks (background
writes, what it learnt since the last look, counters of its own), never which object or class it is.
"""

from __future__ import annotations

import builtins
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Final, Literal, Protocol, runtime_checkable

import torch

from vismemo_hf.store import blob
from vismemo_hf.store.entry import Entry
from vismemo_hf.store.faults import StoreFault

#: what ``put`` / ``pop`` of a tier take and give: a decoded ``Entry`` (K/V where the model runs) or blob bytes
ENTRY: Final = "entry"
BYTES: Final = "bytes"
Holds = Literal["entry", "bytes"]
#: how entries come into a tier:
#: ``FITS``: a put lands in the first such tier with room, and an entry a faster tier gives up lands in it when it
#: fits after room is made; a full read from a slower tier is promoted to the first such tier holding entries.
#: ``RANKED``: only entries the tier above gives up, ranked by prior + reuse (the host tier's victim share).
#: ``COPY``: write-through copies, written in the background: a put writes one (always with ``write_through``, else
#: when no faster tier took it) and a demotion writes one unless the tier holds it already; an entry evicted from it
#: is gone.
#: ``PUBLISH``: every put is published to it in the background; what it holds is managed by whoever runs it (never
#: evicted, demoted into or cleared by this store).
FITS: Final = "fits"
RANKED: Final = "ranked"
COPY: Final = "copy"
PUBLISH: Final = "publish"
Admits = Literal["fits", "ranked", "copy", "publish"]

#: one catalog record of what a tier holds: (key, model fingerprint, grid, (4, dim) region descriptors)
News = tuple[str, str, tuple[int, int, int], torch.Tensor]


class TierUnavailable(StoreFault, RuntimeError):
    """A tier could not answer now (its server, not the entry: the entry is kept, the read is a miss)."""


@runtime_checkable
class Tier(Protocol):
    """What the store asks of a tier.

    ``name``: its name in ``stats()`` and ``tier_of`` (tiers may share one: the devices, the host tier and its victim
    share); ``budget``: bytes it may hold (None: unbounded); ``bytes``: bytes it holds; ``lru``: its keys, least
    recently used first (values are the tier's own); ``holds``: ``ENTRY`` or ``BYTES``, the form ``put`` takes and
    ``pop`` gives; ``admits``: ``FITS``, ``RANKED``, ``COPY`` or ``PUBLISH`` (how entries come in, see there);
    ``shared``: other processes see it too (a read never takes an entry out of it); ``holds_unseen``: it may hold keys
    this process has not seen (others publish to it), so a full read of a key no tier knows asks it when it is
    ``available``; ``read_only``: this process writes nothing to it now.

    Reads: ``identity`` is the (key, model fingerprint) the stored bytes name (None: only the read itself can tell),
    checked before a read is used, so that bytes stored under another key or of another model are never served;
    ``full`` / ``meta`` / ``lookup`` / ``tokens`` raise ``KeyError`` when the tier does not hold the key after all
    (then ``missing``), ``TierUnavailable`` when it cannot answer now, anything else when the bytes are bad.

    Hooks (``TierBase``: no-ops): ``write_async`` (a ``COPY`` tier's background write) and ``publish`` (a
    ``PUBLISH`` tier's), ``pending`` (a write of the key is queued), ``flush`` (wait for them), ``take_failures``
    / ``take_lost`` (keys whose background write failed / that the tier lost, to forget), ``forget`` (stop counting a
    key, its bytes left as they are), ``leave`` (stop counting a key whose blob another trust domain sealed, its
    bytes and any record of it left as they are), ``news`` (catalog records of what it holds that the store has
    not been told: at the first call what it held when opened, later what others published since), ``counts``
    (store-wide counters it adds to ``stats()``), ``add_stats`` (its part in the stats of the tiers of its name),
    ``close``.
    """

    name: str
    budget: int | None
    bytes: int
    shared: bool
    holds_unseen: bool

    @property
    def holds(self) -> Holds: ...
    @property
    def admits(self) -> Admits: ...
    @property
    def read_only(self) -> bool: ...
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
    def available(self) -> bool: ...
    def missing(self, key: str) -> None: ...
    def forget(self, key: str) -> None: ...
    def leave(self, key: str) -> None: ...
    def write_async(self, key: str, data: builtins.bytes) -> None: ...
    def publish(self, key: str, encode: Callable[[], builtins.bytes], descriptors: torch.Tensor) -> None: ...
    def pending(self, key: str) -> bool: ...
    def flush(self) -> None: ...
    def take_failures(self) -> list[str]: ...
    def take_lost(self) -> list[str]: ...
    def news(self, unusable: Callable[[str, Exception], None]) -> Iterable[News]: ...
    def counts(self) -> dict[str, int]: ...
    def add_stats(self, group: dict, own: dict) -> None: ...
    def close(self) -> None: ...


class TierBase:
    """The answers most tiers give alike: an ``lru`` mapping with membership, touch and discard, stats of bytes,
    budget and entries, and every hook a no-op. A tier overrides what it does differently."""

    name: str
    budget: int | None
    bytes: int
    lru: OrderedDict
    holds: Holds = BYTES
    admits: Admits = FITS
    shared = False
    holds_unseen = False
    #: each tier's own (``Tier.put`` / ``Tier.pop``), the item in the form it ``holds``
    put: Callable[[str, Any], None]
    pop: Callable[[str], Any]

    @property
    def read_only(self) -> bool:
        return False

    def __contains__(self, key: str) -> bool:
        return key in self.lru

    def __str__(self) -> str:
        return f"{self.name} tier"

    def sizeof(self, item) -> int:
        """Bytes ``item`` (in the tier's own form, ``put``'s) takes here: a blob's length."""
        return len(item)

    def touch(self, key: str) -> None:
        self.lru.move_to_end(key)

    def discard(self, key: str) -> None:
        if key in self.lru:
            self.pop(key)

    def stats(self) -> dict:
        return {"bytes": self.bytes, "budget": self.budget, "entries": len(self.lru)}

    def available(self) -> bool:
        return True

    def missing(self, key: str) -> None:
        """A read found no ``key`` here (deleted by another process, evicted by a server): stop counting it."""
        self.discard(key)

    def forget(self, key: str) -> None:
        """Stop counting ``key``, its bytes left as they are (a tier whose bytes are its own: discard them)."""
        self.discard(key)

    def leave(self, key: str) -> None:
        """Stop counting ``key``, leaving its bytes and records to whoever sealed them (a shared tier)."""
        self.forget(key)

    def write_async(self, key: str, data: builtins.bytes) -> None:
        self.put(key, data)

    def publish(self, key: str, encode: Callable[[], builtins.bytes], descriptors: torch.Tensor) -> None:
        self.put(key, encode())

    def pending(self, key: str) -> bool:
        return False

    def flush(self) -> None:
        pass

    def take_failures(self) -> list[str]:
        return []

    def take_lost(self) -> list[str]:
        return []

    def news(self, unusable: Callable[[str, Exception], None]) -> Iterable[News]:
        return ()

    def counts(self) -> dict[str, int]:
        return {}

    def add_stats(self, group: dict, own: dict) -> None:
        """Add what ``group`` (the summed stats of the tiers named ``name``) should show of this tier; a tier alone
        under its name has shown all of ``own`` already."""

    def close(self) -> None:
        pass


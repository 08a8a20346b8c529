"""Where entries go: the chain of local tiers (fastest first), what a full tier gives up (``ExactPriorityLRU``)
and where that goes (one tier down, if that tier takes it; the disk tier holds write-through copies, written in
the background), and forgetting an entry no tier holds any more."""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager

from vismemo_hf.store import blob
from vismemo_hf.store.catalog import Catalog
from vismemo_hf.store.entry import Entry
from vismemo_hf.store.eviction import ExactPriorityLRU

logger = logging.getLogger(__name__)


class Placement:
    def __init__(self, chain: list, remote, catalog: Catalog, eviction: ExactPriorityLRU, stats: dict,
                 kv_format: str | None, priors: dict, seal=None) -> None:
        self.chain, self.remote, self.catalog, self.eviction, self.stats = chain, remote, catalog, eviction, stats
        self.devices = [t for t in chain if t.name == "device"]  # one per device, each with its own budget
        k = len(self.devices)
        self.host, self.victim = chain[k], chain[k + 1]
        self.disk = chain[k + 2] if len(chain) > k + 2 else None
        self.kv_format, self.priors, self.seal = kv_format, priors, seal
        self.reuse: dict[str, int] = {}
        self.moving: set[str] = set()  # keys between two tiers during a demotion
        self.lock = threading.RLock()

    def tier_of(self, key: str):
        """The fastest tier holding ``key`` (the remote tier last), or None."""
        for tier in self.chain:
            if key in tier:
                return tier
        return self.remote if self.remote is not None and key in self.remote else None

    def used(self, key: str) -> None:
        """An access that counts for the victim share's ranking."""
        self.reuse[key] = self.reuse.get(key, 0) + 1

    def place(self, tier, key, item, size: int) -> bool:
        if tier.budget == 0 or (tier.budget is not None and size > tier.budget):
            return False
        self.make_room(tier, size)
        tier.put(key, item)
        return True

    def place_on_device(self, key: str, entry: Entry) -> bool:
        """On the first device tier with room for it (each device has its own budget)."""
        return any(self.place(tier, key, entry, tier.sizeof(entry)) for tier in self.devices)

    def make_room(self, tier, size: int) -> None:
        while tier.budget is not None and tier.bytes + size > tier.budget and tier.lru:
            self.evict(tier, self.eviction.victim(tier.lru))

    def evict(self, tier, key: str) -> None:
        """Move ``key`` one tier down the chain if that tier takes it (the disk tier already holds it), or out."""
        self.stats["evictions"] += 1
        item = tier.pop(key)
        if tier is self.disk:  # the last tier: gone
            self.forget_if_gone(key)
            return
        at = self.chain.index(tier)
        lower = self.chain[at + 1] if at + 1 < len(self.chain) else None
        to_device = lower in self.devices  # device tiers hold entries, the others blobs
        data = self.encode(item) if isinstance(item, Entry) and not to_device else item
        if lower is not None and lower is not self.disk:
            with self.in_transit(key):  # making room below may evict its write-through copy: not a reason to forget it
                admitted = self.admit(lower, key, lower.sizeof(data))
                if admitted:
                    lower.put(key, data)
            if admitted:
                self.stats["demotions"] += 1
                return
        self.to_disk_or_drop(key, self.encode(data) if isinstance(data, Entry) else data)

    def admit(self, tier, key: str, size: int) -> bool:
        """Whether ``tier`` takes an entry moving down: the host tier takes any that fits; the victim share keeps the
        entries with the best prior + reuse score, pushing lower-scored ones down."""
        if tier is not self.victim:
            return self.fits_after_room(tier, size)
        if not self.victim.budget or size > self.victim.budget or self.score(key) <= 0:
            return False
        while self.victim.bytes + size > self.victim.budget:
            weakest = min(self.victim.lru, key=self.score)
            if self.score(weakest) >= self.score(key):
                return False
            self.to_disk_or_drop(weakest, self.victim.pop(weakest))
        return True

    def fits_after_room(self, tier, size: int) -> bool:
        if tier.budget == 0 or (tier.budget is not None and size > tier.budget):
            return False
        self.make_room(tier, size)
        return True

    def score(self, key: str) -> float:
        return self.priors.get(key, 0.0) + self.reuse.get(key, 0)

    def to_disk_or_drop(self, key: str, data: bytes) -> None:
        if self.disk is not None and (key in self.disk or self.write_disk(key, data)):
            self.stats["demotions"] += 1
            return
        self.forget_if_gone(key)

    def write_disk(self, key: str, data: bytes) -> bool:
        if key in self.disk:
            return True
        if self.disk.read_only:
            self.stats["writes_read_only"] += 1
            return False
        if self.disk.budget == 0 or (self.disk.budget is not None and len(data) > self.disk.budget):
            return False
        self.make_room(self.disk, len(data))
        self.disk.write_async(key, data)  # counted as held now; the write itself runs in the background
        return True

    def settle_writes(self) -> None:
        """Forget the disk entries whose background write failed."""
        if self.disk is None:
            return
        for key in self.disk.take_failures():
            with self.lock:
                self.stats["write_failures"] += 1
                if key in self.disk:
                    self.disk.forget(key)  # the directory keeps what it held (another process's blob of it)
                self.forget_if_gone(key)
        for key in self.disk.take_lost():  # the index was opened again without it: a miss from now on
            with self.lock:
                if key in self.disk:
                    self.disk.forget(key)
                self.forget_if_gone(key)

    @contextmanager
    def in_transit(self, key: str):
        """While ``key`` moves between tiers it is in none; it must not be forgotten meanwhile."""
        self.moving.add(key)
        try:
            yield
        finally:
            self.moving.discard(key)

    def forget_if_gone(self, key: str) -> None:
        if key not in self.moving and self.tier_of(key) is None:
            self.catalog.remove(key)
            self.eviction.forget(key)

    def corrupt(self, tier, key: str, err: Exception) -> None:
        """A blob that failed its checks (corrupt, foreign, or ``forged``: no valid MAC): removed, counted."""
        logger.warning("vismemo: %s blob %s unusable (%s: %s); removed", tier.name, key[:12], type(err).__name__, err)
        self.stats["forged" if isinstance(err, blob.ForgedBlob) else "corrupt"] += 1
        tier.discard(key)
        self.forget_if_gone(key)

    def encode(self, entry: Entry) -> bytes:
        return blob.encode(entry, self.kv_format, self.seal)

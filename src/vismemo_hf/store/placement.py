"""Where entries go, over the chain of tiers (fastest first, ``tiers.chain``), each asked what it is (``Tier``):
a put lands in the first tier that takes puts with room (``FITS``), through to the tiers of write-through copies
(``COPY``, written in the background) and published to the ``PUBLISH`` tiers; what a full tier gives up is chosen
by ``ExactPriorityLRU`` and goes one tier down if that tier takes it (``FITS``: when it fits after room is made;
``RANKED``: by prior + reuse score), else to a copy tier (which may hold it already), else out; and an entry no tier
holds any more is forgotten."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import contextmanager

from vismemo_hf.store import blob
from vismemo_hf.store.catalog import Catalog
from vismemo_hf.store.entry import Entry
from vismemo_hf.store.eviction import ExactPriorityLRU
from vismemo_hf.store.tiers import COPY, ENTRY, FITS, PUBLISH, RANKED, Tier

logger = logging.getLogger(__name__)


class Placement:
    def __init__(self, tiers: list[Tier], catalog: Catalog, eviction: ExactPriorityLRU, stats: dict,
                 kv_format: str | None, priors: dict, seal=None) -> None:
        self.tiers, self.catalog, self.eviction, self.stats = tiers, catalog, eviction, stats
        self.kv_format, self.priors, self.seal = kv_format, priors, seal
        self.reuse: dict[str, int] = {}
        self.moving: set[str] = set()  # keys between two tiers during a demotion
        self.lock = threading.RLock()

    def admitting(self, *how: str) -> list[Tier]:
        """The tiers whose entries come in as ``how`` says (``FITS``, ``RANKED``, ``COPY``, ``PUBLISH``), in order."""
        return [t for t in self.tiers if t.admits in how]

    def tier_of(self, key: str) -> Tier | None:
        """The fastest tier holding ``key``, or None."""
        return next((tier for tier in self.tiers if key in tier), None)

    def below(self, tier: Tier) -> Tier | None:
        at = self.tiers.index(tier)
        return self.tiers[at + 1] if at + 1 < len(self.tiers) else None

    def used(self, key: str) -> None:
        """An access that counts for the victim share's ranking."""
        self.reuse[key] = self.reuse.get(key, 0) + 1

    def place(self, tier: Tier, key: str, item, size: int) -> bool:
        if tier.budget == 0 or (tier.budget is not None and size > tier.budget):
            return False
        self.make_room(tier, size)
        tier.put(key, item)
        return True

    def place_first(self, key: str, entry: Entry, data: Callable[[], bytes] | None = None) -> bool:
        """On the first tier that takes puts with room for it: the entry itself where a tier holds entries, its blob
        (``data()``, made when first needed) elsewhere; without ``data`` only tiers holding entries (a promotion)."""
        for tier in self.admitting(FITS):
            item: Entry | bytes
            if tier.holds == ENTRY:
                item = entry
            elif data is not None:
                item = data()
            else:
                continue
            if self.place(tier, key, item, tier.sizeof(item)):
                return True
        return False

    def write_through(self, key: str, data: Callable[[], bytes]) -> bool:
        """A copy in every ``COPY`` tier (in the background); whether one holds or takes it."""
        return any([self.write_copy(tier, key, data()) for tier in self.admitting(COPY)])

    def publish(self, key: str, entry: Entry, data: Callable[[], bytes], encoded: bool) -> bool:
        """Publish to every ``PUBLISH`` tier in the background (the blob made there unless ``encoded`` already);
        whether there is one."""
        tiers = self.admitting(PUBLISH)
        for tier in tiers:
            tier.publish(key, data if encoded else (lambda: self.encode(entry)), entry.descriptors)
        return bool(tiers)

    def make_room(self, tier: Tier, size: int) -> None:
        while tier.budget is not None and tier.bytes + size > tier.budget and tier.lru:
            self.evict(tier, self.eviction.victim(tier.lru))

    def evict(self, tier: Tier, key: str) -> None:
        """Move ``key`` one tier down the chain if that tier takes it, else to a copy tier (which may hold it
        already), or out; out of a copy tier it is gone."""
        self.stats["evictions"] += 1
        item = tier.pop(key)
        if tier.admits == COPY:
            self.forget_if_gone(key)
            return
        lower = self.below(tier)
        if lower is not None and lower.admits in (FITS, RANKED):
            data = self.encode(item) if isinstance(item, Entry) and lower.holds != ENTRY else item
            with self.in_transit(key):  # making room below may evict its write-through copy: not a reason to forget it
                admitted = self.admit(lower, key, lower.sizeof(data))
                if admitted:
                    lower.put(key, data)
            if admitted:
                self.stats["demotions"] += 1
                return
            item = data
        self.to_copy_or_drop(key, self.encode(item) if isinstance(item, Entry) else item)

    def admit(self, tier: Tier, key: str, size: int) -> bool:
        """Whether ``tier`` takes an entry moving down: a ``FITS`` tier any that fits; a ``RANKED`` one keeps the
        entries with the best prior + reuse score, pushing lower-scored ones down."""
        if tier.admits != RANKED:
            return self.fits_after_room(tier, size)
        if not tier.budget or size > tier.budget or self.score(key) <= 0:
            return False
        while tier.bytes + size > tier.budget:
            weakest = min(tier.lru, key=self.score)
            if self.score(weakest) >= self.score(key):
                return False
            item = tier.pop(weakest)
            self.to_copy_or_drop(weakest, self.encode(item) if isinstance(item, Entry) else item)
        return True

    def fits_after_room(self, tier: Tier, size: int) -> bool:
        if tier.budget == 0 or (tier.budget is not None and size > tier.budget):
            return False
        self.make_room(tier, size)
        return True

    def score(self, key: str) -> float:
        return self.priors.get(key, 0.0) + self.reuse.get(key, 0)

    def to_copy_or_drop(self, key: str, data: bytes) -> None:
        """An entry leaving the tiers that hold it in their own right: kept where a copy tier holds it or takes it."""
        if any(key in tier or self.write_copy(tier, key, data) for tier in self.admitting(COPY)):
            self.stats["demotions"] += 1
            return
        self.forget_if_gone(key)

    def write_copy(self, tier: Tier, key: str, data: bytes) -> bool:
        if key in tier:
            return True
        if tier.read_only:
            self.stats["writes_read_only"] += 1
            return False
        if tier.budget == 0 or (tier.budget is not None and len(data) > tier.budget):
            return False
        self.make_room(tier, len(data))
        tier.write_async(key, data)  # counted as held now; the write itself runs in the background
        return True

    def settle_writes(self) -> None:
        """Forget the entries whose background write failed, and those a tier lost (a miss from now on)."""
        for tier in self.tiers:
            for key in tier.take_failures():
                with self.lock:
                    self.stats["write_failures"] += 1
                    if key in tier:
                        tier.forget(key)  # what the tier keeps under the key (another process's blob) is not ours
                    self.forget_if_gone(key)
            for key in tier.take_lost():  # e.g. an index opened again without it
                with self.lock:
                    if key in tier:
                        tier.forget(key)
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

    def corrupt(self, tier: Tier, key: str, err: Exception) -> None:
        """A blob that failed its checks (corrupt, foreign, or ``forged``: no valid MAC): removed, counted. In a
        shared tier a blob whose header this store cannot verify (``blob.ForeignSeal``: another secret's, or none)
        is refused and left in place: one process started with another secret must not empty a shared directory."""
        if tier.shared and isinstance(err, blob.ForeignSeal):
            logger.warning("vismemo: %s blob %s refused (%s: %s); left in place", tier.name, key[:12],
                           type(err).__name__, err)
            self.stats["forged"] += 1
            tier.leave(key)
            self.forget_if_gone(key)
            return
        logger.warning("vismemo: %s blob %s unusable (%s: %s); removed", tier.name, key[:12], type(err).__name__, err)
        self.stats["forged" if isinstance(err, blob.ForgedBlob) else "corrupt"] += 1
        tier.discard(key)
        self.forget_if_gone(key)

    def encode(self, entry: Entry) -> bytes:
        return blob.encode(entry, self.kv_format, self.seal)

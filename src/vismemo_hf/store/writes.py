"""The store's writes off the requests' path: entries built and put on its writer thread, announced to its index
at once, completed before the process exits (``store.background.Writer``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from vismemo_hf.store.background import Announced
from vismemo_hf.store.entry import Entry
from vismemo_hf.store.faults import store_call

if TYPE_CHECKING:
    from vismemo_hf.store.background import Writer
    from vismemo_hf.store.catalog import Catalog
    from vismemo_hf.store.placement import Placement
    from vismemo_hf.store.tiers import Tier


class PendingWrites:
    """What ``VisMemoStore`` does with entries it is still writing (it provides the attributes declared here)."""

    writer: Writer
    completer: Writer
    placement: Placement
    catalog: Catalog
    tiers: list[Tier]
    _lock: threading.RLock
    put: Callable[[Entry, torch.Tensor | None], bool]

    def put_later(self, build: Callable[[], tuple[Entry, torch.Tensor | None] | None],
                  announced: Announced | None = None) -> None:
        """Build an entry with ``build()`` (-> (entry, importance) or None) and ``put`` it on the store's writer
        thread, off the request's critical path. ``announced``: what the lookup needs of it, indexed at once (the
        next request finds it; a read of its bytes waits for this write alone); else it is found once written."""
        key = announced.key if announced is not None else None
        if announced is not None and key is not None:
            with self._lock:
                if self.placement.tier_of(key) is not None or self.writer.pending(key):
                    return
                self.placement.moving.add(key)  # in transit to its first tier: never forgotten meanwhile
                self._announced()[key] = announced
                self.catalog.add(key, announced.fingerprint, announced.grid, announced.descriptors)
                self.catalog.add_pixels(key, announced.patch_hashes)

        def run():
            placed = False
            if announced is not None and callable(announced.patch_hashes):
                hashes = store_call("index", announced.patch_hashes, None)  # off the request's path, outside the lock
                with self._lock:  # indexed now, unless a pixel-first lookup needed them first
                    self.catalog.add_pixels(announced.key, hashes)
            try:
                built = store_call("build", build, None)
                if built is not None:
                    placed = bool(store_call("write", lambda: self.put(*built), False))
            finally:
                if key is not None:
                    with self._lock:
                        self._announced().pop(key, None)
                        self.placement.moving.discard(key)
                        if not placed:  # not written: no longer announced. A placed entry stays indexed even
                            # while a remote tier's own write of it is still in flight (``settle_writes``
                            # forgets it if that write fails)
                            self.placement.forget_if_gone(key)

        self.writer.submit(run, key)

    def _announced(self) -> dict[str, Announced]:
        """The announcements of the writes still pending, by key (under ``_lock``)."""
        return self.__dict__.setdefault("_pending_announced", {})

    def pending_image(self, key: str) -> Announced | None:
        """The announcement of ``key`` while its entry is still being written (None once written, or never
        announced): what a request may take from it without waiting for the write."""
        with self._lock:
            return self._announced().get(key)

    def put_when_idle(self, build: Callable[[], tuple[Entry, torch.Tensor | None] | None]) -> None:
        """Build an entry with ``build()`` and ``put`` it on a thread of its own, behind no announced write: for
        entries nobody waits for (an approximate hit's image completed in full), whose build is a forward."""
        self.completer.submit(lambda: self._build_and_put(build))

    def _build_and_put(self, build) -> None:
        built = store_call("build", build, None)
        if built is not None:
            store_call("write", lambda: self.put(*built), None)

    def _wait_for(self, key: str) -> None:
        """Wait for the pending write of ``key`` (never called with the lock held)."""
        if self.writer.pending(key):
            self.writer.wait_for(key)

    def _drain(self) -> None:
        """Wait for every entry ``put_later`` and ``put_when_idle`` are still building (never with the lock held)."""
        self.writer.drain()
        self.completer.drain()

    def _flush_tiers(self) -> None:
        for tier in self.tiers:
            tier.flush()
        self.placement.settle_writes()

    def flush(self) -> None:
        """Wait for entries being built and for the tiers' background writes (disk, remote)."""
        self._drain()
        self._flush_tiers()

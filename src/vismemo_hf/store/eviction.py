"""Which entry a full tier gives up: exact-priority LRU (docs/METHOD.md §5). The least recently used entry goes first,
except that an entry that served an exact hit gets ``protect`` second chances: it moves to the most recently used
end instead, one chance spent each time. Where an evicted entry goes is the store's business (the next tier)."""

from __future__ import annotations

from collections import OrderedDict


class ExactPriorityLRU:
    def __init__(self, protect: int = 2) -> None:
        self.protect = protect
        self._chances: dict[str, int] = {}

    def exact_hit(self, key: str) -> None:
        self._chances[key] = self.protect

    def forget(self, key: str) -> None:
        self._chances.pop(key, None)

    def victim(self, lru: OrderedDict) -> str:
        """The key to evict from a tier whose recency order is ``lru`` (least recent first; must not be empty)."""
        while True:
            key = next(iter(lru))
            if self._chances.get(key, 0) <= 0:
                return key
            self._chances[key] -= 1
            lru.move_to_end(key)

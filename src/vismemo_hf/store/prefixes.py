"""Prefix blocks: the K/V of a request's leading tokens, kept so that a later request that starts with the same
tokens (a chat re-sending its history, a second question about the same page) reuses them whole and computes only
the rest (docs/METHOD.md §9).

A request's tokens are cut into blocks of ``BLOCK`` tokens; block i is named by a chain hash of the model (and
namespace), every token id up to the end of block i and the exact key of every image whose placeholders lie in
those tokens (vLLM's block keys: an image is part of the hash, not only its placeholder ids). Two requests share a
block exactly when everything before the block's end is the same, so a block's K/V are the K/V a full prefill of
the new request computes there. Blocks are stored once, however many requests share them.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from vismemo_hf.store.background import ACTIVITY

#: tokens per block
BLOCK = 32


def block_hashes(owner: str, ids: Sequence[int], images: Sequence[tuple[int, int, str]]) -> list[str]:
    """The chain hash of each whole block of ``ids`` (one row's real token ids); ``images``: (first column, token
    count, exact key) of every image (or video) of the row, in column order."""
    out = []
    h = hashlib.blake2b(owner.encode(), digest_size=16, person=b"vm-prefix")
    at = 0
    ids = list(ids)
    for b in range(len(ids) // BLOCK):
        end = (b + 1) * BLOCK
        h.update(torch.tensor(ids[b * BLOCK:end], dtype=torch.int64).numpy().tobytes())
        while at < len(images) and images[at][0] < end:  # an image that starts in this block names it
            h.update(f"|{images[at][0]}:{images[at][1]}:{images[at][2]}".encode())
            at += 1
        out.append(h.copy().hexdigest())
    return out


class PrefixBlocks:
    """Blocks' K/V in host memory within a byte budget, least recently used out first. Each block holds
    (layers, 2, KV heads, BLOCK, head dim) in the model's dtype. Thread-safe; writes come from the store's writer
    thread, reads from the requests'."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self._blocks: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._pending: dict[str, Future] = {}  # blocks being written: held for ``longest``, waited for by ``read``
        self.reused_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def longest(self, hashes: Sequence[str]) -> int:
        """How many of ``hashes``, from the first on, are held."""
        with self._lock:
            n = 0
            for h in hashes:
                if h not in self._blocks and h not in self._pending:
                    break
                n += 1
            return n

    def announce(self, hashes: Sequence[str], write: Future) -> None:
        """``write`` (a job on the store's writer thread) is adding ``hashes``: they count as held meanwhile."""
        with self._lock:
            for h in hashes:
                self._pending.setdefault(h, write)
        write.add_done_callback(lambda _: self._written(hashes, write))

    def _written(self, hashes: Sequence[str], write: Future) -> None:
        with self._lock:
            for h in hashes:
                if self._pending.get(h) is write:
                    del self._pending[h]

    def read(self, hashes: Sequence[str]) -> list[torch.Tensor] | None:
        """The blocks of ``hashes`` (each refreshed; a block being written is waited for), or None when one is gone
        meanwhile."""
        with self._lock:
            writes = {id(f): f for h in hashes if (f := self._pending.get(h)) is not None}
        ACTIVITY.wait_on(list(writes.values()), None)
        with self._lock:
            out = []
            for h in hashes:
                block = self._blocks.get(h)
                if block is None:
                    return None
                self._blocks.move_to_end(h)
                out.append(block)
            self.reused_blocks += len(out)
            return out

    def add(self, hashes: Sequence[str], blocks: Sequence[torch.Tensor]) -> None:
        """Keep ``blocks`` under ``hashes`` (a held one is only refreshed); older blocks leave for the budget."""
        with self._lock:
            for h, block in zip(hashes, blocks):
                if h in self._blocks:
                    self._blocks.move_to_end(h)
                    continue
                size = block.numel() * block.element_size()
                if self.budget is not None and size > self.budget:
                    continue
                self._blocks[h] = block
                self._bytes += size
                while self.budget is not None and self._bytes > self.budget:
                    _, old = self._blocks.popitem(last=False)
                    self._bytes -= old.numel() * old.element_size()

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._bytes = 0

"""Prefix blocks: the K/V of a request's leading tokens, kept so that a later request that starts with the same
tokens (a chat re-sending its history, a second question about the same page) reuses them whole and computes only
the rest (docs/METHOD.md §9).

A request's tokens are cut into blocks at every multiple of ``BLOCK`` tokens and at the end of every image
(``block_ends``: a second question about a page shares everything up to the page's end, rarely a whole block after
it); block i is named by a chain hash of the model (and namespace), every token id up to the end of block i and the
exact key of every image whose placeholders lie in those tokens (vLLM's block keys: an image is part of the hash, not
only its placeholder ids). Where blocks end depends only on the tokens before: two requests share a block exactly
when everything before the block's end is the same, so a block's K/V are the K/V a full prefill of the new request
computes there. Blocks are stored once, however many requests share them.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from vismemo_hf.store.background import ACTIVITY, exiting

#: tokens per block
BLOCK = 32
#: exact keys of images seen after another image that ``PrefixBlocks.window_slid`` remembers
LATER_KEYS = 512
#: speculations in a row that no request read after which ``window_slid`` declines, but for one in ``RETRY``
UNREAD = 2
RETRY = 8


def block_ends(length: int, images: Sequence[tuple[int, int, str]]) -> list[int]:
    """Where the blocks of a row of ``length`` tokens end: every multiple of ``BLOCK`` and the end of every image (or
    video) of ``images`` ((first column, token count, exact key) in column order), in order, each once, none past
    ``length``."""
    ends = set(range(BLOCK, length + 1, BLOCK))
    ends.update(start + n for start, n, _ in images if 0 < start + n <= length)
    return sorted(ends)


def block_hashes(owner: str, ids: Sequence[int], images: Sequence[tuple[int, int, str]]) -> list[str]:
    """The chain hash of each block of ``ids`` (one row's real token ids), the blocks ending at ``block_ends``;
    ``images``: (first column, token count, exact key) of every image (or video) of the row, in column order."""
    out = []
    h = hashlib.blake2b(owner.encode(), digest_size=16, person=b"vm-prefix")
    at, begin = 0, 0
    data = torch.tensor(list(ids), dtype=torch.int64).numpy().tobytes()
    for end in block_ends(len(ids), images):
        h.update(data[8 * begin:8 * end])
        while at < len(images) and images[at][0] < end:  # an image that starts in this block names it
            h.update(f"|{images[at][0]}:{images[at][1]}:{images[at][2]}".encode())
            at += 1
        out.append(h.copy().hexdigest())
        begin = end
    return out


class Speculation:
    """The state of a speculative write (blocks a request is likely to need, computed while no request runs). A
    request never waits for one: ``claim`` (a reader's) is True once its blocks are written, else it calls the
    speculation off (one not started never runs, one running stops at its next layer: ``running``) and the reader
    computes the blocks itself. ``start`` (the job's): whether to run (not called off, no request in progress)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.state = "waiting"

    def claim(self) -> bool:
        with self._lock:
            if self.state in ("waiting", "running"):
                self.state = "called off"
            return self.state == "done"

    def start(self) -> bool:
        with self._lock:
            if self.state != "waiting" or ACTIVITY.active or exiting():
                self.state = "called off"
                return False
            self.state = "running"
            return True

    @property
    def running(self) -> bool:
        """Whether the job goes on (it asks between layers)."""
        return self.state == "running" and not ACTIVITY.active

    def done(self) -> None:
        with self._lock:
            if self.state == "running":
                self.state = "done"


class PrefixBlocks:
    """Blocks' K/V in host memory within a byte budget, least recently used out first. Each block holds
    (layers, 2, KV heads, its tokens, head dim) in the model's dtype. Thread-safe; writes come from the store's writer
    thread, reads from the requests'."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self._blocks: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._pending: dict[str, Future] = {}  # blocks being written: held for ``longest``, waited for by ``read``
        self._waits: dict[int, Callable[[], None]] = {}  # id of a pending write -> what waits for it
        self._claims: dict[int, Callable[[], bool]] = {}  # id of a pending speculative write -> its claim
        self.reused_blocks = 0
        #: the exact keys of images seen after another image of their request (``window_slid``), newest last
        self._later: OrderedDict[str, None] = OrderedDict()
        self._speculated: str | None = None  # the last block a speculation wrote, until a request reads it
        self._unread = 0  # speculations in a row that no request read
        self._declined = 0
        self.speculations: dict[str, float] = {"submitted": 0, "read": 0, "declined": 0, "ms": 0.0}

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
                if h not in self._blocks:
                    write = self._pending.get(h)
                    claim = self._claims.get(id(write)) if write is not None else None
                    if write is None or claim is not None and not claim():
                        break
                n += 1
            return n

    def held(self, hashes: Sequence[str]) -> int:
        """How many of ``hashes``, from the first on, are held or being written (no speculative write is claimed)."""
        with self._lock:
            n = 0
            for h in hashes:
                if h not in self._blocks and h not in self._pending:
                    break
                n += 1
            return n

    def announce(self, hashes: Sequence[str], write: Future, wait: Callable[[], None] | None = None,
                 claim: Callable[[], bool] | None = None) -> None:
        """``write`` (a job on the store's writer thread) is adding ``hashes``: they count as held meanwhile. ``wait``:
        what a reader calls instead of waiting for ``write`` itself (``Writer.wait_for``: a job not started yet runs
        on the reader's thread, not after the jobs queued before it). ``claim``: a speculative write's (``Speculation``)
        -> whether a reader may count on it (False: it has not started and never will; the reader computes the
        blocks itself)."""
        with self._lock:
            for h in hashes:
                self._pending.setdefault(h, write)
            if wait is not None:
                self._waits[id(write)] = wait
            if claim is not None:
                self._claims[id(write)] = claim
        write.add_done_callback(lambda _: self._written(hashes, write))

    def _written(self, hashes: Sequence[str], write: Future) -> None:
        with self._lock:
            for h in hashes:
                if self._pending.get(h) is write:
                    del self._pending[h]
            self._waits.pop(id(write), None)
            self._claims.pop(id(write), None)

    def read(self, hashes: Sequence[str]) -> list[torch.Tensor] | None:
        """The blocks of ``hashes`` (each refreshed; a block being written is waited for, its write run here when it
        has not started), or None when one is gone meanwhile."""
        with self._lock:
            writes = {id(f): (f, self._waits.get(id(f))) for h in hashes if (f := self._pending.get(h)) is not None}
        for _, wait in writes.values():
            if wait is not None:
                wait()
        ACTIVITY.wait_on([f for f, wait in writes.values() if wait is None], None)
        with self._lock:
            out = []
            for h in hashes:
                block = self._blocks.get(h)
                if block is None:
                    return None
                self._blocks.move_to_end(h)
                out.append(block)
            self.reused_blocks += len(out)
            if self._speculated is not None and self._speculated in hashes:
                self._speculated, self._unread = None, 0
                self.speculations["read"] += 1
            return out

    def window_slid(self, keys: Sequence[str]) -> bool:
        """Whether a request whose images have the exact ``keys`` (in column order, at least two) looks like the next
        step of a window that slides over images (an agent keeping its last screenshots): its first image came
        after another image in an earlier request. Then its next step is likely the same request without its first
        image (``runtime.prefix.slide_later``). Declined, but for one in ``RETRY``, after ``UNREAD`` speculations in
        a row that no request read (the requests do not slide as guessed)."""
        with self._lock:
            slid = keys[0] in self._later
            for key in keys[1:]:
                self._later[key] = None
                self._later.move_to_end(key)
            while len(self._later) > LATER_KEYS:
                self._later.popitem(last=False)
            if not slid:
                return False
            if self._speculated is not None:  # the last speculation was never read
                self._unread += 1
                self._speculated = None
            if self._unread >= UNREAD:
                self._declined += 1
                if self._declined % RETRY:
                    self.speculations["declined"] += 1
                    return False
            return True

    def speculated(self, ms: float) -> None:
        """A speculation took ``ms``."""
        with self._lock:
            self.speculations["ms"] += ms

    def speculating(self, last: str) -> None:
        """A speculation that writes blocks up to ``last`` has been started."""
        with self._lock:
            self._speculated = last
            self.speculations["submitted"] += 1

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

"""The store's background threads: they build and write entries while requests are served."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial

import torch

logger = logging.getLogger(__name__)

#: how much lower than the serving threads a background thread runs (a Linux nice increment, per thread)
NICE = 10


def one_torch_thread() -> None:
    """Make the calling thread's torch operations run on one thread. A thread that runs a parallel torch operation
    gets an OpenMP team of its own, and while that thread lives the process has more OpenMP threads than cores:
    every team's threads then sleep between parallel regions instead of spinning, and each small operation of the
    serving thread waits for them to wake (``benchmarks/stream_latency.py`` measured plain transformers' decoding
    steps several times slower after a stream than before it, in the same process as the stream's store, before this
    setting; ``results/perf/stream-latency.md`` has the run with it). The setting is the thread's own: the serving
    threads keep theirs."""
    torch.set_num_threads(1)


def background_thread() -> None:
    """What a background thread runs first: ``one_torch_thread`` and ``background_priority``."""
    one_torch_thread()
    background_priority()


def background_priority() -> None:
    """Run the calling thread (and the threads it starts) only on CPU time the threads that serve requests leave:
    Linux's ``SCHED_IDLE`` policy for this thread, else a nice increment of ``NICE``. Building and writing a miss's
    entry then waits for the decoding steps instead of slowing them (``results/perf/latency.md``: a miss's decoding
    step as plain's). Where neither can be set (not Linux, a sandbox refusing it) nothing changes."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + NICE))
    except (AttributeError, OSError):
        pass


def background_pool(name: str, workers: int = 1) -> ThreadPoolExecutor:
    """A pool of ``workers`` background threads named ``name`` (``background_thread``)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name, initializer=background_thread)


def torch_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads named ``name`` that serve requests (reads ahead of the layers that need them): at
    the serving threads' priority, torch on one thread each (``one_torch_thread``)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name, initializer=one_torch_thread)


#: how long a process that exits waits for the entries its stores are still writing (seconds), unless
#: ``VISMEMO_EXIT_WRITE_S`` says otherwise; what is left then is dropped, counted and logged
EXIT_WRITE_S = 30.0


class Activity:
    """How many requests' forwards are in progress in the process, and how many threads wait for a write.

    The writer starts a job only while no forward runs (a request's own Python work then never waits for the
    interpreter lock behind a background job's), or while some thread waits for a write (it would otherwise wait for
    ever), or once a job has waited ``MAX_DEFER_S`` (a process that never pauses still gets its entries)."""

    MAX_DEFER_S = 2.0

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.active = 0
        self.waiting = 0

    def enter(self) -> None:
        with self._cond:
            self.active += 1

    def leave(self) -> None:
        with self._cond:
            self.active = max(0, self.active - 1)
            self._cond.notify_all()

    def wait_on(self, futures, timeout: float | None) -> tuple:
        """``concurrent.futures.wait`` for a request, opening the writer's gate meanwhile."""
        with self._cond:
            self.waiting += 1
            self._cond.notify_all()
        try:
            return wait(futures, timeout=timeout)
        finally:
            with self._cond:
                self.waiting -= 1

    def idle(self, deadline: float) -> None:
        """Block the writer until no forward runs, a thread waits for a write, or ``deadline`` (monotonic) passes."""
        with self._cond:
            while self.active and not self.waiting:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(min(left, 0.05)):
                    if time.monotonic() >= deadline:
                        return


#: the process's requests in progress (``runtime.forward`` enters and leaves it around every enabled forward)
ACTIVITY = Activity()

@dataclass(frozen=True)
class Announced:
    """What a lookup needs of an entry still being built: its key, model, grid, region descriptors and token pixel
    hashes (or what computes them). The store indexes it at once, so the next request finds it; a read of its bytes
    waits for the write. ``prefix`` / ``context`` (the digest and sketch of what preceded the image), ``embeds`` /
    ``deepstack`` (its encoder output) and ``kv`` / ``offset`` (its K/V) let a request with the same image be served
    without waiting for the write: an exact hit on its K/V, or one computed in full (another context) on its encoder
    output (``runtime.lookup``)."""

    key: str
    fingerprint: str
    grid: tuple
    descriptors: torch.Tensor
    #: the token pixel hashes, or what computes them (indexed when a pixel-first lookup first needs them)
    patch_hashes: torch.Tensor | Callable[[], torch.Tensor | None] | None = None
    prefix: str | None = None
    context: torch.Tensor | None = None
    embeds: torch.Tensor | None = None
    deepstack: torch.Tensor | None = None
    #: what gives the image's K/V as its entry will hold them, (N, L, 2, H, D) on the host, and the position of its
    #: first token they were computed at: an exact hit reads them without waiting for the write
    kv: Callable[[], torch.Tensor] | None = None
    offset: int = 0
    #: what gives its (H, W) uint8 thumbnail: with ``embeds``, the fine stage scores it as a candidate without
    #: waiting for the write (a miss never waits for another image's entry)
    thumbnail: Callable[[], torch.Tensor] | None = None


class Writer:
    """Entries being built and written on one background thread, off the requests' path.

    A write is pending from ``submit`` until its job has run (a ``gated`` writer starts each job between requests
    only, ``Activity``: a request's decoding steps then never share the interpreter or the memory bus with it);
    ``wait_for(key)`` waits for that key's job alone (a request never waits for another image's write), ``drain``
    for all of them. Pending writes are completed when the process exits (``EXIT_WRITE_S``): a second process
    then finds them."""

    def __init__(self, name: str = "vismemo-put", gated: bool = False) -> None:
        self.name, self.gated = name, gated
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future] = {}
        self._jobs: dict[str, Callable[[], None]] = {}  # the job of each pending key (``wait_for`` may run it)
        self._anonymous: list[Future] = []
        self._lock = threading.Lock()
        self.wait_ms = 0.0
        self.dropped = 0
        #: what runs once the pending writes are done when the process exits (the store's tiers' own writes)
        self.at_exit: list[Callable[[], None]] = []

    @property
    def pool(self) -> ThreadPoolExecutor | None:
        return self._pool

    def submit(self, job: Callable[[], None], key: str | None = None) -> Future:
        """Run ``job`` on the writer thread; ``key``: the entry it writes (what ``wait_for`` waits for)."""
        with self._lock:
            if self._pool is None:
                self._pool = background_pool(self.name)
            _watch_exit(self)
            deadline = time.monotonic() + Activity.MAX_DEFER_S

            def between_requests():
                ACTIVITY.idle(deadline)
                job()

            future = self._pool.submit(between_requests if self.gated else job)
            if key is None:
                self._anonymous.append(future)
            else:
                self._pending[key] = future
                self._jobs[key] = job
        future.add_done_callback(partial(self._done, key))
        return future

    def _done(self, key: str | None, future: Future) -> None:
        with self._lock:
            if key is not None and self._pending.get(key) is future:
                del self._pending[key]
                self._jobs.pop(key, None)
            elif future in self._anonymous:
                self._anonymous.remove(future)

    def pending(self, key: str) -> bool:
        return key in self._pending

    def wait_for(self, key: str) -> None:
        """Wait for the write of ``key``, if one is pending. A job that has not started yet is run here, on the
        calling thread, at once: the request that needs the entry waits for its build and write alone, not for the
        jobs queued before it nor for a gated writer to be let through. Meanwhile the key stays pending (other
        readers wait for this run)."""
        with self._lock:
            future, job = self._pending.get(key), self._jobs.pop(key, None)
            if future is None:
                return
            inline: Future | None = None
            if job is not None:
                inline = Future()
                inline.set_running_or_notify_cancel()
                self._pending[key] = inline
        if inline is not None and job is not None and future.cancel():  # not started: it runs here instead
            t0 = time.perf_counter()
            try:
                job()  # its own faults are caught inside it, as on the writer thread
            finally:
                self.wait_ms += (time.perf_counter() - t0) * 1e3
                inline.set_result(None)
                self._done(key, inline)
            return
        if inline is not None:  # already running (or done): wait for it as it is
            with self._lock:
                if self._pending.get(key) is inline:
                    self._pending[key] = future
            inline.set_result(None)
            if future.done():
                self._done(key, future)
        self._wait([future])

    def drain(self, timeout: float | None = None) -> int:
        """Wait for every pending write (at most ``timeout`` seconds); returns how many were left."""
        with self._lock:
            futures = list(self._pending.values()) + list(self._anonymous)
        return self._wait(futures, timeout)

    def _wait(self, futures: list[Future], timeout: float | None = None) -> int:
        if not futures:
            return 0
        t0 = time.perf_counter()
        done, left = ACTIVITY.wait_on(futures, timeout)
        self.wait_ms += (time.perf_counter() - t0) * 1e3
        for future in done:
            future.result()  # a job's own faults are caught inside it: this raises only for a bug
        return len(left)

    def close(self) -> None:
        self.drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


#: the writers that may hold pending writes when the process exits
_WRITERS: weakref.WeakSet[Writer] = weakref.WeakSet()
_EXIT_HOOKED = False


def _watch_exit(writer: Writer) -> None:
    """Complete ``writer``'s pending writes when the process exits. The hook runs with ``threading``'s exit hooks,
    before ``concurrent.futures`` refuses new work (a disk tier's write scheduled later would be lost)."""
    global _EXIT_HOOKED
    _WRITERS.add(writer)
    if not _EXIT_HOOKED:
        try:
            threading._register_atexit(_complete_at_exit)  # type: ignore[attr-defined]
            _EXIT_HOOKED = True
        except RuntimeError:  # already shutting down: nothing more can be scheduled anyway
            pass


def _after_fork_in_child() -> None:
    """A forked child owns none of its parent's pending writes (their threads are not in it): its writers start
    empty, with pools of their own when they first write, and its exit waits for nothing of the parent's."""
    for writer in list(_WRITERS):
        writer._lock = threading.Lock()
        writer._pool, writer._pending, writer._jobs, writer._anonymous = None, {}, {}, []
    _WRITERS.clear()
    ACTIVITY.__init__()  # type: ignore[misc]  # no request of the parent's runs in the child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


_EXITING = threading.Event()


def exiting() -> bool:
    """Whether the process is exiting (its pending writes being completed): speculative work is no longer started."""
    return _EXITING.is_set()


def _complete_at_exit() -> None:
    _EXITING.set()
    deadline = time.monotonic() + float(os.environ.get("VISMEMO_EXIT_WRITE_S", EXIT_WRITE_S))
    for writer in list(_WRITERS):
        left = writer.drain(max(0.0, deadline - time.monotonic()))
        if left:
            writer.dropped += left
            logger.warning("vismemo: %d entries still being written when the process exited; dropped", left)
        for hook in writer.at_exit:
            hook()

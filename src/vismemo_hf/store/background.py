"""The store's background threads: they build and write entries while requests are served."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

#: how much lower than the serving threads a background thread runs (a Linux nice increment, per thread)
NICE = 10


def one_torch_thread() -> None:
    """Make the calling thread's torch operations run on one thread. A thread that runs a parallel torch operation
    gets an OpenMP team of its own, and while that thread lives the process has more OpenMP threads than cores:
    every team's threads then sleep between parallel regions instead of spinning, and each small operation of the
    serving thread waits for them to wake (``benchmarks/stream_latency.py`` on a 2-core host, before this setting:
    plain transformers' decoding step on the base reader 3.50 ms before any enabled request, 14.84 ms after a
    stream, in the same process as the stream's store; ``results/perf/stream-latency.md`` has the run with it). The
    setting is the thread's own: the serving threads keep theirs."""
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

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
    serving thread waits for them to wake (measured on a 2-core host: a 1 x 256 by 256 x 768 matmul 12 us -> 216 us
    while an idle thread that had run torch operations lived; plain transformers' decoding steps of the ``medium``
    preset 7 -> 22 ms, in the same process as a store whose writer had built one entry). The setting is the
    thread's own: the serving threads keep theirs."""
    torch.set_num_threads(1)


def background_thread() -> None:
    """What a background thread runs first: ``one_torch_thread`` and ``background_priority``."""
    one_torch_thread()
    background_priority()


def background_priority() -> None:
    """Run the calling thread (and the threads it starts) only on CPU time the threads that serve requests leave:
    Linux's ``SCHED_IDLE`` policy for this thread, else a nice increment of ``NICE``. Building and writing a miss's
    entry then waits for the decoding steps instead of slowing them (measured on a 2-core host: a 4,096-token entry
    written while the miss decodes). Where neither can be set (not Linux, a sandbox refusing it) nothing changes."""
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

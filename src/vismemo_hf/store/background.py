"""The store's background threads: they build and write entries while requests are served."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

#: how much lower than the serving threads a background thread runs (a Linux nice increment, per thread)
NICE = 10


def background_priority() -> None:
    """Run the calling thread (and the threads it starts, such as its own OpenMP team) below the threads that serve
    requests: building and writing a miss's entry then takes the CPU that the decoding steps leave, instead of
    slowing them (measured on a 2-core host: a 4,096-token entry written while the miss decodes). Where a thread's
    priority cannot be set (not Linux, a sandbox refusing it) nothing changes."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, os.getpriority(os.PRIO_PROCESS, 0) + NICE))
    except (AttributeError, OSError):
        pass


def background_pool(name: str, workers: int = 1) -> ThreadPoolExecutor:
    """A pool of ``workers`` background threads named ``name`` (``background_priority``)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name, initializer=background_priority)

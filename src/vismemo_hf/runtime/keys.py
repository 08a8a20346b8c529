"""Exact keys hashed ahead of the lookup: the one cost every request pays before it is known to be a miss.

``generate`` asks for the images' encoder output before the prefill (``lookup.DeferredImageFeatures``), and then
prepares the prefill's inputs (positions, masks, logits processors) on the calling thread. From that first call on,
a thread of ``keys_pool`` hashes each image's pixel bytes as the tower reads them (``core.features.pixel_digest``;
BLAKE3 lets the interpreter run meanwhile), so that by the forward the lookup finds the digests done and makes each
exact key from the model, the grid and the digest alone. A digest not yet started when the lookup needs it is hashed
by the lookup itself (never waited for behind another request's); one that failed is too.

Only for pixels on an accelerator (``AHEAD_ON_HOST``): there the host thread that prepares the prefill mostly
queues kernels, and copying the pixels to the host and hashing them is work no other thread of the request does. A
model on the CPU already keeps every core busy (torch's threads); a thread more saved nothing on this project's
machine (``benchmarks/keys_ahead.py``).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from vismemo_hf.core.features import pixel_digest
from vismemo_hf.store.background import torch_pool
from vismemo_hf.store.faults import unexpected

logger = logging.getLogger(__name__)

#: threads that hash requests' images (a few requests at once, from several serving threads)
WORKERS = 2
#: whether pixels on the host are hashed ahead too (else the lookup hashes them)
AHEAD_ON_HOST = False

_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()


def keys_pool() -> ThreadPoolExecutor:
    """The process's pool of key threads (a forked child makes its own: its parent's threads are not in it)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), torch_pool("vismemo-keys", WORKERS))
        return _POOL[1]


class KeysAhead:
    """The pixel digests of one encoder call's images, hashed on ``keys_pool`` (``start``)."""

    __slots__ = ("pixel_values", "future")

    def __init__(self, pixel_values: torch.Tensor, future: Future) -> None:
        self.pixel_values, self.future = pixel_values, future

    def digests(self, pixel_values, count: int) -> list[bytes] | None:
        """The ``count`` digests, in image order, when they were hashed from ``pixel_values`` itself; None (the
        lookup hashes them) when they were not, when hashing had not started yet, or when it failed."""
        if pixel_values is not self.pixel_values:
            return None
        if self.future.cancel():  # not started: hashing here costs the same and waits for nothing
            return None
        try:
            out = self.future.result()
        except (ValueError, IndexError) as err:  # a geometry the split takes only with the placeholder runs
            logger.debug("vismemo: keys ahead failed (%s: %s); hashed at the lookup", type(err).__name__, err)
            return None
        except Exception as err:  # noqa: BLE001 - counted and logged as a bug (raised in strict mode)
            unexpected(err, "keys ahead")
            return None
        return out if len(out) == count else None


def start(adapter, pixel_values, geometry) -> KeysAhead | None:
    """Hash the images of one encoder call (``pixel_values`` and the geometry that cuts them) on ``keys_pool``;
    None where there is nothing to hash."""
    if not isinstance(pixel_values, torch.Tensor) or geometry is None or \
            (pixel_values.device.type == "cpu" and not AHEAD_ON_HOST):
        return None

    def job() -> list[bytes]:
        host = adapter.split_images(adapter.tower_pixels(pixel_values).cpu(), geometry, None)
        return [pixel_digest(pixels) for pixels, _, _ in host]

    return KeysAhead(pixel_values, keys_pool().submit(job))

"""What a lookup derives from a tensor, kept while the tensor is unchanged.

The pixel stage prepares each thumbnail it aligns (high pass, warps, Fourier transforms). A store's candidate comes
back as the same tensor object every time it is a candidate (the memory tier keeps it), and a request's own
thumbnail is aligned with several candidates: ``TensorMemo`` keeps the prepared values of the last few tensors by the
object's identity and its in-place version, never by their values, so a changed or another tensor is prepared anew
(an inference tensor keeps no version: its identity alone).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch


class TensorMemo:
    """An LRU of values computed from tensors, keyed by (the tensor object, a tag), of at most ``max_bytes`` of
    tensors in the values (``nbytes`` of each, counted by the caller's ``compute``). It holds the tensors it keys,
    so an id is not reused while its entry lives; thread-safe (``compute`` runs outside the lock: two threads may
    both compute a value, the last one kept)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[int, Any], tuple[torch.Tensor, int, Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, tensor: torch.Tensor, tag: Any, compute: Callable[[], tuple[Any, int]]) -> Any:
        """The value ``compute()`` returns (as (value, its bytes)) for ``tensor`` as it is now, computed once."""
        key, version = (id(tensor), tag), tensor_version(tensor)
        with self._lock:
            held = self._items.get(key)
            if held is not None and held[0] is tensor and held[1] == version:
                self._items.move_to_end(key)
                return held[2]
        value, nbytes = compute()
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[3]
            if nbytes <= self.max_bytes:
                self._items[key] = (tensor, version, value, nbytes)
                self._bytes += nbytes
            while self._bytes > self.max_bytes:
                self._bytes -= self._items.popitem(last=False)[1][3]
        return value

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's in-place version; -1 for an inference tensor (made under ``torch.inference_mode``), which keeps
    none: what is keyed by it (a lookup's own thumbnails, an entry's tower K/V) is never changed in place."""
    return -1 if tensor.is_inference() else tensor._version

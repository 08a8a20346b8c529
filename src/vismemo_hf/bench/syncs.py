"""Counting host-device synchronisations from Python: the calls that bring a tensor's value to the host.

On a GPU each of them drains the stream, so the hit path has to make its decisions from values it already has on
the host. ``SyncCounter`` interposes on the calls that need a value (``item``, ``tolist``, ``bool()``, ``int()``,
``float()``, ``numpy``, ``cpu``) and on those whose output size depends on the values (``nonzero``, ``unique``,
``masked_select``, ``argwhere``, one-argument ``where``, indexing by a boolean tensor), for tensors on any device:
a run on the CPU counts what the same run would synchronise on a GPU (``repeat_interleave`` by a tensor of
repeats too). ``any`` / ``all`` alone do not synchronise
(their ``bool()`` is counted). With ``sites=True`` each call is also counted at the first frame outside torch, which
names the code to change.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

#: calls that return a host value
VALUE_CALLS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "equal", "allclose")
#: calls whose output size depends on the values (``where`` with one argument only)
SIZE_CALLS = ("nonzero", "unique", "unique_consecutive", "masked_select", "argwhere", "where", "repeat_interleave")


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _syncs(name: str, args, kwargs) -> bool:
    if name in VALUE_CALLS:
        return True
    if name in ("__getitem__", "__setitem__"):
        return len(args) > 1 and _has_bool_index(args[1])
    if name == "where":
        return len(args) + len(kwargs) == 1
    if name == "repeat_interleave":  # a tensor of repeats without output_size
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
        return isinstance(repeats, torch.Tensor) and "output_size" not in kwargs
    return name in SIZE_CALLS


class SyncCounter(TorchFunctionMode):
    """Counts, while active, the calls above (``counts`` by name, ``sites`` by ``file:line`` of the first frame
    outside torch). A torch function mode: it sees every tensor method and torch function called from Python on
    the thread that entered it, and calls made inside one of them are not seen again.
    """

    def __init__(self, sites: bool = False) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.sites: Counter = Counter()
        self._want_sites = sites

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _syncs(name, args, kwargs):
            label = "bool index" if name in ("__getitem__", "__setitem__") else name
            self.counts[label] += 1
            if self._want_sites:
                self._site(label)
        return func(*args, **kwargs)

    def _site(self, label: str) -> None:
        frame = sys._getframe(2)
        while frame is not None and ("/torch/" in frame.f_code.co_filename or frame.f_code.co_filename == __file__):
            frame = frame.f_back
        if frame is not None:
            short = frame.f_code.co_filename.split("/site-packages/")[-1].split("/src/")[-1]
            self.sites[f"{short}:{frame.f_lineno} {label}"] += 1

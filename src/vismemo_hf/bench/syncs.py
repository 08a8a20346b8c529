"""Counting host-device synchronisations from Python: the calls that bring a tensor's value to the host.

On a GPU each of them drains the stream, so the hit path has to make its decisions from values it already has on
the host. ``SyncCounter`` interposes on the calls that need a value (``item``, ``tolist``, ``bool()``, ``int()``,
``float()``, ``numpy``, ``cpu``) and on those whose output size depends on the values (``nonzero``, ``unique``,
``masked_select``, ``argwhere``, one-argument ``where``, indexing by a boolean tensor), for tensors on any device:
a run on the CPU counts what the same run would synchronise on a GPU (``repeat_interleave`` by a tensor of
repeats too). ``any`` / ``all`` alone do not synchronise
(their ``bool()`` is counted). With ``sites=True`` each call is also counted at the first frame outside torch, which
names the code to change.

A read of a tensor that lives on the host is no synchronisation on a GPU: decisions made from host copies cost
nothing there. With ``resident=`` (the model and its inputs) the counter also follows where each tensor would live
on an accelerator and counts apart the reads of those that would live there (``device_counts``): the model's
parameters and buffers and the request's tensors live on the device, and so does every tensor an operator makes
from one of them, or a factory makes with an explicit ``device=`` other than ``"cpu"``; a tensor made from Python
values without one, and the result of ``cpu()`` or ``to("cpu")`` (each a read), live on the host. Any other
``to()`` keeps where its input lives: on a CPU run the counter cannot tell ``to(model.device)`` from
``to(torch.device("cpu"))``, so code that moves a host tensor to the device for the arithmetic makes a new one
with ``device=`` (``runtime.schedule.on_device``).
"""

from __future__ import annotations

import sys
from collections import Counter
from types import FrameType

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

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


def _to_host(args, kwargs) -> bool:
    """``to("cpu")``: a move to the host named as such (``to(tensor.device)`` keeps where the tensor lives)."""
    return any(a == "cpu" for a in [*args[1:], kwargs.get("device")] if isinstance(a, str))


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


class SyncCounter(TorchFunctionMode):
    """Counts, while active, the calls above (``counts`` by name, ``sites`` by ``file:line`` of the first frame
    outside torch). A torch function mode: it sees every tensor method and torch function called from Python on
    the thread that entered it, and calls made inside one of them are not seen again.

    ``resident``: modules and tensors (or containers of them) that live on the accelerator; then ``device_counts``
    / ``device_sites`` count the reads of tensors that would live there (module docstring).
    """

    def __init__(self, sites: bool = False, resident=()) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.sites: Counter = Counter()
        self.device_counts: Counter = Counter()
        self.device_sites: Counter = Counter()
        #: the CUDA driver's own count of the synchronising calls and their sites, where a caller asked the driver
        #: (``bench overhead`` on a GPU); None: not counted
        self.cuda_syncs: int | None = None
        self.cuda_sites: Counter | None = None
        self._want_sites = sites
        self._device = WeakIdKeyDictionary()
        for item in resident if isinstance(resident, (list, tuple)) else (resident,):
            if isinstance(item, torch.nn.Module):
                for t in [*item.parameters(), *item.buffers()]:
                    self._device[t] = True
            else:
                for t in _tensors(item):
                    self._device[t] = True

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def device_total(self) -> int:
        return sum(self.device_counts.values())

    def on_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` would live on the accelerator."""
        return tensor in self._device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = _tensors((args, kwargs))
        resident = any(t in self._device for t in inputs)
        if _syncs(name, args, kwargs):
            label = "bool index" if name in ("__getitem__", "__setitem__") else name
            self.counts[label] += 1
            site = self._site() if self._want_sites else None
            if site:
                self.sites[f"{site} {label}"] += 1
            if resident:
                self._device_read(label, site)
        to_host = name == "to" and _to_host(args, kwargs)
        if to_host and resident:
            self._device_read("to cpu", self._site() if self._want_sites else None)
        out = func(*args, **kwargs)
        if name == "cpu" or to_host:
            # a copy on the host (on a CPU run cpu() returns the tensor itself)
            return out.clone() if resident and isinstance(out, torch.Tensor) else out
        if resident or kwargs.get("device") not in (None, "cpu"):
            for t in _tensors(out):
                self._device[t] = True
            if resident and (name.endswith("_") or name == "__setitem__") and args and \
                    isinstance(args[0], torch.Tensor):  # written into in place
                self._device[args[0]] = True
        return out

    def _device_read(self, label: str, site: str | None) -> None:
        self.device_counts[label] += 1
        if site:
            self.device_sites[f"{site} {label}"] += 1

    @staticmethod
    def _site() -> str | None:
        frame: FrameType | None = sys._getframe(2)
        while frame is not None and ("/torch/" in frame.f_code.co_filename or frame.f_code.co_filename == __file__):
            frame = frame.f_back
        if frame is None:
            return None
        return short_site(frame.f_code.co_filename, frame.f_lineno)


def short_site(filename: str, lineno: int) -> str:
    """``package/module.py:line``: the path below site-packages or src."""
    return f"{filename.split('/site-packages/')[-1].split('/src/')[-1]}:{lineno}"

"""An alias's K/V brought to the device layer by layer, ahead of the layer that reads them.

An approximate hit's alias K/V are read from the store on the fetch thread while the warmup runs. The warmup and the
plan read the first layers only, and each later layer reads its own when the prefill reaches it, so the reader
publishes the read layer by layer (``LayerArrival``) instead of once at the end: a consumer waits for the layer it
reads, never for the whole read.

On an accelerator (``CudaStreams``) each layer is staged in pinned host memory and copied by a non-blocking copy on a
side stream, its keys moved to the request's positions there, and an event recorded after it; the layer that reads it
makes its own stream wait for that event (a wait on the device, not on the host: no sync). On the host
(``HostStreams``) the same schedule runs on the fetch thread: each layer's keys are moved there and published with a
``threading.Event``. Both go through ``stream_layers``; tests drive the accelerator's schedule on the CPU with a
``StreamOps`` that records what it was asked.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import torch


class StreamOps:
    """What the layer schedule asks of a device: a side stream to copy on, staging of a host layer for the copy, an
    event after each layer, and the consumer's wait for it. This base class is the host's (everything synchronous on
    the fetch thread, no events)."""

    def brings(self, source: torch.device, device: torch.device) -> bool:
        """Whether K/V on ``source`` are copied to ``device`` (else the consumer reads them where they are; a device
        named without its index is the current one of its type)."""
        source, device = torch.device(source), torch.device(device)
        return source.type != device.type or None not in (source.index, device.index) and source.index != device.index

    def begin(self) -> None:
        """On the fetch thread, after the read: the side stream's work follows what the read queued."""

    def side(self):
        """The context the copies of one layer run in."""
        return contextlib.nullcontext()

    def stage(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``host`` (a layer's keys or values) on ``device``."""
        return host.to(device)

    def record(self):
        """An event after the work queued so far in ``side`` (None: the work is done when this returns)."""
        return None

    def wait(self, event) -> None:
        """Make the consumer's work after this call run after ``event``."""

    def keep(self, tensor: torch.Tensor) -> None:
        """``tensor``, made on the side stream, is read by the consumer's stream."""


HostStreams = StreamOps


class CudaStreams(StreamOps):
    """Pinned staging, non-blocking copies on a side stream of ``device``, an event per layer; the consumer's stream
    (the one current when the fetch started, and whichever is current when it reads) waits for the event."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.consumer = torch.cuda.current_stream(device)
        self.stream = torch.cuda.Stream(device)

    def begin(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # a device tier's gather, queued there

    def side(self):
        return torch.cuda.stream(self.stream)

    def stage(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        if host.device.type != "cpu":
            return host.to(device, non_blocking=True)
        return host.pin_memory().to(device, non_blocking=True)  # the caching host allocator keeps it until copied

    def record(self):
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def keep(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(self.consumer)


def streams_for(device: torch.device) -> StreamOps:
    return CudaStreams(device) if device.type == "cuda" else HostStreams()


class LayerArrival:
    """Which layers of a fetch are in place. The fetch thread ``publish``es each (with the event after its copies),
    or ``fail``s; ``wait(at)`` returns once layer ``at`` can be read (True), or the fetch failed before it (False)."""

    def __init__(self, layers: int, ops: StreamOps) -> None:
        self.ops = ops
        self._done = [threading.Event() for _ in range(layers)]
        self._events: list = [None] * layers
        self._published = [False] * layers
        self.failed = False
        #: host time consumers spent waiting for layers (the part of the read not hidden behind the computation)
        self.waited_ms = 0.0

    def publish(self, at: int, event=None) -> None:
        self._events[at] = event
        self._published[at] = True
        self._done[at].set()

    def fail(self) -> None:
        self.failed = True
        for done in self._done:
            done.set()

    def ready(self, at: int) -> bool:
        return self._done[at].is_set()

    def wait(self, at: int) -> bool:
        if not self._done[at].is_set():
            t0 = time.perf_counter()
            self._done[at].wait()
            self.waited_ms += (time.perf_counter() - t0) * 1e3
        if not self._published[at]:  # the fetch failed before this layer
            return False
        self.ops.wait(self._events[at])
        return True


def stream_layers(keys_in: torch.Tensor, values_in: torch.Tensor, device: torch.device, move: Callable,
                  arrival: LayerArrival, keys_out: torch.Tensor | None, values_out: torch.Tensor | None) -> None:
    """Bring layer after layer of ``keys_in`` / ``values_in`` (L, H, T, D; host or device) to ``keys_out`` /
    ``values_out`` on ``device`` (None: that side is already in place: ``*_in`` are views the consumer reads), the
    keys through ``move`` (to the request's positions), publishing each layer on ``arrival``. Run on the fetch
    thread; any error fails the arrival (the consumer then computes the image) and is raised again there."""
    ops = arrival.ops
    try:
        ops.begin()
        for at in range(keys_in.shape[0]):
            with ops.side():
                if keys_out is not None:
                    keys_out[at].copy_(move(ops.stage(keys_in[at], device)))
                if values_out is not None:
                    values_out[at].copy_(ops.stage(values_in[at], device))
                event = ops.record()
            arrival.publish(at, event)
    except BaseException:
        arrival.fail()
        raise

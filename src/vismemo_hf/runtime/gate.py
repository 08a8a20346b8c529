"""Whether approximate lookups pay on a model, measured on its own requests (``VisMemoCache(approximate="auto")``).

An approximate lookup is not free: a miss pays for the pixel stage and the fine stage before it is known to be a
miss, and an approximate hit pays for its reader, its plan and the recomputed tokens. Where the model's own
arithmetic is large (an 8B model at 1,024 tokens an image on a CPU) a hit saves far more than that; where it is small
(a tiny model on a CPU, or a model whose prefill a GPU runs in a few milliseconds) a hit can take longer than the full
prefill it replaces, and every miss is slower for nothing. ``ApproximateGate`` keeps the last requests' evidence and
answers, per model and policy, whether the next request looks for an approximate hit at all:

- a hit saves ``rate * tokens - ms``: the miss rate (ms of prefill per token, the lookup's own time taken out) times
  its tokens, minus what it took (until ``MIN_HITS`` hits are measured: half a miss's prefill);
- a miss that looked lost its lookup's time;
- lookups go on while the expected gain of the next one is positive: over the last ``WINDOW`` looking requests, the
  hit rate (one hit and one miss assumed besides) times a hit's saving, minus the miss rate times a miss's loss (or
  while too few were measured); else only an exploring request looks, so that the evidence follows the traffic (a
  new kind of page, a warm GPU): every ``EXPLORE``-th request at first, and each exploration that leaves the gate
  closed doubles the interval, up to ``MAX_EXPLORE`` (a model on which lookups never pay stops paying for them); the
  interval starts again from ``EXPLORE`` once the gate opens.

Exact hits and reused prefixes never depend on it; a request with an exact hit and a looked-up image is evidence of
what the lookup lost or found (not of a prefill's rate). A hit computed in full (another context before it) saved
nothing: it counts as a miss that looked. Times are wall times from the prefill's start to the next forward
of the same cache or the end of ``generate`` (after the first token's synchronisation on an accelerator)."""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field

#: what ``VisMemoCache(approximate=...)`` accepts: look up approximate hits when they pay on the model (``auto``),
#: for every request (``always``: what a quality evaluation measures), or never (exact hits and prefixes only)
MODES = ("auto", "always", "never")


@dataclass
class Sample:
    """One prefill's evidence: whether it looked for approximate hits, found one that reused K/V (one computed in
    full saved nothing: a miss that looked), its tokens, its wall time and the lookup's own share of it (ms).
    ``exact``: some image of it was an exact hit, whose saving is not the approximate lookup's: its time tells
    neither a miss's prefill rate nor what an approximate hit saves, only what the lookup lost."""

    looked: bool
    hit: bool
    tokens: int
    ms: float
    lookup_ms: float
    exact: bool = False


@dataclass
class ApproximateGate:
    """The evidence of one model and policy (thread-safe; see the module docstring)."""

    WINDOW = 24
    EXPLORE = 8
    MAX_EXPLORE = 64
    #: looking requests (and misses for the miss rate) measured before the gate may close
    MIN_LOOKED = 6
    MIN_MISSES = 2
    #: approximate hits measured before what they save is taken from them (else half a miss's prefill is assumed)
    MIN_HITS = 2

    looked: deque = field(default_factory=lambda: deque(maxlen=ApproximateGate.WINDOW))
    rates: deque = field(default_factory=lambda: deque(maxlen=ApproximateGate.WINDOW))
    requests: int = 0
    #: requests between two explorations of a closed gate, and those since the last one
    interval: int = 0
    since: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def looks(self) -> bool:
        """Whether the next request looks for approximate hits."""
        with self._lock:
            self.requests += 1
            if self._open():
                self.interval, self.since = 0, 0
                return True
            if not self.interval:  # just closed: the first exploration after EXPLORE requests
                self.interval, self.since = self.EXPLORE, 0
            self.since += 1
            if self.since < self.interval:
                return False
            self.since, self.interval = 0, min(self.MAX_EXPLORE, 2 * self.interval)
            return True

    def is_open(self) -> bool:
        with self._lock:
            return self._open()

    def gain_ms(self) -> float | None:
        """Mean ms a looking request saved over the window (negative: lost); None while too little is measured."""
        with self._lock:
            return self._gain()

    def _gain(self) -> float | None:
        if len(self.looked) < self.MIN_LOOKED or len(self.rates) < self.MIN_MISSES:
            return None
        rate = statistics.median(self.rates)
        hits = [s for s in self.looked if s.hit]
        misses = [s for s in self.looked if not s.hit]
        timed = [s for s in hits if not s.exact]
        if len(timed) >= self.MIN_HITS:
            saved = statistics.fmean(rate * s.tokens - s.ms for s in timed)
        else:  # too few hits to say what one saves: half a miss's prefill, what a typical hit skips
            saved = 0.5 * rate * statistics.fmean(s.tokens for s in self.looked)
        lost = statistics.fmean(s.lookup_ms for s in misses) if misses else 0.0
        share = (len(hits) + 1) / (len(self.looked) + 2)  # the hit rate, with one hit and one miss assumed
        return share * saved - (1.0 - share) * lost

    def _open(self) -> bool:
        gain = self._gain()
        return gain is None or gain > 0.0

    def record(self, sample: Sample) -> None:
        with self._lock:
            if not sample.hit and not sample.exact and sample.tokens > 0:
                self.rates.append(max(0.0, sample.ms - sample.lookup_ms) / sample.tokens)
            if sample.looked:
                self.looked.append(sample)


class Pending:
    """A prefill's sample waiting for its end (``settle``): the next forward of its cache, or the end of
    ``generate``."""

    __slots__ = ("gate", "sample", "started")

    def __init__(self, gate: ApproximateGate, sample: Sample, started: float) -> None:
        self.gate, self.sample, self.started = gate, sample, started

    def settle(self) -> None:
        self.sample.ms = (time.perf_counter() - self.started) * 1e3
        self.gate.record(self.sample)


_GATES_LOCK = threading.Lock()


def gate_for(adapter, policy_key: str) -> ApproximateGate:
    """The gate of ``adapter``'s model under the policy ``policy_key`` (its repr), made on first use; the gates live
    on the adapter (they go with the enabled model)."""
    with _GATES_LOCK:
        gates = adapter.__dict__.setdefault("_approximate_gates", {})
        return gates.setdefault(policy_key, ApproximateGate())

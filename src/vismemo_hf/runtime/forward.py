"""Per-forward state: one ``ForwardContext`` per model forward that uses a ``VisMemoCache``.

The hooks that ``enable`` installs open it before the base model's forward and close it after; the lookup leaves
its ``PrefillRequest`` on it, the prefill runner sets the ``Layout`` and attention capture of the layer it is
running, and the attention function and ``VisMemoCache.update`` read them. It travels in a context variable, so
nothing per-forward is written on the cache (which holds K/V and slot columns only), and nested or concurrent
forwards (other threads, other caches) never see each other's state.
"""

from __future__ import annotations

import time
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Final

import torch

from vismemo_hf.core.plan import HitKind
from vismemo_hf.runtime.gate import Pending, Sample
from vismemo_hf.store.background import ACTIVITY

if TYPE_CHECKING:
    from vismemo_hf.families.base import ModelAdapter
    from vismemo_hf.runtime.cache import VisMemoCache
    from vismemo_hf.runtime.lookup import PrefillRequest
    from vismemo_hf.runtime.schedule import Layout


@dataclass
class AttentionCapture:
    """Ask the attention function of ``layer`` for the softmax rows of the observation window.

    ``rows`` (B, W): positions of the window's queries among the layer's queries; ``valid`` (B, W):
    False for padding entries of short rows. The function leaves ``probs`` (B, heads, W, slots)."""

    layer: int
    rows: torch.Tensor
    valid: torch.Tensor
    probs: torch.Tensor | None = None


@dataclass
class ForwardContext:
    """What one forward of ``cache`` needs beyond the cache's own K/V.

    ``valid``: (B, columns) False at padding columns, None without padding. ``request``: the lookup's result for
    the prefill (None: no image to look up). ``layout``: the ``schedule.Layout`` of the layer the runner is running
    (None outside the runner: the forward continues the sequence). ``capture``: the attention the runner asks for.
    """

    cache: VisMemoCache
    adapter: ModelAdapter | None = None  # the enabled model's
    attention_mask: torch.Tensor | None = None
    request: PrefillRequest | None = None
    layout: Layout | None = None
    capture: AttentionCapture | None = None
    started: float = field(default_factory=time.perf_counter)
    first_event: int = 0
    #: tokens of a reused prefix the cache holds before this forward computes the rest (``runtime.prefix``)
    reused_prefix: int = 0
    #: the approximate-lookup gate of the prefill's model and policy, whether the prefill looked for approximate hits
    #: and the lookup's own ms (``runtime.gate``); None: no sample to take
    gate: tuple | None = None
    token: Token[ForwardContext | None] | None = field(default=None, repr=False)
    _valid: torch.Tensor | _Unknown | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._valid = _UNKNOWN

    @property
    def valid(self) -> torch.Tensor | None:
        """(B, columns) False at padding columns, None without padding (worked out when first asked: decoding steps
        over a plain layout never ask)."""
        if self._valid is _UNKNOWN:
            mask = self.attention_mask
            self._valid = mask.bool() if mask is not None and mask.ndim == 2 and not bool(mask.all()) else None
        return self._valid

    def take_request(self) -> PrefillRequest | None:
        """The lookup's request, once (the forward that runs it consumes it)."""
        request, self.request = self.request, None
        return request


class _Unknown(Enum):
    """``ForwardContext.valid`` not worked out yet."""

    UNKNOWN = 0


_UNKNOWN: Final = _Unknown.UNKNOWN
_CURRENT: ContextVar[ForwardContext | None] = ContextVar("vismemo_forward", default=None)


def current(cache: VisMemoCache | None = None) -> ForwardContext | None:
    """The forward in progress (of ``cache``, when given), or None."""
    ctx = _CURRENT.get()
    if ctx is None or (cache is not None and ctx.cache is not cache):
        return None
    return ctx


def open_forward(cache: VisMemoCache, attention_mask: torch.Tensor | None,
                 adapter: ModelAdapter | None = None) -> ForwardContext:
    ctx = ForwardContext(cache, adapter=adapter, attention_mask=attention_mask, first_event=len(cache.events))
    ACTIVITY.enter()  # the store's writer starts no job meanwhile (``store.background.Activity``)
    if adapter is not None:
        adapter.hold_fingerprint(True, check=cache.get_seq_length() == 0)  # a prefill, not a decoding step
    ctx.token = _CURRENT.set(ctx)
    return ctx


def close_forward(ctx: ForwardContext, new_tokens: int) -> None:
    """End ``ctx``: its events get the whole pass's wall time as ``prefill``; the cache advances."""
    elapsed = (time.perf_counter() - ctx.started) * 1e3
    events = ctx.cache.events[ctx.first_event:]
    for event in events:
        event.timings["prefill"] = elapsed
    if ctx.gate is not None and events:
        gate, looked, lookup_ms, tokens = ctx.gate
        exact = any(e.kind is HitKind.EXACT for e in events)
        hit = any(e.kind is HitKind.APPROXIMATE and e.recomputed < e.n_tokens for e in events)
        if looked or not exact:
            ctx.cache._gate_pending = Pending(gate, Sample(looked, hit, tokens, 0.0, lookup_ms, exact), ctx.started)
    try:
        ctx.cache.advance(new_tokens - ctx.reused_prefix)  # a reused prefix was counted when it was loaded
    finally:
        ACTIVITY.leave()
        if ctx.adapter is not None:
            ctx.adapter.hold_fingerprint(False)
        assert ctx.token is not None  # set by ``open_forward``
        _CURRENT.reset(ctx.token)


def settle_gate(cache) -> None:
    """Record the last prefill of ``cache`` with its gate (``runtime.gate``), once: its wall time ends now."""
    pending = getattr(cache, "_gate_pending", None)
    if pending is not None:
        cache._gate_pending = None
        pending.settle()

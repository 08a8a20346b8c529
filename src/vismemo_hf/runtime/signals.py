"""What the warmup layers observe, for the routing (``WarmupSignals``) and for VL-Cache compression.

The *observation window* of a row is its text after its last image (else its last 16 real tokens). During the
layers before an image's plan is made, the window's attention to the image is captured (policies that ask for
it); at the decision layer the relative K/V deviation of this request's fresh K/V from the alias's is computed for
the warmup layers, and the check layer's fresh K/V are projected from the hidden states entering it.
"""

from __future__ import annotations

import torch

from vismemo_hf.core.plan import HitKind, WarmupSignals, relative_deviation
from vismemo_hf.runtime.compress import LayerWindowStats, window_stats
from vismemo_hf.runtime.forward import AttentionCapture
from vismemo_hf.runtime.schedule import pad_rows, positions_of

OBSERVATION_FALLBACK = 16  # window size when no text follows the last image


class SignalCollector:
    """Attention captures, window statistics and deviations of one prefill's images (indexed as in the request)."""

    def __init__(self, adapter, cache, matches, batch: int, length: int, valid, device, window_stats: bool):
        self.adapter, self.cache, self.matches = adapter, cache, matches
        self.batch, self.length, self.valid, self.device = batch, length, valid, device
        self.wants_window_stats = window_stats
        self.attention: dict[int, list[torch.Tensor]] = {}  # image -> per warmup layer (H, rows, N)
        self.layer_stats: list[LayerWindowStats] = []
        self._window: list[torch.Tensor] | None = None
        self._partial_window: set[int] = set()  # rows whose window holds visual columns
        self._visual: torch.Tensor | None = None

    def window(self) -> list[torch.Tensor]:
        """Observation window per row: request columns of the text after the row's last image."""
        if self._window is None:
            self._window = []
            for b in range(self.batch):
                valid = self.valid[b].cpu() if self.valid is not None else torch.ones(self.length, dtype=torch.bool)
                ends = [m.start + m.n_tokens for m in self.matches if m.row == b]
                if not ends:
                    self._window.append(torch.empty(0, dtype=torch.long))
                    continue
                cols = torch.nonzero(valid[max(ends):]).flatten() + max(ends)
                if cols.numel() == 0:  # the row ends with an image: its last columns, which a layer may not compute
                    cols = torch.nonzero(valid).flatten()[-OBSERVATION_FALLBACK:]
                    self._partial_window.add(b)
                self._window.append(cols)
        return self._window

    def visual_columns(self) -> torch.Tensor:
        """(B, L) True at the visual tokens of the request's images."""
        if self._visual is None:
            self._visual = torch.zeros(self.batch, self.length, dtype=torch.bool, device=self.device)
            for m in self.matches:
                self._visual[m.row, m.start : m.start + m.n_tokens] = True
        return self._visual

    # -- per layer ----------------------------------------------------------------------------------------
    def capture(self, layer: int, active: torch.Tensor, watching: list[int]) -> AttentionCapture | None:
        """Ask the attention function for the window's softmax rows at ``layer`` when an image in ``watching``
        needs them or compression wants the window's statistics."""
        if not watching and not self.wants_window_stats:
            return None
        where = positions_of(active, self.length)
        idx = pad_rows([where[b, c.to(self.device)] for b, c in enumerate(self.window())], -1, self.device)
        return AttentionCapture(layer, idx.clamp(min=0), idx >= 0)

    def observe(self, capture: AttentionCapture | None, watching: list[int]) -> None:
        """After the layer ran: keep the attention of ``watching`` images and the layer's window statistics."""
        if capture is None:
            return
        probs = capture.probs
        assert probs is not None  # left by the attention function of the layer that ran
        layer = self.cache.layers[capture.layer]
        for i in watching:
            m = self.matches[i]
            slots = layer.slot_of(m.columns(torch.arange(m.n_tokens, device=self.device)), m.row)
            if m.row in self._partial_window:
                rows = probs[m.row][:, capture.valid[m.row]]
            else:  # text after the last image: every window column is computed, the valid rows come first
                rows = probs[m.row][:, : self.window()[m.row].numel()]
            self.attention.setdefault(i, []).append(rows[..., slots])  # read once, at the decision layer
        if self.wants_window_stats:
            self.layer_stats.append(window_stats(probs, capture.valid, layer.slot_columns(),
                                                 self.visual_columns()))

    # -- at the decision layer ----------------------------------------------------------------------------
    def signals(self, i: int, layer: int, needs, reader, hidden, active, cos, sin) -> WarmupSignals:
        """Everything routing may use (``WarmupSignals``) for image ``i``, gathered at ``layer``: the window's
        attention so far, the warmup layers' K/V deviation, the check layer's fresh and cached K/V."""
        m = self.matches[i]
        attention = self.attention.get(i)
        out = WarmupSignals(attention=torch.stack(attention).cpu() if attention else None,
                            span=(m.start, m.start + m.n_tokens), window=self.window()[m.row],
                            prefix_changed=m.prefix_changed, context_change=m.context_change)
        if needs.deviation and m.kind is not HitKind.EXACT:
            out.key_deviation, out.value_deviation = self._deviation(i, layer, reader)
        if needs.check_kv and layer < self.adapter.num_layers:
            out.fresh_kv = self._fresh_kv(i, layer, hidden, active, cos, sin)
            out.cached_kv = reader.cached_at(i, layer, fill=out.fresh_kv)
        return out

    def _deviation(self, i: int, layer: int, reader):
        """(layers, N) relative K and V deviation at every layer below ``layer`` (None, None: not all were read)."""
        m = self.matches[i]
        cols = m.columns(torch.arange(m.n_tokens, device=self.device))
        per_layer = []
        for at in range(layer):
            cache_layer = self.cache.layers[at]
            slots = cache_layer.slot_of(cols, m.row)
            fresh = cache_layer.keys[m.row][:, slots], cache_layer.values[m.row][:, slots]
            cached = reader.cached_at(i, at, fill=fresh)  # tokens a compressed alias lacks: no deviation
            if cached is None:
                return None, None
            per_layer.append(torch.stack([relative_deviation(f, c, host=False) for f, c in zip(fresh, cached)]))
        if not per_layer:
            return None, None
        both = torch.stack(per_layer).cpu()  # (layers, 2, N): one read for every layer
        return both[:, 0], both[:, 1]

    def _fresh_kv(self, i: int, layer: int, hidden, active, cos, sin):
        """K/V ``layer`` would compute for the image's tokens from this request's hidden states: (H, N, D) each."""
        m = self.matches[i]
        where = positions_of(active, self.length)[m.row, m.start : m.start + m.n_tokens]
        return self.adapter.fresh_kv(layer, hidden[m.row, where], cos[m.row, where], sin[m.row, where])

    def token_importance(self, i: int) -> torch.Tensor | None:
        """VL-Cache's ranking of image ``i``'s tokens, for a compressed entry: the window's attention to each token,
        per layer weighted by that layer's VDR x entropy."""
        if not self.layer_stats:
            return None
        m = self.matches[i]
        cols = m.columns(torch.arange(m.n_tokens, device=self.device))
        total = torch.zeros(m.n_tokens)
        for s in self.layer_stats:
            where = positions_of(s.columns[m.row][None], self.length)[0]
            slots = where[cols.to(where.device)]
            score = s.score[m.row][slots.clamp(min=0)].masked_fill(slots < 0, 0.0)
            total += float(s.vdr[m.row] * s.entropy[m.row]) * score.float().cpu()
        return total

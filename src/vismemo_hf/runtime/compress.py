"""VL-Cache compression (Tu et al., ICLR 2025; docs/METHOD.md §4): a smaller decoding KV cache.

After prefill each layer keeps a budget b_l of visual tokens, b_l proportional to
VDR(l) * H(l) -- the share of the observation window's attention that goes to visual
tokens, times that attention's entropy -- with the budgets summing to ``ratio`` of the
visual tokens over all layers. Per layer the visual tokens the window attends to most are
kept; text is never dropped. Dropped slots are removed from the layer, so decoding reads
and attends over fewer keys (memory and time fall with the ratio).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerWindowStats:
    """What one layer's observation window saw, per batch row."""

    score: torch.Tensor  # (B, S) mean attention of the window to each slot
    vdr: torch.Tensor  # (B,) share of that attention on visual slots
    entropy: torch.Tensor  # (B,) mean entropy (nats) of the window's attention rows
    columns: torch.Tensor  # (B, S) request column of each slot (-1 empty)


def window_stats(probs: torch.Tensor, window_valid: torch.Tensor, columns: torch.Tensor,
                 is_visual_column: torch.Tensor) -> LayerWindowStats:
    """Reduce (B, H, W, S) window attention to per-slot scores, VDR and entropy."""
    weight = window_valid[:, None, :, None].to(probs.dtype)
    rows = weight.sum(dim=(1, 2, 3)).clamp_min(1) * probs.shape[1]
    score = (probs * weight).sum(dim=(1, 2)) / rows[:, None]
    visual = is_visual_column.gather(1, columns.clamp(min=0)) & (columns >= 0)
    ent = -(probs * probs.clamp_min(1e-12).log()).sum(-1)  # (B, H, W)
    entropy = (ent * window_valid[:, None, :]).sum(dim=(1, 2)) / rows
    return LayerWindowStats(score, (score * visual).sum(-1), entropy, columns)


def allocate(weights: torch.Tensor, capacity: torch.Tensor, total: int) -> torch.Tensor:
    """Integer budgets proportional to ``weights``, each at most ``capacity``, summing to ``total``
    (water-filling, then largest remainders)."""
    weights = weights.double().clamp_min(0) + 1e-12
    capacity = capacity.long()
    total = min(int(total), int(capacity.sum()))
    budget = torch.zeros_like(capacity, dtype=torch.float64)
    free = torch.ones_like(capacity, dtype=torch.bool)
    left = float(total)
    for _ in range(len(weights)):
        if left <= 1e-9 or not free.any():
            break
        share = left * weights * free / (weights * free).sum()
        over = free & (budget + share >= capacity)
        if not over.any():
            budget += share
            break
        left -= float((capacity - budget)[over].sum())
        budget[over] = capacity[over].double()
        free &= ~over
    out = budget.floor().long()
    remainder = total - int(out.sum())
    if remainder > 0:
        room = (out < capacity)
        frac = (budget - out).masked_fill(~room, -1)
        out[torch.topk(frac, remainder).indices] += 1
    return out


@dataclass
class VLCacheCompression:
    """Keep ``ratio`` of the visual K/V for decoding, spread over layers as VL-Cache does.

    Pass as ``VisMemoCache(compress=VLCacheCompression(ratio=0.1))``. ``ratio=1.0`` keeps
    everything (identical to no compression).
    """

    ratio: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError("compression ratio must lie in (0, 1]")

    def keep(self, stats: list[LayerWindowStats], is_visual_column: torch.Tensor) -> list[torch.Tensor] | None:
        """Per layer, a (B, S) boolean of the slots to keep; None when nothing is dropped."""
        if self.ratio >= 1.0:
            return None
        batch = is_visual_column.shape[0]
        keep = []
        visual = [is_visual_column.gather(1, s.columns.clamp(min=0)) & (s.columns >= 0) for s in stats]
        for layer_stats, vis in zip(stats, visual):
            keep.append(~vis & (layer_stats.columns >= 0))  # text always stays
        for b in range(batch):
            n_vis = torch.tensor([int(v[b].sum()) for v in visual])
            if int(n_vis.sum()) == 0:
                continue
            weights = torch.stack([s.vdr[b] * s.entropy[b] for s in stats]).cpu()
            budgets = allocate(weights, n_vis, round(self.ratio * int(n_vis.sum())))
            for layer, (s, vis) in enumerate(zip(stats, visual)):
                k = int(budgets[layer])
                if k:
                    score = s.score[b].masked_fill(~vis[b], float("-inf"))
                    keep[layer][b, torch.topk(score, k).indices] = True
        return keep

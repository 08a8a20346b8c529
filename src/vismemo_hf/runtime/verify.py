"""Verifying a reuse while the layers run: the probes of a plan (``ImagePlan.verify``) against the alias's K/V.

A changed context's effect on an image's K/V can grow with depth where the check layer does not see it (the
image's tokens read the text before them in later layers). A plan that reuses tokens after such a change computes a
spread of its reuse candidates at every layer (the probes); after each layer their fresh K/V are compared with the
alias's, and the mean over probes of each one's largest relative deviation so far, scaled by the share of the image
the plan reuses, estimates how far the reused tokens are from what a full prefill would hold. At a few checkpoint
layers (``checkpoints``: one host sync each, not one per layer) a plan past its ``verify_tolerance`` fails: the runner
computes that image in full from its decision layer on (``ImagePlan.fallback == "context"``).
"""

from __future__ import annotations

import math

import torch

#: checkpoints per prefill after the decision layer (the last layer always is one)
CHECKPOINTS = 4


def checkpoints(first: int, n_layers: int) -> set[int]:
    """The layers after which the probes are judged: evenly spaced from ``first`` on, the last layer included."""
    if first >= n_layers:
        return set()
    stride = max(1, math.ceil((n_layers - first) / CHECKPOINTS))
    return set(range(first + stride - 1, n_layers, stride)) | {n_layers - 1}


class Verifier:
    """The probes of one prefill's plans; ``observe`` after every layer, ``failed`` at checkpoints."""

    def __init__(self, n_layers: int) -> None:
        self.n_layers = n_layers
        self._worst: dict[int, torch.Tensor] = {}  # image -> (probes,) largest relative deviation so far
        self._checks: dict[int, set[int]] = {}
        self.estimates: dict[int, float] = {}  # image -> the last judged estimate

    def watch(self, i: int, plan) -> None:
        """Start verifying image ``i``'s plan (from its warmup's end on) when it reuses tokens and has probes or a
        confidence guard (``verify_confidence``; without probes, no layer is judged)."""
        if plan is None or not plan.reuse.numel():
            return
        probes = plan.verify is not None and bool(plan.verify.numel())
        if probes or plan.verify_confidence > 0:
            self._worst.pop(i, None)
            self._checks[i] = checkpoints(plan.warmup_layers, self.n_layers) if probes else set()

    def forget(self, i: int) -> None:
        self._worst.pop(i, None)
        self._checks.pop(i, None)

    @property
    def active(self) -> bool:
        """Whether any watched plan has probes to observe."""
        return any(self._checks.values())

    @property
    def watched(self) -> list[int]:
        """The images whose plans are verified (and have not failed)."""
        return list(self._checks)

    def observe(self, layer: int, runs, cache, reader) -> None:
        """After ``layer`` ran: each watched plan's probes, fresh against cached, at that layer (device tensors)."""
        for i, layers in self._checks.items():
            run = runs[i]
            if not layers or layer < run.plan.warmup_layers:
                continue
            cached = reader.cached_at(i, layer)
            if cached is None:
                continue
            m = run.match
            probes = run.plan.verify
            cache_layer = cache.layers[layer]
            slots = cache_layer.slot_of(m.columns(probes.to(cache_layer.keys.device)), m.row)
            fresh = cache_layer.keys[m.row][:, slots], cache_layer.values[m.row][:, slots]
            dev = _relative(fresh[0], cached[0][:, probes.to(cached[0].device)]) + \
                _relative(fresh[1], cached[1][:, probes.to(cached[1].device)])
            worst = self._worst.get(i)
            self._worst[i] = dev if worst is None else torch.maximum(worst, dev)

    def failed(self, layer: int, runs) -> list[int]:
        """Images whose plans fail at ``layer`` (a checkpoint): their estimate is past their tolerance."""
        out = []
        for i, layers in list(self._checks.items()):
            if layer not in layers or i not in self._worst:
                continue
            plan = runs[i].plan
            estimate = float(self._worst[i].mean()) * plan.reuse.numel() / plan.n_tokens
            self.estimates[i] = estimate
            if estimate > plan.verify_tolerance:
                out.append(i)
        return out


def _relative(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """(H, P, D) x 2 -> (P,): squared distance per token over the mean squared norm of ``cached`` (as
    ``core.plan.relative_deviation``, on the device)."""
    fresh, cached = fresh.float(), cached.float().to(fresh.device)
    scale = cached.pow(2).sum(dim=(0, 2)).mean().clamp_min(1e-12)
    return (fresh - cached).pow(2).sum(dim=(0, 2)) / scale

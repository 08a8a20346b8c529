"""``attend-deviate`` (the default): recompute what changed or what the question attends to, reuse the rest.

Warmup attention alone does not find what an answer needs: later answer tokens look at other
tokens than the prefill's window does, and early layers may not attend to the answer region at
all, so a token masked or reused on attention alone turns into a wrong or stale answer. This
policy therefore:

1. recomputes R = the deviation *outliers*: tokens whose K/V deviate from the alias's (changed content, or
   changed context) by more than ``outlier_factor`` x the image's median deviation and ``min_deviation``, up to
   ``max_recompute_ratio``. By default that is all (``recompute_ratio=0``): the budget follows the evidence, so an
   edit of a few cells recomputes few tokens and a larger edit is not reused stale, while a shift or
   re-encoding, which moves every token a little, recomputes little. ``recompute_ratio`` > 0 adds a fixed share:
   at least that many tokens, ``deviation_share`` of them by deviation and the rest by warmup attention
   (``vismemo report pareto`` sweeps it; the default is its cheapest point at plain transformers' quality on
   both readers);
2. reuses every other token from the alias;
3. masks only what attention confidently rules out: tokens whose normalised warmup attention is
   below ``mask_below`` x uniform (1/N), the least attended first and at most ``max_mask_ratio`` of
   the image; ``mask_below=0`` masks nothing;
4. with ``restore_masked`` (default), gives decoding the alias's K/V of the masked tokens, so
   tokens generated later can still attend to them;
5. computes every token (an *early miss*, after the warmup; ``fallback="changed"``) when the image's median
   deviation exceeds ``miss_deviation``: the page changed everywhere (an alias that is another image altogether),
   and outliers measured against that median would reuse most of it stale; near-duplicates move a few tokens, and
   their median stays near 0 (``tests/test_rules.py``, rule 9). A copy changed everywhere a little (moved by part
   of a token, rescanned, blurred, sharpened: no region of its pixels kept) is computed in full from a lower
   median, ``drift_deviation``; below it, its outliers are every token deviating past ``drift_min_deviation``
   (its median measures how much its content changed, not a noise floor), and past ``max_recompute_ratio`` of them
   it is computed in full;
6. recomputes, with every token whose pixels changed in a local edit (at most ``local_share`` of the image), the
   tokens after it in its token row (``dependents``): the rest of a number, word or record reads it in later
   layers, where its deviation does not show at the warmup (``tests/test_context.py``); when a larger region
   changed and the rest is identical (an inserted row), every token from the first changed one on;
7. when the alias was computed after another context (the text, images or videos before the image), adds the
   context check of a small change (``RoutingPolicy.context_recompute``: the tokens the context moved at the check
   layer, and probes that verify the rest at every layer, docs/METHOD.md §3); a larger change, probes past their
   tolerance or an unsure next token compute the image in full (``fallback="context"`` / ``"uncertain"``);
8. with ``min_confidence`` > 0 (off by default), computes the image in full when the model is unsure of its next
   token after the reuse (at the prefill and the first ``watch_tokens`` generated tokens; ``fallback="uncertain"``).

The deviation of a token is the largest, over the warmup layers and the check layer, of its
relative K plus V deviation (``WarmupSignals``). Exact hits after another context are checked the same way
(``ContextRouting(routing="check")``, ``RoutingPolicy.context_plan``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vismemo_hf.core.pixel_first import partly_changed, region_changed, row_share
from vismemo_hf.core.plan import HitKind, ImageFeatures, ImagePlan, WarmupSignals
from vismemo_hf.policies.base import (
    ContextRouting,
    RoutingPolicy,
    approximate_plan,
    changed_tokens,
    reading_dependents,
    register_policy,
    split_by_score,
)
from vismemo_hf.policies.vismemo import warmup_score


def deviation_score(signals: WarmupSignals, n_tokens: int) -> torch.Tensor:
    """(N,) the largest relative K + V deviation of each token over the warmup and check layers."""
    layers: list[torch.Tensor] = []
    if signals.key_deviation is not None and signals.value_deviation is not None:
        layers.extend(signals.key_deviation + signals.value_deviation)
    check = signals.check_deviation
    if check is not None:
        layers.append(check[0] + check[1])
    if not layers:
        raise ValueError("attend-deviate needs K/V deviation signals (warmup or check layer)")
    return torch.stack([x.float().reshape(n_tokens) for x in layers]).amax(0)


@register_policy
@dataclass
class AttendDeviatePolicy(RoutingPolicy):
    name: ClassVar[str] = "attend-deviate"
    needs_attention: ClassVar[bool] = True
    needs_deviation: ClassVar[bool] = True
    needs_check_kv: ClassVar[bool] = True

    warmup_layers: int = 1
    recompute_ratio: float = 0.0
    #: share of the recompute budget picked by deviation (the rest by attention)
    deviation_share: float = 0.5
    outlier_factor: float = 4.0
    min_deviation: float = 0.01
    max_recompute_ratio: float = 0.6
    mask_below: float = 0.1
    max_mask_ratio: float = 0.05
    restore_masked: bool = True
    #: median relative K + V deviation above which the image is computed in full (None: never)
    miss_deviation: float | None = 0.5
    #: the same for a copy changed everywhere a little (more than ``local_share`` of its tokens' pixels changed and no
    #: region of them kept, as after a move by part of a token, a rescan, a zoom): its reused tokens deviate about as
    #: much as its median, and past this bound the tiny reader's answers changed on pages moved by 1-3 pixels. None:
    #: never
    drift_deviation: float | None = 0.1
    #: a copy changed everywhere (as for ``drift_deviation``) below that bound recomputes every token whose deviation
    #: exceeds this, not ``outlier_factor`` x its median: the median measures how much its content changed, not a
    #: noise floor, and tokens reused at a larger bound changed digits on brightened and blurred pages of the base
    #: reader (``results/quality/unseen-changes-drift-0.01.md``); past ``max_recompute_ratio`` it is computed in full. None:
    #: outliers against the median, as for a local edit
    drift_min_deviation: float | None = 0.003
    #: a local edit's reading-order dependents: the tokens after each token whose pixels changed, in its token row,
    #: are recomputed with it (``reading_dependents``): ``"row"`` (the rest of the row), a count, or 0 (none)
    dependents: int | str = "row"
    #: an edit is local when at most this share of the image's tokens changed pixels (a shift or a rescan changes
    #: them all and has no dependents)
    local_share: float = 0.25
    #: a hit after another context is checked (``ContextRouting``), not reused whole
    context: ContextRouting = field(default_factory=lambda: ContextRouting(routing="check"))
    #: an approximate hit in the same context whose next token the model is unsure of (top probability below this,
    #: at the prefill and at each of the first ``watch_tokens`` generated tokens) is computed in full there, as after
    #: another context (``runtime/watch.py``): a near tie between two answers flips under
    #: any approximation. Off (0) by default: an open-ended answer has unsure tokens among its first ones, and a
    #: model with random weights is unsure of every token, so the guard would compute most such hits twice
    min_confidence: float = 0.0
    watch_tokens: int = 16
    #: an approximate hit found by its pixels encodes only its changed tokens, which attend at every full-attention
    #: tower block to the alias's kept tower K/V of the other patches (``RoutingPolicy.reuses_encoder``,
    #: ``families.tower_kv``; docs/METHOD.md §1 step 2): their output agrees closely with a whole-image encode on both
    #: readers (``results/quality/encoder-reuse.md``); entries then keep the tower's K/V
    reuse_encoder: bool = True
    #: a local edit (``local_share``) that changed more than this share of one token row's tokens (a selected or
    #: highlighted row, a bar across the page: a band of changed colour next to every patch of the row) is not lent:
    #: its image is encoded whole (``vismemo report context``'s ``select-row`` / ``highlight-row`` classes,
    #: ``results/quality/rows/``)
    lend_row_share: float = 0.67
    #: an approximate hit whose plan would recompute more than this share of its tokens is computed in full
    #: (``fallback="changed"``): what it reuses sits next to a large change, and it saves at most the rest of a
    #: prefill. On the context report's selected (inverted) rows the tiny reader's answers changed under plans of
    #: 0.35-0.8 of the image (``results/quality/rows/``). None: never
    full_ratio: float | None = 0.35

    def __post_init__(self) -> None:
        super().__post_init__()
        if not all(0.0 <= x <= 1.0 for x in (self.deviation_share, self.max_recompute_ratio, self.max_mask_ratio)):
            raise ValueError("deviation_share, max_recompute_ratio and max_mask_ratio must lie in [0, 1]")
        if self.outlier_factor <= 0 or self.min_deviation < 0 or self.mask_below < 0:
            raise ValueError("outlier_factor must be > 0, min_deviation and mask_below >= 0")
        if self.miss_deviation is not None and not self.miss_deviation >= 0:
            raise ValueError("miss_deviation must be >= 0 or None")
        if self.drift_deviation is not None and not self.drift_deviation >= 0:
            raise ValueError("drift_deviation must be >= 0 or None")
        if self.drift_min_deviation is not None and not self.drift_min_deviation >= 0:
            raise ValueError("drift_min_deviation must be >= 0 or None")
        if not (self.dependents == "row" or (isinstance(self.dependents, int) and self.dependents >= 0)):
            raise ValueError(f"dependents must be 'row' or a count >= 0, got {self.dependents!r}")
        if not 0.0 <= self.local_share <= 1.0:
            raise ValueError("local_share must lie in [0, 1]")
        if not 0.0 <= self.min_confidence <= 1.0 or self.watch_tokens < 0:
            raise ValueError("min_confidence must lie in [0, 1], watch_tokens >= 0")
        if self.full_ratio is not None and not 0.0 <= self.full_ratio <= 1.0:
            raise ValueError("full_ratio must lie in [0, 1] or be None")

    def reuses_encoder(self) -> bool:
        return self.reuse_encoder

    def lends_encoder(self, prefix_changed: bool, context_change: int | None, changed: torch.Tensor | None = None,
                      rows: torch.Tensor | None = None) -> bool:
        if changed is not None and rows is not None and changed.numel() and rows.numel() == changed.numel() and \
                float(changed.float().mean()) <= self.local_share and row_share(changed, rows) > self.lend_row_share:
            return False
        return super().lends_encoder(prefix_changed, context_change)

    def prefetch_tokens(self, image: ImageFeatures, alias: ImageFeatures) -> torch.Tensor:
        return torch.arange(image.n_tokens)  # every token not recomputed is reused

    def select(self, deviation: torch.Tensor, attention: torch.Tensor, n: int,
               threshold: float | None = None) -> torch.Tensor | None:
        """R, sorted: deviation first (outliers past ``threshold``, by default ``outlier_factor`` x the median, at
        least ``min_deviation``; capped), then attention. None: an absolute ``threshold`` with more outliers than the
        cap (the image is computed in full)."""
        budget = self.budget(self.recompute_ratio, n)
        by_deviation = self.budget(self.deviation_share * self.recompute_ratio, n)
        cap = max(self.budget(self.max_recompute_ratio, n), budget)
        absolute = threshold is not None
        if threshold is None:
            threshold = max(self.outlier_factor * float(deviation.median()), self.min_deviation)
        outliers = int((deviation > threshold).sum())
        if absolute and outliers > cap:
            return None
        chosen, _ = split_by_score(deviation, torch.arange(n), min(max(by_deviation, outliers), cap))
        free = torch.ones(n, dtype=torch.bool)
        free[chosen] = False
        top, _ = split_by_score(attention, torch.nonzero(free).flatten(), budget - by_deviation)
        return torch.cat([chosen, top]).sort().values

    def pixel_recompute(self, image: ImageFeatures, alias: ImageFeatures) -> list[torch.Tensor]:
        """What the tokens whose pixels changed make recomputed: a local edit (at most ``local_share`` of the tokens,
        at most ``core.pixel_first.LOCAL_CHANGE`` of the distinctive ones), its tokens and their reading-order
        ``dependents``; a larger region changed with the rest of the image identical (``partly_changed``,
        ``region_changed``: an inserted row moves everything below it, a tall popup covers much of what is read),
        every token from the first changed one on. The tokens before it read nothing that changed, so with the same
        context their K/V are what a full prefill computes; after it, even an unchanged token read the old content
        (on the tiny reader a reuse of those changed answers in the context report's insert-row class). A change of
        every token (a shift, a rescan) is left to the deviation outliers."""
        changed = changed_tokens(image, alias)
        if changed is None or not bool(changed.any()):
            return []
        n = image.n_tokens
        mine, theirs, rows = image.patch_hashes, alias.patch_hashes, image.token_rows
        region = region_changed(mine, theirs, image.token_heights)  # one band per region, whatever the views
        if int(changed.sum()) <= self.local_share * n and not region:  # with dependents 0: themselves
            return [torch.nonzero(reading_dependents(changed, rows, self.dependents)).flatten()]
        if region or partly_changed(mine, theirs):
            return [torch.arange(int(torch.nonzero(changed.cpu())[0]), n)]
        return []

    def changed_everywhere(self, image: ImageFeatures, alias: ImageFeatures) -> bool:
        """Whether more than ``local_share`` of the image's tokens show other pixels than the alias's (unknown
        hashes count as changed everywhere)."""
        changed = changed_tokens(image, alias)
        return changed is None or int(changed.sum()) > self.local_share * image.n_tokens

    def plan(self, image: ImageFeatures, alias: ImageFeatures, prefetched: torch.Tensor,
             signals: WarmupSignals) -> ImagePlan:
        n = image.n_tokens
        deviation = deviation_score(signals, n)
        if self.miss_deviation is not None and float(deviation.median()) > self.miss_deviation:
            return ImagePlan.full(HitKind.APPROXIMATE, n, alias.key, fallback="changed")  # changed everywhere
        by_pixels = self.pixel_recompute(image, alias)
        everywhere = not by_pixels and self.changed_everywhere(image, alias)
        if self.drift_deviation is not None and everywhere and float(deviation.median()) > self.drift_deviation:
            return ImagePlan.full(HitKind.APPROXIMATE, n, alias.key, fallback="changed")
        attention = warmup_score(signals, n)
        chosen = self.select(deviation, attention, n, self.drift_min_deviation if everywhere else None)
        if chosen is None:
            return ImagePlan.full(HitKind.APPROXIMATE, n, alias.key, fallback="changed")
        recompute = [chosen, *by_pixels]
        probes = None
        if signals.prefix_changed and self.context.routing == "check":  # the alias was computed after another context
            context = self.context_recompute(signals, n)
            if context is None:
                return ImagePlan.full(HitKind.APPROXIMATE, n, alias.key, fallback="context")
            recompute.append(context[0])
            probes = context[1]
        recompute = torch.unique(torch.cat(recompute))
        if self.full_ratio is not None and recompute.numel() > self.full_ratio * n:
            return ImagePlan.full(HitKind.APPROXIMATE, n, alias.key, fallback="changed")
        rest = torch.ones(n, dtype=torch.bool)
        rest[recompute] = False
        mask = torch.zeros(0, dtype=torch.long)
        if self.mask_below > 0 and signals.attention is not None and signals.attention.shape[0]:
            unlikely = torch.nonzero(rest & (attention < self.mask_below / n)).flatten()
            mask, _ = split_by_score(-attention, unlikely, self.budget(self.max_mask_ratio, n))
            rest[mask] = False
        reuse = torch.nonzero(rest).flatten()
        extra = self.verification(probes, signals) if probes is not None else \
            {"verify_confidence": self.min_confidence, "verify_watch": self.watch_tokens if self.min_confidence else 0}
        return approximate_plan(self, image, alias, recompute, reuse, mask, restore_masked=self.restore_masked, **extra)

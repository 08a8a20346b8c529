"""Steps 2-3 of the data path for one prefill with hits: plan each image, then run the layers over the columns the
plans compute, reusing the rest from the alias (replaces the language model's forward for that prefill).

The loop is the only caller of its collaborators, each owning its state: the ``Schedule`` (active columns and slot
layouts), the ``AliasReader`` (every read of cached K/V), the ``SignalCollector`` (what the warmup observes) and
``writeback`` (complete images become entries). Layers are the model's own, called one by one; reused and masked
tokens cost no query or FFN work.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, cast

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from vismemo_hf.core.plan import CacheEvent, HitKind, ImagePlan
from vismemo_hf.runtime import prefix as prefixes
from vismemo_hf.runtime.alias import AliasReader, stored_tokens
from vismemo_hf.runtime.forward import ForwardContext
from vismemo_hf.runtime.lookup import ImageMatch, PrefillRequest
from vismemo_hf.runtime.rerun import Rerun, Scope
from vismemo_hf.runtime.schedule import ActiveStates, ImageSpan, Layout, Schedule, causal_mask, padded_on_device
from vismemo_hf.runtime.signals import SignalCollector
from vismemo_hf.runtime.verify import Verifier
from vismemo_hf.runtime.watch import Watch
from vismemo_hf.runtime.writeback import complete_later, reused_encoder, write_entries
from vismemo_hf.store.faults import store_call

if TYPE_CHECKING:
    from vismemo_hf.runtime.cache import VisMemoLayer

logger = logging.getLogger(__name__)


@dataclass
class ImageRun:
    """The runner's state for one image: its match (``as_miss()`` once its alias cannot be used), where its
    tokens sit in M-RoPE positions, its plan and what was read for it before warmup."""

    match: ImageMatch
    offset: int = 0
    plan: ImagePlan | None = None
    prefetched: torch.Tensor | None = None
    timings: dict = field(default_factory=dict)
    verify_estimate: float | None = None

    @property
    def planned(self) -> ImagePlan:
        """``plan``, read where it is made already (a watched image's, every image's once the layers ran)."""
        assert self.plan is not None, "the image has no plan yet"
        return self.plan

    def span(self) -> ImageSpan:
        return ImageSpan(self.match.row, self.match.start, self.match.n_tokens, self.plan)

    def event(self, reader: AliasReader | None, i: int) -> CacheEvent:
        m, plan = self.match, self.planned
        timings = {"lookup": m.lookup_ms, "encoder": m.encoder_ms, **(reader.timings(i) if reader else {}),
                   **self.timings}
        return CacheEvent(kind=m.kind, alias=m.alias.key if m.alias is not None else None, key=m.features.key,
                          row=m.row, n_tokens=m.n_tokens, recomputed=plan.recompute.numel(), reused=plan.reuse.numel(),
                          masked=plan.mask.numel(), score=m.score, timings=timings, plan=plan,
                          prefix_changed=m.prefix_changed, bytes_read=reader.bytes_read(i) if reader else 0,
                          lookup_bytes=m.lookup_bytes, shift=m.alias.shift if m.alias is not None else (0, 0),
                          pixel_score=m.pixel_score, fallback=plan.fallback, verify_estimate=self.verify_estimate,
                          drift=m.drift, context_change=m.context_change, found_by=m.found_by,
                          encoded_tokens=m.n_tokens if m.encoded_tokens is None else m.encoded_tokens)


def whole_encoded(matches: list[ImageMatch], images: dict[int, str], inputs_embeds: torch.Tensor,
                  visual_pos_masks: torch.Tensor | None, deepstack: list | None) -> tuple[list, torch.Tensor, list | None]:
    """(matches, inputs_embeds, deepstack features) with the ``images`` lent encoder output given their own whole
    encode (a demoted one, fallback "miss", as a miss): their rows of the text model's inputs and of Qwen3-VL's
    deepstack features replaced (new tensors; the ones given are left as they are)."""
    matches, embeds = list(matches), inputs_embeds.clone()
    ranks = None
    if deepstack is not None and visual_pos_masks is not None:
        ranks = (visual_pos_masks.reshape(-1).long().cumsum(0) - 1).reshape(visual_pos_masks.shape)
        deepstack = [d.clone() for d in deepstack]
    for i, fallback in images.items():
        m = matches[i]
        if m.whole_encode is None:
            continue
        m = m.whole_encode(m)
        m = m.as_miss() if fallback == "miss" else m
        columns = m.columns(torch.arange(m.n_tokens, device=embeds.device))
        embeds[m.row, columns] = m.embeds.to(embeds.device, embeds.dtype)
        if ranks is not None and deepstack is not None and m.deepstack is not None:  # ranks: only with deepstack
            at = ranks[m.row, columns.to(ranks.device)]
            for level, features in enumerate(deepstack):
                features[at.to(features.device)] = m.deepstack[level].to(features.device, features.dtype)
        matches[i] = m
    return matches, embeds, deepstack


def _positions(position_ids: torch.Tensor | None, batch: int = 1, length: int = 0, device=None) -> torch.Tensor:
    """(3, B, L) positions of a prefill: the model's M-RoPE ids, 1-D ids repeated, or (none given: a 1-D model
    called without them) the columns, as the language model itself would number them."""
    if position_ids is None:
        position_ids = torch.arange(length, device=device).expand(batch, -1)
    return (position_ids[None].expand(3, -1, -1) if position_ids.ndim == 2 else position_ids)[-3:]


def _offsets(positions: torch.Tensor, matches) -> list[int]:
    """The first position of each image: one read for all of them."""
    if not matches:
        return []
    rows = torch.tensor([m.row for m in matches], device=positions.device)
    starts = torch.tensor([m.start for m in matches], device=positions.device)
    return [int(p) for p in positions[0, rows, starts].tolist()]


class PrefillRunner:
    """One prefill with images: plans, reads, the layer loop, entries and events."""

    def __init__(self, adapter, ctx: ForwardContext, request: PrefillRequest, inputs_embeds, attention_mask,
                 position_ids, forced: dict[int, str] | None = None):
        #: images computed in full from the start, and why (a ``Rerun`` from the whole encode found it so)
        self.forced = forced or {}
        self.adapter, self.ctx, self.cache, self.policy = adapter, ctx, ctx.cache, ctx.cache.policy
        self.batch, self.length, _ = inputs_embeds.shape
        self.positions = _positions(position_ids, self.batch, self.length, inputs_embeds.device)
        self.position_ids = position_ids
        valid = attention_mask.bool() if attention_mask is not None and attention_mask.ndim == 2 else None
        self.valid = None if valid is None or bool(valid.all()) else valid
        self.runs = [ImageRun(m, at) for m, at in zip(request.images, _offsets(self.positions, request.images))]
        #: the images lent their alias's encoder output (``ImageMatch.whole_encode``), found once: most prefills have none
        self._lent = {i for i, r in enumerate(self.runs) if r.match.whole_encode is not None}
        device = inputs_embeds.device
        self.schedule = Schedule(self.batch, self.length, self.valid, device)
        self.reader = AliasReader(adapter, self.cache.store, [r.match for r in self.runs],
                                  self.cache.owner(adapter.fingerprint))
        stats = self.cache.compress is not None or (self.cache.store_misses and self.cache.store.keep_ratio is not None)
        self.signals = SignalCollector(adapter, self.cache, [r.match for r in self.runs], self.batch, self.length,
                                       self.valid, device, window_stats=stats)
        self._plain = Layout(None, causal_mask(self.batch, self.length, self.valid, device), [])
        self.verifier = Verifier(adapter.num_layers)
        #: (layer, states, time) to run the layers from again when a plan fails verification
        self._snapshot: tuple[int, tuple, float] | None = None
        #: (plans, columns) of the masked tokens given back for decoding
        self._kept: tuple[tuple[ImagePlan | None, ...], torch.Tensor] | None = None
        self.prefix = request.prefix  # its blocks are written up to the first image not computed as in full

    # -- planning -----------------------------------------------------------------------------------------
    def _demote(self, i: int) -> None:
        run = self.runs[i]
        logger.warning("vismemo: alias K/V of %s unavailable; running a full prefill of the image",
                       run.match.features.key[:12])
        run.match = run.match.as_miss()
        run.plan = self.policy.miss_plan(run.match.features)
        self.reader.forget(i)

    def _start(self) -> None:
        """Plans that need no warmup, and the reads that overlap the warmup."""
        for i, run in enumerate(self.runs):
            m = run.match
            if i in self.forced and m.kind is not HitKind.MISS:
                assert m.alias is not None  # a hit has the alias it was found by
                run.plan = ImagePlan.full(m.kind, m.n_tokens, m.alias.key, fallback=self.forced[i])
            elif m.kind is HitKind.APPROXIMATE and not m.aligned:  # warped: its tokens do not show what the alias's did
                assert m.alias is not None  # a hit has the alias it was found by
                run.plan = ImagePlan.full(HitKind.APPROXIMATE, m.n_tokens, m.alias.key, fallback="warp")
            else:
                run.plan = self.policy.early_plan(m.kind, m.features, m.alias, m.prefix_changed, self.adapter.num_layers,
                                                  m.context_change)
            if m.kind is HitKind.MISS:
                continue
            if run.plan is not None:
                if not self.reader.bind(i, run.plan, run.offset):
                    self._demote(i)
                continue
            assert m.alias is not None  # a hit left to plan later: ``early_plan`` checked its alias
            t0 = time.perf_counter()
            run.prefetched, first = self.policy.prefetch(m.kind, m.features, m.alias)
            run.timings["plan"] = (time.perf_counter() - t0) * 1e3
            if run.prefetched.numel():
                self.reader.fetch(i, run.prefetched, first, run.offset, background=m.kind is HitKind.APPROXIMATE)
        self._whole_encodes()

    def _whole_encodes(self) -> None:
        """Raise a ``Rerun`` from the whole encode when an image lent encoder output is computed in full: its plan
        computes every token."""
        if not self._lent:
            return
        need = {i: "miss" if self.runs[i].match.kind is HitKind.MISS else plan.fallback or "recomputed"
                for i in self._lent if (plan := self.runs[i].plan) is not None and plan.complete}
        if need:
            raise Rerun(need, Scope.ENCODE)

    def reset(self, first: int, images: dict[int, str]) -> None:
        """What a rerun throws away (``runtime.rerun``), in one place: ``images`` computed in full (each plan and
        its fallback, its alias reads and verification forgotten), the cache's layers from ``first`` on, the warmup
        statistics of those layers, the forward's layout and capture."""
        t0 = self._snapshot[2] if self._snapshot is not None else time.perf_counter()
        for i, reason in images.items():
            run = self.runs[i]
            m = run.match
            logger.info("vismemo: the reuse of %s is computed in full (%s, estimate %.4g)", m.features.key[:12], reason,
                        self.verifier.estimates.get(i, float("nan")))
            run.plan = ImagePlan.full(m.kind, m.n_tokens, m.alias.key if m.alias is not None else None,
                                      fallback=reason)
            run.timings["rewind"] = (time.perf_counter() - t0) * 1e3
            self.verifier.forget(i)
            self.reader.forget(i)
        self.cache.drop_layers(first)
        self.signals.layer_stats = self.signals.layer_stats[:first]
        self.ctx.layout, self.ctx.capture = None, None

    def abandon(self) -> None:
        """Throw away all this run computed (a ``Rerun`` from the whole encode): every layer, every read."""
        self.reset(0, {})
        self.reader.close()

    def _decide(self, layer: int, states: ActiveStates) -> None:
        """Plans due before ``layer``, made from what the layers below it observed."""
        for i, run in enumerate(self.runs):
            kind = run.match.kind
            if run.plan is not None or self.policy.decision_layer(kind) != layer:
                continue
            if not self.reader.wait(i):  # the prefetch failed: no alias K/V to reuse
                self._demote(i)
                continue
            # left to plan here: a hit whose reads ``_start`` began (its alias checked by ``early_plan``)
            assert run.match.alias is not None and run.prefetched is not None
            t0 = time.perf_counter()
            signals = self.signals.signals(i, layer, self.policy.signal_needs(kind), self.reader, states.hidden,
                                           states.columns, states.cos, states.sin)
            run.plan = self.policy.route(kind, run.match.features, run.match.alias, run.prefetched, signals)
            run.timings["plan"] = run.timings.get("plan", 0.0) + (time.perf_counter() - t0) * 1e3
            if not self.reader.bind(i, run.plan, run.offset):
                self._demote(i)
                continue
            self.verifier.watch(i, run.plan)
            if i in self.verifier.watched and self._snapshot is None:  # probes or a confidence guard may fail it
                self._snapshot = (layer, states.snapshot(), time.perf_counter())
        self._whole_encodes()

    def _rewind(self, failed: list[int], states: ActiveStates, reason: str) -> int:
        """A ``Rerun`` of the ``failed`` plans' images from the layers: reset from the first decision layer with
        probes, its states restored; one of them lent encoder output widens it to the whole encode. Returns that
        layer."""
        rerun = Rerun({i: reason for i in failed}, Scope.LAYERS)
        if self._lent.intersection(rerun.images):
            raise rerun.widened(Scope.ENCODE)
        assert self._snapshot is not None  # failed plans are watched ones, and the first watched plan took it
        first, snapshot, _ = self._snapshot
        self.reset(first, rerun.images)
        states.restore(snapshot)
        self._snapshot = (first, snapshot, time.perf_counter()) if self.verifier.watched else None
        return first

    def _watching(self) -> list[int]:
        """Images still warming up whose routing reads the window's attention."""
        return [i for i, r in enumerate(self.runs) if r.plan is None and r.match.kind is HitKind.APPROXIMATE
                and self.policy.signal_needs(r.match.kind).attention]

    def _plans(self) -> dict:
        return {i: r.plan for i, r in enumerate(self.runs) if r.plan is not None}

    def _restored(self, layer: int) -> torch.Tensor | None:
        """(B, K) columns of the masked tokens given back for decoding at ``layer`` (their slots are kept free)."""
        given = [r for r in self.runs if r.plan is not None and r.plan.restore_masked and r.plan.mask.numel()
                 and layer >= r.plan.warmup_layers]
        if not given:
            return None
        key = tuple(r.plan for r in given)  # one tensor per set of plans: the schedule recognises it at each layer
        if self._kept is None or len(self._kept[0]) != len(key) or any(a is not b for a, b in zip(self._kept[0], key)):
            rows: list[list[torch.Tensor]] = [[] for _ in range(self.batch)]
            for run in given:
                rows[run.match.row].append(run.match.columns(stored_tokens(run.match.alias, run.planned.mask)))
            self._kept = (key, padded_on_device([torch.cat(r) if r else torch.empty(0, dtype=torch.long) for r in rows],
                                                -1, self.schedule.device))
        return self._kept[1]

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self, inputs_embeds, visual_pos_masks=None, deepstack_visual_embeds=None) -> BaseModelOutputWithPast:
        t_start = time.perf_counter()
        self._start()
        cos, sin = self.adapter.rope(inputs_embeds, self.positions)
        states = ActiveStates(self.schedule.all_columns, inputs_embeds, cos, sin)
        deepstack = _DeepstackAdder(visual_pos_masks, deepstack_visual_embeds)
        self._t_warm_end: float | None = None
        self._layers(states, deepstack, 0)
        uncertain = self._uncertain(states)
        if uncertain:
            self._layers(states, deepstack, self._rewind(uncertain, states, "uncertain"))
        self.ctx.layout = None
        hidden = self.adapter.final_norm(states.result())
        t_end = time.perf_counter()
        events = self._finish(t_start, self._t_warm_end or t_end, t_end)
        watched = [i for i in self.verifier.watched if self.runs[i].planned.verify_watch]
        if watched and self.adapter.output_head is not None:
            plans = [self.runs[i].planned for i in watched]
            self.cache.watch = Watch(inputs_embeds, self.position_ids, visual_pos_masks, deepstack_visual_embeds,
                                     max(p.verify_confidence for p in plans), max(p.verify_watch for p in plans),
                                     [events[i] for i in watched], self._whole_inputs(inputs_embeds, visual_pos_masks,
                                                                                      deepstack_visual_embeds))
        return BaseModelOutputWithPast(last_hidden_state=hidden, cache=self.cache)

    def _whole_inputs(self, inputs_embeds, visual_pos_masks, deepstack):
        """What gives a watch's repair (which computes the whole sequence in full) the text model's inputs with every
        image lent encoder output given its own whole encode; None: no image was."""
        if not self._lent:
            return None
        lent, matches = dict.fromkeys(self._lent, "uncertain"), [r.match for r in self.runs]
        return lambda: whole_encoded(matches, lent, inputs_embeds, visual_pos_masks, deepstack)[1:]

    def _layers(self, states: ActiveStates, deepstack, layer: int) -> None:
        """The decoder layers from ``layer`` on (again from a decision layer when a plan fails verification)."""
        while layer < self.adapter.num_layers:
            self._decide(layer, states)
            if self._t_warm_end is None and all(r.plan is not None for r in self.runs):
                self._t_warm_end = time.perf_counter()
            states.narrow(self.schedule.active(layer, [r.span() for r in self.runs]))
            reused = self.reader.reused(layer, self._plans(), self.batch)
            reused_columns = None if reused is None else reused[2]
            if self.schedule.is_plain(states.columns, reused_columns):
                self.ctx.layout = self._plain
            else:
                writer, self.ctx.layout = self.schedule.layout(states.columns, reused_columns, self._restored(layer))
                self.cache.layer(layer).open(writer)
                if reused is not None:
                    self.cache.layer(layer).preload(*reused)
            watching = self._watching()
            self.ctx.capture = self.signals.capture(layer, states.columns, watching)
            states.hidden = self.adapter.run_layer(layer, states.hidden, None, states.cos, states.sin, self.cache)
            self.signals.observe(self.ctx.capture, watching)
            self.ctx.capture = None
            states.hidden = deepstack(layer, states.hidden, states.columns)
            if self.verifier.active:
                self.verifier.observe(layer, self.runs, self.cache, self.reader)
                failed = self.verifier.failed(layer, self.runs)
                if failed:
                    layer = self._rewind(failed, states, "context")
                    continue
            layer += 1

    def _uncertain(self, states: ActiveStates) -> list[int]:
        """Verified images of rows whose next token the model is unsure of (top probability below the plan's
        ``verify_confidence``): any approximation may change such an answer, so they are computed in full."""
        watched = self.verifier.watched
        head = self.adapter.output_head
        if not watched or head is None:
            return []
        last = self.adapter.final_norm(states.result()[:, -1:])
        top = torch.softmax(head(last).float(), -1).amax(-1)[:, 0].cpu()
        return [i for i in watched if float(top[self.runs[i].match.row]) < self.runs[i].planned.verify_confidence]

    def _finish(self, t_start: float, t_warm_end: float, t_end: float) -> list[CacheEvent]:
        """After the layers: restored tokens for decoding, entries, compression, the settled layout, the events (in
        the request's order, returned)."""
        cache, plans = self.cache, self._plans()
        for layer, keys, values, columns in self.reader.restore(plans, {i: r.offset for i, r in enumerate(self.runs)},
                                                                self.batch):
            cache.layer(layer).preload(keys, values, columns)
        done = [(i, r.match, r.plan, r.offset) for i, r in enumerate(self.runs)]
        write_entries(self.adapter, cache, done, self.signals.token_importance)
        lossless = cache.store.kv_format is None and cache.store.keep_ratio is None
        # the first column of each row whose K/V are not a full prefill's: the prefix blocks and the completed
        # images end before it
        exact_until = [self.length] * self.batch
        for r in self.runs:
            if not exact_kv(r, lossless):
                exact_until[r.match.row] = min(exact_until[r.match.row], r.match.start)
        complete_later(self.adapter, cache, done, self.positions,
                       lambda i: self.runs[i].match.start <= exact_until[self.runs[i].match.row])
        for i, estimate in self.verifier.estimates.items():
            self.runs[i].verify_estimate = estimate
        for layer in cast("list[VisMemoLayer]", cache.layers):  # every layer of the cache is one (``VisMemoCache.layer``)
            layer.settle(self.length)
        prefixes.write(cache, self.prefix, exact_until[0])
        if cache.compress is not None and self.runs:
            keep = cache.compress.keep(self.signals.layer_stats, self.signals.visual_columns())
            for layer, kept in zip(cast("list[VisMemoLayer]", cache.layers), keep or []):
                layer.keep_slots(kept)
        events = []
        for i, run in enumerate(self.runs):
            warm = (t_warm_end - t_start) * 1e3 if run.match.kind is HitKind.APPROXIMATE else 0.0
            run.timings.update(warmup=warm, recompute=(t_end - t_warm_end) * 1e3)
            events.append(run.event(self.reader, i))
            record_event(cache, events[-1])
        return events


def exact_kv(run: ImageRun, lossless: bool) -> bool:
    """Whether an image's K/V are what a full prefill computes: computed at every layer from its own encoder output,
    or an exact hit reused whole after the same context from a store that keeps K/V as computed (``lossless``: no
    8-bit format, no compressed entries)."""
    m, plan = run.match, run.planned
    if m.kind is HitKind.EXACT and not plan.complete:
        assert m.alias is not None  # a hit has the alias it was found by
        return lossless and not m.prefix_changed and plan.mask.numel() == 0 and m.alias.kv_tokens is None
    return plan.complete and not reused_encoder(m)


class _DeepstackAdder:
    """Qwen3-VL's deepstack: the tower's intermediate features added to the visual tokens after the first layers."""

    def __init__(self, visual_pos_masks, embeds) -> None:
        self.embeds, self.rank = embeds, None
        if embeds is not None and visual_pos_masks is not None:
            flat = visual_pos_masks.reshape(-1).long()
            self.rank = (flat.cumsum(0) - 1).reshape(visual_pos_masks.shape).masked_fill(~visual_pos_masks, -1)

    def __call__(self, layer: int, hidden, columns):
        if self.rank is None or layer >= len(self.embeds):
            return hidden
        features = self.embeds[layer]
        if features.shape[0] == 0:
            return hidden
        # an exact hit's features come from the store, on the host: moved once here (an asynchronous copy)
        features = features.to(hidden.device, hidden.dtype, non_blocking=True)
        r = self.rank.gather(1, columns.clamp(min=0)).masked_fill(columns < 0, -1)
        # every column gathers a feature and the non-visual ones add nothing: no selection, whose size is a read
        ok = (r >= 0)[..., None]
        added = features[r.clamp(min=0)]
        return torch.where(ok, hidden + added, hidden)


def record_event(cache, event: CacheEvent) -> None:
    cache.events.append(event)
    store_call("stats", lambda: cache.store.record(event.kind, prefix_changed=event.prefix_changed,
                                                   fallback=event.fallback), None)


def computed_in_full(adapter, cache, request: PrefillRequest) -> list[ImagePlan] | None:
    """Each image's plan when every image of ``request`` is computed at every layer before any layer runs (a miss, or
    a hit the routing computes in full from the start: ``RoutingPolicy.early_plan`` after a context change that is not
    small, a warped copy), from its own encoder output; else None. Such a prefill reuses nothing: the model's own
    forward runs it, as a miss's, and the plans give its events and entries (``finish_native``)."""
    if cache.compress is not None or (cache.store_misses and cache.store.keep_ratio is not None):
        return None  # the runner's statistics choose what a compressed cache or entry keeps
    plans = []
    for m in request.images:
        if m.kind is HitKind.MISS:
            plans.append(cache.policy.miss_plan(m.features))
            continue
        if m.whole_encode is not None or m.alias is None or reused_encoder(m):
            return None  # encoder output partly its alias's: the runner encodes it whole, or completes it later
        if m.kind is HitKind.APPROXIMATE and not m.aligned:
            plan = ImagePlan.full(HitKind.APPROXIMATE, m.n_tokens, m.alias.key, fallback="warp")
        else:
            plan = cache.policy.early_plan(m.kind, m.features, m.alias, m.prefix_changed, adapter.num_layers,
                                           m.context_change)
        if plan is None or not plan.complete:
            return None
        plans.append(plan)
    return plans


def finish_native(adapter, request: PrefillRequest, ctx: ForwardContext, position_ids,
                  plans: list[ImagePlan] | None = None) -> None:
    """After a prefill the model computed itself (every image a miss, or computed in full: ``plans``, from
    ``computed_in_full``; an exact hit inside a reused prefix): store its images, record its events."""
    cache = ctx.cache
    positions = None if position_ids is None else _positions(position_ids)
    offsets = _offsets(positions, request.images) if positions is not None else [m.start for m in request.images]
    if plans is None:
        plans = [ImagePlan.exact(m.n_tokens, m.features.key) if m.kind is HitKind.EXACT
                 else cache.policy.miss_plan(m.features) for m in request.images]
    runs = [ImageRun(m, at, plan, timings={"warmup": 0.0, "recompute": 0.0})
            for m, at, plan in zip(request.images, offsets, plans)]
    write_entries(adapter, cache, [(i, r.match, r.plan, r.offset) for i, r in enumerate(runs)])
    prefixes.write(cache, request.prefix, cast("VisMemoLayer", cache.layers[0]).get_seq_length() if cache.layers else 0)
    for i, run in enumerate(runs):
        record_event(cache, run.event(None, i))


def run_prefill(adapter, request, *, ctx: ForwardContext, inputs_embeds, attention_mask=None, position_ids=None,
                visual_pos_masks=None, deepstack_visual_embeds=None, **_ignored) -> BaseModelOutputWithPast:
    """The prefill of ``request``; again from the whole encode of the images lent encoder output whose plans turn out
    to compute them in full (a ``Rerun`` from the whole encode), those computed in full from the start (each image at
    most once)."""
    forced: dict[int, str] = {}
    while True:
        runner = PrefillRunner(adapter, ctx, request, inputs_embeds, attention_mask, position_ids, forced)
        try:
            return runner.run(inputs_embeds, visual_pos_masks, deepstack_visual_embeds)
        except Rerun as again:
            if again.scope is not Scope.ENCODE:
                raise
            runner.abandon()
            logger.info("vismemo: %s; starting the prefill again from their whole encode", again)
            matches, inputs_embeds, deepstack_visual_embeds = whole_encoded(
                list(request.images), again.images, inputs_embeds, visual_pos_masks, deepstack_visual_embeds)
            request = replace(request, images=tuple(matches))
            forced.update({i: fallback for i, fallback in again.images.items() if fallback != "miss"})

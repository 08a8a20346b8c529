"""Every read of cached K/V during a prefill: the prefetch before warmup, the reads a plan still needs, the
per-layer gather of reused tokens and the masked tokens given back for decoding.

Reads come from the exact hit's entry (already in memory) or from the store (sparse reads of an approximate hit's
alias), keys re-rotated to this request's offset. A read that fails or comes back malformed leaves the image with
nothing to reuse: the runner computes it as a miss. A compressed alias holds some tokens only; reads address
its stored rows, and ``cached_at`` fills the tokens it lacks.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from vismemo_hf.core.plan import HitKind
from vismemo_hf.runtime.schedule import on_device
from vismemo_hf.runtime.stream import LayerArrival, StreamOps, stream_layers, streams_for
from vismemo_hf.store.background import torch_pool
from vismemo_hf.store.faults import store_call
from vismemo_hf.store.tiers import token_rows

logger = logging.getLogger(__name__)

_POOL = torch_pool("vismemo-fetch", 2)


@dataclass
class FetchedKV:
    """Alias K/V read for some tokens (sorted) from ``first_layer`` on; keys already at this request's offset. A read
    streamed layer by layer (``arrival``) fills ``keys`` / ``values`` while the prefill runs: ``layer(at)`` waits for
    its layer."""

    tokens: torch.Tensor
    first_layer: int
    keys: torch.Tensor  # (L - first_layer, H, T, D)
    values: torch.Tensor
    arrival: LayerArrival | None = None

    def layer(self, at: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) (H, T, D) of the ``at``-th read layer, once it is in place."""
        if self.arrival is not None and not self.arrival.wait(at):
            raise RuntimeError(f"vismemo: alias K/V of read layer {at} could not be brought to the device")
        return self.keys[at], self.values[at]

    def covers(self, tokens: torch.Tensor) -> bool:
        return bool(torch.isin(tokens, self.tokens).all())

    def positions(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self.tokens, tokens)


@dataclass
class _Reads:
    """What has been read for one image."""

    fetched: FetchedKV | None = None
    asked: bool = False  # a read was started
    #: a background read: its future ((FetchedKV or None, ms)), or a streamed one's (published FetchedKV or None, the
    #: read's ms)
    pending: Future[tuple[FetchedKV | None, float]] | tuple[Future[FetchedKV | None], Future[float]] | None = None
    streaming: Future[float] | None = None  # a streamed read still bringing layers (its future: the read's ms)
    reuse_index: torch.Tensor | None = None  # position of each of the plan's reused tokens in ``fetched``
    restored: tuple | None = None  # (FetchedKV, tokens, positions) of masked tokens given back for decoding
    bytes: int = 0
    timings: dict = field(default_factory=dict)


def stored_tokens(alias, tokens: torch.Tensor) -> torch.Tensor:
    """The ``tokens`` whose K/V the alias entry holds (all of them unless it is compressed)."""
    return tokens if alias.kv_tokens is None else tokens[alias.stored(tokens)]


class AliasReader:
    """Reads of cached K/V for the images of one prefill (indexed as in the request)."""

    def __init__(self, adapter, store, matches, owner: str) -> None:
        self.adapter, self.store, self.matches, self.owner = adapter, store, matches, owner
        self._reads = {i: _Reads() for i in range(len(matches))}
        #: what the per-layer gathers index with, built once per distinct set and device rather than per layer:
        #: (kind, identities...) -> (the objects keyed on, the value); identities stay valid while the objects live
        self._memo: dict = {}

    def _memoised(self, key: tuple, keep: tuple, build):
        hit = self._memo.get(key)
        if hit is None or any(a is not b for a, b in zip(hit[0], keep)):
            hit = (keep, build())
            self._memo[key] = hit
        return hit[1]

    # -- reading -----------------------------------------------------------------------------------------
    def _host_kv(self, i: int, tokens: torch.Tensor, first_layer: int) -> torch.Tensor | None:
        """The alias's stored K/V of ``tokens`` (sorted) at layers >= ``first_layer``: (T, L', 2, H, D), or None."""
        m = self.matches[i]
        try:
            rows = m.alias.stored_rows(tokens)  # rows of the stored K/V (fewer than tokens in a compressed entry)
        except ValueError as err:  # a token the alias does not hold: nothing to reuse (a miss, never an error)
            logger.warning("vismemo: %s", err)
            return None
        if m.kind is HitKind.EXACT:  # the entry's K/V, or (still being written) what its announcement gives
            kv = token_rows(m.alias_entry.kv if m.alias_entry is not None else m.alias_kv(), rows)[:, first_layer:]
        else:
            kv = store_call("read", lambda: self.store.get_tokens(m.alias.key, self.owner, rows,
                                                                  first_layer), None)
        if kv is None or kv.shape[:2] != (tokens.numel(), self.adapter.num_layers - first_layer):
            return None
        self._reads[i].bytes += kv.numel() * kv.element_size()
        return kv

    def _read(self, i: int, tokens: torch.Tensor, first_layer: int, offset: int) -> tuple[FetchedKV | None, float]:
        """(FetchedKV or None, ms): the alias K/V of ``tokens`` (sorted) at layers >= ``first_layer``."""
        m = self.matches[i]
        t0 = time.perf_counter()
        kv = self._host_kv(i, tokens, first_layer)
        fetched = None
        if kv is not None:
            kv = self._to_layers(kv, first_layer)
            keys = self._moved(kv[:, :, 0].permute(1, 2, 0, 3), offset - m.alias_offset, m.alias.shift)  # (L', H, T, D)
            fetched = FetchedKV(tokens, first_layer, keys, kv[:, :, 1].permute(1, 2, 0, 3))
        return fetched, (time.perf_counter() - t0) * 1e3

    def _streamed(self, i: int, tokens: torch.Tensor, first_layer: int, offset: int, device: torch.device,
                  ops: StreamOps, published: Future[FetchedKV | None]) -> float:
        """On the fetch thread: read the alias K/V, publish a ``FetchedKV`` whose layers arrive one by one on
        ``device`` (``runtime.stream``), then bring them there. Returns the read's ms."""
        m = self.matches[i]
        t0 = time.perf_counter()
        try:
            kv = self._host_kv(i, tokens, first_layer)
        except BaseException as err:
            published.set_exception(err)
            raise
        if kv is None:
            published.set_result(None)
            return (time.perf_counter() - t0) * 1e3
        keys_in, values_in = kv[:, :, 0].permute(1, 2, 0, 3), kv[:, :, 1].permute(1, 2, 0, 3)  # (L', H, T, D) views
        delta, shift = offset - m.alias_offset, m.alias.shift
        here = not ops.brings(kv.device, device)
        arrival = LayerArrival(keys_in.shape[0], ops)
        with ops.side():
            keys = keys_in if here and delta == 0 and shift == (0, 0) else \
                torch.empty(keys_in.shape, dtype=kv.dtype, device=device)
            values = values_in if here else torch.empty(values_in.shape, dtype=kv.dtype, device=device)
        for made in {id(t): t for t in (keys, values) if t is not keys_in and t is not values_in}.values():
            ops.keep(made)
        published.set_result(FetchedKV(tokens, first_layer, keys, values, arrival))
        stream_layers(keys_in, values_in, device, lambda k: self._moved(k, delta, shift), arrival,
                      None if keys is keys_in else keys, None if values is values_in else values)
        return (time.perf_counter() - t0) * 1e3

    def _one_device(self, first_layer: int) -> torch.device | None:
        """The device every layer from ``first_layer`` on computes on (None: several, or the meta device)."""
        devices = {torch.device(self.adapter.layer_device(layer))
                   for layer in range(first_layer, self.adapter.num_layers)}
        device = next(iter(devices)) if len(devices) == 1 else None
        return None if device is None or device.type == "meta" else device

    def _to_layers(self, kv: torch.Tensor, first_layer: int) -> torch.Tensor:
        """``kv`` on the accelerator its layers compute on, in one copy, when they all compute on one: sliced per
        layer on the host, every layer's keys and values would be gathered there and copied apart (two synchronous
        copies a layer on a GPU). Layers on several devices, or on the host, take their slices as they are."""
        device = self._one_device(first_layer)
        if device is None or device.type == "cpu" or kv.device == device:
            return kv
        return kv.to(device, non_blocking=True)

    def _moved(self, keys: torch.Tensor, delta: int, shift: tuple[int, int]) -> torch.Tensor:
        """Cached keys at this request's positions (``ModelAdapter.move_keys``): the image starts ``delta``
        positions later, and a moved alias (``shift`` = (dy, dx) tokens) shows each token dy rows and dx columns
        earlier."""
        return self.adapter.move_keys(keys, delta, shift)

    def _add_time(self, i: int, name: str, ms: float) -> None:
        timings = self._reads[i].timings
        timings[name] = timings.get(name, 0.0) + ms

    def fetch(self, i: int, tokens: torch.Tensor, first_layer: int, offset: int, background: bool = False) -> bool:
        """Read now, or (``background``) start reading on the fetch thread so that the read overlaps warmup: the
        read K/V then arrive layer by layer (``runtime.stream``) when every layer computes on one device."""
        reads = self._reads[i]
        reads.asked = True
        if background:
            device = self._one_device(first_layer)
            if device is None:
                reads.pending = _POOL.submit(self._read, i, tokens, first_layer, offset)
                return True
            published: Future[FetchedKV | None] = Future()
            reads.pending = (published, _POOL.submit(self._streamed, i, tokens, first_layer, offset, device,
                                                     streams_for(device), published))
            return True
        reads.fetched, ms = self._read(i, tokens, first_layer, offset)
        self._add_time(i, "fetch", ms)
        self._add_time(i, "fetch_wait", ms)
        return reads.fetched is not None

    def wait(self, i: int) -> bool:
        """Finish a background read, or (streamed) wait until its first layers can be asked for (the time still
        spent waiting is ``fetch_wait``); False: a read was asked for and gave nothing."""
        reads = self._reads[i]
        if reads.pending is not None:
            t0 = time.perf_counter()
            if isinstance(reads.pending, tuple):  # streamed: the layers arrive as the prefill goes
                published, work = reads.pending
                reads.fetched = published.result()
                reads.streaming = work
            else:
                reads.fetched, ms = reads.pending.result()
                self._add_time(i, "fetch", ms)
            reads.pending = None
            self._add_time(i, "fetch_wait", (time.perf_counter() - t0) * 1e3)
        return reads.fetched is not None or not reads.asked

    def bind(self, i: int, plan, offset: int) -> bool:
        """Point the plan's reuse set at read K/V, reading again only if the prefetch does not cover it. False: the
        alias K/V are unavailable (the image must be computed)."""
        self.wait(i)
        reads = self._reads[i]
        if plan.reuse.numel() == 0:
            return True
        first = int(plan.reuse_from.min())
        f = reads.fetched
        if f is None or f.first_layer > first or not f.covers(plan.reuse):
            if not self.fetch(i, plan.reuse, first, offset):
                return False
            f = reads.fetched
            assert f is not None  # the read ``fetch`` made now
        reads.reuse_index = f.positions(plan.reuse)
        return True

    def close(self) -> None:
        """Wait for every read still running (a prefill that starts again reads anew); their failures are theirs."""
        for reads in self._reads.values():
            pending = reads.pending if not isinstance(reads.pending, tuple) else reads.pending[1]
            for work in (pending, reads.streaming):
                if work is not None:
                    try:
                        work.result()
                    except Exception as err:  # noqa: BLE001 - a read that failed has nothing left to wait for
                        logger.debug("vismemo: a read ended with %s", err)
            reads.pending = reads.streaming = None

    def forget(self, i: int) -> None:
        """The image will be computed: nothing of its alias is used."""
        self._reads[i] = _Reads(bytes=self._reads[i].bytes, timings=self._reads[i].timings)

    def cached_at(self, i: int, layer: int, fill=None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The alias's (K, V) of every token of image ``i`` at ``layer``, (H, N, D) each, if they were read. A
        compressed alias lacks some tokens: ``fill`` (K, V) stands in for them (without it: None)."""
        m = self.matches[i]
        stored = stored_tokens(m.alias, torch.arange(m.n_tokens))
        f = self._reads[i].fetched
        if f is None or f.first_layer > layer or not f.covers(stored):
            return None
        keys, values = f.layer(layer - f.first_layer)
        if stored.numel() < m.n_tokens:
            if fill is None:
                return None
            pos = f.positions(stored)
            out = tuple(x.clone() for x in fill)
            out[0][:, stored.to(out[0].device)] = keys[:, pos].to(out[0].device, out[0].dtype)
            out[1][:, stored.to(out[1].device)] = values[:, pos].to(out[1].device, out[1].dtype)
            return out
        if f.tokens.numel() == m.n_tokens:  # every token, in order: no gather
            return keys, values
        pos = f.positions(stored)
        return keys[:, pos], values[:, pos]

    # -- per-layer gather ---------------------------------------------------------------------------------
    def reused(self, layer: int, plans: dict, batch: int):
        """Reused K/V at ``layer``: keys, values (B, H, R, D) and their columns (B, R), or None. ``plans``: image
        index -> its plan (images being computed have none)."""

        def select(i):
            reads, plan = self._reads[i], plans.get(i)
            if plan is None or reads.reuse_index is None:
                return None
            count = plan.reused_count_at(layer)  # with the plan, names the set (the sets nest with depth)

            def chosen():
                picked = plan.reuse_selected_at(layer)
                return plan.reuse[picked], reads.reuse_index[picked]

            tokens, index = self._memoised(("reuse", i, count), (plan, reads.reuse_index), chosen)
            return reads.fetched, tokens, index

        return self._gather(layer, select, batch)

    def restore(self, plans: dict, offsets: dict, batch: int):
        """Plans with ``restore_masked``: the alias's K/V of their masked tokens for each late layer (for decoding),
        as (layer, keys, values, columns); the tokens a compressed alias lacks stay out."""
        wanted = [i for i, p in plans.items() if p.restore_masked and p.mask.numel()]
        for i in wanted:
            masked = stored_tokens(self.matches[i].alias, plans[i].mask)
            if not masked.numel():
                continue
            f = self._reads[i].fetched
            first = plans[i].warmup_layers
            if f is None or f.first_layer > first or not f.covers(masked):
                f, ms = self._read(i, masked, first, offsets[i])
                self._add_time(i, "fetch", ms)
                if f is None:
                    logger.warning("vismemo: masked tokens of %s not restored (alias K/V unavailable)",
                                   self.matches[i].features.key[:12])
                    continue
            self._reads[i].restored = (f, masked, f.positions(masked))
        restoring = [i for i in wanted if self._reads[i].restored is not None]
        if not restoring:
            return
        for layer in range(min(plans[i].warmup_layers for i in restoring), self.adapter.num_layers):

            def select(i, layer=layer):
                if i not in restoring or layer < plans[i].warmup_layers:
                    return None
                return self._reads[i].restored

            gathered = self._gather(layer, select, batch)
            if gathered is not None:
                yield (layer, *gathered)

    def _gather(self, layer: int, select, batch: int):
        """The K/V at ``layer`` of the tokens ``select(i)`` names ((FetchedKV, tokens, positions in it), or None), on
        the device that layer computes on: keys, values (B, H, T, D) and their columns (B, T), or None."""
        device = self.adapter.layer_device(layer)
        per_row: list[list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]]] = [[] for _ in range(batch)]
        for i, m in enumerate(self.matches):
            picked = select(i)
            if picked is None or picked[1].numel() == 0:
                continue
            f, tokens, idx = picked
            keys, values = f.layer(layer - f.first_layer)
            if idx.numel() != f.tokens.numel():  # not every read token in order: a gather
                idx = self._memoised(("index", id(idx), f.keys.device), (idx,), lambda idx=idx, f=f: idx.to(f.keys.device))
                keys, values = keys.index_select(1, idx), values.index_select(1, idx)
            per_row[m.row].append((keys.to(device, non_blocking=True), values.to(device, non_blocking=True),
                                   i, tokens))
        if not any(per_row):
            return None
        picked = tuple((p[2], p[3]) for parts in per_row for p in parts)
        # the same tokens give the same columns tensor at every layer: the layers' writes recognise it
        cols = self._memoised(("columns", device, *(id(t) for _, t in picked)), tuple(t for _, t in picked),
                              lambda: self._columns(per_row, batch, device))
        if batch == 1 and len(per_row[0]) == 1:  # the common case: one image, no padding to build
            keys, values = per_row[0][0][:2]
            return keys[None], values[None], cols
        width = cols.shape[1]
        ref = next(p for parts in per_row for p in parts)[0]
        keys = ref.new_zeros(batch, ref.shape[0], width, ref.shape[-1])
        values = ref.new_zeros(batch, ref.shape[0], width, ref.shape[-1])
        for b, parts in enumerate(per_row):
            if parts:
                n = sum(p[3].numel() for p in parts)
                keys[b, :, :n] = torch.cat([p[0] for p in parts], dim=1)
                values[b, :, :n] = torch.cat([p[1] for p in parts], dim=1)
        return keys, values, cols

    def _columns(self, per_row: list, batch: int, device) -> torch.Tensor:
        """(B, T) request columns of the gathered tokens, rows padded with -1."""
        rows = [torch.cat([self.matches[i].columns(t) for _, _, i, t in parts]) if parts
                else torch.empty(0, dtype=torch.long) for parts in per_row]
        width = max(r.numel() for r in rows)
        cols = torch.full((batch, width), -1, dtype=torch.long)
        for b, r in enumerate(rows):
            cols[b, : r.numel()] = r
        return on_device(cols, device)  # built on the host: the layouts read its host copy

    # -- accounting ---------------------------------------------------------------------------------------
    def bytes_read(self, i: int) -> int:
        return self._reads[i].bytes

    def timings(self, i: int) -> dict:
        """``fetch``: the read's ms (a streamed read's once it has brought every layer); ``fetch_wait``: the time
        the prefill waited for it (its layers included)."""
        reads = self._reads[i]
        out = dict(reads.timings)
        fetched = reads.fetched
        arrival = fetched.arrival if fetched is not None else None
        if reads.streaming is not None and fetched is not None and arrival is not None and \
                arrival.ready(len(fetched.keys) - 1) and not arrival.failed:  # every layer in place: it returns at once
            out["fetch"] = out.get("fetch", 0.0) + reads.streaming.result()
        if arrival is not None and arrival.waited_ms:
            out["fetch_wait"] = out.get("fetch_wait", 0.0) + arrival.waited_ms
        return out

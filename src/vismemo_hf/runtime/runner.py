"""Steps 2-4 of the data path for one prefill: plan, execute layer by layer, store complete entries.

Replaces the language model's forward when a ``PrefillRequest`` is pending. Layers are
called one by one (no copy of the model's code): at each layer only the "active"
columns (text, and the visual tokens the plans compute there) go through it, so reused
and masked tokens cost no attention-query or FFN work; reused K/V are preloaded into the
cache layer, re-rotated to this request's offset.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from vismemo_hf.core.plan import HitKind, ImagePlan, WarmupSignals, relative_deviation
from vismemo_hf.core.rope import rerotate, rotate_half
from vismemo_hf.runtime.attention import query_blocks
from vismemo_hf.runtime.compress import window_stats
from vismemo_hf.runtime.context import AttentionCapture, ForwardContext
from vismemo_hf.runtime.lookup import ImageState, PrefillRequest
from vismemo_hf.store.entry import Entry
from vismemo_hf.store.store import store_call
from vismemo_hf.store.tiers import token_rows

logger = logging.getLogger(__name__)

OBSERVATION_FALLBACK = 16  # window size when no text follows the last image


@dataclass
class FetchedKV:
    """Alias K/V read for some tokens (sorted) from ``first_layer`` on; keys already at this request's offset."""

    tokens: torch.Tensor
    first_layer: int
    keys: torch.Tensor  # (L - first_layer, H, T, D)
    values: torch.Tensor

    def covers(self, tokens: torch.Tensor) -> bool:
        return bool(torch.isin(tokens, self.tokens).all())

    def positions(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self.tokens, tokens)


_READER = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vismemo-fetch")


def _pad(rows: list[torch.Tensor], fill: int, device) -> torch.Tensor:
    width = max((r.numel() for r in rows), default=0)
    out = torch.full((len(rows), width), fill, dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


class PrefillRunner:
    """One prefill with images: plans, fetches, the layer loop, storing and events."""

    def __init__(self, adapter, ctx: ForwardContext, request: PrefillRequest, inputs_embeds, attention_mask,
                 position_ids):
        self.adapter, self.ctx, self.cache, self.request = adapter, ctx, ctx.cache, request
        self.policy = self.cache.policy
        self.text = adapter.text
        self.batch, self.length, self.hidden_size = inputs_embeds.shape
        self.device = inputs_embeds.device
        if position_ids is None:
            raise ValueError("VisMemo prefill needs the model's 3-D position ids")
        if position_ids.ndim == 2:
            position_ids = position_ids[None].expand(3, -1, -1)
        self.positions = position_ids[-3:]
        self.valid = attention_mask.bool() if attention_mask is not None and attention_mask.ndim == 2 else None
        if self.valid is not None and bool(self.valid.all()):
            self.valid = None
        self.rows = [[img for img in request.images if img.row == b] for b in range(self.batch)]
        self._active_signature, self._active_layout = None, None

    # -- early stage: plans that need no warmup, and fetches ---------------------------------------
    def _read(self, img: ImageState, tokens: torch.Tensor, first_layer: int):
        """Alias K/V of ``tokens`` (sorted) at layers >= ``first_layer``, keys moved to this offset; and the ms it took."""
        t0 = time.perf_counter()
        try:
            rows = img.alias.stored_rows(tokens)  # rows of the stored K/V (fewer than tokens in a compressed entry)
        except ValueError as err:  # a token the alias does not hold: nothing to reuse (a miss, never an error)
            logger.warning("vismemo: %s", err)
            return None, (time.perf_counter() - t0) * 1e3
        if img.kind is HitKind.EXACT:
            kv = token_rows(img.alias_entry.kv, rows)[:, first_layer:]
        else:
            kv = store_call(
                "read",
                lambda: self.cache.store.get_tokens(img.alias.key, self.adapter.fingerprint, rows, first_layer),
                None,
            )
        fetched = None
        if kv is not None and kv.shape[:2] == (tokens.numel(), self.adapter.num_layers - first_layer):
            img.bytes_read += kv.numel() * kv.element_size()
            keys = kv[:, :, 0].permute(1, 2, 0, 3)  # (L', H, T, D)
            keys = rerotate(keys, img.offset - img.alias_offset, self.text.rotary_emb.inv_freq)
            fetched = FetchedKV(tokens, first_layer, keys, kv[:, :, 1].permute(1, 2, 0, 3))
        return fetched, (time.perf_counter() - t0) * 1e3

    def _fetch(self, img: ImageState, tokens: torch.Tensor, first_layer: int, background: bool = False) -> bool:
        """Read now, or (``background``) start reading on the fetch thread so the read overlaps warmup."""
        if background:
            img.fetch_future = _READER.submit(self._read, img, tokens, first_layer)
            return True
        img.fetched, ms = self._read(img, tokens, first_layer)
        for name in ("fetch", "fetch_wait"):
            img.timings[name] = img.timings.get(name, 0.0) + ms
        return img.fetched is not None

    def _await(self, img: ImageState) -> bool:
        """Finish a background read; the time still spent waiting here is ``fetch_wait``."""
        if img.fetch_future is None:
            return True
        t0 = time.perf_counter()
        img.fetched, ms = img.fetch_future.result()
        img.fetch_future = None
        img.timings["fetch"] = img.timings.get("fetch", 0.0) + ms
        img.timings["fetch_wait"] = img.timings.get("fetch_wait", 0.0) + (time.perf_counter() - t0) * 1e3
        return img.fetched is not None

    def _demote(self, img: ImageState) -> None:
        logger.warning("vismemo: alias K/V of %s unavailable; running a full prefill of the image", img.features.key[:12])
        img.kind, img.alias, img.alias_entry, img.score = HitKind.MISS, None, None, None
        img.fetched = img.fetch_index = None
        img.plan = self.policy.miss_plan(img.features)

    def _bind(self, img: ImageState) -> None:
        """Point the plan's reuse set at fetched K/V, reading again only if the prefetch does not cover it."""
        plan = img.plan
        self._await(img)
        if plan.reuse.numel() == 0:
            return
        first = int(plan.reuse_from.min())
        fetched = img.fetched
        if fetched is None or fetched.first_layer > first or not fetched.covers(plan.reuse):
            if not self._fetch(img, plan.reuse, first):
                self._demote(img)
                return
        img.fetch_index = img.fetched.positions(plan.reuse)

    def decide_layer(self, img: ImageState) -> int:
        """The layer before which ``img``'s plan is made (the end of its warmup)."""
        return self.policy.prefix_check_layer if img.kind is HitKind.EXACT else self.policy.warmup_layers

    def prepare(self) -> None:
        for img in self.request.images:
            img.offset = int(self.positions[0, img.row, img.start])
            if img.kind is HitKind.EXACT:
                img.plan = self.policy.exact_plan(img.features, img.alias.key, img.prefix_changed)
                if img.plan is not None:
                    img.plan = img.plan.limited_to(img.alias, self.policy.missing)
                    self._bind(img)
                elif self.policy.prefix_check_layer >= self.adapter.num_layers:  # no layer to check: compute it
                    img.plan = ImagePlan.full(HitKind.EXACT, img.n_tokens, img.alias.key)
                else:  # decided at the check layer: the whole entry is at hand
                    self._fetch(img, self._stored(img, torch.arange(img.n_tokens)), 0)
            elif img.kind is HitKind.MISS:
                img.plan = self.policy.miss_plan(img.features)
            else:
                t0 = time.perf_counter()
                tokens = self.policy.prefetch_tokens(img.features, img.alias).sort().values
                first = self.policy.warmup_layers
                if self.policy.needs_deviation:  # the warmup layers' K/V of every token, for the deviation
                    tokens, first = torch.arange(img.n_tokens), 0
                tokens = self._stored(img, tokens)
                img.prefetched = tokens
                img.timings["plan"] = (time.perf_counter() - t0) * 1e3
                if tokens.numel():
                    self._fetch(img, tokens, first, background=True)

    def _finish_plans(self, layer: int, hidden, active, cos, sin) -> None:
        for img in self.request.images:
            if img.plan is not None or self.decide_layer(img) != layer:
                continue
            if not self._await(img):  # the prefetch failed: no alias K/V to reuse
                self._demote(img)
                continue
            t0 = time.perf_counter()
            signals = self._signals(img, layer, hidden, active, cos, sin)
            if img.kind is HitKind.EXACT:
                img.plan = self.policy.prefix_plan(img.features, img.alias.key, signals)
            else:
                img.plan = self.policy.plan(img.features, img.alias, img.prefetched, signals)
            img.plan = img.plan.limited_to(img.alias, self.policy.missing)
            img.timings["plan"] = img.timings.get("plan", 0.0) + (time.perf_counter() - t0) * 1e3
            self._bind(img)

    @staticmethod
    def _stored(img: ImageState, tokens: torch.Tensor) -> torch.Tensor:
        """The ``tokens`` whose K/V the alias entry holds (all of them unless it is compressed)."""
        return tokens if img.alias.kv_tokens is None else tokens[img.alias.stored(tokens)]

    def _cached_at(self, img: ImageState, layer: int, fill=None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The alias's (K, V) of every token of ``img`` at ``layer``, (H, N, D) each, if they were read. A
        compressed alias holds no K/V for some tokens: ``fill`` (K, V) stands in for them (else None)."""
        stored = self._stored(img, torch.arange(img.n_tokens))
        f = img.fetched
        if f is None or f.first_layer > layer or not f.covers(stored):
            return None
        at = layer - f.first_layer
        if stored.numel() < img.n_tokens:
            if fill is None:
                return None
            pos = f.positions(stored)
            out = tuple(x.clone() for x in fill)
            out[0][:, stored.to(out[0].device)] = f.keys[at][:, pos].to(out[0].device, out[0].dtype)
            out[1][:, stored.to(out[1].device)] = f.values[at][:, pos].to(out[1].device, out[1].dtype)
            return out
        if f.tokens.numel() == img.n_tokens:  # every token, in order: no gather
            return f.keys[at], f.values[at]
        pos = f.positions(stored)
        return f.keys[at][:, pos], f.values[at][:, pos]

    def _signals(self, img: ImageState, layer: int, hidden, active, cos, sin) -> WarmupSignals:
        """Everything routing may use (``WarmupSignals``), gathered at ``layer`` (the end of warmup)."""
        window = self._window_columns()[img.row]
        signals = WarmupSignals(
            attention=torch.stack(img.attention) if img.attention else None,
            span=(img.start, img.start + img.n_tokens),
            window=window,
            prefix_changed=img.prefix_changed,
        )
        exact = img.kind is HitKind.EXACT
        if self.policy.needs_deviation and not exact:
            cols = img.columns(torch.arange(img.n_tokens, device=self.device))
            k_dev, v_dev = [], []
            for at in range(layer):
                cache_layer = self.cache.layers[at]
                slots = cache_layer.slot_of(cols, img.row)
                fresh = cache_layer.keys[img.row][:, slots], cache_layer.values[img.row][:, slots]
                cached = self._cached_at(img, at, fill=fresh)  # tokens a compressed alias lacks: no deviation
                if cached is None:
                    break
                k_dev.append(relative_deviation(fresh[0], cached[0]))
                v_dev.append(relative_deviation(fresh[1], cached[1]))
            else:
                if k_dev:
                    signals.key_deviation, signals.value_deviation = torch.stack(k_dev), torch.stack(v_dev)
        if (self.policy.needs_check_kv or exact) and layer < self.adapter.num_layers:
            signals.fresh_kv = self._fresh_kv(layer, img, hidden, active, cos, sin)
            signals.cached_kv = self._cached_at(img, layer, fill=signals.fresh_kv)
        return signals

    def _fresh_kv(self, layer_idx: int, img: ImageState, hidden, active, cos, sin):
        """K/V the layer would compute for the image's tokens from this request's hidden states: (H, N, D) each."""
        layer = self.text.layers[layer_idx]
        attn = layer.self_attn
        row = active[img.row]
        where = torch.full((self.length,), -1, dtype=torch.long, device=self.device)
        where[row[row >= 0]] = torch.nonzero(row >= 0).flatten()
        pos = where[img.start : img.start + img.n_tokens]
        x = layer.input_layernorm(hidden[img.row, pos])
        keys = attn.k_proj(x).view(img.n_tokens, -1, attn.head_dim)
        values = attn.v_proj(x).view(img.n_tokens, -1, attn.head_dim)
        if getattr(attn, "k_norm", None) is not None:  # Qwen3-VL normalises keys before RoPE
            keys = attn.k_norm(keys)
        c, s = cos[img.row, pos][:, None], sin[img.row, pos][:, None]
        keys = keys * c + rotate_half(keys) * s
        return keys.transpose(0, 1), values.transpose(0, 1)

    # -- per-layer schedule -------------------------------------------------------------------------
    def _active(self, layer: int) -> torch.Tensor:
        """(B, A) request columns computed at ``layer``; -1 pads short rows.

        A plan's computed sets shrink monotonically with depth, so (plan, set size) names the set:
        the layout is rebuilt only at the layers where it changes."""
        signature = tuple(
            (id(img.plan), img.plan.computed_count_at(layer)) if img.plan is not None else None
            for img in self.request.images
        )
        if signature != self._active_signature:
            self._active_signature, self._active_layout = signature, self._build_active(layer)
        return self._active_layout

    def _build_active(self, layer: int) -> torch.Tensor:
        rows = []
        for b in range(self.batch):
            keep = torch.ones(self.length, dtype=torch.bool)
            for img in self.rows[b]:
                keep[img.start : img.start + img.n_tokens] = False
                tokens = img.plan.computed_at(layer) if img.plan is not None else torch.arange(img.n_tokens)
                keep[img.columns(tokens)] = True
            rows.append(torch.nonzero(keep).flatten())
        return _pad(rows, -1, self.device)

    def _reused(self, layer: int):
        """Reused K/V at ``layer``: keys, values (B, H, R, D) and their columns (B, R), or None."""

        def select(img):
            if img.fetch_index is None:
                return None
            selected = img.plan.reuse_selected_at(layer)
            return img.plan.reuse[selected], img.fetch_index[selected]

        return self._alias_kv(layer, select)

    def _restore_masked(self) -> None:
        """Plans with ``restore_masked``: the alias's K/V of their masked tokens join each late layer for decoding."""
        images = [img for img in self.request.images
                  if img.plan is not None and img.plan.restore_masked and img.plan.mask.numel()]
        for img in images:
            first = img.plan.warmup_layers
            masked = self._stored(img, img.plan.mask)  # a compressed alias has nothing for the tokens it lacks
            if not masked.numel():
                continue
            f = img.fetched
            if f is None or f.first_layer > first or not f.covers(masked):
                f, ms = self._read(img, masked, first)
                img.timings["fetch"] = img.timings.get("fetch", 0.0) + ms
                if f is None:
                    logger.warning("vismemo: masked tokens of %s not restored (alias K/V unavailable)",
                                   img.features.key[:12])
                    continue
            img.restored = (f, masked, f.positions(masked))
        if not any(img.restored is not None for img in images):
            return
        for layer in range(min(img.plan.warmup_layers for img in images), self.adapter.num_layers):

            def select(img, layer=layer):
                if img.restored is None or layer < img.plan.warmup_layers:
                    return None
                return img.restored[1], img.restored[2]

            restored = self._alias_kv(layer, select, lambda img: img.restored[0] if img.restored else None)
            if restored is not None:
                self.cache.layer(layer).preload(*restored)

    def _alias_kv(self, layer: int, select, source=lambda img: img.fetched):
        """Alias K/V at ``layer`` of the tokens ``select(img)`` names ((tokens, positions in ``source(img)``), or
        None), on that layer's device (device maps): keys, values (B, H, T, D) and their columns (B, T), or None."""
        device = self.adapter.layer_device(layer)
        per_row = []
        for b in range(self.batch):
            parts = []
            for img in self.rows[b]:
                if img.plan is None or source(img) is None:
                    continue
                picked = select(img)
                if picked is None or picked[0].numel() == 0:
                    continue
                tokens, idx = picked
                f = source(img)
                at = layer - f.first_layer
                columns = img.columns(tokens).to(device)
                if idx.numel() == f.tokens.numel():  # every fetched token, in order: no gather
                    keys, values = f.keys[at], f.values[at]
                else:
                    idx = idx.to(f.keys.device)
                    keys, values = f.keys[at][:, idx], f.values[at][:, idx]
                parts.append((keys.to(device, non_blocking=True), values.to(device, non_blocking=True), columns))
            per_row.append(parts)
        if not any(per_row):
            return None
        if self.batch == 1 and len(per_row[0]) == 1:  # the common case: one image, no padding to build
            keys, values, cols = per_row[0][0]
            return keys[None], values[None], cols[None]
        width = max(sum(p[2].numel() for p in parts) for parts in per_row)
        ref = next(p for parts in per_row for p in parts)[0]
        heads, dim = ref.shape[0], ref.shape[-1]
        keys = ref.new_zeros(self.batch, heads, width, dim)
        values = ref.new_zeros(self.batch, heads, width, dim)
        cols = torch.full((self.batch, width), -1, dtype=torch.long, device=device)
        for b, parts in enumerate(per_row):
            if parts:
                n = sum(p[2].numel() for p in parts)
                keys[b, :, :n] = torch.cat([p[0] for p in parts], dim=1)
                values[b, :, :n] = torch.cat([p[1] for p in parts], dim=1)
                cols[b, :n] = torch.cat([p[2] for p in parts])
        return keys, values, cols

    def _window_columns(self) -> list[torch.Tensor]:
        """Observation window per row: text after the row's last image, else its last 16 real tokens."""
        out = []
        for b in range(self.batch):
            valid = self.valid[b].cpu() if self.valid is not None else torch.ones(self.length, dtype=torch.bool)
            if not self.rows[b]:
                out.append(torch.empty(0, dtype=torch.long))
                continue
            end = max(img.start + img.n_tokens for img in self.rows[b])
            cols = torch.nonzero(valid[end:]).flatten() + end
            if cols.numel() == 0:
                cols = torch.nonzero(valid).flatten()[-OBSERVATION_FALLBACK:]
            out.append(cols)
        return out

    def _causal_mask(self) -> torch.Tensor:
        cols = torch.arange(self.length, device=self.device)
        allowed = (cols[None, :] <= cols[:, None])[None].expand(self.batch, -1, -1).clone()
        if self.valid is not None:
            allowed &= self.valid[:, None, :]
        return allowed[:, None]

    # -- execution ------------------------------------------------------------------------------------
    def run(self, inputs_embeds, visual_pos_masks=None, deepstack_visual_embeds=None) -> BaseModelOutputWithPast:
        cache, ctx, text = self.cache, self.ctx, self.text
        t_start = time.perf_counter()
        self.prepare()
        cos, sin = text.rotary_emb(inputs_embeds, self.positions)
        all_columns = torch.arange(self.length, device=self.device).expand(self.batch, -1)
        active, hidden = all_columns, inputs_embeds
        pos_cos, pos_sin = cos, sin
        final = inputs_embeds.clone()
        identity_mask = slot_layout = None
        compress = cache.compress if self.request.images else None
        # VL-Cache's window statistics: for compressing the decoding K/V, or the entries this prefill stores
        window_stats_wanted = compress is not None or (
            cache.store_misses and getattr(cache.store, "keep_ratio", None) is not None and self.request.images)
        capture_rows = self._window_columns() if self.policy.needs_attention or window_stats_wanted else None
        window_stats_per_layer = []
        deepstack_rank = None
        if deepstack_visual_embeds is not None and visual_pos_masks is not None:
            flat = visual_pos_masks.reshape(-1).long()
            deepstack_rank = (flat.cumsum(0) - 1).reshape(visual_pos_masks.shape).masked_fill(~visual_pos_masks, -1)
        t_warm_end = None
        for layer_idx, decoder_layer in enumerate(text.layers):
            self._finish_plans(layer_idx, hidden, active, pos_cos, pos_sin)
            pending = [i for i in self.request.images if i.plan is None]
            warming = [i for i in pending if i.kind is HitKind.APPROXIMATE]
            if not pending and t_warm_end is None:
                t_warm_end = time.perf_counter()
            new_active = self._active(layer_idx)
            if not torch.equal(new_active, active):
                hidden, pos_cos, pos_sin = self._shrink(active, new_active, hidden, final, cos, sin)
                active = new_active
            reused = self._reused(layer_idx)
            cache_layer = cache.layer(layer_idx)
            identity = reused is None and active.shape == all_columns.shape and torch.equal(active, all_columns)
            mask = None
            if reused is not None:
                cache_layer.preload(*reused)
            wants_attention = bool(warming) and self.policy.needs_attention
            capturing = capture_rows is not None and (wants_attention or window_stats_wanted)
            if identity:
                ctx.incoming = None
                if self.valid is not None:  # padding; without it SDPA's causal mode is exact (and faster)
                    identity_mask = identity_mask if identity_mask is not None else self._causal_mask()
                    mask = identity_mask
            else:
                ctx.incoming = active
                slots = active if reused is None else torch.cat([reused[2], active], dim=1)
                if slot_layout is None or not torch.equal(slot_layout, slots):  # same layout: same mask
                    slot_layout = slots
                    order = slots.argsort(dim=1, stable=True)
                    ordered = bool((slots[:, 1:] >= slots[:, :-1]).all())
                    ctx.slot_order = None if ordered else order
                    ctx.slot_mask = cache_layer.mask_for(slots if ordered else slots.gather(1, order), active,
                                                         ctx.valid)
                    ctx.slot_blocks = query_blocks(ctx.slot_mask)
            if capturing:
                ctx.capture = AttentionCapture(layer_idx, *self._window_rows(active, capture_rows))
            hidden = decoder_layer(
                hidden,
                attention_mask=mask,
                position_ids=None,
                cache=cache,
                use_cache=True,
                position_embeddings=(pos_cos, pos_sin),
            )
            if capturing:
                probs, window_valid = ctx.capture.probs, ctx.capture.valid
                if wants_attention:
                    self._collect_attention(layer_idx, warming, probs, window_valid)
                if window_stats_wanted:
                    window_stats_per_layer.append(
                        window_stats(probs, window_valid, cache_layer.slot_columns(), self._visual_columns()))
                ctx.capture = None
            if deepstack_rank is not None and layer_idx < len(deepstack_visual_embeds):
                hidden = self._add_deepstack(hidden, active, deepstack_rank, deepstack_visual_embeds[layer_idx])
        ctx.incoming = ctx.slot_order = ctx.slot_mask = ctx.slot_blocks = None
        self._scatter(active, hidden, final)
        hidden = text.norm(final)
        t_end = time.perf_counter()
        t_warm_end = t_warm_end or t_end
        self._restore_masked()
        self._store_complete(window_stats_per_layer)
        if compress is not None:
            keep = compress.keep(window_stats_per_layer, self._visual_columns())
            for layer, kept in zip(cache.layers, keep or []):
                layer.keep_slots(kept)
        for layer in cache.layers:
            layer.settle(self.length)
        for img in self.request.images:
            img.timings["warmup"] = (t_warm_end - t_start) * 1e3 if img.kind is HitKind.APPROXIMATE else 0.0
            img.timings["recompute"] = (t_end - t_warm_end) * 1e3
            cache.events.append(img.event())
            store_call("stats", lambda i=img: cache.store.record(i.kind, prefix_changed=i.prefix_changed), None)
        return BaseModelOutputWithPast(last_hidden_state=hidden, cache=cache)

    def _scatter(self, active, hidden, final) -> None:
        ok = active >= 0
        rows = torch.arange(self.batch, device=self.device)[:, None].expand_as(active)
        final[rows[ok], active[ok]] = hidden[ok].to(final.dtype)

    def _shrink(self, active, new_active, hidden, final, cos, sin):
        """Carry hidden states from ``active`` to its subset ``new_active``; park the dropped ones in ``final``."""
        self._scatter(active, hidden, final)
        where = torch.full((self.batch, self.length), -1, dtype=torch.long, device=self.device)
        ok = active >= 0
        rows = torch.arange(self.batch, device=self.device)[:, None].expand_as(active)
        where[rows[ok], active[ok]] = torch.nonzero(ok)[:, 1]
        idx = where.gather(1, new_active.clamp(min=0))
        if bool(((idx < 0) & (new_active >= 0)).any()):
            raise RuntimeError("a plan computes a token at a layer after one where it was not computed")
        idx = idx.clamp(min=0)
        hidden = hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1]))
        cols = new_active.clamp(min=0)[..., None].expand(-1, -1, cos.shape[-1])
        return hidden, cos.gather(1, cols), sin.gather(1, cols)

    def _window_rows(self, active, window_columns):
        """Positions of the observation-window columns inside the active set: (B, W) and validity."""
        where = torch.full((self.batch, self.length), -1, dtype=torch.long, device=self.device)
        ok = active >= 0
        rows = torch.arange(self.batch, device=self.device)[:, None].expand_as(active)
        where[rows[ok], active[ok]] = torch.nonzero(ok)[:, 1]
        idx = _pad([where[b, c.to(self.device)] for b, c in enumerate(window_columns)], -1, self.device)
        return idx.clamp(min=0), idx >= 0

    def _visual_columns(self) -> torch.Tensor:
        """(B, L) True at the visual tokens of the request's images."""
        if getattr(self, "_visual", None) is None:
            self._visual = torch.zeros(self.batch, self.length, dtype=torch.bool, device=self.device)
            for img in self.request.images:
                self._visual[img.row, img.start : img.start + img.n_tokens] = True
        return self._visual

    def _collect_attention(self, layer_idx: int, pending: list[ImageState], probs, window_valid) -> None:
        cache_layer = self.cache.layers[layer_idx]
        for img in pending:
            slots = cache_layer.slot_of(img.columns(torch.arange(img.n_tokens, device=self.device)), img.row)
            rows = probs[img.row][:, window_valid[img.row]]
            img.attention.append(rows[..., slots].cpu())

    def _add_deepstack(self, hidden, active, rank, embeds):
        r = rank.gather(1, active.clamp(min=0)).masked_fill(active < 0, -1)
        ok = r >= 0
        if not bool(ok.any()):
            return hidden
        hidden = hidden.clone()
        hidden[ok] = hidden[ok] + embeds[r[ok]].to(hidden.device, hidden.dtype)
        return hidden

    def _token_importance(self, img: ImageState, stats) -> torch.Tensor | None:
        """VL-Cache's ranking of one image's tokens (METHOD §4) at token granularity, for a compressed entry: the
        observation window's attention to each token, per layer weighted by that layer's VDR x entropy."""
        if not stats:
            return None
        cols = img.columns(torch.arange(img.n_tokens, device=self.device))
        total = torch.zeros(img.n_tokens)
        for s in stats:
            slot_columns = s.columns[img.row]
            where = torch.full((self.length,), -1, dtype=torch.long, device=slot_columns.device)
            ok = slot_columns >= 0
            where[slot_columns[ok]] = torch.nonzero(ok).flatten()
            slots = where[cols.to(where.device)]
            score = s.score[img.row][slots.clamp(min=0)].masked_fill(slots < 0, 0.0)
            total += float(s.vdr[img.row] * s.entropy[img.row]) * score.float().cpu()
        return total

    def _store_complete(self, window_stats_per_layer=()) -> None:
        """Store every image whose K/V were computed at every layer (misses, and hits under policies that recompute all)."""
        write_entries(self.adapter, self.cache, self.request.images,
                      lambda img: self._token_importance(img, window_stats_per_layer))


def write_entries(adapter, cache, images, importance=lambda img: None) -> None:
    """Store every image whose K/V were computed at every layer, read from the cache's layers (once per key)."""
    if not cache.store_misses:
        return
    done = set()
    fingerprint = adapter.fingerprint
    for img in images:
        key = img.features.key
        if img.kind is HitKind.EXACT or not img.plan.complete or key in done:
            continue
        done.add(key)
        cols = img.columns(torch.arange(img.n_tokens))
        per_layer = []
        for layer in cache.layers:
            slots = layer.slot_of(cols, img.row).to(layer.keys.device)
            per_layer.append(torch.stack([layer.keys[img.row][:, slots], layer.values[img.row][:, slots]]).cpu())
        kv = torch.stack(per_layer).permute(3, 0, 1, 2, 4).contiguous()  # (N, L, 2, H, D)
        if not bool(torch.isfinite(kv).all()):
            logger.warning("vismemo: image %s has non-finite K/V; not stored", key[:12])
            continue
        entry = Entry(key=key, fingerprint=fingerprint, grid=img.features.grid, embeds=img.embeds.detach(),
                      deepstack=img.deepstack.detach() if img.deepstack is not None else None,
                      descriptors=img.descriptors, entropy=img.features.entropy, kv=kv.detach(), offset=img.offset,
                      patch_hashes=img.features.patch_hashes, prefix=img.prefix)
        weights = importance(img)
        store_call("write", lambda e=entry, i=weights: cache.store.put(e, importance=i), None)


def finish_native(adapter, request, ctx: ForwardContext, position_ids) -> None:
    """After a prefill the model computed itself (every image a miss): store its images, record its events."""
    cache = ctx.cache
    positions = None
    if position_ids is not None:
        positions = (position_ids[None] if position_ids.ndim == 2 else position_ids)[-3:]
    for img in request.images:
        img.offset = int(positions[0, img.row, img.start]) if positions is not None else img.start
        img.plan = cache.policy.miss_plan(img.features)
        img.timings.update(warmup=0.0, recompute=0.0)
    write_entries(adapter, cache, request.images)
    for img in request.images:
        cache.events.append(img.event())
        store_call("stats", lambda i=img: cache.store.record(i.kind, prefix_changed=i.prefix_changed), None)


def run_prefill(adapter, request, *, ctx: ForwardContext, inputs_embeds, attention_mask=None, position_ids=None,
                visual_pos_masks=None, deepstack_visual_embeds=None, **_ignored) -> BaseModelOutputWithPast:
    runner = PrefillRunner(adapter, ctx, request, inputs_embeds, attention_mask, position_ids)
    return runner.run(inputs_embeds, visual_pos_masks, deepstack_visual_embeds)

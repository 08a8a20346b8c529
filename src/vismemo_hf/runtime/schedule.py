"""The schedule of a prefill: from the images' plans to each layer's layout. Pure tensor code, no model.

At layer l a row's *active* columns are its text (and padding) plus the visual tokens its images' plans compute
there; the layer's *slots* hold, in request-column order, the K/V it attends over (reused tokens written from their
alias, active ones computed) and the masked tokens given back for decoding afterwards. A ``Layout`` holds what
attention needs for one layer: the queries' columns, the boolean mask over the slots and its query blocks. Plans
only shrink the computed set with depth, so a layout is rebuilt only at the layers where it changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: query rows per block at least (smaller blocks cost more in call overhead than they save)
MIN_BLOCK_ROWS = 32
MAX_BLOCKS = 16


def pad_rows(rows: list[torch.Tensor], fill: int, device) -> torch.Tensor:
    """(B, max len) long tensor of ``rows``, short rows padded with ``fill``."""
    width = max((r.numel() for r in rows), default=0)
    out = torch.full((len(rows), width), fill, dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


def positions_of(columns: torch.Tensor, length: int) -> torch.Tensor:
    """(B, length) position of each request column inside ``columns`` (B, A) (-1 where it is absent): the
    inverse of a padded column layout. A scatter, with the pads sent to a spare column: no value is read."""
    where = torch.full((columns.shape[0], length + 1), -1, dtype=torch.long, device=columns.device)
    target = torch.where(columns >= 0, columns, length)
    where.scatter_(1, target, torch.arange(columns.shape[1], device=columns.device).expand_as(columns))
    return where[:, :length]


def slot_mask(key_columns: torch.Tensor, query_columns: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """(B, 1, q, S) boolean: a query sees a slot whose column is not after its own and is not padding. A query with
    nothing to see stays fully masked, as in the model's own masks (SDPA gives it zeros; never read)."""
    allowed = (key_columns[:, None, :] <= query_columns[:, :, None]) & (key_columns[:, None, :] >= 0)
    if valid is not None:
        allowed &= valid.gather(1, key_columns.clamp(min=0))[:, None, :]
    return allowed[:, None]


def causal_mask(batch: int, length: int, valid: torch.Tensor | None, device) -> torch.Tensor | None:
    """The plain layout's mask: None without padding (SDPA's causal mode is exact and faster)."""
    if valid is None:
        return None
    cols = torch.arange(length, device=device)
    return slot_mask(cols.expand(batch, -1), cols.expand(batch, -1), valid)


def query_blocks(mask: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first row, end row, key end) of each query block of a boolean (B, 1, q, S) mask: the block's rows see
    no key slot at or after ``key end``. One block (the whole mask) when the queries are few."""
    q_len, s_len = mask.shape[-2:]
    blocks = min(MAX_BLOCKS, q_len // MIN_BLOCK_ROWS)
    if blocks <= 1:
        return [(0, q_len, s_len)]
    bounds = [round(k * q_len / blocks) for k in range(blocks + 1)]
    # the last slot each row sees (0 for a row that sees none), then each block's largest: one read for all blocks
    slots = torch.arange(1, s_len + 1, device=mask.device)
    last = (mask.any(dim=(0, 1)) * slots).amax(-1)  # (q,)
    ends = torch.stack([last[r0:r1].amax() for r0, r1 in zip(bounds[:-1], bounds[1:])]).tolist()
    return [(r0, r1, int(end) if end else s_len) for r0, r1, end in zip(bounds[:-1], bounds[1:], ends)]


@dataclass(frozen=True)
class Layout:
    """What one layer's attention needs. ``incoming``: (B, q) request columns of its queries (None: the plain
    sequence); ``mask``: (B, 1, q, S) over the layer's slots (None: plain causal); ``blocks``: its query blocks."""

    incoming: torch.Tensor | None
    mask: torch.Tensor | None
    blocks: list


@dataclass(frozen=True)
class Placement:
    """Where one image sits and what its plan computes: ``plan`` None means undecided (every token computed)."""

    row: int
    start: int
    n_tokens: int
    plan: object | None


class SlotWriter:
    """Where a layer's writes land in one slot layout, worked out once and shared by every layer with that layout.

    ``columns`` (B, S): the request column of each slot, sorted, -1 padded. ``plan(columns)`` says where K/V of
    request ``columns`` (B, T) go: ``("run", s0, s1)`` (one row into consecutive slots: a copy) or
    ``("scatter", rows, slots, where)``; it is kept per columns tensor, so that the layers, which write the same
    tensors (a layout's queries, a reused set), read no tensor value after the first of them. ``settled`` is the
    layout once the prefill wrote some of those plans: unwritten slots empty (-1), or None when every column is
    held in order (the plain layout)."""

    def __init__(self, columns: torch.Tensor, length: int) -> None:
        self.columns, self.length = columns, length
        self.slot_of = positions_of(columns, length)
        self._plans: dict = {}
        self._settled: dict = {}

    def plan(self, columns: torch.Tensor) -> tuple:
        hit = self._plans.get(id(columns))
        if hit is None or hit[0] is not columns:
            hit = (columns, self._plan(columns))
            self._plans[id(columns)] = hit
        return hit[1]

    def _plan(self, columns: torch.Tensor) -> tuple:
        columns = columns.to(self.slot_of.device)
        ok = columns >= 0
        slots = self.slot_of.gather(1, columns.clamp(min=0))
        # one read decides: a written column the layout lacks; one row, no pads, consecutive slots (a copy)
        steps = slots[:, 1:] - slots[:, :-1]
        lacking, pads, gaps, first, last = torch.stack([
            ((slots < 0) & ok).sum(), (~ok).sum(), (steps != 1).sum() if steps.numel() else slots.new_zeros(()),
            slots[0, 0] if slots.numel() else slots.new_zeros(()),
            slots[0, -1] if slots.numel() else slots.new_zeros(())]).tolist()
        if lacking:
            raise RuntimeError("K/V written to a column the layer's layout does not hold")
        if columns.shape[0] == 1 and columns.numel() and not pads and not gaps:
            return ("run", int(first), int(last) + 1)
        rows = torch.arange(columns.shape[0], device=columns.device)[:, None].expand_as(columns)[ok]
        where = torch.arange(columns.shape[1], device=columns.device)[None].expand_as(columns)[ok]
        return ("scatter", rows, slots[ok], where)

    def settled(self, written: list[tuple]) -> torch.Tensor | None:
        key = tuple(id(p) for p in written)
        hit = self._settled.get(key)
        if hit is None or any(a is not b for a, b in zip(hit[0], written)):
            hit = (list(written), self._settle(written))
            self._settled[key] = hit
        return hit[1]

    def _settle(self, written: list[tuple]) -> torch.Tensor | None:
        filled = torch.zeros(self.columns.shape, dtype=torch.bool, device=self.columns.device)
        for p in written:
            if p[0] == "run":
                filled[:, p[1] : p[2]] = True
            else:
                filled[p[1].to(filled.device), p[2].to(filled.device)] = True
        cols = self.columns.masked_fill(~filled, -1)
        if cols.shape[1] == self.length and bool((cols == torch.arange(self.length, device=cols.device)).all()):
            return None
        return cols


class Schedule:
    """Active columns and slot layouts of one prefill, each built once per change."""

    def __init__(self, batch: int, length: int, valid: torch.Tensor | None, device) -> None:
        self.batch, self.length, self.valid, self.device = batch, length, valid, device
        self.all_columns = torch.arange(length, device=device).expand(batch, -1)
        self._active_key, self._active = None, None
        self._slots, self._layout = None, None

    def active(self, layer: int, images: list[Placement]) -> torch.Tensor:
        """(B, A) request columns computed at ``layer``; -1 pads short rows."""
        key = tuple((id(p.plan), p.plan.computed_count_at(layer)) if p.plan is not None else None for p in images)
        if key != self._active_key:
            self._active_key, self._active = key, self._build_active(layer, images)
        return self._active

    def _build_active(self, layer: int, images: list[Placement]) -> torch.Tensor:
        rows = []
        for b in range(self.batch):
            keep = torch.ones(self.length, dtype=torch.bool)
            for p in images:
                if p.row != b:
                    continue
                keep[p.start : p.start + p.n_tokens] = False
                tokens = p.plan.computed_at(layer) if p.plan is not None else torch.arange(p.n_tokens)
                keep[tokens + p.start] = True
            rows.append(torch.nonzero(keep).flatten())
        return pad_rows(rows, -1, self.device)

    def is_plain(self, active: torch.Tensor, reused_columns: torch.Tensor | None) -> bool:
        """Every column computed, nothing reused: the model's own masks apply."""
        return reused_columns is None and active.shape == self.all_columns.shape and torch.equal(active,
                                                                                                 self.all_columns)

    def _mark(self, *columns: torch.Tensor | None) -> torch.Tensor:
        """(B, L) True at every request column of ``columns`` ((B, k) each, -1 padded)."""
        marked = torch.zeros(self.batch, self.length + 1, dtype=torch.bool, device=self.device)
        for cols in columns:
            if cols is not None:
                cols = cols.to(self.device)
                marked.scatter_(1, torch.where(cols >= 0, cols, self.length), True)  # pads to a spare column
        return marked[:, : self.length]

    def layout(self, active: torch.Tensor, reused_columns: torch.Tensor | None,
               kept_columns: torch.Tensor | None = None) -> tuple[SlotWriter, Layout]:
        """(the ``SlotWriter`` of the slots, sorted and -1 padded; the ``Layout``) of a layer computing ``active``
        (B, A) and reusing ``reused_columns`` (B, R); its slots also hold ``kept_columns`` (B, K), written after the
        prefill (masked tokens given back for decoding) and invisible until then."""
        key = (active, reused_columns, kept_columns)
        if self._slots is None or not all(_same(a, b) for a, b in zip(self._slots, key)):
            visible = self._mark(active, reused_columns)
            kept = visible | self._mark(kept_columns)
            slots = _held(kept)
            mask = slot_mask(slots, active, self.valid) & visible.gather(1, slots.clamp(min=0))[:, None, None, :]
            self._slots, self._layout = key, (SlotWriter(slots, self.length), Layout(active, mask, query_blocks(mask)))
        return self._layout


def _held(kept: torch.Tensor) -> torch.Tensor:
    """(B, S) the columns where ``kept`` (B, L) is True, in order, rows padded with -1: one read (the width)."""
    width = int(kept.sum(1).max()) if kept.numel() else 0
    columns = torch.arange(kept.shape[1], device=kept.device).expand_as(kept)
    order = torch.sort((~kept).to(torch.int8), dim=1, stable=True).indices[:, :width]  # held columns first, in order
    return torch.where(kept.gather(1, order), columns.gather(1, order), -1)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """The same columns: the same tensor (the schedule and the reader hand out one per set), else equal values."""
    if a is b:
        return True
    return a is not None and b is not None and a.shape == b.shape and torch.equal(a, b)


class ActiveStates:
    """The hidden states of the columns a layer computes, with their rotary embeddings; columns a later layer no
    longer computes are parked, by column, in the output buffer."""

    def __init__(self, columns: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.columns, self.hidden, self.cos, self.sin = columns, hidden, cos, sin
        self._all = columns  # the first columns: every column of every row, in order
        self._cos_all, self._sin_all = cos, sin
        # every column's last state, and a spare column the pads of a narrowed layout are written to
        self._buf = torch.cat([hidden, hidden.new_zeros(hidden.shape[0], 1, hidden.shape[-1])], 1)

    @property
    def _out(self) -> torch.Tensor:
        return self._buf[:, :-1]

    def _park(self) -> None:
        cols = self.columns
        if cols is self._all:  # every column, in order
            self._out.copy_(self.hidden.to(self._buf.dtype))
            return
        target = torch.where(cols >= 0, cols, self._buf.shape[1] - 1)[..., None].expand(-1, -1, self._buf.shape[-1])
        self._buf.scatter_(1, target, self.hidden.to(self._buf.dtype))  # a scatter reads no value

    def snapshot(self) -> tuple:
        """What ``restore`` needs to run the layers from here again."""
        return self.columns, self.hidden.clone(), self.cos, self.sin, self._buf.clone()

    def restore(self, snapshot: tuple) -> None:
        self.columns, hidden, self.cos, self.sin, buf = snapshot
        self.hidden, self._buf = hidden.clone(), buf.clone()

    def narrow(self, columns: torch.Tensor) -> None:
        """Keep the states of ``columns`` (B, A'), a subset of the current columns of every row."""
        if columns is self.columns or (columns.shape == self.columns.shape and torch.equal(columns, self.columns)):
            return
        self._park()
        where = positions_of(self.columns, self._out.shape[1])
        idx = where.gather(1, columns.clamp(min=0))
        if bool(((idx < 0) & (columns >= 0)).any()):
            raise RuntimeError("a plan computes a token at a layer after one where it was not computed")
        idx = idx.clamp(min=0)
        self.hidden = self.hidden.gather(1, idx[..., None].expand(-1, -1, self.hidden.shape[-1]))
        cols = columns.clamp(min=0)[..., None].expand(-1, -1, self._cos_all.shape[-1])
        self.cos, self.sin = self._cos_all.gather(1, cols), self._sin_all.gather(1, cols)
        self.columns = columns

    def result(self) -> torch.Tensor:
        """(B, L, d): every column's last computed state."""
        self._park()
        return self._out

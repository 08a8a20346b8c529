"""The schedule of a prefill: from the images' plans to each layer's layout. Pure tensor code, no model.

At layer l a row's *active* columns are its text (and padding) plus the visual tokens its images' plans compute
there; the layer's *slots* hold, in request-column order, the K/V it attends over (reused tokens written from their
alias, active ones computed) and the masked tokens given back for decoding afterwards. A ``Layout`` holds what
attention needs for one layer: the queries' columns, the boolean mask over the slots and its query blocks. Plans
only shrink the computed set with depth, so a layout is rebuilt only at the layers where it changes.

Every decision here reads index values (widths, whether a write is a copy, which slots a block sees); on an
accelerator each such read would drain the stream. So the index sets are built on the host and moved to the device
once (``on_device``), which remembers the host copy (``host_of``): the decisions read the host copies, the
arithmetic uses the device ones, and a prefill reads no value of a device tensor here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from vismemo_hf.core.plan import ImagePlan

#: query rows per block at least (smaller blocks cost more in call overhead than they save)
MIN_BLOCK_ROWS = 32
MAX_BLOCKS = 16


#: device tensor -> its host copy (the tensors ``on_device`` made)
_MIRRORS = WeakIdKeyDictionary()


def on_device(host: torch.Tensor, device) -> torch.Tensor:
    """A device copy of the host tensor ``host`` (a new tensor even on a CPU device), whose ``host_of`` is ``host``:
    an asynchronous copy, no read. ``host`` may be a view with overlapping elements (an ``expand``): the copy is
    dense, as a write into it must be."""
    host = host.contiguous()
    out = torch.empty(host.shape, dtype=host.dtype, device=device)
    if out.device.type == "cuda":  # from pinned memory: a copy in stream order that the host does not wait for
        out.copy_(host.pin_memory(), non_blocking=True)
    else:
        out.copy_(host)
    _MIRRORS[out] = host
    return out


def host_of(tensor: torch.Tensor) -> torch.Tensor:
    """The host copy of ``tensor``: the one ``on_device`` kept, else a read of it."""
    host = _MIRRORS.get(tensor)
    return host if host is not None else tensor.cpu()


def padded_on_device(rows: list[torch.Tensor], fill: int, device) -> torch.Tensor:
    """``pad_rows`` of host ``rows``, built on the host and moved to ``device`` (``host_of`` gives it back)."""
    return on_device(pad_rows([r.cpu() for r in rows], fill, "cpu"), device)


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
    where = columns.new_full((columns.shape[0], length + 1), -1, dtype=torch.long)  # where ``columns`` lives
    target = torch.where(columns >= 0, columns, length)
    where.scatter_(1, target, torch.ones_like(columns, dtype=torch.long).cumsum(1) - 1)
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
    if min(MAX_BLOCKS, q_len // MIN_BLOCK_ROWS) <= 1:
        return [(0, q_len, s_len)]
    slots = torch.arange(1, s_len + 1, device=mask.device)
    return _blocks((mask.any(dim=(0, 1)) * slots).amax(-1), q_len, s_len)  # the last slot each row sees


def _blocks(last: torch.Tensor, q_len: int, s_len: int) -> list[tuple[int, int, int]]:
    """Query blocks from ``last`` (q,): one past the last slot each query row sees (0: none); one read."""
    blocks = min(MAX_BLOCKS, q_len // MIN_BLOCK_ROWS)
    if blocks <= 1:
        return [(0, q_len, s_len)]
    bounds = [round(k * q_len / blocks) for k in range(blocks + 1)]
    ends = torch.stack([last[r0:r1].amax() for r0, r1 in zip(bounds[:-1], bounds[1:])]).tolist()
    return [(r0, r1, int(end) if end else s_len) for r0, r1, end in zip(bounds[:-1], bounds[1:], ends)]


def layout_blocks(slots: torch.Tensor, queries: torch.Tensor, valid: torch.Tensor | None,
                  visible: torch.Tensor) -> list[tuple[int, int, int]]:
    """``query_blocks`` of the layout mask ``slot_mask(slots, queries, valid) & visible`` (its slots' columns
    visible), worked out from the host index sets without building the mask: slots are sorted by column, so the
    slots a query sees are the visible ones among those whose column is not after its own."""
    q_len, s_len = queries.shape[1], slots.shape[1]
    if min(MAX_BLOCKS, q_len // MIN_BLOCK_ROWS) <= 1:
        return [(0, q_len, s_len)]
    held = slots >= 0
    ok = held & visible.gather(1, slots.clamp(min=0))
    if valid is not None:
        ok &= valid.gather(1, slots.clamp(min=0))
    index = torch.arange(1, s_len + 1).expand_as(slots)
    last_ok = torch.cummax(torch.where(ok, index, 0), dim=1).values  # (B, S): one past the last usable slot so far
    keys = torch.where(held, slots, torch.iinfo(slots.dtype).max).contiguous()
    upto = torch.searchsorted(keys, queries.clamp(min=-1).contiguous(), right=True)  # (B, q) slots not after it
    seen = torch.where(upto > 0, last_ok.gather(1, (upto - 1).clamp(min=0)), 0)
    seen = torch.where(queries >= 0, seen, 0)
    return _blocks(seen.amax(0), q_len, s_len)


@dataclass(frozen=True)
class Layout:
    """What one layer's attention needs. ``incoming``: (B, q) request columns of its queries (None: the plain
    sequence); ``mask``: (B, 1, q, S) over the layer's slots (None: plain causal); ``blocks``: its query blocks."""

    incoming: torch.Tensor | None
    mask: torch.Tensor | None
    blocks: list
    _additive: dict = field(default_factory=dict, compare=False, repr=False)

    def additive(self, dtype: torch.dtype, eager: bool = False) -> list[torch.Tensor]:
        """Each query block's part of ``mask`` ((r0, r1, key end) of ``blocks``; the whole mask without blocks) as
        an additive mask of ``dtype`` (0 where seen, -inf elsewhere: what SDPA turns a boolean mask into at every
        call), made once and shared by every layer with this layout. ``eager``: the whole mask, with the dtype's
        lowest value for unseen keys (what the models' eager attention adds)."""
        assert self.mask is not None
        masks = self._additive.get((dtype, eager))
        if masks is None:
            parts = [self.mask] if eager else [self.mask[:, :, r0:r1, :end] for r0, r1, end in self.blocks] or \
                [self.mask]
            fill = torch.finfo(dtype).min if eager else float("-inf")
            masks = [torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, fill) for m in parts]
            self._additive[(dtype, eager)] = masks
        return masks


@dataclass(frozen=True)
class ImageSpan:
    """Where one image sits and what its plan computes: ``plan`` None means undecided (every token computed)."""

    row: int
    start: int
    n_tokens: int
    plan: ImagePlan | None


class SlotWriter:
    """Where a layer's writes land in one slot layout, worked out once and shared by every layer with that layout.

    ``columns`` (B, S): the request column of each slot, sorted, -1 padded. ``plan(columns)`` says where K/V of
    request ``columns`` (B, T) go: ``("run", s0, s1)`` (one row into consecutive slots: a copy) or
    ``("scatter", rows, slots, where, every)`` (``every``: ``where`` names every written column, in order); it is
    kept per columns tensor, so that the layers, which write the same tensors (a layout's queries, a reused set),
    read no tensor value after the first of them. ``settled`` is the layout once the prefill wrote some of those
    plans: unwritten slots empty (-1), or None when every column is held in order (the plain layout). ``filled``:
    the prefill writes every slot before attention reads any (no pads, no slot kept for later), so a layer's
    buffers need not start as zeros (an unwritten slot must be zero: SDPA multiplies its value by a zero weight)."""

    def __init__(self, columns: torch.Tensor, length: int, filled: bool = False) -> None:
        self.columns, self.length, self.filled = columns, length, filled
        self.slot_of = positions_of(host_of(columns), length)  # on the host: the plans are decided there
        self._plans: dict = {}
        self._settled: dict = {}

    def plan(self, columns: torch.Tensor) -> tuple:
        hit = self._plans.get(id(columns))
        if hit is None or hit[0] is not columns:
            hit = (columns, self._plan(columns))
            self._plans[id(columns)] = hit
        return hit[1]

    def _plan(self, columns: torch.Tensor) -> tuple:
        columns = host_of(columns)
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
        rows = torch.arange(columns.shape[0])[:, None].expand_as(columns)
        where = torch.arange(columns.shape[1])[None].expand_as(columns)
        if not pads:  # every column is written: nothing to select
            rows, slots, where = rows.reshape(-1), slots.reshape(-1), where.reshape(-1)
        else:
            rows, slots, where = rows[ok], slots[ok], where[ok]
        device = self.columns.device  # moved once: every layer with this layout writes them
        return ("scatter", on_device(rows, device), on_device(slots, device), on_device(where, device), not pads)

    def settled(self, written: list[tuple]) -> torch.Tensor | None:
        key = tuple(id(p) for p in written)
        hit = self._settled.get(key)
        if hit is None or any(a is not b for a, b in zip(hit[0], written)):
            hit = (list(written), self._settle(written))
            self._settled[key] = hit
        return hit[1]

    def _settle(self, written: list[tuple]) -> torch.Tensor | None:
        columns = host_of(self.columns)
        filled = torch.zeros(columns.shape, dtype=torch.bool)
        for p in written:
            if p[0] == "run":
                filled[:, p[1] : p[2]] = True
            else:
                filled[host_of(p[1]), host_of(p[2])] = True
        cols = columns.masked_fill(~filled, -1)
        if cols.shape[1] == self.length and bool((cols == torch.arange(self.length)).all()):
            return None
        return on_device(cols, self.columns.device)


class Schedule:
    """Active columns and slot layouts of one prefill, each built once per change."""

    def __init__(self, batch: int, length: int, valid: torch.Tensor | None, device) -> None:
        self.batch, self.length, self.valid, self.device = batch, length, valid, device
        self.all_columns = on_device(torch.arange(length).expand(batch, -1), device)
        self._active_key: tuple[tuple[int, int] | None, ...] | None = None
        self._active: torch.Tensor | None = None
        #: the (active, reused, kept) columns of the last layout, and that layout
        self._slots: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None
        self._layout: tuple[SlotWriter, Layout] | None = None
        self._valid_h: torch.Tensor | None = None

    def active(self, layer: int, images: list[ImageSpan]) -> torch.Tensor:
        """(B, A) request columns computed at ``layer``; -1 pads short rows."""
        key = tuple((id(p.plan), p.plan.computed_count_at(layer)) if p.plan is not None else None for p in images)
        if key != self._active_key or self._active is None:
            self._active_key, self._active = key, self._build_active(layer, images)
        return self._active

    def _build_active(self, layer: int, images: list[ImageSpan]) -> torch.Tensor:
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
        return padded_on_device(rows, -1, self.device)

    def is_plain(self, active: torch.Tensor, reused_columns: torch.Tensor | None) -> bool:
        """Every column computed, nothing reused: the model's own masks apply."""
        if reused_columns is not None or active.shape != self.all_columns.shape:
            return False
        return active is self.all_columns or torch.equal(host_of(active), host_of(self.all_columns))

    def _mark(self, *columns: torch.Tensor | None) -> torch.Tensor:
        """(B, L) True (on the host) at every request column of ``columns`` ((B, k) each, -1 padded)."""
        marked = torch.zeros(self.batch, self.length + 1, dtype=torch.bool)
        for cols in columns:
            if cols is not None:
                cols = host_of(cols)
                marked.scatter_(1, torch.where(cols >= 0, cols, self.length), True)  # pads to a spare column
        return marked[:, : self.length]

    def layout(self, active: torch.Tensor, reused_columns: torch.Tensor | None,
               kept_columns: torch.Tensor | None = None) -> tuple[SlotWriter, Layout]:
        """(the ``SlotWriter`` of the slots, sorted and -1 padded; the ``Layout``) of a layer computing ``active``
        (B, A) and reusing ``reused_columns`` (B, R); its slots also hold ``kept_columns`` (B, K), written after the
        prefill (masked tokens given back for decoding) and invisible until then."""
        key = (active, reused_columns, kept_columns)
        if self._slots is None or self._layout is None or not all(_same(a, b) for a, b in zip(self._slots, key)):
            visible = self._mark(active, reused_columns)
            kept = visible | self._mark(kept_columns)
            slots_host = _held(kept)
            slots = on_device(slots_host, self.device)
            seen = on_device(visible.gather(1, slots_host.clamp(min=0)), self.device)
            mask = slot_mask(slots, active, self.valid) & seen[:, None, None, :]
            blocks = layout_blocks(slots_host, host_of(active), self._valid_host(), visible)
            filled = kept_columns is None and not bool((slots_host < 0).any())  # every slot visible, no pads
            self._slots, self._layout = key, (SlotWriter(slots, self.length, filled), Layout(active, mask, blocks))
        return self._layout

    def _valid_host(self) -> torch.Tensor | None:
        if self.valid is None:
            return None
        if self._valid_h is None:
            self._valid_h = self.valid.cpu()  # a padded batch: one read per prefill
        return self._valid_h


def _held(kept: torch.Tensor) -> torch.Tensor:
    """(B, S) the columns where the host ``kept`` (B, L) is True, in order, rows padded with -1."""
    width = int(kept.sum(1).max()) if kept.numel() else 0
    columns = torch.arange(kept.shape[1]).expand_as(kept)
    order = torch.sort((~kept).to(torch.int8), dim=1, stable=True).indices[:, :width]  # held columns first, in order
    return torch.where(kept.gather(1, order), columns.gather(1, order), -1)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """The same columns: the same tensor (the schedule and the reader hand out one per set), else equal values
    (of their host copies)."""
    if a is b:
        return True
    return a is not None and b is not None and a.shape == b.shape and torch.equal(host_of(a), host_of(b))


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
        """Keep the states of ``columns`` (B, A'), a subset of the current columns of every row (decided on the
        host copies of both)."""
        if columns is self.columns:
            return
        new, old = host_of(columns), host_of(self.columns)
        if new.shape == old.shape and torch.equal(new, old):
            return
        self._park()
        idx = positions_of(old, self._out.shape[1]).gather(1, new.clamp(min=0))
        if bool(((idx < 0) & (new >= 0)).any()):
            raise RuntimeError("a plan computes a token at a layer after one where it was not computed")
        idx = on_device(idx.clamp(min=0), self.hidden.device)
        self.hidden = self.hidden.gather(1, idx[..., None].expand(-1, -1, self.hidden.shape[-1]))
        cols = columns.clamp(min=0)[..., None].expand(-1, -1, self._cos_all.shape[-1])
        self.cos, self.sin = self._cos_all.gather(1, cols), self._sin_all.gather(1, cols)
        self.columns = columns

    def result(self) -> torch.Tensor:
        """(B, L, d): every column's last computed state."""
        self._park()
        return self._out

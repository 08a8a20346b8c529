"""``VisMemoCache``: a ``DynamicCache`` whose layers may hold reused and skip masked visual tokens.

Each layer stores K/V slots plus, once it differs from the plain layout, the request
column of every slot (``columns``, -1 for an empty slot). The attention function
(``attention.py``) turns those columns into the layer's mask, so masked tokens stay out
of attention in prefill and in every decoding step, and reused tokens are attended
where a full prefill would have attended them.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING, TypedDict, cast

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from vismemo_hf.core.features import checked_namespace, scoped
from vismemo_hf.core.plan import CacheEvent
from vismemo_hf.core.thresholds import LookupThresholds
from vismemo_hf.defaults import DEFAULT_POLICY
from vismemo_hf.policies import RoutingPolicy, get_policy, tolerance
from vismemo_hf.runtime import forward
from vismemo_hf.runtime.compress import VLCacheCompression
from vismemo_hf.runtime.gate import MODES as APPROXIMATE_MODES
from vismemo_hf.runtime.gate import Pending
from vismemo_hf.runtime.schedule import SlotWriter, slot_mask
from vismemo_hf.store.store import VisMemoStore, default_store

if TYPE_CHECKING:
    from vismemo_hf.runtime.watch import Watch


class VisMemoLayer(DynamicLayer):
    """One decoder layer's K/V slots; ``columns is None`` means slot i holds request column i (the plain layout),
    else ``columns`` (B, S) names the request column of every slot (-1: an empty slot).

    A prefill with a slot layout ``open``s the layer with its slots' columns in request-column order; reused and
    computed K/V are then written into their slots, so attention reads them in order and the layer needs no
    reordering afterwards. ``settle`` marks the slots nothing was written to as empty, and gives back the plain
    layout when every column is held."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.columns: torch.Tensor | None = None  # (B, S) long
        self._writer: SlotWriter | None = None  # the open layout while a prefill writes, shared with other layers
        self._written: list[tuple] = []  # the writer's plans written so far
        self._visible: torch.Tensor | None = None  # (B, S) the last decoding step's mask (mapped layers)

    @property
    def mapped(self) -> bool:
        return self.columns is not None

    @property
    def _kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of a layer that holds K/V (``is_initialized``)."""
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    def _materialise_columns(self, batch: int, device: torch.device) -> torch.Tensor:
        if self.columns is None:
            n = self.get_seq_length()
            self.columns = torch.arange(n, device=device).expand(batch, n).clone()
        return self.columns

    def open(self, layout: SlotWriter | torch.Tensor, length: int | None = None) -> None:
        """Lay the layer out as ``layout`` (a ``SlotWriter``, or slot columns (B, S), sorted, -1 padded, with the
        request ``length``) before a prefill writes it."""
        if isinstance(layout, SlotWriter):
            writer = layout
        elif length is None:
            raise TypeError("open: slot columns need the request length")
        else:
            writer = SlotWriter(layout, int(length))
        self.columns, self._writer, self._written = writer.columns, writer, []
        self.keys = self.values = None
        self.is_initialized = False
        self._visible = None

    def _write(self, writer: SlotWriter, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor) -> None:
        """Write K/V (B, H, T, D) of request ``columns`` (B, T; -1 pads) into their slots of the open layout
        (``writer``, whose ``columns`` are the layer's)."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
            shape = (keys.shape[0], keys.shape[1], writer.columns.shape[1], keys.shape[-1])
            make = "new_empty" if writer.filled else "new_zeros"  # slots no write reaches stay zero
            self.keys, self.values = getattr(keys, make)(shape), getattr(values, make)(shape)
        held_keys, held_values = self._kv
        plan = writer.plan(columns)
        self._written.append(plan)
        if plan[0] == "run":  # one row into consecutive slots: a copy
            _, s0, s1 = plan
            held_keys[:, :, s0:s1] = keys.to(held_keys.dtype)
            held_values[:, :, s0:s1] = values.to(held_values.dtype)
            return
        _, rows, slots, where, every = plan
        device = held_keys.device
        rows, slots, where = rows.to(device), slots.to(device), where.to(device)
        if held_keys.shape[0] == 1:  # one row: a copy along the slot axis, cheaper than an indexed put over two axes
            if not every:
                keys, values = keys.index_select(2, where), values.index_select(2, where)
            held_keys.index_copy_(2, slots, keys.to(held_keys.dtype))
            held_values.index_copy_(2, slots, values.to(held_values.dtype))
            return
        held_keys[rows, :, slots] = keys[rows, :, where].to(held_keys.dtype)
        held_values[rows, :, slots] = values[rows, :, where].to(held_values.dtype)

    def preload(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor) -> None:
        """Write reused K/V (B, H, R, D) of request ``columns`` (B, R) into the open layout."""
        if self._writer is None:
            raise RuntimeError("preload needs a layer opened with a slot layout")
        self._write(self._writer, keys, values, columns)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, columns: torch.Tensor,
               contiguous: bool, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        """Computed K/V of request ``columns`` (B, q): written into the open layout of a prefill, else appended
        (``contiguous``: they continue the sequence)."""
        if self._writer is not None:
            self._write(self._writer, key_states, value_states, columns)
            return self._kv
        if contiguous and not self.mapped:
            return super().update(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cols = self._materialise_columns(key_states.shape[0], key_states.device)
        columns = columns.to(cols.device)
        keys, values = self._kv
        self.keys = torch.cat([keys, key_states], dim=-2) if keys.numel() else key_states
        self.values = torch.cat([values, value_states], dim=-2) if values.numel() else value_states
        self.columns = torch.cat([cols, columns], dim=1)
        return self.keys, self.values

    def attention_mask(self, queries: int, valid_columns: torch.Tensor | None) -> torch.Tensor:
        """(B, 1, q, S) boolean mask of this layer's slots for the ``queries`` slots appended last. A decoding step
        (one query, which sees every slot that is not empty or padding) extends the previous step's mask by its own
        slot instead of building it again."""
        cols = self.columns
        assert cols is not None  # asked of mapped layers only
        if queries != 1:
            return slot_mask(cols, cols[:, -queries:], valid_columns)
        width = cols.shape[1]
        if self._visible is not None and self._visible.shape[1] == width - 1:
            self._visible = torch.cat([self._visible, self._visible.new_ones(self._visible.shape[0], 1)], dim=1)
        else:
            self._visible = slot_mask(cols, cols[:, -1:], valid_columns)[:, 0, 0]
        return self._visible[:, None, None, :]

    def slot_columns(self) -> torch.Tensor:
        """(B, S) request column of every slot."""
        if self.columns is not None:
            return self.columns
        n = self.get_seq_length()
        keys = self._kv[0]
        return torch.arange(n, device=keys.device).expand(keys.shape[0], n)

    def keep_slots(self, keep: torch.Tensor) -> None:
        """Drop every slot where ``keep`` (B, S) is False (rows padded with empty slots)."""
        self._visible = None
        keys, values = self._kv
        cols = self._materialise_columns(keys.shape[0], keys.device)
        keep = keep.to(cols.device) & (cols >= 0)
        width = int(keep.sum(1).max())
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :width]
        kept = keep.gather(1, order)
        idx = order[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
        self.keys, self.values = keys.gather(2, idx), values.gather(2, idx)
        self.columns = cols.gather(1, order).masked_fill(~kept, -1)

    def settle(self, length: int) -> None:
        """End of a prefill: slots nothing was written to become empty, and the layer is the plain layout again when
        it holds every column once in order (later forwards and readers then see a DynamicCache's layout)."""
        self._visible = None
        if self._writer is not None:
            writer, written = self._writer, self._written
            self._writer, self._written = None, []
            if self.is_initialized:
                self.columns = writer.settled(written)  # worked out once per layout and set of writes
                return
            self.columns = torch.full_like(writer.columns, -1)  # nothing was written
        cols = self.columns
        if cols is None or not self.is_initialized:
            return
        if cols.shape[1] == length and bool((cols == torch.arange(length, device=cols.device)).all()):
            self.columns = None

    def slot_of(self, columns: torch.Tensor, row: int) -> torch.Tensor:
        """Slot index of each request column in ``row`` (the columns must be stored)."""
        cols = self.columns
        if cols is None:
            return columns
        table = torch.full((int(cols[row].max()) + 2,), -1, dtype=torch.long, device=cols.device)
        ok = cols[row] >= 0
        table[cols[row][ok]] = torch.nonzero(ok).flatten()
        slots = table[columns.to(table.device).clamp(max=table.numel() - 1)]
        if (slots < 0).any():
            raise RuntimeError("requested columns are not stored in this layer")
        return slots

    def crop(self, tokens_to_remove: int) -> None:
        self._visible = None
        super().crop(tokens_to_remove)
        if self.columns is not None and tokens_to_remove:
            self.columns = self.columns[:, : -abs(tokens_to_remove)]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._visible = None
        super().reorder_cache(beam_idx)
        if self.columns is not None:
            self.columns = self.columns.index_select(0, beam_idx.to(self.columns.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._visible = None
        super().batch_repeat_interleave(repeats)
        if self.columns is not None:
            self.columns = self.columns.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._visible = None
        super().batch_select_indices(indices)
        if self.columns is not None:
            self.columns = self.columns[indices]


class _Unset:
    """Marks a default the caller did not pass, so the policy's own default applies (it prints as the number)."""


class _UnsetFloat(float, _Unset):
    pass


class _Overrides(TypedDict, total=False):
    """The ``LookupThresholds`` fields a ``VisMemoCache`` was given."""

    tau: float
    tau_fine: float
    adaptive: bool
    same_pixels: float | None


def check_thresholds(thresholds: LookupThresholds | None, model) -> None:
    """A ValueError when ``thresholds`` were calibrated for another model than ``model`` (enabled or not)."""
    if thresholds is None or thresholds.fingerprint is None or model is None:
        return
    from vismemo_hf.families import ModelAdapter

    adapter = getattr(model, "_vismemo", None) or ModelAdapter.for_model(model)
    if thresholds.fingerprint != adapter.fingerprint:
        raise ValueError(f"lookup thresholds calibrated for model {thresholds.fingerprint[:12]} given for model "
                         f"{adapter.fingerprint[:12]} ({type(model).__name__}): run `vismemo calibrate` for this "
                         "model or pass thresholds=None")


class VisMemoCache(DynamicCache):
    """Cache that looks every image of a request up in ``store`` and reuses what it may.

    Use it like a ``DynamicCache`` on a model passed to ``vismemo_hf.enable`` first:
    ``model.generate(**inputs, cache=VisMemoCache())``. ``events`` holds one
    ``CacheEvent`` per image seen. Extra keyword arguments are options of the policy.

    ``policy`` is a registered name (``vismemo_hf.available_policies()``), a preset in
    ``configs/policies/`` or a YAML path, or a policy instance; the default, ``attend-deviate``,
    recomputes what changed or what the question attends to and reuses the rest (``vismemo`` is
    the paper's routing, docs/METHOD.md §2). ``warmup_layers``, ``recompute_ratio`` and ``reuse_ratio``
    (None: the policy's own, attend-deviate 1, 0 %, 10 %; vismemo 3, 30 %, 10 %; cacheblend 1 check layer,
    15 %) and the policy's other options (``context``: a dict of ``ContextRouting`` fields, how a hit after another
    context is checked) are passed on to it.
    ``compress=VLCacheCompression(ratio)`` shrinks the K/V kept for decoding after prefill.

    Approximate lookup compares embeddings centred by the model's reference means with ``thresholds``: a
    ``LookupThresholds``, or a preset name / YAML path written by ``vismemo calibrate`` for the model; None: the
    store's calibration for the model (``VisMemoStore(thresholds=...)``), else tau 0.8 and tau_fine 0.85 raised
    above the model's unrelated reference pairs. ``tau`` / ``tau_fine`` / ``same_pixels`` (the pixel-first stage's
    least unchanged share; None: no pixel-first stage) override single values; ``top_k`` candidates get the fine
    stage (0: exact hits only).

    ``namespace`` (a tenant, user or project name; default the store's ``namespace``): like vLLM's ``cache_salt``,
    it enters every exact key and the lookup index, so that this cache never reuses, exactly or approximately, an
    entry another namespace stored, and stores its own for its namespace only.

    ``model`` (optional): the model this cache will serve; given, thresholds calibrated for another model are an
    error here rather than at the first approximate lookup inside ``generate``.

    ``approximate``: ``"auto"`` (default; ``VISMEMO_APPROXIMATE`` in the environment sets another) looks for
    approximate hits while they save more time than the lookups cost on the model, measured on its last requests
    (``runtime.gate``: on a model whose prefill takes a few milliseconds a hit can take longer than the prefill it
    replaces); ``"always"`` on every request (what a quality evaluation measures); ``"never"``: exact hits and
    reused prefixes only.
    """

    def __init__(
        self,
        store: VisMemoStore | None = None,
        policy: str | RoutingPolicy = DEFAULT_POLICY,
        warmup_layers: int | None = None,
        recompute_ratio: float | None = None,
        reuse_ratio: float | None = None,
        thresholds: str | LookupThresholds | None = None,
        tau: float | None = None,
        tau_fine: float | None = None,
        same_pixels: float | None = _UnsetFloat(0.75),
        top_k: int = 5,
        store_misses: bool = True,
        compress: VLCacheCompression | None = None,
        namespace: str | None = None,
        model: torch.nn.Module | None = None,
        approximate: str | None = None,
        **policy_options: object,
    ) -> None:
        Cache.__init__(self, layer_class_to_replicate=VisMemoLayer)
        if store is not None and not isinstance(store, VisMemoStore):
            raise TypeError(f"store must be a VisMemoStore (one shared by every cache, so that hits happen), got "
                            f"{type(store).__name__}; for a preset build it once: VisMemoStore.from_config({store!r})")
        self.store = store if store is not None else default_store()
        self.namespace = checked_namespace(namespace) if namespace is not None else self.store.namespace
        if not isinstance(policy, (str, os.PathLike, RoutingPolicy)):
            raise TypeError(f"policy must be a policy name, a preset name or path, or a RoutingPolicy, got {policy!r}")
        policy = os.fspath(policy) if isinstance(policy, os.PathLike) else policy
        shared = {"warmup_layers": warmup_layers, "recompute_ratio": recompute_ratio, "reuse_ratio": reuse_ratio}
        given = {k: v for k, v in shared.items() if v is not None}
        self.policy = get_policy(policy, **given, **policy_options)
        #: the policy as given; ``policy`` is it as it serves the model of the last prefill (``serve``)
        self.given_policy = self.policy
        self._served: str | None = None
        self._context_given = "context" in policy_options  # a context routing passed is kept as it is
        if isinstance(thresholds, (str, os.PathLike)):
            thresholds = LookupThresholds.load(os.fspath(thresholds))
        if thresholds is not None and not isinstance(thresholds, LookupThresholds):
            raise TypeError(f"thresholds must be a lookup preset's name or path or LookupThresholds, got {thresholds!r}")
        check_thresholds(thresholds, model)
        self.thresholds = thresholds
        self._overrides: _Overrides = {}
        if tau is not None:
            self._overrides["tau"] = float(tau)
        if tau_fine is not None:
            self._overrides["tau_fine"] = float(tau_fine)
            self._overrides["adaptive"] = False
        if not isinstance(same_pixels, _Unset):
            self._overrides["same_pixels"] = same_pixels
        replace(LookupThresholds(), **self._overrides)  # a bad tau is an error here, not at the first lookup
        if not isinstance(top_k, int) or isinstance(top_k, bool):
            raise TypeError(f"top_k must be an int, got {top_k!r}")
        if top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not isinstance(store_misses, bool):
            raise TypeError(f"store_misses must be True or False, got {store_misses!r}")
        if compress is not None and not isinstance(compress, VLCacheCompression):
            raise TypeError(f"compress must be None or a VLCacheCompression (e.g. VLCacheCompression(0.5)), got "
                            f"{compress!r}")
        approximate = approximate if approximate is not None else os.environ.get("VISMEMO_APPROXIMATE", "auto")
        if approximate not in APPROXIMATE_MODES:
            raise ValueError(f"approximate must be one of {', '.join(APPROXIMATE_MODES)}, got {approximate!r}")
        self.approximate = approximate
        self.top_k = top_k
        self.store_misses = store_misses
        self.compress = compress
        self.events: list[CacheEvent] = []
        self._length = 0
        #: the first tokens of an answer whose prefill reused K/V after another context (``runtime/watch.py``)
        self.watch: Watch | None = None
        #: the last prefill's sample for its approximate-lookup gate, until its first token is taken (``runtime.gate``)
        self._gate_pending: Pending | None = None

    def owner(self, fingerprint: str) -> str:
        """Whose entries this cache reads and writes for a model (``core/features.py`` ``scoped``)."""
        return scoped(fingerprint, self.namespace)

    def serve(self, fingerprint: str) -> None:
        """A prefill of the model ``fingerprint`` names begins: ``policy`` becomes the given policy with that model's
        calibrated context tolerance, where it has one, no ``context`` was passed and the policy checks contexts with
        its own default routing (``policies.tolerance``, written by ``vismemo calibrate --context``)."""
        if self._served != fingerprint:
            self.policy = tolerance.for_model(self.given_policy, fingerprint, self._context_given)
            self._served = fingerprint

    def lookup_thresholds(self, fingerprint: str) -> LookupThresholds:
        """The thresholds for a model: this cache's, else the store's calibration for that model, else the defaults;
        then ``tau`` / ``tau_fine`` if they were passed."""
        base = self.thresholds or self.store.thresholds_for(fingerprint) or LookupThresholds()
        return replace(base, **self._overrides)

    # -- transformers Cache API ----------------------------------------------------------------
    @property
    def vismemo_layers(self) -> list[VisMemoLayer]:
        """``layers`` as what they are: every layer of this cache is a ``VisMemoLayer`` (``layer_class_to_replicate``,
        ``layer``, ``drop_layers``)."""
        return cast("list[VisMemoLayer]", self.layers)

    def layer(self, layer_idx: int) -> VisMemoLayer:
        while len(self.layers) <= layer_idx:
            self.layers.append(VisMemoLayer())
        return cast(VisMemoLayer, self.layers[layer_idx])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = forward.current(self)
        if ctx is None:
            raise RuntimeError(
                "VisMemoCache is used by a model that was not prepared: call vismemo_hf.enable(model) once "
                "before generate() (without it every image would silently get a full prefill)"
            )
        layer = cast(VisMemoLayer, self.layers[layer_idx]) if layer_idx < len(self.layers) else self.layer(layer_idx)
        incoming = ctx.layout.incoming if ctx.layout is not None else None
        if incoming is not None:
            return layer.update(key_states, value_states, columns=incoming, contiguous=False)
        if not layer.mapped:  # the plain layout continues: DynamicLayer's own append
            return DynamicLayer.update(layer, key_states, value_states)
        q = key_states.shape[-2]  # a continuation of a layer with left-out slots: the next columns in order
        cols = torch.arange(self._length, self._length + q, device=key_states.device)
        return layer.update(key_states, value_states, columns=cols.expand(key_states.shape[0], q), contiguous=True)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._length

    @property
    def mapped(self) -> bool:
        """Some layer's slots are not the plain sequence (tokens left out): forwards need slot masks."""
        return any(layer.mapped for layer in self.vismemo_layers)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self._length + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        self._visible = None
        self.watch = None
        super().crop(tokens_to_remove)
        self._length -= abs(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.watch is not None:
            self.watch.reorder(beam_idx)
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.watch = None
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.watch = None
        super().batch_select_indices(indices)

    def reset(self) -> None:
        super().reset()
        self.layers = []
        self._length = 0
        self.watch = None

    def restart(self) -> None:
        """Forget every layer's K/V: a forward then computes the sequence from its start (``runtime/watch.py``)."""
        self.layers = []
        self._length = 0

    def rewound_to(self, length: int) -> None:
        """The layers hold ``length`` columns before the forward in progress adds its own."""
        self._length = length

    def drop_layers(self, first: int) -> None:
        """Forget what the layers from ``first`` on hold (a prefill that runs them again)."""
        for i in range(first, len(self.layers)):
            self.layers[i] = VisMemoLayer()

    def advance(self, new_tokens: int) -> None:
        """Close a forward that added ``new_tokens`` request columns (called by ``forward.close_forward``)."""
        self._length += new_tokens

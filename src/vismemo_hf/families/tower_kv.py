"""The vision tower's own K/V: kept from a whole-image encode, lent to a partial one (encoder reuse, issue R).

A partial encode (``ModelAdapter.encode_tokens``) runs only the tokens an approximate hit recomputes. Given only
a halo of neighbours as context, a full-attention tower's output for them is far from a whole-image encode's
(``results/quality/encoder-reuse.md`` measures how far, with a halo of 2 tokens). Lent instead the
alias's K/V of every other patch at every attention layer, the changed tokens attend over the whole image as in a
whole-image encode; what differs is only that the unchanged patches' states are the alias's (they never saw the
changed pixels), the same approximation the language model's reuse makes one level up.

Both sides go through the tower's attention interface (``transformers``' ``ALL_ATTENTION_FUNCTIONS``): for the
duration of one encode the tower's configuration names ``vismemo_tower``, a function that records each layer's
rotated keys and values (``capture``) or appends the lent ones (``lend``) and then calls the implementation the
tower was configured with, so that the arithmetic is that implementation's. Both take the non-flash branch of the
Qwen towers' attention (one call per image, or per window in Qwen2.5-VL's windowed blocks). Windowed blocks are
not lent to: a partial encode there runs whole windows (``core.pixel_first.encoder_tokens``), exact by itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from vismemo_hf.families import routing
from vismemo_hf.families.base import execution_device

NAME = "vismemo_tower"


@dataclass
class _Run:
    """One encode's state: which module is which layer, what to record or lend, the implementation to call."""

    layers: dict[int, int]
    inner: object
    lent: set[int]
    record: dict[int, list] | None = None
    extra: dict[int, list] | None = None
    calls: dict[int, int] = field(default_factory=dict)


_RUN: ContextVar[_Run | None] = ContextVar("vismemo_tower", default=None)


def _own_attention(config):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen2_vl.modeling_qwen2_vl import eager_attention_forward

    return ALL_ATTENTION_FUNCTIONS.get_interface(routing.own_implementation(config), eager_attention_forward)


def _attention(module, query, key, value, attention_mask=None, **kwargs):
    run = _RUN.get()
    if run is None or id(module) not in run.layers:
        return _own_attention(module.config)(module, query, key, value, attention_mask=attention_mask, **kwargs)
    layer = run.layers[id(module)]
    if layer in run.lent:
        call = run.calls.get(layer, 0)
        run.calls[layer] = call + 1
        if run.record is not None:
            run.record.setdefault(layer, []).append((key, value))
        if run.extra is not None:
            more_k, more_v = run.extra[layer][call]
            key = torch.cat([key, more_k.to(key.device, key.dtype)], dim=2)  # a stored entry's: on the host
            value = torch.cat([value, more_v.to(value.device, value.dtype)], dim=2)
    return run.inner(module, query, key, value, attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Make ``vismemo_tower`` a transformers attention implementation (once; ``enable`` does it)."""
    from transformers import AttentionInterface

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, _attention)


def full_layers(visual) -> list[int]:
    """The blocks whose attention spans the whole image (all but Qwen2.5-VL's windowed ones)."""
    full = getattr(visual, "fullatt_block_indexes", None)
    return list(range(len(visual.blocks))) if full is None else sorted(full)


def can_capture(visual) -> bool:
    """Whether the tower's attention can be recorded and lent to (not a fused flash kernel)."""
    implementation = routing.own_implementation(visual.config) or ""
    return "flash" not in implementation and hasattr(visual, "blocks")


@contextmanager
def _running(visual, record=None, extra=None):
    register()
    view = visual.blocks[0].attn.config
    if not isinstance(view, routing.ConfigView):
        raise RuntimeError("the vision tower is not routed: enable(model) gives its attention modules a ConfigView")
    own = routing.own_implementation(view)
    if own and "flash" in own:
        raise NotImplementedError("tower K/V reuse runs the non-flash attention branch")
    layers = {id(block.attn): i for i, block in enumerate(visual.blocks)}
    token = _RUN.set(_Run(layers, _own_attention(view), set(full_layers(visual)), record, extra))
    try:
        with routing.routed(view, NAME):
            yield
    finally:
        _RUN.reset(token)


def expected_shape(visual, patches: int) -> tuple[int, int, int, int]:
    """The tower K/V ``capture`` gives for an image of ``patches`` patches: (full blocks, 2, patches, width)."""
    attn = visual.blocks[0].attn
    return len(full_layers(visual)), 2, patches, attn.qkv.out_features // 3


@contextmanager
def capture(visual, order: list[torch.Tensor | None]):
    """Record, for each full-attention block, every image's rotated (K, V); yields a list that holds, after the
    block, per image in patch order what lays its K/V out as one (layers, 2, patches, width) tensor when first
    called (an entry's build, off the request's path). ``order``: per image, the patch order the tower ran them in
    (a permutation; None: their own order)."""
    record: dict[int, list] = {}
    out: list[Callable[[], torch.Tensor]] = []
    with _running(visual, record=record):
        yield out
    layers = full_layers(visual)
    out.extend(functools.cache(functools.partial(_laid_out, record, layers, i, perm)) for i, perm in enumerate(order))


def _laid_out(record: dict[int, list], layers: list[int], image: int, perm: torch.Tensor | None) -> torch.Tensor:
    per = []
    for layer in layers:
        k, v = record[layer][image]
        kv = torch.stack([k[0], v[0]]).transpose(1, 2).flatten(2)  # (2, patches, heads * head_dim)
        if perm is not None:
            kv = kv[:, torch.argsort(perm.to(kv.device))]
        per.append(kv)
    return torch.stack(per).detach()


@contextmanager
def lend(visual, kept: list[tuple[torch.Tensor, torch.Tensor]]):
    """Lend, at every full-attention block, each image's other patches: ``kept`` per image (tower K/V as
    ``capture`` gives it, (M,) patch rows not in the partial encode)."""
    heads = visual.blocks[0].attn.num_heads
    device = execution_device(visual)
    if device.type not in ("cpu", "meta"):  # a stored entry's K/V sit on the host: moved in one copy, then gathered
        # there (a gather of every layer on the host and a copy per layer cost a GPU encode more than a whole one)
        kept = [(kv.to(device, non_blocking=True), rows.to(device, non_blocking=True)) for kv, rows in kept]
    extra: dict[int, list] = {}
    for j, layer in enumerate(full_layers(visual)):
        extra[layer] = []
        for kv, rows in kept:
            k, v = kv[j][:, rows].unflatten(-1, (heads, -1)).transpose(1, 2).unbind(0)
            extra[layer].append((k[None], v[None]))
    with _running(visual, extra=extra):
        yield

"""Analytic FLOPs of a request: the vision encoder and the language model's prefill under a plan.

The benchmarks' floors: a kind's TTFT cannot go below the arithmetic it runs, the encoder included (a miss and an
approximate hit run it whole today, an exact hit not at all). ``encoder_flops`` counts the vision tower from its
config (patch embedding, each block's projections, MLP and attention over the patches each patch sees, the 2x2
merger, Qwen3-VL's deepstack mergers); ``plan_flops`` the decoder layers (projections and MLP of the computed
tokens, attention over exactly the keys each query sees). Both take a model config, so the same plan is also
priced at a real model's published geometry (``configs/models/qwen3-vl-8b.yaml``, ...): what a stand-in measures
is then read against what the real model would spend.
"""

from __future__ import annotations

import torch

#: real geometries the benchmarks price their plans at (model presets)
REAL_PRESETS = ("qwen3-vl-8b", "qwen2.5-vl-7b")


def layer_flops(config, queries: int, keys: float) -> float:
    """Forward FLOPs of one decoder layer: projections and MLP for ``queries`` tokens, attention over ``keys``."""
    t = config.text_config
    d, heads, kv, ffn = t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.intermediate_size
    head_dim = getattr(t, "head_dim", None) or d // heads
    linear = 2 * queries * (d * heads * head_dim * 2 + 2 * d * kv * head_dim + 3 * d * ffn)
    attention = 4 * heads * head_dim * queries * keys
    return linear + attention


def plan_flops(config, length: int, start: int, plan) -> float:
    """FLOPs of a prefill of ``length`` columns whose image (at column ``start``) is routed by ``plan``: at each
    layer the text and the plan's computed tokens are queries, and each query attends to exactly the keys it
    sees (text, computed and reused tokens at or before its column; masked tokens are no keys)."""
    n = plan.n_tokens
    per_layout = {}
    total = 0.0
    for layer in range(config.text_config.num_hidden_layers):
        computed, reused = plan.computed_at(layer), plan.reused_at(layer)
        layout = (computed.numel(), reused.numel())  # the sets nest with depth: their sizes name them
        if layout not in per_layout:
            query = torch.ones(length, dtype=torch.bool)
            query[start : start + n] = False
            query[start + computed] = True
            key = query.clone()
            key[start + reused] = True
            pairs = int(key.long().cumsum(0)[query].sum())
            queries = int(query.sum())
            per_layout[layout] = layer_flops(config, queries, pairs / queries)
        total += per_layout[layout]
    return total


def encoder_flops(config, patches: int) -> float:
    """Forward FLOPs of the vision tower on one image of ``patches`` patches (its ``grid_thw`` product).

    Qwen2-VL: blocks of width ``embed_dim`` with a plain MLP (``mlp_ratio``), full attention over the image;
    Qwen2.5-VL: a gated MLP, attention inside windows of ``window_size`` pixels except ``fullatt_block_indexes``;
    Qwen3-VL: a plain MLP, full attention, one merger per ``deepstack_visual_indexes`` entry besides the last one.
    """
    v = config.vision_config
    family = config.model_type
    if family == "qwen2_vl":
        d, f, gated = v.embed_dim, int(v.embed_dim * v.mlp_ratio), False
    else:
        d, f, gated = v.hidden_size, v.intermediate_size, family == "qwen2_5_vl"
    merge = v.spatial_merge_size ** 2
    embed = 2 * patches * v.in_channels * v.temporal_patch_size * v.patch_size ** 2 * d
    linear = 2 * patches * (4 * d * d + (3 if gated else 2) * d * f)
    full = 4 * patches * patches * d
    if family == "qwen2_5_vl":
        window = min(patches, (v.window_size // v.patch_size) ** 2)
        full_layers = set(v.fullatt_block_indexes)
        attention = sum(full if i in full_layers else 4 * patches * window * d for i in range(v.depth))
    else:
        attention = v.depth * full
    out = getattr(v, "out_hidden_size", None) or getattr(v, "hidden_size", d)
    mergers = 1 + len(getattr(v, "deepstack_visual_indexes", None) or ())
    merger = mergers * 2 * (patches // merge) * (merge * d * merge * d + merge * d * out)
    return embed + v.depth * linear + attention + merger


def patches_of(config, visual_tokens: int) -> int:
    """Patches of an image that gives ``visual_tokens`` tokens (the merger's 2x2)."""
    return visual_tokens * config.vision_config.spatial_merge_size ** 2


def miss_flops(config, length: int, start: int, visual_tokens: int) -> tuple[float, float]:
    """(encoder, language model) FLOPs of a miss: the whole tower, every token through every layer."""
    from vismemo_hf.core.plan import HitKind, ImagePlan

    full = ImagePlan.full(HitKind.MISS, visual_tokens)
    return encoder_flops(config, patches_of(config, visual_tokens)), plan_flops(config, length, start, full)


def encoder_share(config, length: int, start: int, visual_tokens: int) -> float:
    """The vision encoder's share of a miss's FLOPs."""
    enc, llm = miss_flops(config, length, start, visual_tokens)
    return enc / (enc + llm)


def kind_floor(config, length: int, start: int, plan, encoded_patches: int) -> float:
    """FLOPs a request of this kind runs: the encoder on ``encoded_patches`` (all of them for a miss or today's
    approximate hit, none for an exact hit) and the plan's prefill."""
    enc = encoder_flops(config, encoded_patches) if encoded_patches else 0.0
    return enc + plan_flops(config, length, start, plan)


def real_configs() -> dict:
    """preset name -> its config (the published geometry; nothing is built)."""
    from vismemo_hf.families import preset_config

    return {name: preset_config(name) for name in REAL_PRESETS}

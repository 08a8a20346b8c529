"""Analytic FLOPs of a request: the vision encoder and the language model's prefill under a plan.

The benchmarks' floors: a kind's TTFT cannot go below the arithmetic it runs, the encoder included (a miss and an
approximate hit run it whole today, an exact hit not at all). ``encoder_flops`` counts the vision tower from its
config, as its family file prices it (patch embedding, each block's projections, MLP and attention over the
patches each patch sees, the mergers); ``plan_flops`` the decoder layers (projections and MLP of the computed
tokens, attention over exactly the keys each query sees). Both take a model config, so the same plan is also
priced at a real model's published geometry (``configs/models/qwen3-vl-8b.yaml``, ...): what a stand-in measures
is then read against what the real model would spend.
"""

from __future__ import annotations

import torch

#: real geometries the benchmarks price their plans at (model presets)
REAL_PRESETS = ("qwen3-vl-8b", "qwen2.5-vl-7b", "glm-4.6v-flash", "llava-onevision-7b")


def layer_flops(config, queries: int, keys: float) -> float:
    """Forward FLOPs of one decoder layer: projections and MLP for ``queries`` tokens, attention over ``keys``."""
    t = config.text_config
    d, heads, kv, ffn = t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.intermediate_size
    head_dim = getattr(t, "head_dim", None) or d // heads
    linear = 2 * queries * (d * heads * head_dim * 2 + 2 * d * kv * head_dim + 3 * d * ffn)
    attention = 4 * heads * head_dim * queries * keys
    return linear + attention


def _layer_layouts(config, length: int, start: int, plan) -> list[tuple[int, int, int, int]]:
    """(queries, keys, query-key pairs, layers) of each distinct layer layout of a prefill of ``length`` columns
    whose image (at column ``start``) is routed by ``plan``: the text and the plan's computed tokens are queries,
    they and the reused tokens keys (masked tokens are neither); a query pairs with the keys at or before its
    column."""
    n = plan.n_tokens
    per_layout: dict[tuple[int, int], list[int]] = {}
    for layer in range(config.text_config.num_hidden_layers):
        computed, reused = plan.computed_at(layer), plan.reused_at(layer)
        layout = (computed.numel(), reused.numel())  # the sets nest with depth: their sizes name them
        if layout not in per_layout:
            query = torch.ones(length, dtype=torch.bool)
            query[start : start + n] = False
            query[start + computed] = True
            key = query.clone()
            key[start + reused] = True
            per_layout[layout] = [int(query.sum()), int(key.sum()), int(key.long().cumsum(0)[query].sum()), 0]
        per_layout[layout][3] += 1
    return [(q, k, pairs, layers) for q, k, pairs, layers in per_layout.values()]


def plan_flops(config, length: int, start: int, plan) -> float:
    """FLOPs of a prefill of ``length`` columns whose image (at column ``start``) is routed by ``plan``: at each
    layer the text and the plan's computed tokens are queries, and each query attends to exactly the keys it
    sees (text, computed and reused tokens at or before its column; masked tokens are no keys)."""
    return sum(layer_flops(config, queries, pairs / queries) * layers
               for queries, _, pairs, layers in _layer_layouts(config, length, start, plan))


def plan_layouts(config, length: int, start: int, plan) -> dict[tuple[int, int], int]:
    """How many decoder layers run each (queries, keys) layout of ``plan`` (``_layer_layouts``): what
    ``bench.latency.plain_kernels_ms`` times plain transformers' own layers on."""
    out: dict[tuple[int, int], int] = {}
    for queries, keys, _, layers in _layer_layouts(config, length, start, plan):
        out[(queries, keys)] = out.get((queries, keys), 0) + layers
    return out


def encoder_flops(config, patches: int) -> float:
    """Forward FLOPs of the vision tower on one image of ``patches`` patches (its ``grid_thw`` product): the
    family's own count (``ModelAdapter.encoder_flops``: each family file prices its tower)."""
    from vismemo_hf.families import FAMILIES

    return FAMILIES[config.model_type].model_encoder_flops(config, patches)


def partial_encoder_flops(config, encoded: int, patches: int) -> float:
    """FLOPs of a partial encode (an approximate hit found by its pixels): the tower on the ``encoded`` patches,
    which attend to the lent K/V of the image's other ``patches - encoded`` as well (``families.tower_kv``)."""
    from vismemo_hf.families import FAMILIES

    if encoded <= 0:
        return 0.0
    if encoded >= patches:
        return encoder_flops(config, patches)
    lent = FAMILIES[config.model_type].lent_flops(config.vision_config, encoded, patches)
    return encoder_flops(config, encoded) + lent


def entry_bytes(config, visual_tokens: int, itemsize: int = 2) -> tuple[int, int]:
    """(language-model K/V, tower K/V) bytes of one image's entry in a ``itemsize``-byte dtype: every decoder layer's
    keys and values of its tokens, and the tower's own K/V that encoder reuse keeps (``Entry.tower_kv``)."""
    from vismemo_hf.families import FAMILIES

    t = config.text_config
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    llm = t.num_hidden_layers * 2 * t.num_key_value_heads * head_dim * visual_tokens
    tower = FAMILIES[config.model_type].tower_kv_values(config.vision_config, patches_of(config, visual_tokens))
    return llm * itemsize, tower * itemsize


def patches_of(config, visual_tokens: int) -> int:
    """Patches of an image that gives ``visual_tokens`` tokens (the family's: a merger's 2x2, or one per token)."""
    from vismemo_hf.families import FAMILIES

    return FAMILIES[config.model_type].patches_for(config, visual_tokens)


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
    """FLOPs a request of this kind runs: the encoder on ``encoded_patches`` (all of them for a miss or an
    approximate hit found by its encoder output, the changed ones for one found by its pixels, lent the others'
    K/V: ``partial_encoder_flops``; none for an exact hit) and the plan's prefill."""
    patches = patches_of(config, plan.n_tokens)
    return partial_encoder_flops(config, encoded_patches, patches) + plan_flops(config, length, start, plan)


def real_configs() -> dict:
    """preset name -> its config (the published geometry; nothing is built)."""
    from vismemo_hf.families import preset_config

    return {name: preset_config(name) for name in REAL_PRESETS}

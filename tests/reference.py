"""Independent reference computations for the tests: a plain layer loop with hand-made masks."""

import torch


def _embed(model, inputs):
    base = model.model
    ids = inputs["input_ids"]
    embeds = base.get_input_embeddings()(ids)
    if "image_sizes" in inputs:  # LLaVA-OneVision: tiles, 1-D positions counted over the unpadded columns
        out = base.get_image_features(inputs["pixel_values"], inputs["image_sizes"], return_dict=True)
        valid = inputs.get("attention_mask", torch.ones_like(ids))
        positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
    else:
        out = base.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True)
        positions, _ = base.get_rope_index(ids, inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"])
    feats = torch.cat(list(out.pooler_output))
    is_img = ids == model.config.image_token_id
    embeds = embeds.masked_scatter(is_img[..., None], feats.to(embeds.dtype))
    deepstack = None
    if getattr(out, "deepstack_features", None) is not None:
        deepstack = [torch.cat(list(level)) for level in out.deepstack_features]
    return embeds, positions, is_img, deepstack


def late_layers(model, first: int, hide: torch.Tensor) -> list:
    """Per-layer hide masks: nothing below layer ``first``, ``hide`` from it on."""
    n_layers = model.config.text_config.num_hidden_layers
    return [None] * first + [hide] * (n_layers - first)


@torch.no_grad()
def masked_logits(model, inputs, hides: list, query_from: int = 0) -> torch.Tensor:
    """Last-position logits of a full forward in which, at each layer, the queries at columns >=
    ``query_from`` do not attend the key columns where that layer's ``hides[l]`` (B, L) is True."""
    text = model.model.language_model
    embeds, positions, is_img, deepstack = _embed(model, inputs)
    b, n, _ = embeds.shape
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None].expand(b, -1, -1)
    if "attention_mask" in inputs:
        causal = causal & inputs["attention_mask"].bool()[:, None, :]
    queries = (torch.arange(n) >= query_from)[None, :, None]
    cos, sin = text.rotary_emb(embeds, positions)
    hidden = embeds
    for i, layer in enumerate(text.layers):
        mask = causal
        if hides[i] is not None:
            mask = causal & ~(hides[i][:, None, :] & queries)
            mask = mask | ~mask.any(-1, keepdim=True)
        mask = mask[:, None]
        hidden = layer(hidden, attention_mask=mask, position_embeddings=(cos, sin))
        if deepstack is not None and i < len(deepstack):
            hidden = hidden.clone()
            hidden[is_img] = hidden[is_img] + deepstack[i]
    return model.lm_head(text.norm(hidden))[:, -1]


def extend(inputs, tokens: torch.Tensor):
    """``inputs`` with ``tokens`` (B, k) appended as text."""
    out = dict(inputs)
    out["input_ids"] = torch.cat([inputs["input_ids"], tokens], 1)
    if "mm_token_type_ids" in inputs:
        out["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(tokens)], 1)
    if "attention_mask" in inputs:
        out["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(tokens)], 1)
    return out

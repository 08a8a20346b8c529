"""Offline calibration: VL-Cache's per-layer sensitivity profile (``vismemo profile-vlcache``).

For calibration pairs (a page and an edited copy, same prompt) both are prefilled in full;
a layer's sensitivity is the relative squared deviation between the copy's fresh visual K/V
and the original's (what reuse would have supplied), averaged over tokens, heads and pairs.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from vismemo_hf.eval import synthetic
from vismemo_hf.progress import progress as progress_bar


@torch.no_grad()
def _visual_kv(model, processor, image, question):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=[image], return_tensors="pt").to(model.device)
    cache = DynamicCache()
    model(**inputs, cache=cache, use_cache=True)
    visual = (inputs["input_ids"][0] == model.config.image_token_id).nonzero().flatten()
    return [(layer.keys[0][:, visual].float(), layer.values[0][:, visual].float()) for layer in cache.layers]


def layer_sensitivity(model, processor, pairs: int = 4, seed: int = 0) -> list[float]:
    """Mean relative K/V deviation per decoder layer over ``pairs`` synthetic (page, edited page) pairs."""
    totals: list[float] | None = None
    for i in progress_bar(range(pairs), desc="profile-vlcache", unit="pair"):
        s = seed + i
        question = "What is the value of the third row?"
        old = _visual_kv(model, processor, synthetic.page(s), question)
        new = _visual_kv(model, processor, synthetic.edited(s, row=i % 6, value=f"{(7 * s) % 10000:04d}"), question)
        devs = []
        for (k0, v0), (k1, v1) in zip(old, new):
            num = (k1 - k0).pow(2).sum() + (v1 - v0).pow(2).sum()
            den = k1.pow(2).sum() + v1.pow(2).sum()
            devs.append(float(num / den.clamp_min(1e-12)))
        totals = devs if totals is None else [a + b for a, b in zip(totals, devs)]
    if totals is None:
        raise ValueError(f"pairs must be at least 1, got {pairs}")
    return [t / pairs for t in totals]

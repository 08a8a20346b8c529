"""Load a model and its processor from a local checkpoint or a preset name (random weights)."""

from __future__ import annotations

from pathlib import Path

import torch


def load_model(spec: str, family: str | None = None, dtype=torch.float32, seed: int = 0, device: str = "cpu"):
    """``(model, processor)``: ``spec`` is ``"vismemo-docqa-tiny"`` (the packaged reading model), a local
    checkpoint folder (``from_pretrained``) or a preset
    of ``configs/models/`` built with random weights and an offline processor (``family`` picks the
    family of family-agnostic presets such as ``tiny``; default qwen2_vl)."""
    from vismemo_hf.eval.docqa import MODEL_NAME, docqa_model

    if spec == MODEL_NAME:
        model, processor = docqa_model(dtype=dtype)
        return model.to(device), processor
    if Path(spec).is_dir():
        from transformers import AutoModelForImageTextToText, AutoProcessor

        model = AutoModelForImageTextToText.from_pretrained(spec, dtype=dtype).eval().to(device)
        return model, AutoProcessor.from_pretrained(spec)
    from vismemo_hf.offline import offline_processor
    from vismemo_hf.presets import load_preset
    from vismemo_hf.testing import build_model

    family = family or load_preset(spec).get("family") or "qwen2_vl"
    processor = offline_processor(family)
    return build_model(spec, family, seed=seed, dtype=dtype, tokenizer=processor.tokenizer, device=device), processor

"""Tiny random Qwen-VL models with offline processors, for tests, the demo and trying the library.

``tiny_model(family)`` returns ``(model, processor)`` built from ``configs/models/tiny.yaml``
with a byte-level tokenizer and the family's real processor classes and chat template, so
the code that drives them drives a real checkpoint too.
"""

from __future__ import annotations

import torch

from vismemo_hf.eval.docqa import docqa_model as _load_docqa
from vismemo_hf.families import preset_config
from vismemo_hf.offline import byte_tokenizer, offline_processor

__all__ = ["build_model", "byte_tokenizer", "docqa_model", "offline_processor", "tiny_model"]


def build_model(preset: str, family: str | None = None, seed: int = 0, dtype=torch.float32, tokenizer=None,
                device: str = "cpu", **text_overrides):
    """A random-weight model of ``preset`` (eval mode, SDPA attention), created directly on ``device``;
    ``text_overrides`` replace text-config fields."""
    from transformers import AutoModelForImageTextToText

    config = preset_config(preset, family, tokenizer=tokenizer, **text_overrides)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    return model.eval()


def tiny_model(family: str = "qwen2_vl", seed: int = 0, **text_overrides):
    """``(model, processor)``: a tiny random ``family`` model in fp32 with an offline processor."""
    processor = offline_processor(family)
    model = build_model("tiny", family, seed=seed, tokenizer=processor.tokenizer, **text_overrides)
    return model, processor


def docqa_model():
    """``(model, processor)`` of ``vismemo-docqa-tiny``, the packaged model trained to read synthetic forms."""
    return _load_docqa()

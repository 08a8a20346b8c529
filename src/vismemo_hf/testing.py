"""Tiny random Qwen-VL models with offline processors, for tests, the demo and trying the library.

``tiny_model(family)`` returns ``(model, processor)`` built from ``configs/models/tiny.yaml``
with a byte-level tokenizer and the family's real processor classes and chat template, so
the code that drives them drives a real checkpoint too.
"""

from __future__ import annotations

from vismemo_hf.eval.docqa import docqa_model as _load_docqa
from vismemo_hf.families import build_model
from vismemo_hf.offline import byte_tokenizer, offline_processor

__all__ = ["build_model", "byte_tokenizer", "docqa_model", "offline_processor", "tiny_model"]


def tiny_model(family: str = "qwen2_vl", seed: int = 0, **text_overrides):
    """``(model, processor)``: a tiny random ``family`` model in fp32 with an offline processor."""
    processor = offline_processor(family)
    model = build_model("tiny", family, seed=seed, tokenizer=processor.tokenizer, **text_overrides)
    return model, processor


def docqa_model():
    """``(model, processor)`` of ``vismemo-docqa-tiny``, the packaged model trained to read synthetic forms."""
    return _load_docqa()

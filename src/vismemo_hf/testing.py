"""Tiny random models of every supported family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, GLM-4.1V, GLM-4.6V,
GLM-4.5V, LLaVA-OneVision) with offline processors, for tests, the demo and trying the library.

``tiny_model(family)`` returns ``(model, processor)`` built from ``configs/models/tiny.yaml``
with a byte-level tokenizer and the family's real processor classes and chat template, so
the code that drives them drives a real checkpoint too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vismemo_hf.eval.docqa import docqa_model as _load_docqa
from vismemo_hf.families import build_model
from vismemo_hf.offline import byte_tokenizer, offline_processor

if TYPE_CHECKING:
    from transformers import PreTrainedModel, ProcessorMixin

__all__ = ["build_model", "byte_tokenizer", "docqa_model", "offline_processor", "tiny_model"]


def tiny_model(family: str = "qwen2_vl", seed: int = 0, **text_overrides) -> tuple[PreTrainedModel, ProcessorMixin]:
    """``(model, processor)``: a tiny random ``family`` model in fp32 with an offline processor."""
    from vismemo_hf.families import FAMILIES

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; families: {', '.join(FAMILIES)}")
    processor = offline_processor(family)
    model = build_model("tiny", family, seed=seed, tokenizer=processor.tokenizer, **text_overrides)
    return model, processor


def docqa_model():
    """``(model, processor)`` of ``vismemo-docqa-tiny``, the packaged model trained to read synthetic forms."""
    return _load_docqa()

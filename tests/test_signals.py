"""Warmup signals are the model's real attention: captured probabilities equal an eager forward's."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import vismemo_hf
from vismemo_hf.policies.base import register_policy
from vismemo_hf.policies.vismemo import VisMemoPolicy
from vismemo_hf.testing import tiny_model

from conftest import build_inputs, stored

SEEN = []


@dataclass
class RecordingPolicy(VisMemoPolicy):
    name: ClassVar[str] = "test-recording"

    def plan(self, image, alias, prefetched, signals):
        SEEN.append(signals)
        return super().plan(image, alias, prefetched, signals)


@pytest.mark.approximate
def test_captured_window_attention_equals_eager_attention(tiny, pages, family):
    register_policy(RecordingPolicy)  # the registry fixture removes it afterwards
    model, processor = tiny
    store = stored(model, processor, pages["base"])
    inputs = build_inputs(processor, [pages["edit"]])
    SEEN.clear()
    cache = vismemo_hf.VisMemoCache(store=store, policy="test-recording", warmup_layers=2)
    with torch.no_grad():
        model(**inputs, cache=cache, use_cache=True)
    (signals,) = SEEN
    eager, _ = tiny_model(family)
    eager.model.language_model.config._attn_implementation = "eager"
    with torch.no_grad():
        out = eager(**inputs, output_attentions=True)
    ids = inputs["input_ids"][0]
    visual = (ids == model.config.image_token_id).nonzero().flatten()
    window = torch.arange(int(visual[-1]) + 1, ids.shape[0])  # the text after the image
    for layer in range(2):
        expected = out.attentions[layer][0][:, window][:, :, visual]
        assert torch.allclose(signals.attention[layer], expected, atol=1e-5), layer

"""Qwen3-VL and Qwen3-VL-MoE: interleaved M-RoPE sections, 16-pixel patches, no default system turn, and
deepstack: the tower's intermediate features, added to the visual tokens after the first decoder layers, are part
of each image's encoder output (stored with it, handed back to the model with it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vismemo_hf.families.base import HALF, tower_flops
from vismemo_hf.families.qwen2_vl import QWEN2_TEMPLATE, QwenAdapter

QWEN3_TEMPLATE = QWEN2_TEMPLATE.replace(
    "{% if loop.first and message['role'] != 'system' and add_system_prompt is not defined %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}", "")


@dataclass
class Qwen3VLAdapter(QwenAdapter):
    image_mean: tuple = field(default=HALF)
    image_std: tuple = field(default=HALF)
    model_types: ClassVar[tuple[str, ...]] = ("qwen3_vl",)
    title: ClassVar[str] = "Qwen3-VL"
    processor_class: ClassVar[str] = "Qwen3VLProcessor"
    video_processor_class: ClassVar[str] = "qwen3_vl.video_processing_qwen3_vl:Qwen3VLVideoProcessor"
    patch_size: ClassVar[int] = 16
    chat_template: ClassVar[str] = QWEN3_TEMPLATE

    @property
    def deepstack_levels(self) -> int:
        return len(getattr(self.vision_config, "deepstack_visual_indexes", ()))

    def subset_inputs(self, items, device) -> dict:
        """The learned position table resampled to each whole image, at the wanted tokens' patches."""
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights

        visual, unit = self.base.visual, self.merge**2
        indices, weights = [], []
        for _, grid, tokens in items:
            taps, taken = get_vision_interpolation_indices_and_weights(
                torch.tensor([grid]), num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
                align_corners=visual.interpolation_align_corners, spatial_merge_size=self.merge)
            patch_rows = (tokens.to(torch.long)[:, None] * unit + torch.arange(unit)).reshape(-1)
            indices.append(taps[patch_rows])
            weights.append(taken[patch_rows])
        return {"interp_indices": torch.cat(indices).to(device), "interp_weights": torch.cat(weights).to(device)}

    def split_encoded(self, out) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        per_layer = [list(level) for level in out.deepstack_features]
        return [(e, torch.stack([level[i] for level in per_layer]) if per_layer else None)
                for i, e in enumerate(out.pooler_output)]

    def encoder_outputs(self, per_image):
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        embeds = tuple(e for e, _ in per_image)
        levels = per_image[0][1].shape[0] if per_image and per_image[0][1] is not None else 0
        deepstack = [tuple(d[level] for _, d in per_image) for level in range(levels)]
        return BaseModelOutputWithDeepstackFeatures(pooler_output=embeds, deepstack_features=deepstack)

    @classmethod
    def rope_parameters(cls, text: dict) -> dict:
        return {**super().rope_parameters(text), "mrope_interleaved": True}

    @classmethod
    def encoder_flops(cls, vision, patches: int) -> float:
        """A plain MLP, full attention, one merger per ``deepstack_visual_indexes`` entry besides the last one."""
        d = vision.hidden_size
        mergers = 1 + len(getattr(vision, "deepstack_visual_indexes", None) or ())
        return tower_flops(vision, patches, d, vision.intermediate_size, False) + \
            cls.merger_flops(vision, patches, d, mergers)


@dataclass
class Qwen3VLMoeAdapter(Qwen3VLAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("qwen3_vl_moe",)
    title: ClassVar[str] = "Qwen3-VL-MoE"
    moe: ClassVar[bool] = True

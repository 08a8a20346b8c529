"""Qwen2-VL and Qwen2.5-VL: M-RoPE over halves of the head dimension, a 2x2 patch merge, a default system turn.

The generic adapter fits them; only the re-rotation of cached keys is done here in float64 angles (a long text
before an image moves it by thousands of positions) and the offline processor is named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vismemo_hf.core.rope import rerotate, turn
from vismemo_hf.families.base import ModelAdapter, tower_flops
from vismemo_hf.families.lending import LendingTower, subset_patches

# The chat template of Qwen2-VL / Qwen2.5-VL (a default system turn); Qwen3-VL's has none.
QWEN2_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' and add_system_prompt is not defined %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class QwenAdapter(LendingTower, ModelAdapter):
    """What the Qwen-VL families share: keys turned over halves of the head dimension, a tower that encodes some
    of an image's tokens (``LendingTower``)."""

    chat_template: ClassVar[str] = QWEN2_TEMPLATE

    def encode_tokens(self, get_image_features, items, lent=None):
        """As ``ModelAdapter.encode_tokens``: the tokens' patch rows go through the tower as one sequence per image,
        with the positions (and the family's ``subset_inputs``) they have in the whole image, handed to the tower
        precomputed (``transformers.vision_utils``); the tower is told a grid of the subset's size only so that it
        splits its output per image. Images of one frame only. ``lent``: per image, an alias's tower K/V
        (``families.tower_kv``), whose other patches the wanted ones attend to at every full-attention block."""
        if not items or any(grid[0] != 1 for _, grid, _ in items):
            return None
        rows, positions, lengths = subset_patches(items, self.merge)
        device = items[0][0].device
        grids = [(1, self.merge, self.merge * tokens.numel()) for _, _, tokens in items]
        inputs = {"position_ids": positions.to(device),
                  "cu_seqlens": torch.tensor(lengths, dtype=torch.int32, device=device),
                  **self.subset_inputs(items, device)}
        with self.lending(items, lent):
            out = get_image_features(rows, torch.tensor(grids, device=device), return_dict=True, **inputs)
        return self.split_encoded(out)

    def subset_inputs(self, items, device) -> dict:
        """What else the tower precomputes from the grid, for the tokens of ``items`` (``encode_tokens``)."""
        return {}

    def move_keys(self, keys: torch.Tensor, delta: int, shift: tuple[int, int] = (0, 0)) -> torch.Tensor:
        """As ``ModelAdapter.move_keys``; the text's delta in float64 angles (``delta`` may be long), a moved
        alias's (0, -dy, -dx) from the model's rotary embedding."""
        keys = rerotate(keys, delta, self.text.rotary_emb.inv_freq)
        if shift == (0, 0):
            return keys
        return turn(keys, *self.turn((0, -shift[0], -shift[1])))

    @classmethod
    def merger_flops(cls, vision, patches: int, width: int, mergers: int = 1) -> float:
        """The 2x2 patch mergers: (4 width -> 4 width -> out) per visual token, ``mergers`` of them."""
        merge = vision.spatial_merge_size ** 2
        out = getattr(vision, "out_hidden_size", None) or getattr(vision, "hidden_size", width)
        return mergers * 2 * (patches // merge) * (merge * width * merge * width + merge * width * out)


@dataclass
class Qwen2VLAdapter(QwenAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("qwen2_vl",)
    title: ClassVar[str] = "Qwen2-VL"
    processor_class: ClassVar[str] = "Qwen2VLProcessor"
    video_processor_class: ClassVar[str] = "qwen2_vl.video_processing_qwen2_vl:Qwen2VLVideoProcessor"
    #: Qwen2-VL's tower outputs the text hidden size directly (no ``out_hidden_size``)
    vision_out_key: ClassVar[str] = "hidden_size"

    @classmethod
    def encoder_flops(cls, vision, patches: int) -> float:
        """Blocks of width ``embed_dim`` with a plain MLP (``mlp_ratio``), full attention over the image."""
        d = vision.embed_dim
        return tower_flops(vision, patches, d, int(d * vision.mlp_ratio), False) + cls.merger_flops(vision, patches, d)


@dataclass
class Qwen2_5_VLAdapter(QwenAdapter):  # noqa: N801 (the transformers class name)
    model_types: ClassVar[tuple[str, ...]] = ("qwen2_5_vl",)
    title: ClassVar[str] = "Qwen2.5-VL"
    processor_class: ClassVar[str] = "Qwen2_5_VLProcessor"
    video_processor_class: ClassVar[str] = "qwen2_vl.video_processing_qwen2_vl:Qwen2VLVideoProcessor"

    @property
    def encoder_window(self) -> int:
        vision = self.vision_config
        return vision.window_size // self.merge // vision.patch_size

    def tower_order(self, grids) -> list[torch.Tensor | None]:
        """The tower runs every block in window order (``get_vision_window_index``)."""
        from transformers.vision_utils import get_vision_window_index

        vision, unit, out = self.vision_config, self.merge**2, []
        for grid in grids.tolist() if isinstance(grids, torch.Tensor) else grids:
            index, _ = get_vision_window_index(torch.tensor([grid]), self.merge, vision.window_size, vision.patch_size)
            out.append((index[:, None] * unit + torch.arange(unit)).reshape(-1))
        return out

    def subset_inputs(self, items, device) -> dict:
        """The windows of the windowed blocks: each wanted token in the window it has in the whole image, the
        windows in the tower's order (row-major, tokens row-major inside); a window all of whose tokens are wanted
        is computed as in the whole image."""
        side, unit = self.encoder_window, self.merge**2
        order, bounds, first = [], [0], 0
        for _, (_, h, w), tokens in items:
            width = w // self.merge
            across = width // side + 1  # the tower pads every row of windows by a window
            tokens = tokens.to(torch.long)
            window = (tokens // width // side) * across + (tokens % width) // side
            ranked = torch.argsort(window * (h * w) + tokens)
            order.append(ranked + first)
            counts = torch.unique_consecutive(window[ranked], return_counts=True)[1]
            bounds.extend((bounds[-1] + counts.cumsum(0) * unit).tolist())
            first += tokens.numel()
        return {"window_index": torch.cat(order).to(device),
                "cu_window_seqlens": torch.tensor(bounds, dtype=torch.int32, device=device)}

    @classmethod
    def encoder_flops(cls, vision, patches: int) -> float:
        """A gated MLP; attention inside windows of ``window_size`` pixels except ``fullatt_block_indexes``."""
        d = vision.hidden_size
        window = min(patches, (vision.window_size // vision.patch_size) ** 2)
        full = set(vision.fullatt_block_indexes)
        attention = sum(4 * patches * (patches if i in full else window) * d for i in range(vision.depth))
        return tower_flops(vision, patches, d, vision.intermediate_size, True, attention) + \
            cls.merger_flops(vision, patches, d)

"""GLM-4.1V, GLM-4.6V (dense) and GLM-4.5V (MoE): what differs from the generic adapter.

* Images and videos share one placeholder token (a video is frames of ``<|image|>`` runs between
  ``<|begin_of_video|>`` and ``<|end_of_video|>``): the processor's ``mm_token_type_ids`` (1 image, 2 video) tell
  them apart.
* Partial RoPE: only the first ``partial_rotary_factor`` of each head's dimensions turn (interleaved pairs in the
  dense models, halves in the MoE one); the modeling module's own ``apply_rotary_pos_emb`` does it, and the M-RoPE
  sections cover those dimensions only.
* Its chat format and processors (``Glm4vProcessor``, ``Glm46VProcessor``; the pixel budget counts both frames of a
  temporal patch).
* Its tower interpolates a learned position embedding over the whole image's grid: a partial encode
  (``encode_tokens``) calls the tower itself with the whole grids and the subset's positions, and splits its output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vismemo_hf.families.base import ModelAdapter, tower_flops
from vismemo_hf.families.lending import LendingTower, subset_patches

GLM_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|begin_of_video|><|video|><|end_of_video|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

#: the modality codes of ``mm_token_type_ids``
IMAGE, VIDEO = 1, 2


@dataclass
class Glm4vAdapter(LendingTower, ModelAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("glm4v",)
    title: ClassVar[str] = "GLM-4.1V"
    processor_class: ClassVar[str] = "Glm4vProcessor"
    image_processor_class: ClassVar[str] = "Glm4vImageProcessor"
    video_processor_class: ClassVar[str] = "glm4v.video_processing_glm4v:Glm4vVideoProcessor"
    pixel_budget_frames: ClassVar[int] = 2
    special_tokens: ClassVar[tuple[str, ...]] = (
        "<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|begin_of_image|>",
        "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|video|>")
    #: the token that ends an answer (a GLM reply ends where the next user turn would begin)
    eos_token: ClassVar[str] = "<|user|>"
    chat_template: ClassVar[str] = GLM_TEMPLATE

    def encode_tokens(self, get_image_features, items, lent=None):
        """As ``ModelAdapter.encode_tokens``: the tokens' patch rows go through the tower as one sequence per image,
        with the positions they have in the whole image precomputed (``transformers.vision_utils``) and the whole
        images' grids, over which the tower interpolates its position embedding; so the tower is called itself and
        its output split here. Images of one frame only. ``lent``: as ``QwenAdapter.encode_tokens``."""
        if not items or any(grid[0] != 1 for _, grid, _ in items):
            return None
        rows, positions, lengths = subset_patches(items, self.merge)
        visual, device = self.base.visual, items[0][0].device
        grids = torch.tensor([tuple(grid) for _, grid, _ in items], device=device)
        with self.lending(items, lent):
            out = visual(rows.type(visual.dtype), grid_thw=grids, return_dict=True, position_ids=positions.to(device),
                         cu_seqlens=torch.tensor(lengths, dtype=torch.int32, device=device))
        return [(e, None) for e in out.pooler_output.split([t.numel() for _, _, t in items])]

    def image_mask(self, input_ids: torch.Tensor, token_types: torch.Tensor | None = None) -> torch.Tensor:
        placeholders = input_ids == self.image_token_id
        if token_types is None:  # no videos can be told apart: every run is an image
            return placeholders
        return placeholders & (_aligned(token_types, input_ids) == IMAGE)

    def video_mask(self, input_ids: torch.Tensor, token_types: torch.Tensor | None = None) -> torch.Tensor:
        if token_types is None:
            return torch.zeros_like(input_ids, dtype=torch.bool)
        return (input_ids == self.image_token_id) & (_aligned(token_types, input_ids) == VIDEO)


    @classmethod
    def rope_parameters(cls, text: dict) -> dict:
        """Partial rotary (``partial_rotary_factor``, 0.5 by default as in the published models): the M-RoPE
        sections cover the turned dimensions only; a preset written for full rotation has its sections scaled."""
        rope = super().rope_parameters(text)
        factor = float(text.pop("partial_rotary_factor", 0.5))
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        pairs = int(head_dim * factor) // 2
        sections = rope["mrope_section"]
        if sum(sections) != pairs:
            scaled = [max(1, int(s * pairs / sum(sections))) for s in sections[:-1]]
            sections = [*scaled, pairs - sum(scaled)]
            if sections[-1] < 1:
                raise ValueError(f"mrope_section {rope['mrope_section']} cannot cover {pairs} rotary pairs")
        return {**rope, "mrope_section": sections, "partial_rotary_factor": factor}

    @classmethod
    def encoder_flops(cls, vision, patches: int) -> float:
        """Blocks with a gated MLP as wide as ``out_hidden_size``, full attention; then a 2x2 convolution to
        ``out_hidden_size`` and a gated merger of ``intermediate_size`` per visual token."""
        d, out = vision.hidden_size, vision.out_hidden_size
        merge = vision.spatial_merge_size ** 2
        tokens = patches // merge
        downsample = 2 * tokens * merge * d * out
        merger = 2 * tokens * (out * out + 3 * out * vision.intermediate_size)
        return tower_flops(vision, patches, d, out, True) + downsample + merger

    @classmethod
    def token_ids(cls, tokenizer) -> dict:
        ids = tokenizer.convert_tokens_to_ids
        return dict(image_token_id=ids("<|image|>"), video_token_id=ids("<|video|>"),
                    image_start_token_id=ids("<|begin_of_image|>"), image_end_token_id=ids("<|end_of_image|>"),
                    video_start_token_id=ids("<|begin_of_video|>"), video_end_token_id=ids("<|end_of_video|>"))


@dataclass
class Glm46VAdapter(Glm4vAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("glm46v",)
    title: ClassVar[str] = "GLM-4.6V"
    processor_class: ClassVar[str] = "Glm46VProcessor"
    image_processor_class: ClassVar[str] = "Glm46VImageProcessor"
    video_processor_class: ClassVar[str] = "glm46v.video_processing_glm46v:Glm46VVideoProcessor"


@dataclass
class Glm4vMoeAdapter(Glm4vAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("glm4v_moe",)
    title: ClassVar[str] = "GLM-4.5V"
    moe: ClassVar[bool] = True


def _aligned(token_types: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``token_types`` over the columns of ``input_ids``: tokens appended after the processor's (candidate tokens of
    prompt-lookup or assisted decoding) are text."""
    types = token_types.to(input_ids.device)
    extra = input_ids.shape[1] - types.shape[1]
    if extra > 0:
        types = torch.cat([types, types.new_zeros(types.shape[0], extra)], 1)
    return types[:, :input_ids.shape[1]]

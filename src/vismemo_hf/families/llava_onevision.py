"""LLaVA-OneVision: a SigLIP tower, a projector and a Qwen2 language model with 1-D RoPE.

What differs from the generic adapter:

* One image is several tiles (any-resolution: the base view and the tiles of the best grid of
  ``image_grid_pinpoints``, unpadded, a newline embedding after each row), packed into one run of ``<image>``
  tokens whose length only the packing knows: an image's "grid" is ``(1, 1, N)``, N its placeholder run, and its
  pixels are its tiles (``pixel_values[i, :tiles]``). A request with several images in a sample does not tile them
  (``batch_num_images``); the tiles used are part of the pixels and so of the exact key.
* The visual tokens are not one (t, h, w) grid of patch groups whose pixels the pixel features read: images are
  misses and exact hits (``approximate = False``); entries hold no thumbnail, zero patch entropy and no token hashes.
* Positions are 1-D: a cached key moves by the text's delta only, an ordinary RoPE rotation over halves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vismemo_hf.families.base import transformers_class
from vismemo_hf.families.qwen2_vl import QWEN2_TEMPLATE, QwenAdapter

LLAVA_TEMPLATE = QWEN2_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>\n").replace(
    "<|vision_start|><|video_pad|><|vision_end|>", "<video>\n")
#: the offline processor's geometry (``configs/models/tiny.yaml``'s tower: 56-pixel tiles of 14-pixel patches)
TILE, PATCH = 56, 14
PINPOINTS = [[56, 56], [56, 112], [112, 56], [112, 112], [112, 168], [168, 112], [168, 168]]


@dataclass
class LlavaOnevisionAdapter(QwenAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("llava_onevision",)
    title: ClassVar[str] = "LLaVA-OneVision"
    processor_class: ClassVar[str] = "LlavaOnevisionProcessor"
    image_processor_class: ClassVar[str] = "LlavaOnevisionImageProcessor"
    video_processor_class: ClassVar[str] = \
        "llava_onevision.video_processing_llava_onevision:LlavaOnevisionVideoProcessor"
    vision_attribute: ClassVar[str] = "vision_tower"
    vision_out_key: ClassVar[str | None] = None
    approximate: ClassVar[bool] = False
    partial_encoder: ClassVar[bool] = False  # no approximate hits: nothing encodes part of an image
    special_tokens: ClassVar[tuple[str, ...]] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>")
    chat_template: ClassVar[str] = LLAVA_TEMPLATE

    # -- the request's images ------------------------------------------------------------------------------
    @property
    def merge(self) -> int:
        return 1  # a grid (1, 1, N) is N tokens

    def image_geometry(self, kwargs: dict):
        return kwargs.get("image_sizes"), kwargs.get("batch_num_images")

    def deferred_geometry(self, deferred):
        return deferred.argument("image_sizes"), deferred.kwargs.get("batch_num_images")

    def image_count(self, geometry) -> int:
        return int(geometry[0].shape[0])

    def _tiled(self, geometry) -> list[bool]:
        sizes, per_sample = geometry
        if per_sample is None:
            return [True] * sizes.shape[0]
        return [n == 1 for n in per_sample.tolist() for _ in range(n)]

    def split_images(self, pixel_values: torch.Tensor, geometry, run_lengths) -> list[tuple]:
        from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

        config = self.model.config
        sizes = geometry[0]
        tiles = [image_size_to_num_patches(image_size=size, grid_pinpoints=config.image_grid_pinpoints,
                                           patch_size=config.vision_config.image_size) if tiled else 1
                 for size, tiled in zip(sizes, self._tiled(geometry))]
        if pixel_values.dim() == 5:
            pixels = [p[:n] for p, n in zip(pixel_values, tiles)]
        else:
            pixels = list(torch.split(pixel_values, tiles))
        lengths = run_lengths or [0] * len(pixels)
        return [(p, (1, 1, int(n)), (tuple(int(x) for x in size.tolist()), tiled))
                for p, n, size, tiled in zip(pixels, lengths, sizes, self._tiled(geometry))]

    def encode_images(self, get_image_features, images: list[tuple]):
        """One image at a time: whether an image is tiled depends on its sample (``batch_num_images``), which a
        batch of the images that missed no longer shows."""
        out = []
        for pixels, _, (size, tiled) in images:
            encoded = get_image_features(pixels, torch.tensor([size], device=pixels.device),
                                         batch_num_images=torch.tensor([1 if tiled else 2]), return_dict=True)
            out.append((encoded.pooler_output[0], None))
        return out

    def pixel_features(self, pixels: torch.Tensor, grid, hashes=None):
        n = grid[2]
        return lambda: (torch.zeros(n), None)

    def patch_hashes(self, pixels: torch.Tensor, grid) -> None:
        return None

    def thumbnail_of(self, pixels: torch.Tensor, grid):
        return None

    # -- 1-D positions ---------------------------------------------------------------------------------------
    def rope(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.text.rotary_emb(hidden, positions[0])

    def turn(self, delta: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        if len(set(delta)) != 1:
            raise ValueError(f"1-D positions move by one delta, not {delta}")
        rotary = self.text.rotary_emb
        from vismemo_hf.families.base import execution_device

        x = torch.zeros(1, dtype=torch.float32, device=execution_device(rotary))
        cos, sin = rotary(x, torch.tensor([[delta[0]]], device=x.device))
        scale = float(getattr(rotary, "attention_scaling", 1.0))
        return cos[0, 0].float() / scale, sin[0, 0].float() / scale

    # -- presets and the offline processor -------------------------------------------------------------------
    @classmethod
    def rope_parameters(cls, text: dict) -> dict:
        text.pop("mrope_section", None)
        return {"rope_type": "default", "rope_theta": float(text.pop("rope_theta"))}

    @classmethod
    def config_kwargs(cls, vision: dict) -> dict:
        """The tiny tower's pinpoints for its 56-pixel tiles; transformers' own (384-pixel tiles) otherwise."""
        pinpoints = vision.pop("image_grid_pinpoints", PINPOINTS if vision.get("image_size") == TILE else None)
        return {"image_grid_pinpoints": pinpoints, "vision_feature_select_strategy": "full",
                "vision_feature_layer": -1}

    # -- what the benchmarks price ---------------------------------------------------------------------------
    @classmethod
    def encoder_flops(cls, vision, patches: int) -> float:
        """SigLIP over each tile on its own: patch embedding, ``num_hidden_layers`` blocks (projections, a plain
        MLP of ``intermediate_size``, attention over the tile's patches); ``patches`` spread over whole tiles."""
        per_tile = (vision.image_size // vision.patch_size) ** 2
        tiles = -(-patches // per_tile)
        w, depth = vision.hidden_size, vision.num_hidden_layers
        embed = 2 * patches * vision.num_channels * vision.patch_size ** 2 * w
        linear = 2 * patches * (4 * w * w + 2 * w * vision.intermediate_size)
        attention = 4 * tiles * per_tile ** 2 * w
        return embed + depth * (linear + attention)

    @classmethod
    def model_encoder_flops(cls, config, patches: int) -> float:
        """The tower and the two-layer projector to the language model's width, per patch."""
        w, d = config.vision_config.hidden_size, config.text_config.hidden_size
        return cls.encoder_flops(config.vision_config, patches) + 2 * patches * (w * d + d * d)

    @classmethod
    def patches_for(cls, config, visual_tokens: int) -> int:
        """A token per patch (the ``full`` feature strategy; the newline tokens left out)."""
        return visual_tokens

    @classmethod
    def bench_image_size(cls, config, visual_tokens: int) -> tuple[int, int]:
        """A square page of k x k tiles: the base image's tokens and k² tiles' (plus a newline per row of them)."""
        tile, patch = config.vision_config.image_size, config.vision_config.patch_size
        per_tile = (tile // patch) ** 2
        k = max(1, round(max(visual_tokens / per_tile - 1, 1) ** 0.5))
        return k * tile, k * tile

    @classmethod
    def free_image_size(cls, processor, config) -> None:
        """Nothing: the tiles keep the tower's size, and their grid follows the image's."""

    @classmethod
    def token_ids(cls, tokenizer) -> dict:
        ids = tokenizer.convert_tokens_to_ids
        return dict(image_token_index=ids("<image>"), video_token_index=ids("<video>"))

    @classmethod
    def offline_processor(cls, tokenizer, min_tokens: int = 4, max_tokens: int = 256, vision=None):
        """Tiles of the tower's ``image_size`` (default the tiny tower's 56 pixels, with its pinpoints; other tiles
        with transformers' own pinpoints, as ``config_kwargs`` gives the model)."""
        tile = vision.image_size if vision is not None else TILE
        patch = vision.patch_size if vision is not None else PATCH
        size = {"height": tile, "width": tile}
        pinpoints = {"image_grid_pinpoints": PINPOINTS} if tile == TILE else {}
        image = transformers_class(cls.image_processor_class)(size=size, **pinpoints, image_mean=list(cls.image_mean),
                                                              image_std=list(cls.image_std))
        video = transformers_class(cls.video_processor_class)(size=size)
        return transformers_class(cls.processor_class)(
            image_processor=image, tokenizer=tokenizer, video_processor=video, num_image_tokens=(tile // patch) ** 2,
            vision_feature_select_strategy="full", chat_template=cls.chat_template)

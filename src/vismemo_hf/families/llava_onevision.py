"""LLaVA-OneVision: a SigLIP tower, a projector and a Qwen2 language model with 1-D RoPE.

What differs from the generic adapter:

* One image is several tiles (any-resolution: the base view and the tiles of the best grid of
  ``image_grid_pinpoints``, unpadded, a newline embedding after each row), packed into one run of ``<image>``
  tokens whose length only the packing knows: an image's "grid" is ``(1, 1, N)``, N its placeholder run, and its
  pixels are its tiles (``pixel_values[i, :tiles]``). A request with several images in a sample does not tile them
  (``batch_num_images``); the tiles used are part of the pixels and so of the exact key.
* The visual tokens are not one (t, h, w) grid: each token's pixel hash and patch entropy are its tile patch's,
  packed by the model's own ``pack_image_features`` (an unpadded token keeps its patch's, a downsampled one mixes
  its patches' values, a newline token has its own constant), so an approximate hit knows which tokens changed and
  their reading rows (the base view's rows, then each tile row up to its newline). A copy is matched in place only
  (``movable = False``: a move of the page is no move along the packed run) and only with an alias of the same
  packing (``same_layout``: newlines at the same tokens). The pixel stage aligns the base view's thumbnail (the
  whole image at the tile size), or the tiles' where they give a larger one (a tower of small tiles).
* The tower encodes each tile alone (``tile_encoder``): an entry keeps a digest of each tile's patches
  (``tile_digests``), and an edited copy found by its pixels re-encodes only the tiles whose digest changed (the base
  view, and the tiles its edits fall in); every other token keeps its alias's output, which is what encoding the
  whole image gives it (a downsampled tiling mixes neighbouring tiles in a token: ``_footprints``).
* Positions are 1-D: a cached key moves by the text's delta only, an ordinary RoPE rotation over halves.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, ClassVar, cast

import torch

from vismemo_hf.core.memo import TensorMemo
from vismemo_hf.families.base import transformers_class
from vismemo_hf.families.qwen2_vl import QWEN2_TEMPLATE, QwenAdapter

if TYPE_CHECKING:
    from transformers import PretrainedConfig

LLAVA_TEMPLATE = QWEN2_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>\n").replace(
    "<|vision_start|><|video_pad|><|vision_end|>", "<video>\n")
#: the offline processor's geometry (``configs/models/tiny.yaml``'s tower: 56-pixel tiles of 14-pixel patches)
TILE, PATCH = 56, 14
PINPOINTS = [[56, 56], [56, 112], [112, 56], [112, 112], [112, 168], [168, 112], [168, 168]]
#: a newline token's pixel hash: the bits of -1.0 as a float64 (no packed CRC-32C, a value >= 0, has them)
NEWLINE = struct.unpack("<q", struct.pack("<d", -1.0))[0]  # plain bytes: no tensor at import (meta device contexts)
#: what the hashes of the tiles' tokens are xor-ed with (``patch_hashes``): its sign bit clear, a tagged hash is never
#: ``NEWLINE``'s
TILE_VIEW = 0x2545F4914F6CDD1D
#: each tile patch's CRC-32C of a request's host pixels: its pixel hashes and its tiles' digests read them once. The
#: memo holds the pixels it keys, so their bytes count: a few recent images at most
_CRCS = TensorMemo(128 << 20)


class TileReuse:
    """The tiles of an image, each encoded alone (``VisionTower.tile_encoder``): their digests, kept with an entry,
    and an edited copy's encode of the tiles its changes are computed from. Mixed into the adapter, whose packing
    (``_pack``, ``_per_tile``) and patch rows it reads."""

    tile_encoder: ClassVar[bool] = True

    if TYPE_CHECKING:  # what the adapter it is mixed into gives it, declared for the type checker only
        @property
        def _per_tile(self) -> int: ...

        def _pack(self, features: torch.Tensor, extra, newline: torch.Tensor) -> torch.Tensor: ...

        def _packs_patches(self) -> bool: ...

        def _patch_rows(self, pixels: torch.Tensor) -> torch.Tensor: ...

    def _tile_crcs(self, pixels: torch.Tensor) -> torch.Tensor:
        """(tiles, patches per tile) int64: each tile patch's CRC-32C, as the tower reads it (``_patch_rows``)."""
        from vismemo_hf.core.features import patch_hashes

        def compute():
            crcs = patch_hashes(self._patch_rows(pixels), 1).reshape(pixels.shape[0], -1)
            return crcs, crcs.numel() * crcs.element_size() + pixels.numel() * pixels.element_size()
        return _CRCS.get(pixels, "tile crcs", compute)

    def tile_digests(self, pixels: torch.Tensor, grid, extra=None):
        """A call that gives (T,) int64: per tile, 8 bytes of BLAKE2b over its patches' CRC-32C (equal for tiles
        whose every patch the tower reads is unchanged, as the pixel-first stage judges a token); None for an image
        not tiled or without its tiles."""
        if extra is None or not extra[1] or pixels.dim() != 4 or pixels.shape[0] < 2:
            return None

        def digests() -> torch.Tensor:
            rows = self._tile_crcs(pixels).numpy()
            return torch.tensor([int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little",
                                                signed=True) for row in rows], dtype=torch.int64)
        return functools.cache(digests)

    def _footprints(self, tiles: int, extra) -> torch.Tensor:
        """(N, tiles) bool: the tiles each packed token's value is computed from: its patch's tile, or with a
        downsampled tiling (more tokens than ``anyres_max_N`` allows) the tiles its interpolation reads; none at
        the newline tokens. One packing of the tiles' indicators, each its own channel."""
        indicators = torch.eye(tiles, dtype=torch.float64)[:, None, :].expand(tiles, self._per_tile, tiles)
        return self._pack(indicators, extra, torch.zeros(tiles, dtype=torch.float64)) > 0

    def encode_edited(self, get_image_features, edits: dict) -> dict:
        """Per edited copy, the tiles that its changed tokens are computed from, through the tower in one call, each
        alone as a whole encode runs it, and packed as the model packs them: the tokens computed from a changed tile
        (a downsampled tiling mixes a token's neighbouring tiles: those are encoded too) take the packing's values,
        every other token keeps the alias's, which are the same. An image is left out (encoded whole) when it or its
        alias has no tile digests, when every tile is needed, or when a token whose pixels changed is computed from
        no changed tile (the pixel rule and the digests disagree)."""
        out = {}
        for i, ((pixels, grid, extra), entry, changed, digests) in edits.items():
            theirs = entry.tile_digests
            if theirs is None or digests is None or entry.embeds.shape[0] != grid[2] or not self._packs_patches():
                continue
            mine = digests()
            if mine.shape != theirs.shape:
                continue
            redo = mine != theirs
            footprints = self._footprints(mine.numel(), extra) if not bool(redo.all()) else None
            if footprints is None or footprints.shape[0] != grid[2]:
                continue
            fresh = (footprints & redo).any(1)  # tokens computed from a changed tile
            needed = footprints[fresh].any(0) | redo  # the tiles those tokens are computed from
            if bool(needed.all()) or bool((changed.cpu() & ~fresh & footprints.any(1)).any()):
                continue
            embeds = entry.embeds.to(pixels.device)
            if bool(fresh.any()):
                at = torch.nonzero(needed).flatten()
                new = self._encode_tiles(get_image_features, pixels[at.to(pixels.device)], extra)
                tiles = new.new_zeros(mine.numel(), *new.shape[1:])
                tiles[at.to(new.device)] = new
                packed = self._pack(tiles, extra, new.new_zeros(new.shape[-1]))  # newlines stay the alias's
                rows = torch.nonzero(fresh).flatten().to(new.device)
                embeds = embeds.to(new.dtype).index_copy(0, rows, packed[rows])
            out[i] = (embeds, None, int(fresh.sum()))
        return out

    def _encode_tiles(self, get_image_features, tiles: torch.Tensor, extra) -> torch.Tensor:
        """(k, patches per tile, d): the tower and projector over ``tiles``, each as its own untiled image (what the
        model runs on every tile of an image before packing them)."""
        k, size = tiles.shape[0], extra[0]
        encoded = get_image_features(tiles, torch.tensor([size] * k, device=tiles.device),
                                     batch_num_images=torch.tensor([max(2, k)]), return_dict=True)
        return torch.stack([features[: self._per_tile] for features in encoded.pooler_output])


@dataclass
class LlavaOnevisionAdapter(TileReuse, QwenAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("llava_onevision",)
    title: ClassVar[str] = "LLaVA-OneVision"
    processor_class: ClassVar[str] = "LlavaOnevisionProcessor"
    image_processor_class: ClassVar[str] = "LlavaOnevisionImageProcessor"
    video_processor_class: ClassVar[str] = \
        "llava_onevision.video_processing_llava_onevision:LlavaOnevisionVideoProcessor"
    vision_attribute: ClassVar[str] = "vision_tower"
    vision_out_key: ClassVar[str | None] = None
    movable: ClassVar[bool] = False
    partial_encoder: ClassVar[bool] = False  # tiles are encoded whole (SigLIP attends over each tile)
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
        """Per image (its tiles, (1, 1, N), (image size, tiled)); N from ``run_lengths`` (the placeholder runs), or
        without them (a processor's output) from the packing."""
        from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

        config = cast("PretrainedConfig", self.model.config)
        sizes = geometry[0]
        tiles = [image_size_to_num_patches(image_size=size, grid_pinpoints=config.image_grid_pinpoints,
                                           patch_size=config.vision_config.image_size) if tiled else 1
                 for size, tiled in zip(sizes, self._tiled(geometry))]
        if pixel_values.dim() == 5:
            pixels = [p[:n] for p, n in zip(pixel_values, tiles)]
        else:
            pixels = list(torch.split(pixel_values, tiles))
        extras = [(tuple(int(x) for x in size.tolist()), tiled) for size, tiled in zip(sizes, self._tiled(geometry))]
        lengths = run_lengths or [self._packed(torch.zeros(p.shape[0], self._per_tile), x, 0.0).numel()
                                  for p, x in zip(pixels, extras)]
        return [(p, (1, 1, int(n)), x) for p, n, x in zip(pixels, lengths, extras)]

    def encode_images(self, get_image_features, images: list[tuple]):
        """One image at a time: whether an image is tiled depends on its sample (``batch_num_images``), which a
        batch of the images that missed no longer shows."""
        out = []
        for pixels, _, (size, tiled) in images:
            encoded = get_image_features(pixels, torch.tensor([size], device=pixels.device),
                                         batch_num_images=torch.tensor([1 if tiled else 2]), return_dict=True)
            out.append((encoded.pooler_output[0], None))
        return out

    # -- the tokens' pixels: each tile patch's, packed as the model packs the tiles' features ---------------
    @property
    def _per_tile(self) -> int:
        vision = self.vision_config
        return (vision.image_size // vision.patch_size) ** 2

    def _packed(self, values: torch.Tensor, extra, newline: float) -> torch.Tensor:
        """(N,) float64: ``values`` ((tiles, patches per tile), one per tile patch) through the model's own
        ``pack_image_features`` (unpadding, downsampling, newlines of value ``newline``)."""
        return self._pack(values.to(torch.float64).cpu()[:, :, None], extra,
                          torch.tensor([newline], dtype=torch.float64))[:, 0]

    def _pack(self, features: torch.Tensor, extra, newline: torch.Tensor) -> torch.Tensor:
        """(N, d): ``features`` ((tiles, patches per tile, d)) packed as the model packs an image's tiles."""
        ratio = getattr(self.model.config, "vision_aspect_ratio", None) or "anyres_max_9"
        packed, _ = self.base.pack_image_features([features], torch.tensor([extra[0]]), image_newline=newline,
                                                  vision_aspect_ratio=ratio)
        return packed[0]

    def _patch_rows(self, pixels: torch.Tensor) -> torch.Tensor:
        """(tiles * patches, C * p * p) each tile patch's pixels, channel-major, as SigLIP's patch embedding (a
        convolution of stride p) reads them: a tile's last pixels that fill no patch are not read (384 / 14)."""
        p = self.vision_config.patch_size
        t, c, h, w = pixels.shape
        rows, cols = h // p, w // p
        x = pixels.detach().cpu()[:, :, : rows * p, : cols * p].reshape(t, c, rows, p, cols, p)
        return x.permute(0, 2, 4, 1, 3, 5).reshape(t * rows * cols, c * p * p).contiguous()

    def _packs_patches(self) -> bool:
        """Whether each tile's features are its patches' (the ``full`` strategy; ``default`` drops the first)."""
        return getattr(self.model.config, "vision_feature_select_strategy", "full") == "full"

    def patch_hashes(self, pixels: torch.Tensor, grid, extra=None) -> torch.Tensor | None:
        """(N,) int64: the bits of each token's packed patch CRC-32C (exact for a token that shows one patch,
        a mix of its patches' for a downsampled one), those of the tiles' tokens tagged (``TILE_VIEW``), and
        ``NEWLINE`` at the newline tokens; None when unknown. The tag keeps the two views apart: an image of the
        tile size is one tile equal to its base view, and untagged every token's hash would occur twice, so none
        would be distinctive and the pixel-first stage would never find it (``core.pixel_first.distinctive``)."""
        if extra is None or not self._packs_patches() or pixels.dim() != 4:
            return None
        packed = self._packed(self._tile_crcs(pixels), extra, -1.0)
        if packed.numel() != grid[2]:
            return None
        hashes = packed.view(torch.int64)
        tiles = (torch.arange(hashes.numel()) >= self._per_tile) & (hashes != NEWLINE) if pixels.shape[0] > 1 \
            else torch.zeros_like(hashes, dtype=torch.bool)
        return torch.where(tiles, hashes ^ TILE_VIEW, hashes)

    def pixel_features(self, pixels: torch.Tensor, grid, hashes=None, extra=None):
        known = functools.cache(lambda: hashes if hashes is not None else self.patch_hashes(pixels, grid, extra))

        def entropy():
            if known() is None:
                return torch.zeros(grid[2])
            from vismemo_hf.core.features import patch_entropy

            p, c = self.vision_config.patch_size, pixels.shape[1]
            values = patch_entropy(self._patch_rows(pixels), channels=c, temporal_patch=1, patch=p, merge=1,
                                   image_mean=self.image_mean, image_std=self.image_std)
            return self._packed(values.reshape(pixels.shape[0], -1), extra, 0.0).float()
        return entropy, known

    def token_rows(self, features) -> torch.Tensor | None:
        """The base view's rows of patches, then one row per run of tokens ended by a newline."""
        hashes = features.patch_hashes
        if hashes is None:
            return None
        side = self.vision_config.image_size // self.vision_config.patch_size
        at = torch.arange(hashes.numel())
        ended = torch.zeros(hashes.numel(), dtype=torch.long)
        ended[1:] = (hashes[:-1] == NEWLINE).long().cumsum(0)  # newlines before each token (none in the base view)
        return torch.where(at < self._per_tile, at // side, side + ended)

    def hash_rows(self, hashes: torch.Tensor, grid) -> torch.Tensor:
        """The height of each token on one scale for both views (the pixel-first region rule,
        ``core.pixel_first.region_share``): the base view's rows of patches, and each tile row mapped to the base
        view row at its height (the packed tile rows, unpadded, span the image's height as the base view does). A
        changed region then shows as one band of rows, not as one in each view: two rows swapped, counted apart,
        were four bands and never a region."""
        rows = self.token_rows(SimpleNamespace(patch_hashes=hashes))
        assert rows is not None  # the hashes are given: their rows are known
        side = self.vision_config.image_size // self.vision_config.patch_size
        tiled = rows >= side
        if not bool(tiled.any()):
            return rows
        count = int(rows[tiled].max()) - side + 1  # the tile rows
        mapped = (((rows - side).to(torch.float64) + 0.5) * side / count).floor().long().clamp(0, side - 1)
        return torch.where(tiled, mapped, rows)

    def same_layout(self, image, alias) -> bool:
        """Both packings known and their newlines at the same tokens (an image of another size or tiling can
        have as many tokens in other rows)."""
        mine, theirs = image.patch_hashes, alias.patch_hashes
        return mine is not None and theirs is not None and mine.shape == theirs.shape and \
            bool(((mine == NEWLINE) == (theirs == NEWLINE)).all())

    def thumbnail_of(self, pixels: torch.Tensor, grid, extra=None):
        """What the pixel stage aligns (``core.features.view_thumbnail``): the base view's thumbnail (the whole image
        at the tile size), or the tiles' (``_canvas``) where they give a larger one at the same pixels per token (a
        tower of small tiles, whose base view is a few tokens a side: a 56-pixel base view of a page moved by 2 px
        aligned worse than another page of its layout); None without the tiles."""
        if extra is None or pixels.dim() != 4:
            return None
        from vismemo_hf.core.features import thumb_per_token, view_thumbnail

        hw, view = self.thumbnail_hw(grid), (lambda: pixels[0])
        shape = self._tile_grid(pixels.shape[0], extra)
        if shape is not None:
            tiled = (shape[0] * hw[0], shape[1] * hw[1])
            if max(tiled) > max(hw) and thumb_per_token(tiled) == thumb_per_token(hw):
                hw, view = tiled, (lambda: self._canvas(pixels, *shape))
        return functools.cache(lambda: view_thumbnail(view(), hw, image_mean=self.image_mean,
                                                      image_std=self.image_std))

    def thumbnail_fits(self, shape: tuple[int, ...], grid) -> bool:
        """The base view's thumbnail, or the tiles' of some rows and columns of tiles at its pixels per token."""
        from vismemo_hf.core.features import thumb_per_token, thumbnail_shape

        hw = self.thumbnail_hw(grid)
        if tuple(shape) == thumbnail_shape(hw):
            return True
        per = thumb_per_token(hw)
        if len(shape) != 2 or any(side % (per * hw[0]) for side in shape) or min(shape) <= 0:
            return False
        return thumb_per_token((shape[0] // per, shape[1] // per)) == per

    def _tile_grid(self, tiles: int, extra) -> tuple[int, int] | None:
        """(rows, columns) of the image's tiles after its base view; None for an untiled image."""
        from transformers.models.llava_onevision.modeling_llava_onevision import get_anyres_image_grid_shape

        if not extra[1] or tiles < 2:
            return None
        rows, cols = get_anyres_image_grid_shape(list(extra[0]),
                                                 cast("PretrainedConfig", self.model.config).image_grid_pinpoints,
                                                 self.vision_config.image_size)
        return (int(rows), int(cols)) if rows * cols == tiles - 1 else None

    @staticmethod
    def _canvas(pixels: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """(C, rows * tile, cols * tile): the tiles after the base view laid out as the image they cut."""
        _, c, h, w = pixels.shape
        return pixels[1 : 1 + rows * cols].reshape(rows, cols, c, h, w).permute(2, 0, 3, 1, 4).reshape(c, rows * h,
                                                                                                      cols * w)

    def thumbnail_hw(self, grid) -> tuple[int, int]:
        """The base view's patches (its tokens: the first ``_per_tile`` of the run)."""
        side = self.vision_config.image_size // self.vision_config.patch_size
        return side, side

    def image_processor(self, min_tokens: int = 4, max_tokens: int = 1024):
        """The model's tiling (its tower's tile size and ``image_grid_pinpoints``) and normalisation."""
        tile = self.vision_config.image_size
        return transformers_class(self.image_processor_class)(
            size={"height": tile, "width": tile},
            image_grid_pinpoints=cast("PretrainedConfig", self.model.config).image_grid_pinpoints,
            image_mean=list(self.image_mean), image_std=list(self.image_std))

    # -- 1-D positions ---------------------------------------------------------------------------------------
    positions_1d = True

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

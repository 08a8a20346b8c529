"""The model adapter every family file specialises: everything the runtime, lookup and store need from a model.

The runtime reads no family-specific field: where images and videos sit in the ids, the rotary embedding and how
a cached key is turned by a position delta, the K/V a layer computes, the vision tower's call and per-token outputs,
the processor of reference images, the config a preset becomes, all go through ``ModelAdapter``. This base class
is written against what the transformers VLMs share (``model.visual``, ``model.language_model`` with ``layers``,
``norm`` and ``rotary_emb``, the modeling module's own ``apply_rotary_pos_emb``); a family file
(``families/<name>.py``) overrides only what differs and is registered in ``defaults.FAMILY_MODULES``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import sys
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vismemo_hf.core.features import exact_key, thumbnail, thumbnail_shape, token_grid

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Processor normalisation of each family (needed to recover pixels for patch entropy).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)


def transformers_class(name: str):
    """``"Class"`` from ``transformers`` or ``"module:Class"`` from ``transformers.models.module``."""
    import transformers

    if ":" in name:
        module, cls = name.split(":")
        return getattr(importlib.import_module(f"transformers.models.{module}"), cls)
    return getattr(transformers, name)



#: where a family's base model keeps its vision tower (``ModelAdapter.vision_attribute``)
VISION_ATTRIBUTES = ("visual", "vision_tower")


def base_model(model):
    """The ``*Model`` (vision tower + language model) of a ``*ForConditionalGeneration``, or ``model`` itself."""
    if hasattr(model, "language_model") and any(hasattr(model, a) for a in VISION_ATTRIBUTES):
        return model
    return getattr(model, "model", None)


#: config fields that say where or how a model was loaded, not what it computes
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation",
                         "_attn_implementation_autoset", "attn_implementation", "_experts_implementation"}


def _config_identity(value):
    """The config as nested plain data without the fields that depend on the loading path or the library."""
    if isinstance(value, dict):
        return {k: _config_identity(v) for k, v in sorted(value.items()) if k not in _VOLATILE_CONFIG_KEYS}
    if isinstance(value, (list, tuple)):
        return [_config_identity(v) for v in value]
    return value


def model_fingerprint(model, samples_per_tensor: int = 64) -> str:
    """Hash of the architecture and a strided sample of every weight tensor.

    Cheap enough for 8B+ models (a few values per tensor) and different for any other
    initialisation or fine-tune that touches the sampled tensors. The same weights loaded from
    another folder, or with another attention implementation, have the same fingerprint, so
    stores shared between machines and processes hit.
    """
    h = hashlib.sha256()
    h.update(type(model).__name__.encode())
    h.update(json.dumps(_config_identity(model.config.to_dict()), sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
            if p.device.type == "meta" or p.numel() == 0:
                continue
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // samples_per_tensor)
            h.update(flat[::step][:samples_per_tensor].float().cpu().numpy().tobytes())
    return h.hexdigest()[:32]


def execution_device(module) -> torch.device:
    """Where ``module`` computes: accelerate's hook decides for a dispatched module (its offloaded parameters sit on
    ``meta``), else its parameters' device."""
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", None) or [hook]:
        device = getattr(h, "execution_device", None)
        if device is not None:
            return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def tower_flops(vision, patches: int, width: int, mlp: int, gated: bool, attention: float | None = None) -> float:
    """FLOPs of a ViT tower's patch embedding and blocks: ``width``-wide blocks with a plain or gated MLP of ``mlp``
    and (default) full attention of every patch over the image (``attention``: the tower's total instead)."""
    embed = 2 * patches * vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2 * width
    linear = 2 * patches * (4 * width * width + (3 if gated else 2) * width * mlp)
    full = vision.depth * 4 * patches * patches * width if attention is None else attention
    return embed + vision.depth * linear + full


def _weights_signature(params: tuple) -> tuple:
    """Where every parameter lives and how often it was written in place: changes whenever weights do."""
    return tuple((p.data_ptr(), p._version) for p in params)


#: guards ``WeightsIdentity.held`` (module-wide: a lock on the dataclass would not survive a deepcopy of the model)
_HOLDING = threading.Lock()


@dataclass
class WeightsIdentity:
    """``model_fingerprint`` of a model's weights, worked out again only when a parameter moved or was written in
    place (``_weights_signature``); while forwards are in progress (``held``) the value checked as the first began."""

    value: str | None = None
    signature: tuple | None = None
    params: tuple | None = None  # the model's parameters (``enable`` lists them again)
    held: int = 0

    def of(self, model) -> str:
        if self.held > 0 and self.value is not None:
            return self.value
        if self.params is None:
            self.params = tuple(model.parameters())
        # the architectures field is the one config field a model's own methods write (``save_pretrained``)
        signature = (_weights_signature(self.params), tuple(getattr(model.config, "architectures", None) or ()))
        if signature != self.signature:
            self.value, self.signature = model_fingerprint(model), signature
        assert self.value is not None  # worked out at the first call (no signature equals the initial None)
        return self.value



class VisionTower:
    """What the runtime and the benchmarks need of a family's vision tower: its calls (whole images, some of an
    image's tokens), its output per image, and its price (``bench/flops.py``). ``ModelAdapter`` is one."""

    #: whether the tower can encode some of an image's tokens at their own positions (``encode_tokens``): an
    #: approximate hit then encodes only what changed and reuses its alias's encoder output for the rest
    partial_encoder: ClassVar[bool] = False

    #: the base model's attribute holding the vision tower
    vision_attribute: ClassVar[str] = "visual"

    #: the model whose tower this is (``ModelAdapter.model``)
    model: torch.nn.Module

    if TYPE_CHECKING:  # what ``ModelAdapter`` gives every tower, declared for the type checker only
        @property
        def text(self) -> Any: ...

        @property
        def deepstack_levels(self) -> int: ...

        def thumbnail_hw(self, grid) -> tuple[int, int]: ...

    def tower_pixels(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` as the vision tower reads them: every family's encoder casts them to its tower's dtype
        before any other use (``get_image_features``: ``pixel_values.type(self.visual.dtype)``; SigLIP's patch
        embedding), so two images equal in it are encoded alike, and the exact key hashes these bytes. A bf16
        tower's are half a float32 request's (on a GPU: half the copy to the host, half the hash); a tower of
        finer dtype than the pixels gets the pixels themselves (the cast adds nothing)."""
        dtype = getattr(getattr(base_model(self.model), self.vision_attribute, None), "dtype", None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or \
                not pixel_values.is_floating_point() or dtype.itemsize >= pixel_values.element_size():
            return pixel_values
        return pixel_values.detach().to(dtype)

    def image_key(self, owner: str, pixels: torch.Tensor, grid) -> str:
        """The exact key of one image (its rows of the pixel values) for ``owner`` (``VisMemoCache.owner``): what the
        lookup computes for a request's images (``core.features.exact_key`` of ``tower_pixels``)."""
        return exact_key(owner, self.tower_pixels(pixels).cpu(), cast("tuple[int, int, int]", tuple(int(g) for g in grid)))

    def encode(self, get_image_features, pixel_values, grids) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Run the vision tower once over several images: per image (embeds (N, d), deepstack (k, N, d) | None)."""
        return self.split_encoded(get_image_features(pixel_values, grids, return_dict=True))

    def encode_images(self, get_image_features, images: list[tuple]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``encode`` of ``split_images``' (pixels, grid, extra) items, in one batch."""
        pixels = torch.cat([p for p, _, _ in images]) if len(images) > 1 else images[0][0]  # one image: no copy
        return self.encode(get_image_features, pixels, torch.tensor([g for _, g, _ in images], device=pixels.device))

    def encode_capturing(self, get_image_features, pixel_values, grids):
        """``encode``, and per image what gives the tower's own K/V when called, which a later ``encode_tokens`` of
        an edited copy lends (``families.tower_kv``); None in their place when the family's tower cannot."""
        return self.encode(get_image_features, pixel_values, grids), None

    def lendable(self, tower: torch.Tensor | None, patches: int) -> bool:
        """Whether an entry's tower K/V can be lent to a partial encode of an image of ``patches`` patches."""
        return False

    def encode_tokens(self, get_image_features, items: list[tuple[torch.Tensor, tuple, torch.Tensor]], lent=None) \
            -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
        """The encoder output of some tokens of some images, in one call: ``items`` holds (the image's pixel rows,
        its grid, the sorted tokens wanted); per image (embeds (k, d), extra features (levels, k, d) | None) of those
        tokens, each at its own place in its image, attending to the others wanted of its image only, and with
        ``lent`` (per image, an alias's tower K/V from ``encode_capturing``) to the alias's other patches as well
        (docs/METHOD.md §1, encoder reuse). None: the family's tower cannot (``partial_encoder``)."""
        return None

    #: whether the tower encodes an image as tiles each alone (LLaVA-OneVision's any-resolution views): an edited
    #: copy then re-encodes the tiles whose digest changed and keeps its alias's output of the others
    #: (``encode_edited``), exactly what a whole encode gives them
    tile_encoder: ClassVar[bool] = False

    def tile_digests(self, pixels: torch.Tensor, grid, extra=None):
        """A call that gives the (T,) int64 digests of the image's tiles (``Entry.tile_digests``), computed on first
        call; None: the tower encodes each image whole (``tile_encoder``)."""
        return None

    def encode_edited(self, get_image_features, edits: dict) -> dict:
        """{image: (embeds, deepstack, tokens encoded)} of the edited copies (``edits``: image -> ((pixels, grid,
        extra), the alias's entry, (N,) changed tokens, the image's ``tile_digests`` call)) that the tower re-encodes
        in part by itself (``tile_encoder``); an image left out is encoded another way. {}: none."""
        return {}

    def thumbnail_fits(self, shape: tuple[int, ...], grid) -> bool:
        """Whether a stored thumbnail of ``shape`` is one this model makes for an image of ``grid``."""
        return tuple(shape) == thumbnail_shape(self.thumbnail_hw(grid))

    def split_encoded(self, out) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The tower's output per image: (embeds (N, d), extra visual features (k, N, d) | None)."""
        return [(e, None) for e in out.pooler_output]

    def placeholder_output(self, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Zeros in place of an image's encoder output (embeds, extra features), for an image whose tokens a prefill
        does not compute (inside a reused prefix)."""
        text = cast("PretrainedConfig", self.model.config).text_config
        device, dtype = execution_device(self.text), next(self.text.parameters()).dtype
        embeds = torch.zeros(n_tokens, text.hidden_size, device=device, dtype=dtype)
        levels = self.deepstack_levels
        return embeds, (torch.zeros(levels, n_tokens, text.hidden_size, device=device, dtype=dtype) if levels else None)

    def encoder_outputs(self, per_image: list[tuple[torch.Tensor, torch.Tensor | None]]):
        """The ``mm_encoder_outputs["image"]`` object the model's forward expects."""
        return BaseModelOutputWithPooling(pooler_output=tuple(e for e, _ in per_image))

    # -- what the benchmarks price (bench/flops.py) ---------------------------------------------------------
    @classmethod
    def encoder_flops(cls, vision, patches: int) -> float:
        """Forward FLOPs of the family's vision tower (config ``vision``) on one image of ``patches`` patches."""
        raise NotImplementedError(f"{cls.__name__} does not price its vision tower")

    @classmethod
    def lent_flops(cls, vision, encoded: int, patches: int) -> float:
        """What a partial encode of ``encoded`` of ``patches`` patches adds to ``encoder_flops(encoded)``: its
        queries' attention to the lent K/V of the others (``families.tower_kv``); 0 for a tower that lends none."""
        return 0.0

    @classmethod
    def tower_kv_values(cls, vision, patches: int) -> int:
        """Values of an image's kept tower K/V (``Entry.tower_kv``); 0 for a tower that keeps none."""
        return 0

    @classmethod
    def model_encoder_flops(cls, config, patches: int) -> float:
        """``encoder_flops`` with what the model adds between the tower and the language model (a family whose
        projector is sized by the language model prices it here)."""
        return cls.encoder_flops(config.vision_config, patches)

    @classmethod
    def patches_for(cls, config, visual_tokens: int) -> int:
        """Patches of an image that gives ``visual_tokens`` tokens (the merger's groups of patches)."""
        return visual_tokens * config.vision_config.spatial_merge_size ** 2

    @classmethod
    def bench_image_size(cls, config, visual_tokens: int) -> tuple[int, int]:
        """(width, height) of a page the family's processor turns into about ``visual_tokens`` tokens, once
        ``free_image_size`` lets it keep the size (the benchmarks' lengths): a near-square grid of merged patches."""
        side = int(round(visual_tokens ** 0.5))
        px = config.vision_config.spatial_merge_size * config.vision_config.patch_size
        return side * px, max(1, visual_tokens // side) * px

    @classmethod
    def free_image_size(cls, processor, config) -> None:
        """Let ``processor`` keep an image's size, up to 20,000 tokens (the benchmarks choose their lengths)."""
        group = (config.vision_config.spatial_merge_size * config.vision_config.patch_size) ** 2
        processor.image_processor.size = {"shortest_edge": 4 * group, "longest_edge": 20000 * group}


@dataclass
class ModelAdapter(VisionTower):
    """Handles on one enabled model: its parts, geometry and identity (the generic family; see the module doc)."""

    model: torch.nn.Module
    family: str
    image_mean: tuple = field(default=CLIP_MEAN)
    image_std: tuple = field(default=CLIP_STD)
    _weights: WeightsIdentity = field(default_factory=WeightsIdentity, repr=False)

    # -- what a family file declares ----------------------------------------------------------------------
    #: the ``model_type`` values this adapter serves (its config class is looked up in ``transformers``)
    model_types: ClassVar[tuple[str, ...]] = ()
    #: a readable name for error messages
    title: ClassVar[str] = ""
    #: the processor, image processor and video processor classes of its checkpoints (``transformers_class``)
    processor_class: ClassVar[str] = ""
    image_processor_class: ClassVar[str] = "Qwen2VLImageProcessor"
    video_processor_class: ClassVar[str] = ""
    patch_size: ClassVar[int] = 14
    #: the family's processor multiplies the pixel budget by the temporal patch (GLM-4V counts both frames)
    pixel_budget_frames: ClassVar[int] = 1
    #: mixture-of-experts decoders (presets add their ``moe`` block of ``text_config``)
    moe: ClassVar[bool] = False
    #: the vision config's key of the width the tower hands to the text model (None: a projector sets it)
    vision_out_key: ClassVar[str | None] = "out_hidden_size"
    #: whether images can be approximate hits: the family's visual tokens form a (t, h, w) grid of patch groups whose
    #: pixels the lookup's pixel features read (a family without one serves misses and exact hits)
    approximate: ClassVar[bool] = True
    #: whether a copy moved by whole visual tokens is matched moved (``core.thresholds.best_shift``): the tokens form
    #: one row-major grid in which a move is a shift of rows and columns
    movable: ClassVar[bool] = True
    #: the text model takes 1-D positions (the first row of the runner's (3, B, L) ones), not M-RoPE's three
    positions_1d: ClassVar[bool] = False

    @property
    def max_shift(self) -> int:
        """The moves, in visual tokens, the fine stage compares a candidate at (``core.thresholds.best_shift``)."""
        from vismemo_hf.core.thresholds import MAX_SHIFT

        return MAX_SHIFT if self.movable else 0

    @classmethod
    def for_model(cls, model, image_mean=None, image_std=None) -> ModelAdapter:
        """The adapter of ``model``'s family (``families.FAMILIES``), whichever class it is called on."""
        from vismemo_hf.families import FAMILIES, model_family

        family = model_family(model)
        adapter = FAMILIES[family]
        return adapter(model=model, family=family, image_mean=tuple(image_mean or adapter.image_mean),
                       image_std=tuple(image_std or adapter.image_std))

    @property
    def fingerprint(self) -> str:
        """``model_fingerprint`` of the weights as they are now (``WeightsIdentity``): entries of other weights are
        never served. A parameter object replaced by another is seen after ``enable(model)`` again."""
        return self._weights.of(self.model)

    def hold_fingerprint(self, held: bool, check: bool = True) -> None:
        """A forward begins (True) or ends (False): a prefill checks the weights once as it begins (``check``; a
        check reads every parameter's address and version), a decoding step, which looks nothing up, does not."""
        if held and check:
            self._weights.of(self.model)
        with _HOLDING:  # forwards of several threads: no count lost (a lost one would hold the value for ever)
            self._weights.held = max(0, self._weights.held + (1 if held else -1))

    # -- parts -----------------------------------------------------------------------------
    @property
    def base(self):
        return base_model(self.model)

    @property
    def text(self):
        return self.base.language_model

    def layer_device(self, layer: int) -> torch.device:
        """The device decoder layer ``layer`` computes on (device maps, offloaded layers)."""
        return execution_device(self.text.layers[layer])

    # -- where the images are ------------------------------------------------------------------------------
    def image_mask(self, input_ids: torch.Tensor, token_types: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L) True at the image placeholders of ``input_ids`` (``token_types``: the processor's
        ``mm_token_type_ids``, for families whose videos share the image placeholder)."""
        return input_ids == self.image_token_id

    def video_mask(self, input_ids: torch.Tensor, token_types: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L) True at the video placeholders."""
        return input_ids == self.video_token_id

    # -- the request's images -------------------------------------------------------------------------------
    def image_geometry(self, kwargs: dict):
        """What, besides the pixels, says how a forward's images were cut (``image_grid_thw``)."""
        return kwargs.get("image_grid_thw")

    def deferred_geometry(self, deferred):
        """The same for a deferred encoder call (``DeferredImageFeatures``: its second argument and options)."""
        return deferred.argument("image_grid_thw")

    def image_count(self, geometry) -> int:
        """How many images a forward's encoder input holds."""
        return int(geometry.shape[0])

    def split_images(self, pixel_values: torch.Tensor, geometry, run_lengths) -> list[tuple]:
        """``(pixels, grid, extra)`` of each image: its rows of the flattened patches (``grid`` = its
        ``image_grid_thw`` row), nothing extra. ``run_lengths``: the token count of each image's placeholder run
        (families whose token count the grid does not tell)."""
        grids = [tuple(int(x) for x in g) for g in geometry.tolist()]
        rows = torch.tensor([t * h * w for t, h, w in grids]).cumsum(0).tolist()
        return [(p, g, None) for p, g in zip(torch.tensor_split(pixel_values, rows[:-1]), grids)]

    def tokens_in(self, grid) -> int:
        """Visual tokens of an image of ``grid``."""
        return (grid[0] * grid[1] * grid[2]) // self.merge**2

    def processed_images(self, inputs) -> list[tuple]:
        """``split_images`` of a processor's output (``image_processor()(images=...)``: reference images,
        calibration pairs), whose token counts the geometry tells."""
        return self.split_images(inputs["pixel_values"], self.image_geometry(inputs), None)

    def pixel_features(self, pixels: torch.Tensor, grid, hashes: torch.Tensor | None = None, extra=None):
        """What computes an image's patch entropy and its token pixel hashes, each when first needed
        (``ImageFeatures``; ``hashes``: already computed; ``extra``: ``split_images``' third item of the image)."""
        from vismemo_hf.core.features import patch_entropy

        return (lambda: patch_entropy(pixels, **self.entropy_kwargs()),
                lambda: hashes if hashes is not None else self.patch_hashes(pixels, grid, extra))

    def patch_hashes(self, pixels: torch.Tensor, grid, extra=None) -> torch.Tensor | None:
        """(N,) hash of each visual token's pixels (``core.features.patch_hashes``), or None (no token grid)."""
        from vismemo_hf.core.features import patch_hashes

        return patch_hashes(pixels, self.merge)

    def token_rows(self, features) -> torch.Tensor | None:
        """(N,) the row of each of an image's visual tokens (``ImageFeatures.token_rows``), or None: the rows of
        its (t, h, w) grid."""
        return None

    def hash_rows(self, hashes: torch.Tensor, grid) -> torch.Tensor:
        """(N,) the token row of each of an image's patch ``hashes`` (``token_rows``, or the rows of its token grid):
        the pixel-first stage's region rule (``core.pixel_first.region_share``)."""
        rows = self.token_rows(SimpleNamespace(patch_hashes=hashes))
        if rows is not None:
            return rows
        return torch.arange(hashes.numel()) // max(1, int(token_grid(tuple(grid), self.merge)[2]))

    def same_layout(self, image, alias) -> bool:
        """Whether token i of two images of one grid (anything with their ``patch_hashes``: features, entries)
        stands at the same place of both: always, for a family whose grid says where every token is (nothing is
        read, so no image's hashes are computed for it)."""
        return True

    @property
    def encoder_window(self) -> int | None:
        """The side, in visual tokens, of the windows the tower's windowed blocks attend within (None: none)."""
        return None

    def thumbnail_of(self, pixels: torch.Tensor, grid, extra=None):
        """What computes an image's (H, W) uint8 thumbnail once (the pixel stage, the store), or None."""
        return functools.cache(lambda: thumbnail(pixels, grid, **self.entropy_kwargs()))

    def thumbnail_hw(self, grid) -> tuple[int, int]:
        """(rows, columns) of the tokens the thumbnail spans (its pixels per token: ``thumb_per_token``)."""
        return token_grid(tuple(grid), self.merge)[1:]

    # -- the language model's computation (the only place that names its modules) -----------------------
    def _rope_function(self):
        """The modeling module's own ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)`` (half or interleaved
        rotation, partial rotary dimensions: whatever the family does)."""
        attention = type(self.text.layers[0].self_attn)
        return sys.modules[attention.__module__].apply_rotary_pos_emb

    def rotate(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``keys`` (..., T, D) turned as the model turns them by (cos, sin) (T, D') or (D',) (its RoPE)."""
        k = keys.float()
        cos, sin = cos.to(k.device, k.dtype), sin.to(k.device, k.dtype)
        if cos.ndim == 1:
            cos, sin = cos[None], sin[None]
        _, out = self._rope_function()(k, k, cos, sin, unsqueeze_dim=0)  # (1, T, D') against (..., T, D)
        return out.to(keys.dtype)

    def turn(self, delta: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscaled (cos, sin) (D',) float32 of the M-RoPE position delta (t, h, w): what moves a cached key by it,
        from the model's own rotary embedding."""
        rotary = self.text.rotary_emb
        x = torch.zeros(1, dtype=torch.float32, device=execution_device(rotary))  # where its buffers compute
        cos, sin = rotary(x, torch.tensor(delta, dtype=torch.long, device=x.device).view(3, 1, 1))
        scale = float(getattr(rotary, "attention_scaling", 1.0))
        return cos[0, 0].float() / scale, sin[0, 0].float() / scale

    def move_keys(self, keys: torch.Tensor, delta: int, shift: tuple[int, int] = (0, 0)) -> torch.Tensor:
        """Cached keys (..., T, D) at this request's positions: the image starts ``delta`` positions later (every
        coordinate moves by it), and a moved alias (``shift`` = (dy, dx) tokens) shows each token dy rows and dx
        columns earlier (its h and w coordinates move by -dy and -dx more)."""
        if delta == 0 and shift == (0, 0):
            return keys
        return self.rotate(keys, *self.turn((delta, delta - shift[0], delta - shift[1])))

    def rope(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of the M-RoPE ``positions`` (3, B, L)."""
        return self.text.rotary_emb(hidden, positions)

    def run_layer(self, layer: int, hidden, mask, cos, sin, cache):
        """Decoder layer ``layer`` on ``hidden`` (B, q, d) at rotary (cos, sin), writing its K/V to ``cache``."""
        return self.text.layers[layer](hidden, attention_mask=mask, position_ids=None, cache=cache, use_cache=True,
                                       position_embeddings=(cos, sin))

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.text.norm(hidden)

    @property
    def output_head(self):
        """The model's output projection to the vocabulary (None for a base model enabled without one)."""
        get = getattr(self.model, "get_output_embeddings", None)
        return get() if get is not None else None

    def fresh_kv(self, layer: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(K, V), (KV heads, N, D) each, that ``layer`` computes for the hidden states (N, d) entering it at rotary
        (cos, sin) (N, D'): its input norm, k/v projections, key norm (Qwen3-VL) and RoPE."""
        block = self.text.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(hidden)
        keys = attn.k_proj(x).view(hidden.shape[0], -1, attn.head_dim)
        values = attn.v_proj(x).view(hidden.shape[0], -1, attn.head_dim)
        if getattr(attn, "k_norm", None) is not None:  # Qwen3-VL normalises keys before RoPE
            keys = attn.k_norm(keys)
        keys = self.rotate(keys.transpose(0, 1), cos, sin)
        return keys, values.transpose(0, 1)

    # -- geometry --------------------------------------------------------------------------
    @property
    def vision_config(self):
        return self.model.config.vision_config

    @property
    def merge(self) -> int:
        return self.vision_config.spatial_merge_size

    @property
    def image_token_id(self) -> int:
        return cast("PretrainedConfig", self.model.config).image_token_id

    @property
    def video_token_id(self) -> int:
        return cast("PretrainedConfig", self.model.config).video_token_id

    @property
    def num_layers(self) -> int:
        return cast("PretrainedConfig", self.model.config).text_config.num_hidden_layers

    @property
    def head_dim(self) -> int:
        return self.text.layers[0].self_attn.head_dim

    @property
    def deepstack_levels(self) -> int:
        """How many intermediate tower features are added to the first decoder layers (Qwen3-VL's deepstack)."""
        return 0

    def entry_problem(self, entry, grid) -> str | None:
        """Why a stored entry cannot serve this model for an image of ``grid`` (None: it can). Checks what a
        corrupt or foreign entry could get wrong: grid, token and layer counts, widths, K/V shape, offset. Cheap on
        purpose (it runs on every exact hit and candidate): the bytes themselves are checked by the blob's hashes."""
        text = cast("PretrainedConfig", self.model.config).text_config
        n = self.tokens_in(grid)
        levels = entry.deepstack.shape[0] if entry.deepstack is not None else 0
        checks = [
            (tuple(entry.grid) == tuple(grid), f"grid {tuple(entry.grid)} for {tuple(grid)}"),
            (entry.n_tokens == n, f"{entry.n_tokens} tokens for {n}"),
            (entry.n_layers == self.num_layers, f"{entry.n_layers} layers for {self.num_layers}"),
            (entry.embeds.ndim == 2 and entry.embeds.shape[-1] == text.hidden_size,
             f"embedding width {tuple(entry.embeds.shape)} for {text.hidden_size}"),
            (levels == self.deepstack_levels, f"{levels} deepstack levels for {self.deepstack_levels}"),
            (entry.deepstack is None or tuple(entry.deepstack.shape[1:]) == tuple(entry.embeds.shape),
             "deepstack shape"),
            (entry.kv is None or tuple(entry.kv.shape) == (entry.kv_count, self.num_layers, 2,
                                                            text.num_key_value_heads, self.head_dim),
             f"K/V shape {None if entry.kv is None else tuple(entry.kv.shape)}"),
            (entry.kv_tokens is None or (entry.kv_tokens.numel() <= n and (
                entry.kv_tokens.numel() == 0 or int(entry.kv_tokens.max()) < n)), "stored token indices"),
            (0 <= entry.offset < getattr(text, "max_position_embeddings", 2**31), f"offset {entry.offset}"),
            (entry.entropy.shape == (n,) and bool(torch.isfinite(entry.entropy).all()), "patch entropy"),
            (entry.thumbnail is None or self.thumbnail_fits(tuple(entry.thumbnail.shape), grid),
             f"thumbnail {None if entry.thumbnail is None else tuple(entry.thumbnail.shape)}"),
        ]
        return next((why for ok, why in checks if not ok), None)

    def entropy_kwargs(self) -> dict:
        vc = self.vision_config
        return dict(
            channels=getattr(vc, "in_channels", getattr(vc, "in_chans", 3)),
            temporal_patch=vc.temporal_patch_size,
            patch=vc.patch_size,
            merge=vc.spatial_merge_size,
            image_mean=self.image_mean,
            image_std=self.image_std,
        )

    def image_processor(self, min_tokens: int = 4, max_tokens: int = 1024):
        """The family's image processor with the model's patch geometry and normalisation (no hub access): what
        encodes the lookup's reference images."""
        return self.make_image_processor(self.vision_config.patch_size, self.merge, self.vision_config.temporal_patch_size,
                                          self.image_mean, self.image_std, min_tokens, max_tokens)

    @classmethod
    def make_image_processor(cls, patch: int, merge: int = 2, temporal: int = 2, mean=None, std=None,
                             min_tokens: int = 4, max_tokens: int = 1024):
        token_px = patch * merge
        budget = token_px**2 * cls.pixel_budget_frames
        return transformers_class(cls.image_processor_class)(
            size={"shortest_edge": min_tokens * budget, "longest_edge": max_tokens * budget}, patch_size=patch,
            temporal_patch_size=temporal, merge_size=merge, image_mean=list(mean or cls.image_mean),
            image_std=list(std or cls.image_std))

    # -- presets and offline processors (configs/models/, offline.py) ----------------------------------------
    #: special tokens of the family's chat format that an offline tokenizer adds (``offline.byte_tokenizer``)
    special_tokens: ClassVar[tuple[str, ...]] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                                                 "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
    #: the offline tokenizer's end of an answer and its padding
    eos_token: ClassVar[str] = "<|im_end|>"
    pad_token: ClassVar[str] = "<|endoftext|>"

    @classmethod
    def rope_parameters(cls, text: dict) -> dict:
        """The ``rope_parameters`` of a preset's text block (its ``rope_theta`` and ``mrope_section`` popped)."""
        return {"rope_type": "default", "rope_theta": float(text.pop("rope_theta")),
                "mrope_section": list(text.pop("mrope_section"))}

    @classmethod
    def config_kwargs(cls, vision: dict) -> dict:
        """Top-level config fields a preset keeps in its vision block (popped from it); default none."""
        return {}

    @classmethod
    def token_ids(cls, tokenizer) -> dict:
        """The config's placeholder and delimiter token ids for an offline ``tokenizer``."""
        ids = tokenizer.convert_tokens_to_ids
        return dict(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                    vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))

    #: the chat template of the family's offline processor
    chat_template: ClassVar[str] = ""

    @classmethod
    def offline_processor(cls, tokenizer, min_tokens: int = 4, max_tokens: int = 256, vision=None):
        """The family's processor with local image / video processors, ``tokenizer`` and its ``chat_template``
        (``offline.py``); ``vision``: the tower's config, for a family whose processor follows its geometry."""
        image = cls.make_image_processor(cls.patch_size, min_tokens=min_tokens, max_tokens=max_tokens)
        return transformers_class(cls.processor_class)(
            image_processor=image, tokenizer=tokenizer, video_processor=transformers_class(cls.video_processor_class)(),
            chat_template=cls.chat_template)

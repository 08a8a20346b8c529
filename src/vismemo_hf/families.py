"""What differs between the supported model families, behind one small adapter."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vismemo_hf.core.features import thumbnail_shape
from vismemo_hf.core.rope import rotate_half

# Processor normalisation of each family (needed to recover pixels for patch entropy).
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_HALF = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class FamilySpec:
    """Everything that differs between the supported model families; adding a family is one entry of
    ``FAMILIES``. Class names are looked up in ``transformers`` when needed."""

    model_type: str
    config_class: str
    processor_class: str
    video_processor_class: str  # "module:Class" under transformers.models
    image_mean: tuple
    image_std: tuple
    patch_size: int
    #: Qwen3-VL: the vision tower also returns deepstack features added to the first decoder layers
    deepstack: bool = False
    #: mixture-of-experts decoder (presets add their ``moe`` block of ``text_config``)
    moe: bool = False
    #: Qwen3-VL's M-RoPE interleaves its sections
    mrope_interleaved: bool = False
    #: Qwen2-VL's tower outputs the text hidden size directly (no ``out_hidden_size``)
    vision_out_key: str = "out_hidden_size"
    #: the chat template's default system turn (Qwen2 / 2.5-VL have one, Qwen3-VL has none)
    system_turn: bool = True

    def transformers_class(self, name: str):
        import importlib

        import transformers

        if ":" in name:
            module, cls = name.split(":")
            return getattr(importlib.import_module(f"transformers.models.{module}"), cls)
        return getattr(transformers, name)


FAMILIES: dict[str, FamilySpec] = {
    spec.model_type: spec
    for spec in (
        FamilySpec("qwen2_vl", "Qwen2VLConfig", "Qwen2VLProcessor",
                   "qwen2_vl.video_processing_qwen2_vl:Qwen2VLVideoProcessor", _CLIP_MEAN, _CLIP_STD, 14,
                   vision_out_key="hidden_size"),
        FamilySpec("qwen2_5_vl", "Qwen2_5_VLConfig", "Qwen2_5_VLProcessor",
                   "qwen2_vl.video_processing_qwen2_vl:Qwen2VLVideoProcessor", _CLIP_MEAN, _CLIP_STD, 14),
        FamilySpec("qwen3_vl", "Qwen3VLConfig", "Qwen3VLProcessor",
                   "qwen3_vl.video_processing_qwen3_vl:Qwen3VLVideoProcessor", _HALF, _HALF, 16,
                   deepstack=True, mrope_interleaved=True, system_turn=False),
        FamilySpec("qwen3_vl_moe", "Qwen3VLMoeConfig", "Qwen3VLProcessor",
                   "qwen3_vl.video_processing_qwen3_vl:Qwen3VLVideoProcessor", _HALF, _HALF, 16,
                   deepstack=True, moe=True, mrope_interleaved=True, system_turn=False),
    )
}


def base_model(model):
    """The ``*Model`` (vision tower + language model) of a ``*ForConditionalGeneration``, or ``model`` itself."""
    return model if hasattr(model, "language_model") and hasattr(model, "visual") else getattr(model, "model", None)


def model_family(model) -> str:
    family = getattr(getattr(model, "config", None), "model_type", None)
    base = base_model(model)
    if family not in FAMILIES or not hasattr(base, "language_model") or not hasattr(base, "visual"):
        raise ValueError(
            f"vismemo supports Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE (model_type {', '.join(FAMILIES)}) "
            f"as *ForConditionalGeneration or *Model; got {type(model).__name__} (model_type={family!r})"
        )
    return family


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


def _weights_signature(params: tuple) -> tuple:
    """Where every parameter lives and how often it was written in place: changes whenever weights do."""
    return tuple((p.data_ptr(), p._version) for p in params)


@dataclass
class ModelAdapter:
    """Handles on one enabled model: its parts, geometry and identity."""

    model: torch.nn.Module
    family: str
    image_mean: tuple = field(default=_CLIP_MEAN)
    image_std: tuple = field(default=_CLIP_STD)
    _fingerprint: str | None = field(default=None, repr=False)
    _signature: tuple | None = field(default=None, repr=False)
    _params: tuple | None = field(default=None, repr=False)  # the model's parameters (``enable`` refreshes them)

    @classmethod
    def for_model(cls, model, image_mean=None, image_std=None) -> ModelAdapter:
        family = model_family(model)
        spec = FAMILIES[family]
        return cls(model=model, family=family, image_mean=tuple(image_mean or spec.image_mean),
                   image_std=tuple(image_std or spec.image_std))

    @property
    def fingerprint(self) -> str:
        """``model_fingerprint`` of the weights as they are now: recomputed after any weight changes (loading, an
        in-place edit, a copy's own tensors), so that entries of other weights are never served. A parameter
        object replaced by another is seen after ``enable(model)`` again."""
        if self._params is None:
            self._params = tuple(self.model.parameters())
        signature = _weights_signature(self._params)
        if signature != self._signature:
            self._fingerprint, self._signature = model_fingerprint(self.model), signature
        return self._fingerprint

    # -- parts -----------------------------------------------------------------------------
    @property
    def base(self):
        return base_model(self.model)

    def layer_device(self, layer: int) -> torch.device:
        """The device decoder layer ``layer`` computes on (device maps, offloaded layers)."""
        return execution_device(self.text.layers[layer])

    # -- the language model's computation (the only place that names its modules) -----------------------
    @property
    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies of the text model (what re-rotating a cached key needs)."""
        return self.text.rotary_emb.inv_freq

    def turn(self, delta: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscaled (cos, sin) (head_dim,) float32 of the M-RoPE position delta (t, h, w): what moves a cached key
        by it (``core.rope.turn``), from the model's own rotary embedding."""
        rotary = self.text.rotary_emb
        x = torch.zeros(1, dtype=torch.float32, device=execution_device(rotary))  # where its buffers compute
        cos, sin = rotary(x, torch.tensor(delta, dtype=torch.long, device=x.device).view(3, 1, 1))
        scale = float(getattr(rotary, "attention_scaling", 1.0))
        return cos[0, 0].float() / scale, sin[0, 0].float() / scale

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
        (cos, sin) (N, D): its input norm, k/v projections, key norm (Qwen3-VL) and RoPE."""
        block = self.text.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(hidden)
        keys = attn.k_proj(x).view(hidden.shape[0], -1, attn.head_dim)
        values = attn.v_proj(x).view(hidden.shape[0], -1, attn.head_dim)
        if getattr(attn, "k_norm", None) is not None:  # Qwen3-VL normalises keys before RoPE
            keys = attn.k_norm(keys)
        keys = keys * cos[:, None] + rotate_half(keys) * sin[:, None]
        return keys.transpose(0, 1), values.transpose(0, 1)

    @property
    def text(self):
        return self.base.language_model

    @property
    def spec(self) -> FamilySpec:
        return FAMILIES[self.family]

    @property
    def has_deepstack(self) -> bool:
        return self.spec.deepstack

    # -- geometry --------------------------------------------------------------------------
    @property
    def vision_config(self):
        return self.model.config.vision_config

    @property
    def merge(self) -> int:
        return self.vision_config.spatial_merge_size

    @property
    def image_token_id(self) -> int:
        return self.model.config.image_token_id

    @property
    def video_token_id(self) -> int:
        return self.model.config.video_token_id

    @property
    def num_layers(self) -> int:
        return self.model.config.text_config.num_hidden_layers

    @property
    def deepstack_levels(self) -> int:
        return len(getattr(self.vision_config, "deepstack_visual_indexes", ())) if self.has_deepstack else 0

    def entry_problem(self, entry, grid) -> str | None:
        """Why a stored entry cannot serve this model for an image of ``grid`` (None: it can). Checks what a
        corrupt or foreign entry could get wrong: grid, token and layer counts, widths, K/V shape, offset. Cheap on
        purpose (it runs on every exact hit and candidate): the bytes themselves are checked by the blob's hashes."""
        text = self.model.config.text_config
        n = (grid[0] * grid[1] * grid[2]) // self.merge**2
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
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
                                                            text.num_key_value_heads, head_dim),
             f"K/V shape {None if entry.kv is None else tuple(entry.kv.shape)}"),
            (entry.kv_tokens is None or (entry.kv_tokens.numel() <= n and (
                entry.kv_tokens.numel() == 0 or int(entry.kv_tokens.max()) < n)), "stored token indices"),
            (0 <= entry.offset < getattr(text, "max_position_embeddings", 2**31), f"offset {entry.offset}"),
            (entry.entropy.shape == (n,) and bool(torch.isfinite(entry.entropy).all()), "patch entropy"),
            (entry.thumbnail is None or tuple(entry.thumbnail.shape) == thumbnail_shape(grid, self.merge),
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

    # -- vision encoder --------------------------------------------------------------------
    def encode(self, get_image_features, pixel_values, grids) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Run the vision tower once over several images: per image (embeds (N, d), deepstack (k, N, d) | None)."""
        return self.split_encoded(get_image_features(pixel_values, grids, return_dict=True))

    def split_encoded(self, out) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The tower's output per image: (embeds (N, d), deepstack (k, N, d) | None)."""
        embeds = list(out.pooler_output)
        if not self.has_deepstack:
            return [(e, None) for e in embeds]
        per_layer = [list(level) for level in out.deepstack_features]
        return [(e, torch.stack([level[i] for level in per_layer])) for i, e in enumerate(embeds)]

    def encoder_outputs(self, per_image: list[tuple[torch.Tensor, torch.Tensor | None]]):
        """The ``mm_encoder_outputs["image"]`` object the model's forward expects."""
        embeds = tuple(e for e, _ in per_image)
        if not self.has_deepstack:
            return BaseModelOutputWithPooling(pooler_output=embeds)
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        levels = per_image[0][1].shape[0]
        deepstack = [tuple(d[level] for _, d in per_image) for level in range(levels)]
        return BaseModelOutputWithDeepstackFeatures(pooler_output=embeds, deepstack_features=deepstack)


# -- model presets (configs/models/) ------------------------------------------------------------------
def preset_config(name: str, family: str | None = None, tokenizer=None, **text_overrides):
    """A transformers config for preset ``name`` in ``family`` (default: the preset's own).

    With ``tokenizer``, vocabulary size and special token ids come from it (offline
    tokenizers); otherwise the real models' ids apply. ``text_overrides`` replace text-config fields
    (``num_hidden_layers=1``, ...).
    """
    from vismemo_hf.presets import load_preset

    preset = load_preset(name)
    family = family or preset.get("family")
    if family not in FAMILIES:
        raise ValueError(f"preset {name!r} needs a family, one of {', '.join(FAMILIES)}")
    if preset.get("family") not in (None, family):
        raise ValueError(f"preset {name!r} is a {preset['family']} geometry, not {family}")
    spec = FAMILIES[family]
    text = {**preset["text_config"], **text_overrides}
    moe = text.pop("moe", None)
    if spec.moe:
        if moe is None:
            raise ValueError(f"preset {name!r} has no `moe` block in text_config for the {family} family")
        text.update(moe)
    vision = dict(preset["vision_config"].get(family, preset["vision_config"]))
    if any(k in FAMILIES for k in vision):
        raise ValueError(f"preset {name!r} has no vision tower for {family}")
    rope = {"rope_type": "default", "rope_theta": float(text.pop("rope_theta")),
            "mrope_section": list(text.pop("mrope_section"))}
    if spec.mrope_interleaved:
        rope["mrope_interleaved"] = True
    text.update(rope_parameters=rope, vocab_size=len(tokenizer) if tokenizer is not None else preset["vocab_size"])
    vision[spec.vision_out_key] = text["hidden_size"]
    kwargs = {"text_config": text, "vision_config": vision}
    if tokenizer is not None:
        ids = tokenizer.convert_tokens_to_ids
        kwargs.update(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                      vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
        text.update(bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return spec.transformers_class(spec.config_class)(**kwargs)


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

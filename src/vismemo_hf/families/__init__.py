"""Model families: one adapter file each (``families/<name>.py``), registered in ``defaults.FAMILY_MODULES``.

``ModelAdapter.for_model(model)`` picks the adapter by the model's ``config.model_type``; the runtime, lookup,
store and policies use a model only through it. Adding a family: its file (an adapter subclass overriding what
differs from ``base.ModelAdapter``), its line in ``defaults.FAMILY_MODULES``, its block in the model presets, and
its test block (tests run every registered family).
"""

from __future__ import annotations

import importlib

import torch

from vismemo_hf.defaults import FAMILY_MODULES
from vismemo_hf.families.base import (
    ModelAdapter,
    base_model,
    execution_device,
    model_fingerprint,
    transformers_class,
)

__all__ = ["FAMILIES", "ModelAdapter", "base_model", "build_model", "execution_device", "model_family",
           "model_fingerprint", "preset_config", "transformers_class"]


def _registry() -> dict[str, type[ModelAdapter]]:
    out = {}
    for model_type, module in FAMILY_MODULES.items():
        found = [a for a in vars(importlib.import_module(f"vismemo_hf.families.{module}")).values()
                 if isinstance(a, type) and issubclass(a, ModelAdapter) and model_type in a.model_types]
        if len(found) != 1:
            raise ImportError(f"families/{module}.py defines {len(found)} adapters for {model_type!r}, not one")
        out[model_type] = found[0]
    return out


#: model_type -> its adapter class, in ``defaults.FAMILY_MODULES``' order
FAMILIES: dict[str, type[ModelAdapter]] = _registry()


def model_family(model) -> str:
    """The ``model_type`` of a supported model (a ``*ForConditionalGeneration`` or its ``*Model``), else ValueError."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    base = base_model(model)
    if family not in FAMILIES or not hasattr(base, "language_model") or \
            not hasattr(base, FAMILIES[family].vision_attribute):
        names = ", ".join(dict.fromkeys(a.title for a in FAMILIES.values()))
        raise ValueError(f"vismemo supports {names} (model_type {', '.join(FAMILIES)}) as *ForConditionalGeneration "
                         f"or *Model; got {type(model).__name__} (model_type={family!r})")
    return family


# -- model presets (configs/models/) ------------------------------------------------------------------
def preset_config(name: str, family: str | None = None, tokenizer=None, **text_overrides):
    """A transformers config for preset ``name`` in ``family`` (default: the preset's own).

    With ``tokenizer``, vocabulary size and special token ids come from it (offline
    tokenizers); otherwise the real models' ids apply. ``text_overrides`` replace text-config fields
    (``num_hidden_layers=1``, ...). A preset's ``vision_config`` holds one block per family (or one tower for
    its own family); its ``text_config`` may hold per-family blocks of fields that differ (``glm4v: {...}``).
    """
    from vismemo_hf.presets import find, load_preset

    preset = load_preset(name)
    try:
        return _config(name, preset, family, tokenizer, text_overrides)
    except KeyError as err:  # the file is what to fix: name it and what it lacks
        raise ValueError(f"model preset {find('models', name)} lacks {err.args[0]!r}") from err
    except (TypeError, AttributeError) as err:
        raise ValueError(f"model preset {find('models', name)} is malformed ({type(err).__name__}: {err})") from err


def _config(name: str, preset: dict, family: str | None, tokenizer, text_overrides: dict):
    family = family or preset.get("family")
    if family not in FAMILIES:
        raise ValueError(f"preset {name!r} needs a family, one of {', '.join(FAMILIES)}")
    if preset.get("family") not in (None, family):
        raise ValueError(f"preset {name!r} is a {preset['family']} geometry, not {family}")
    adapter = FAMILIES[family]
    text = {k: v for k, v in preset["text_config"].items() if k not in FAMILIES}
    text.update({**preset["text_config"].get(family, {}), **text_overrides})
    moe = text.pop("moe", None)
    if adapter.moe:
        if moe is None:
            raise ValueError(f"preset {name!r} has no `moe` block in text_config for the {family} family")
        text.update(moe)
    vision = dict(preset["vision_config"].get(family, preset["vision_config"]))
    if any(k in FAMILIES for k in vision):
        raise ValueError(f"preset {name!r} has no vision tower for {family}")
    text.update(rope_parameters=adapter.rope_parameters(text),
                vocab_size=len(tokenizer) if tokenizer is not None else preset["vocab_size"])
    if adapter.vision_out_key is not None:
        vision[adapter.vision_out_key] = text["hidden_size"]
    kwargs = {**adapter.config_kwargs(vision), "text_config": text, "vision_config": vision}
    if tokenizer is not None:
        kwargs.update(adapter.token_ids(tokenizer))
        text.update(bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **kwargs)


def build_model(preset: str, family: str | None = None, seed: int = 0, dtype=torch.float32, tokenizer=None,
                device: str = "cpu", **text_overrides):
    """A random-weight model of ``preset`` (eval mode, SDPA attention), created directly on ``device``;
    ``text_overrides`` replace text-config fields."""
    from transformers import AutoModelForImageTextToText

    config = preset_config(preset, family, tokenizer=tokenizer, **text_overrides)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    except (TypeError, ValueError) as err:  # a geometry no model can have ("hidden_size: big", a zero width)
        from vismemo_hf.presets import find

        raise ValueError(f"model preset {find('models', preset)} gives no model ({type(err).__name__}: {err})") \
            from err
    return model.eval()

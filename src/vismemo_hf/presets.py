"""Model presets (``configs/models/*.yaml``): geometries to build random-weight models from.

A preset names a ``text_config`` and a ``vision_config`` (flat for a single family, or
one block per family for family-agnostic geometries like ``tiny``).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from vismemo_hf.families import FAMILIES


def config_dir() -> Path:
    """``configs/`` of a source checkout, or its copy inside an installed wheel."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "configs", here.parents[1] / "configs"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("vismemo configs/ folder not found next to the package or in the source tree")


#: the kinds of preset, each a folder of ``configs/``
KINDS = {"models": "model preset", "policies": "policy preset", "store": "store preset",
         "vlcache": "VL-Cache profile", "lookup": "lookup thresholds preset"}


def available(kind: str) -> list[str]:
    """Names of the presets of ``kind`` shipped in ``configs/``."""
    return sorted(p.stem for p in (config_dir() / kind).glob("*.yaml"))


def find(kind: str, name: str, missing_ok: bool = False) -> Path | None:
    """The YAML file of preset ``name`` of ``kind`` (``models``, ``policies``, ``store``, ``vlcache``, ``lookup``): a path
    to a .yaml / .yml file, or the stem of a file in ``configs/KIND/``. An unknown name is a ValueError that
    lists the available ones (or None with ``missing_ok``)."""
    path = Path(name)
    if path.suffix not in (".yaml", ".yml"):
        path = config_dir() / kind / f"{name}.yaml"
    if path.is_file():
        return path
    if missing_ok:
        return None
    raise ValueError(f"unknown {KINDS[kind]} {name!r} (no file {path}); available: {', '.join(available(kind))}")


def load(kind: str, name: str, missing_ok: bool = False) -> dict | None:
    """The mapping in preset ``name`` of ``kind`` (see ``find``)."""
    path = find(kind, name, missing_ok)
    if path is None:
        return None
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{KINDS[kind]} {path} must hold a mapping")
    return data


def load_preset(name: str) -> dict:
    return load("models", name)


def preset_config(name: str, family: str | None = None, tokenizer=None, **text_overrides):
    """A transformers config for preset ``name`` in ``family`` (default: the preset's own).

    With ``tokenizer``, vocabulary size and special token ids come from it (offline
    tokenizers); otherwise the real models' ids apply. ``text_overrides`` replace text-config fields
    (``num_hidden_layers=1``, ...).
    """
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

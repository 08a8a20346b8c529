"""Load a model and its processor: a packaged reader, a local checkpoint, a model in the Hugging Face cache, or a
preset name (random weights)."""

from __future__ import annotations

from pathlib import Path

import torch


def _from_pretrained(spec: str, dtype, device: str, **kwargs):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(spec, dtype=dtype, **kwargs).eval().to(device)
    return model, AutoProcessor.from_pretrained(spec, **kwargs)


def load_model(spec: str, family: str | None = None, dtype=torch.float32, seed: int = 0, device: str = "cpu"):
    """``(model, processor)``: ``spec`` is ``"vismemo-docqa-tiny"`` or ``"vismemo-docqa-base"`` (the packaged
    reading models), a local checkpoint folder, a hub id already in the Hugging Face cache (nothing is downloaded),
    or a preset of ``configs/models/`` built with random weights and an offline processor (``family`` picks the
    family of family-agnostic presets such as ``tiny``; default qwen2_vl)."""
    from vismemo_hf.eval import docqa, docqa_base
    from vismemo_hf.presets import find, load_preset

    if spec == docqa.MODEL_NAME:
        model, processor = docqa.docqa_model(dtype=dtype)
        return model.to(device), processor
    if spec == docqa_base.MODEL_NAME:
        model, processor = docqa_base.docqa_base_model(dtype=dtype)
        return model.to(device), processor
    if Path(spec).is_dir():
        if not (Path(spec) / "config.json").is_file():
            raise ValueError(f"{spec} is a folder without config.json: not a model checkpoint")
        return _from_pretrained(spec, dtype, device)
    if spec.startswith(("/", "./", "../", "~")) and not Path(spec).expanduser().exists():
        raise ValueError(f"no model folder {spec}")
    try:
        find("models", spec)
    except (FileNotFoundError, ValueError):
        if "/" in spec and not Path(spec).exists():
            try:
                return _from_pretrained(spec, dtype, device, local_files_only=True)
            except OSError as err:
                raise ValueError(f"{spec!r} is not in the Hugging Face cache (nothing is downloaded here): download "
                                 f"it first or pass a local folder") from err
        raise ValueError(f"{spec!r} is neither a local checkpoint folder, a cached hub model, "
                         f"{docqa.MODEL_NAME}, {docqa_base.MODEL_NAME} nor a model preset") from None
    from vismemo_hf.families import build_model, preset_config
    from vismemo_hf.offline import offline_processor

    family = family or load_preset(spec).get("family") or "qwen2_vl"
    tokenizer = offline_processor(family).tokenizer
    vision = preset_config(spec, family, tokenizer=tokenizer).vision_config
    processor = offline_processor(family, tokenizer=tokenizer, vision=vision)
    return build_model(spec, family, seed=seed, dtype=dtype, tokenizer=processor.tokenizer, device=device), processor

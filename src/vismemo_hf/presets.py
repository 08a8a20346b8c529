"""Presets: the YAML files of ``configs/`` (model geometries, policies, stores, VL-Cache profiles, lookup thresholds),
found by name or path and read as plain mappings. ``families.preset_config`` turns a model preset into a config."""

from __future__ import annotations

from pathlib import Path

import yaml


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

"""Presets: YAML files of model geometries, policies, stores, VL-Cache profiles and lookup thresholds, found by
name or path and read as plain mappings. ``families.preset_config`` turns a model preset into a config.

A name is looked up along one search path, first match wins: the working directory's ``configs/KIND/``, then
``$XDG_CONFIG_HOME/vismemo/KIND/`` (``~/.config/vismemo/KIND/`` when the variable is unset), then the presets shipped
with the package. Commands that write presets (``vismemo calibrate``, ``vismemo profile-vlcache``) write to the first
place (``write_path``), so a preset just written is found by its name from the same directory.
"""

from __future__ import annotations

import os
from pathlib import Path

#: the kinds of preset, each a folder of ``configs/``
KINDS = {"models": "model preset", "policies": "policy preset", "store": "store preset",
         "vlcache": "VL-Cache profile", "lookup": "lookup thresholds preset",
         "context": "context tolerance preset"}


def config_dir() -> Path:
    """The presets shipped with the package: ``configs/`` inside an installed wheel, or of a source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "configs", here.parents[1] / "configs"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("vismemo configs/ folder not found next to the package or in the source tree")


def user_dir() -> Path:
    """``$XDG_CONFIG_HOME/vismemo`` (``~/.config/vismemo`` when unset): a user's presets, found from any directory."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "vismemo"


def search_path() -> list[Path]:
    """The folders holding ``KIND/NAME.yaml`` presets, first match wins (duplicates, as in a source checkout whose
    ``configs/`` is the package's, appear once)."""
    places, seen = [], set()
    for place in (Path.cwd() / "configs", user_dir(), config_dir()):
        key = place.resolve() if place.exists() else place
        if key not in seen:
            seen.add(key)
            places.append(place)
    return places


def write_path(kind: str, name: str) -> Path:
    """Where a command writes preset ``name`` of ``kind``: the first place of the search path (``./configs/KIND/``)."""
    return Path("configs") / kind / f"{name}.yaml"


def listing(kind: str) -> list[tuple[str, Path, list[Path]]]:
    """(name, the file a lookup of ``name`` reads, the files of the same name it shadows) of every preset of ``kind``
    on the search path, sorted by name."""
    found: dict[str, list[Path]] = {}
    for place in search_path():
        for path in sorted((place / kind).glob("*.yaml")) if (place / kind).is_dir() else []:
            found.setdefault(path.stem, []).append(path)
    return [(name, paths[0], paths[1:]) for name, paths in sorted(found.items())]


def available(kind: str) -> list[str]:
    """Names of the presets of ``kind`` on the search path."""
    return [name for name, _, _ in listing(kind)]


def find(kind: str, name: str, missing_ok: bool = False) -> Path | None:
    """The YAML file of preset ``name`` of ``kind`` (``models``, ``policies``, ``store``, ``vlcache``, ``lookup``): a path
    to a .yaml / .yml file, or the stem of a file in ``KIND/`` of the search path. An unknown name is a ValueError
    that lists the available ones and the places searched (or None with ``missing_ok``)."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml"):
        if path.is_file():
            return path
        if missing_ok:
            return None
        raise ValueError(f"{KINDS[kind]} file {path} not found")
    for place in search_path():
        candidate = place / kind / f"{name}.yaml"
        if candidate.is_file():
            return candidate
    if missing_ok:
        return None
    raise ValueError(f"unknown {KINDS[kind]} {name!r} (searched {', '.join(str(p / kind) for p in search_path())}); "
                     f"available: {', '.join(available(kind)) or 'none'}")


def read(path: Path, what: str) -> dict:
    """The mapping in YAML file ``path``; a file that is not YAML, or holds something else than a mapping, is a
    one-line ValueError naming the file, the line and what is wrong (``what``: the kind of file, for the message)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{what} {path} is not valid YAML ({problem} at{where or ' an unknown place'})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path} is not a text file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path} must hold a mapping of options, got {type(data).__name__}")
    return data


def load(kind: str, name: str, missing_ok: bool = False) -> dict | None:
    """The mapping in preset ``name`` of ``kind`` (see ``find`` and ``read``)."""
    path = find(kind, name, missing_ok)
    if path is None:
        return None
    return read(path, KINDS[kind])


def load_preset(name: str) -> dict:
    data = load("models", name)
    assert data is not None
    return data

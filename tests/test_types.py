"""Types: the wheel ships ``py.typed``, every public name is annotated, the whole package type-checks and the public
API type-checks as README.md uses it (mypy on ``src/vismemo_hf`` and ``tests/typecheck/public_api.py``, configured in
pyproject.toml ``[tool.mypy]``)."""

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import vismemo_hf

ROOT = Path(__file__).resolve().parents[1]
#: the dunders a user calls (the rest are Python's or a dataclass's)
USER_DUNDERS = {"__init__", "__call__", "__contains__", "__len__", "__iter__", "__getitem__", "__enter__", "__exit__"}


def unannotated(function, where: str) -> list[str]:
    """``where(parameter)`` for each parameter of ``function`` without an annotation (``self`` / ``cls`` aside), and
    ``where -> ?`` when its return has none."""
    signature = inspect.signature(function)
    missing = [f"{where}({p.name})" for i, p in enumerate(signature.parameters.values())
               if p.annotation is p.empty and not (i == 0 and p.name in ("self", "cls"))]
    return missing + ([f"{where} -> ?"] if signature.return_annotation is signature.empty else [])


def public_members(cls: type):
    """(name, function) of every public method, property, static and class method ``cls`` defines or inherits from
    a vismemo_hf class (what it inherits from transformers is transformers' to annotate)."""
    seen = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("vismemo_hf"):
            continue
        for name, attr in vars(klass).items():
            if name in seen or (name.startswith("_") and name not in USER_DUNDERS):
                continue
            seen.add(name)
            if isinstance(attr, property):
                yield name, attr.fget
            elif isinstance(attr, (staticmethod, classmethod)):
                yield name, attr.__func__
            elif inspect.isfunction(attr):
                yield name, attr


def missing_annotations(names) -> list[str]:
    missing = []
    for name in names:
        obj = getattr(vismemo_hf, name)
        if inspect.isclass(obj):
            for member, function in public_members(obj):
                missing += unannotated(function, f"{name}.{member}")
        else:
            missing += unannotated(obj, name)
    return missing


def mypy(*files: Path) -> subprocess.CompletedProcess:
    """mypy with the project's configuration (its cache in .mypy_cache): on ``files``, else on what it names."""
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                           *map(str, files)], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_the_wheel_ships_py_typed():
    tomllib = pytest.importorskip("tomllib")
    assert (ROOT / "src" / "vismemo_hf" / "py.typed").is_file()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["vismemo_hf"]


def test_every_public_name_is_annotated():
    assert missing_annotations(vismemo_hf.__all__) == []


def test_the_annotation_check_finds_a_missing_annotation(monkeypatch):
    def enable(model, *, image_mean: tuple | None = None) -> object:  # `model` deliberately unannotated
        return model

    monkeypatch.setattr(vismemo_hf, "enable", enable)
    assert missing_annotations(["enable"]) == ["enable(model)"]


def test_the_package_and_the_public_api_type_check():
    """The whole package type-checks (0 errors), and README.md's use of the public API with no expression of a type
    that is or contains Any."""
    result = mypy()
    assert result.returncode == 0, result.stdout + result.stderr
    checked = len(list((ROOT / "src" / "vismemo_hf").rglob("*.py"))) + 1
    assert f"Success: no issues found in {checked} source files" in result.stdout


def test_the_type_check_fails_on_an_unannotated_public_function(tmp_path):
    """The same check, on a copy of ``enable`` with ``image_mean`` unannotated: mypy fails, naming the parameter."""
    (tmp_path / "unannotated_api.py").write_text(textwrap.dedent("""\
        from collections.abc import Sequence
        from typing import TypeVar

        ModelT = TypeVar("ModelT")


        def enable(model: ModelT, *, image_mean=None, image_std: Sequence[float] | None = None) -> ModelT:
            return model
    """))
    (tmp_path / "public_api.py").write_text(textwrap.dedent("""\
        from unannotated_api import enable

        SIGNATURES: list[object] = [enable]
    """))
    result = mypy(tmp_path / "public_api.py")
    assert result.returncode == 1, result.stdout + result.stderr
    assert 'public_api.py:3: error: Expression type contains "Any"' in result.stdout
    assert "image_mean: Any" in result.stdout

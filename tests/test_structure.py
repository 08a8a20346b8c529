"""The layout the README promises, checked in every test run: no function over 80 lines, no class over 350, no two
subpackages importing each other (``tests/structure.py`` prints the same for a reader)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("structure", Path(__file__).with_name("structure.py"))
structure = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(structure)


def test_no_long_function_or_class():
    functions, classes = structure.sizes()
    assert not functions and not classes, functions + classes


def test_subpackages_import_one_way():
    _, mutual = structure.imports()
    assert not mutual


def test_every_subpackage_ships_in_the_wheel():
    """Each folder of the package with an ``__init__.py`` is listed in pyproject.toml's packages (setuptools leaves
    an unlisted one out of the wheel, and an installed library then fails at its first import)."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root / "src").parts) for p in (root / "src").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)

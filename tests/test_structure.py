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

"""Sizes and imports of the package: functions over 80 lines, classes over 350, subpackages importing each other."""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "vismemo_hf"


def sizes():
    long_functions, long_classes = [], []
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            n = node.end_lineno - node.lineno + 1
            where = f"{path.relative_to(ROOT)}:{node.lineno} {getattr(node, 'name', '')} ({n} lines)"
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and n > 80:
                long_functions.append(where)
            elif isinstance(node, ast.ClassDef) and n > 350:
                long_classes.append(where)
    return long_functions, long_classes


def package_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imports():
    edges = set()
    for path in ROOT.rglob("*.py"):
        src = package_of(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vismemo_hf."):
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("vismemo_hf.")]
            for name in names:
                dst = name.split(".")[1]
                if dst != src:
                    edges.add((src, dst))
    return sorted(edges), sorted((a, b) for a, b in edges if (b, a) in edges and a < b)


if __name__ == "__main__":
    f, c = sizes()
    edges, mutual = imports()
    print("functions > 80:", *f, sep="\n  ")
    print("classes > 350:", *c, sep="\n  ")
    print("mutual imports:", mutual)
    sys.exit(1 if f or c or mutual else 0)

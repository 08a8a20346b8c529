"""Run transformers' own model tests of the supported families with VisMemo in the loop, and report.

    python tests/compat/run.py TESTS_DIR [--mode enable|cache|plain] [--family qwen2_vl ...] [--json OUT]

``TESTS_DIR`` is a transformers test tree (``tests/models/<family>/``, ``tests/*.py``, a ``conftest.py`` that
loads ``PYTEST_EXTRA_PLUGIN``), copied to a scratch folder first (it may be read-only). ``plain`` runs without the
plugin. Exit status 1 when a test fails that ``ALLOWED`` does not list.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import transformers

from vismemo_hf.defaults import FAMILY_NAMES as FAMILIES

HERE = Path(__file__).resolve().parent

#: tests that may fail with VisMemo enabled, and why (none at present)
ALLOWED: dict[str, str] = {}


def run_family(tree: Path, family: str, mode: str, timeout: int) -> dict:
    report = tree / f"report-{family}.xml"
    path = [str(tree), str(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "VISMEMO_STORE": "memory"}
    if mode != "plain":
        env["PYTEST_EXTRA_PLUGIN"], env["VISMEMO_COMPAT_MODE"] = "vismemo_compat", mode
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--timeout={timeout}",
           f"--junitxml={report}", f"tests/models/{family}/test_modeling_{family}.py"]
    run = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failed = []
    reasons = {}
    if not report.is_file():  # pytest could not even collect: every test of the family counts as failed
        return {**counts, "failed": 1, "failures": [f"<collection: exit {run.returncode}> {run.stdout[-300:]}"]}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name")
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            counts["failed"] += 1
            failed.append(name)
            if not case.get("classname"):  # the module itself did not import: say why (a version drift, say)
                lines = [ln for ln in (bad.text or bad.get("message") or "").splitlines() if ln.strip()]
                reasons[name] = lines[-1].strip() if lines else "collection error"

        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": sorted(failed), "reasons": reasons}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", type=Path, help="transformers test tree (e.g. ../shared/compat/transformers-tests)")
    parser.add_argument("--mode", choices=["enable", "cache", "plain"], default="enable")
    parser.add_argument("--family", action="append", choices=FAMILIES, help="default: every supported family")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    if not (args.tests / "tests" / "models").is_dir():
        print(f"error: {args.tests} is not a transformers test tree (no tests/models/)", file=sys.stderr)
        return 2
    results = {}
    with tempfile.TemporaryDirectory(prefix="vismemo-compat-") as scratch:
        tree = Path(scratch) / "tree"
        shutil.copytree(args.tests, tree, symlinks=True)
        for path in tree.rglob("*"):
            path.chmod(path.stat().st_mode | 0o200)
        (tree / "src").mkdir(exist_ok=True)
        link = tree / "src" / "transformers"
        if not link.exists():
            link.symlink_to(Path(transformers.__file__).parent)
        for family in args.family or FAMILIES:
            results[family] = run_family(tree, family, args.mode, args.timeout)
            r = results[family]
            unexpected = [f for f in r["failures"] if f not in ALLOWED]
            print(f"{family:13s} {args.mode:6s} passed {r['passed']:4d} failed {r['failed']:3d} "
                  f"skipped {r['skipped']:4d}", flush=True)
            for name in r["failures"]:
                print(f"    {'allowed' if name in ALLOWED else 'FAILED '} {name}" +
                      (f" ({ALLOWED[name]})" if name in ALLOWED else "") +
                      (f": {r['reasons'][name]}" if name in r.get("reasons", {}) else ""), flush=True)
            r["unexpected"] = unexpected
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"mode": args.mode, "transformers": transformers.__version__,
                                         "families": results}, indent=2))
    return 1 if any(r["unexpected"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

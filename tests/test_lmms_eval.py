"""An offline lmms-eval run of the vismemo backend on a small slice, results JSON checked."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_lmms_eval_offline_run_on_a_slice(tmp_path):
    pytest.importorskip("lmms_eval")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    vismemo = [sys.executable, "-m", "vismemo_hf.cli"]
    subprocess.run(vismemo + ["build-stream", "synthdoc", "--bases", "3"], cwd=tmp_path, env=env, check=True)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "lmms_eval", "--model", "vismemo",
           "--model_args", "pretrained=vismemo-docqa-tiny,policy=vismemo,max_new_tokens=6",
           "--tasks", "vismemo_synthdoc", "--include_path", str(REPO / "eval_tasks"), "--limit", "10",
           "--batch_size", "1", "--output_path", str(out)]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    files = list(out.rglob("*_results.json"))
    assert files, f"lmms-eval wrote no results (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    results = json.loads(files[0].read_text())["results"]["vismemo_synthdoc"]
    assert 0.0 <= results["anls,none"] <= 1.0
    # the slice holds new pages and follow-ups: answers were scored per hit kind that actually happened
    def measured(value):
        return isinstance(value, (int, float)) and value == value  # a kind with no answers aggregates to NaN

    kinds = [k for k in ("exact", "approximate", "miss") if measured(results.get(f"anls_{k},none"))]
    assert "miss" in kinds and len(kinds) >= 2, results

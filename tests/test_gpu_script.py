"""The GPU command (issue S): ``benchmarks/h200_latency.sh`` runs its five steps and writes every report. A lent GPU
is rare and its time short, so the same steps run here on the CPU with the tiny preset: a flag the CLI no longer
takes, or a step that fails, is found before a GPU's minutes are spent on it."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_command_runs_every_step_and_writes_its_reports(tmp_path):
    env = {**os.environ, "PRESET": "tiny", "DTYPE": "float32", "DEVICE": "cpu", "LENGTHS": "64", "DISK_LENGTH": "64",
           "LAYERS": "2,4", "WORKLOAD_MODEL": "tiny:qwen2_vl", "WORKLOAD_STREAMS": "chat", "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "h200_latency.sh"), str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode == 0 and "stopped" not in output, output[-3000:]
    assert "no GPU" in output.splitlines()[0]
    for report in ("latency.md", "store-on-gpu/latency.md", "store-on-disk/latency.md"):
        text = (tmp_path / report).read_text()
        assert "| 64 | plain |" in text and "| 64 | exact |" in text, report
        assert "| 64 | approximate | attend-deviate |" in text, report
    assert "| tiny:qwen2_vl | chat |" in (tmp_path / "workload" / "workload.md").read_text()
    overhead = (tmp_path / "overhead" / "overhead.md").read_text()
    assert "| exact |" in overhead and "syncs at 2 layers" in overhead and "syncs at 4 layers" in overhead

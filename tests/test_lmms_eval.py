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
    tasks = subprocess.run(vismemo + ["tasks-path"], cwd=tmp_path, env=env, check=True, capture_output=True,
                           text=True).stdout.strip()  # found without a clone: the tasks ship with the package
    cmd = [sys.executable, "-m", "lmms_eval", "--model", "vismemo",
           "--model_args", "pretrained=vismemo-docqa-tiny,max_new_tokens=6",
           "--tasks", "vismemo_synthdoc", "--include_path", tasks, "--limit", "10",
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
    counts = {k: results[f"answers_{k},none"] for k in ("exact", "approximate", "miss")}  # realized, not intended
    assert sum(counts.values()) == 10 and all((counts[k] > 0) == (k in kinds) for k in counts), counts


def _schema_parquets(tmp_path):
    """Two parquet files in the published column schemas (DocVQA, InfographicVQA) of synthetic pages the reader
    reads: two pages of one document (the second an edited copy, a natural near-duplicate) and a third page;
    other pages for each task, since one run shares one store."""
    import random

    import datasets

    from vismemo_hf.eval import synthdoc

    def pages(seed):
        base = synthdoc.random_form(seed)
        return [base, synthdoc.edit_value(base, 1, random.Random(seed)), synthdoc.random_form(seed + 1, style="table")]

    docvqa, infovqa = [], []
    for rows, seed in ((docvqa, 64_000), (infovqa, 65_000)):
        for p, page in enumerate(pages(seed)):
            image = synthdoc.render(page)
            for q, (key, value) in enumerate(page.rows[:2]):
                common = dict(questionId=str(100 * p + q), question=synthdoc.question_for(key), answers=[value],
                              image=image, data_split="validation")
                if rows is docvqa:
                    rows.append(dict(common, question_types=["form"], docId=p, ucsf_document_page_no=str(p + 1),
                                     ucsf_document_id="doc0" if p < 2 else "doc1"))
                else:
                    rows.append(dict(common, answer_type=["single span"], operation_reasoning=[], ocr="",
                                     image_url=f"https://example.invalid/{p}.png"))
    paths = {}
    for name, rows in (("docvqa", docvqa), ("infovqa", infovqa)):
        paths[name] = tmp_path / "src" / f"{name}-validation.parquet"
        paths[name].parent.mkdir(exist_ok=True)
        datasets.Dataset.from_list(rows).cast_column("image", datasets.Image()).to_parquet(str(paths[name]))
    return paths


def test_real_page_streams_from_published_schemas_run_end_to_end(tmp_path):
    """build-stream docvqa / infovqa on parquet in the published schemas gives every page approximate follow-ups
    (and finds the natural near-duplicate with the lookup's descriptors); lmms-eval scores them by hit kind."""
    pytest.importorskip("lmms_eval")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    paths = _schema_parquets(tmp_path)
    vismemo = [sys.executable, "-m", "vismemo_hf.cli"]
    for task, path in paths.items():
        built = subprocess.run(vismemo + ["build-stream", task, "--source", str(path), "--near-model",
                                          "vismemo-docqa-tiny"], cwd=tmp_path, env=env, check=True,
                               capture_output=True, text=True).stdout
        assert "intended hit kinds: miss 2, exact 3, approximate 10" in built, built
        assert "natural 1" in built, built
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "lmms_eval", "--model", "vismemo",
           "--model_args", "pretrained=vismemo-docqa-tiny,max_new_tokens=6",
           "--tasks", "vismemo_docvqa,vismemo_infovqa", "--include_path", str(REPO / "eval_tasks"),
           "--batch_size", "1", "--output_path", str(out)]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    files = list(out.rglob("*_results.json"))
    assert files, f"lmms-eval wrote no results (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    results = json.loads(files[0].read_text())["results"]
    for task in ("vismemo_docvqa", "vismemo_infovqa"):
        r = results[task]
        assert r["anls,none"] >= 0.9 and r["anls_approximate,none"] >= 0.9 and r["anls_exact,none"] >= 0.9, r
        # misses include the perturbed copies the lookup declined: the reader's own full-prefill accuracy on them
        assert r["anls_miss,none"] >= 0.75, r


def test_backend_model_args_reach_the_store_and_the_cache():
    pytest.importorskip("lmms_eval")
    from vismemo_hf.eval.lmms import VisMemoLMM

    lmm = VisMemoLMM(pretrained="vismemo-docqa-tiny", kv_format="int8", keep_ratio="0.5",
                     thresholds="vismemo-docqa-tiny", missing="recompute", namespace="2024")
    assert (lmm.store.kv_format, lmm.store.keep_ratio, lmm.store.namespace) == ("int8", 0.5, "2024")
    assert lmm.options == {"thresholds": "vismemo-docqa-tiny", "missing": "recompute"}

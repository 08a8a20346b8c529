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
    other pages for each task."""
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
    store = lmm.store_for("vismemo_synthdoc")  # the task's own store, under a namespace of the task's own
    assert (store.kv_format, store.keep_ratio, store.namespace) == ("int8", 0.5, "2024/vismemo_synthdoc")
    # every request looks for approximate hits (what a quality figure measures) unless model_args say otherwise
    assert lmm.options == {"approximate": "always", "thresholds": "vismemo-docqa-tiny", "missing": "recompute"}
    run = VisMemoLMM(pretrained="vismemo-docqa-tiny", namespace="2024", store_scope="run").store_for("a")
    assert run.namespace == "2024" and run is not store
    with pytest.raises(ValueError, match="store_scope"):
        VisMemoLMM(pretrained="vismemo-docqa-tiny", store_scope="tasks")
    # thresholds of another model, or a policy option that does not exist, fail when the backend starts
    with pytest.raises(ValueError, match="calibrated for model"):
        VisMemoLMM(pretrained="vismemo-docqa-tiny", thresholds="vismemo-docqa-base")
    with pytest.raises(TypeError):
        VisMemoLMM(pretrained="vismemo-docqa-tiny", no_such_option="1")


def _two_task_requests(lmm):
    """The same two-request stream (a page, then another question on it) as tasks ``a`` and ``b``, the requests of
    both interleaved as lmms-eval hands them over (by doc id)."""
    from lmms_eval.api.instance import Instance

    from vismemo_hf.eval import synthdoc
    from vismemo_hf.eval.lmms_tasks import doc_to_text, doc_to_visual

    page = synthdoc.random_form(71_000)
    image = synthdoc.render(page)
    docs = [dict(id=f"r{q}", question=synthdoc.question_for(key), answers=[value], prefix="", image=image)
            for q, (key, value) in enumerate(page.rows[:2])]
    lmm.task_dict = {task: {"test": docs} for task in ("a", "b")}
    requests = []
    for doc_id in range(len(docs)):
        for task in ("a", "b"):
            requests.append(Instance(request_type="generate_until", idx=0,
                                     arguments=(doc_to_text(docs[doc_id]), {"max_new_tokens": 4}, doc_to_visual,
                                                doc_id, task, "test"),
                                     metadata={"task": task, "doc_id": doc_id, "repeats": 1}))
    return docs, requests


@pytest.mark.parametrize("scope", ["task", "run"])
def test_each_task_has_its_own_store_unless_the_run_shares_one(scope):
    """Default scope: the second task's first request is a miss, as if it ran alone; store_scope=run: the second
    task runs after the first, on its store, so the same page is an exact hit there."""
    pytest.importorskip("lmms_eval")
    from vismemo_hf.eval.lmms import ANSWERS, VisMemoLMM
    from vismemo_hf.eval.lmms_tasks import answer_of, process_results

    lmm = VisMemoLMM(pretrained="vismemo-docqa-tiny", max_new_tokens=4,
                     **({} if scope == "task" else {"store_scope": scope}))
    docs, requests = _two_task_requests(lmm)
    ANSWERS.clear()
    lmm.generate_until(requests)
    kinds = {task: [answer_of(doc, task).kind for doc in docs] for task in ("a", "b")}
    assert kinds == {"a": ["miss", "exact"], "b": ["miss" if scope == "task" else "exact", "exact"]}, kinds
    assert len(lmm.stores) == (2 if scope == "task" else 1)
    # scored outside lmms-eval's task context, an id two tasks answered is not guessed
    assert process_results(docs[0], ["0000"])["answers_miss"] == 0


def _counts(results):
    return {k: results[f"answers_{k},none"] for k in ("miss", "exact", "approximate", "fallback")}


def test_two_tasks_in_one_run_report_their_own_hit_kind_counts(tmp_path):
    """One lmms-eval run of two tasks on the same stream: each task's results record the hit-kind counts it would
    have alone (its first request a miss, not an exact hit on the other task's page), and fallbacks."""
    pytest.importorskip("lmms_eval")
    import shutil

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    vismemo = [sys.executable, "-m", "vismemo_hf.cli"]
    subprocess.run(vismemo + ["build-stream", "synthdoc", "--bases", "2", "--out",
                              ".cache/vismemo-data/docvqa/test.parquet"], cwd=tmp_path, env=env, check=True)
    (tmp_path / ".cache/vismemo-data/infovqa").mkdir()
    shutil.copy(tmp_path / ".cache/vismemo-data/docvqa/test.parquet", tmp_path / ".cache/vismemo-data/infovqa")
    tasks = subprocess.run(vismemo + ["tasks-path"], cwd=tmp_path, env=env, check=True, capture_output=True,
                           text=True).stdout.strip()
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "lmms_eval", "--model", "vismemo",
           "--model_args", "pretrained=vismemo-docqa-tiny,max_new_tokens=6",
           "--tasks", "vismemo_docvqa,vismemo_infovqa", "--include_path", tasks, "--limit", "6",
           "--batch_size", "1", "--output_path", str(out), "--log_samples"]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    files = list(out.rglob("*_results.json"))
    assert files, f"lmms-eval wrote no results (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    results = json.loads(files[0].read_text())["results"]
    docvqa, infovqa = _counts(results["vismemo_docvqa"]), _counts(results["vismemo_infovqa"])
    assert docvqa == infovqa, (docvqa, infovqa)  # the same stream gives the same realised kinds, run together
    assert sum(docvqa[k] for k in ("miss", "exact", "approximate")) == 6 and docvqa["miss"] >= 1, docvqa
    assert 0 <= docvqa["fallback"] <= 6
    for task in ("vismemo_docvqa", "vismemo_infovqa"):  # the first request of each task: a miss
        samples = [json.loads(line) for f in out.rglob(f"*samples_{task}.jsonl") for line in f.read_text().splitlines()]
        first = min(samples, key=lambda s: s["doc_id"])
        assert first["answers_miss"] == 1 and first["answers_exact"] == 0, first

"""The packaged reading model: loads offline, reads held-out pages of every type, and exposes stale reuse."""


import pytest

from vismemo_hf.eval import docqa, synthdoc
from vismemo_hf.eval.quality import evaluate, summarise

from conftest import docqa_reader

pytestmark = pytest.mark.skipif(not (docqa.PACKAGED / "config.json").is_file(), reason="no packaged checkpoint")


def test_packaged_checkpoint_is_small_and_loads_by_name():
    size = sum(f.stat().st_size for f in docqa.PACKAGED.iterdir())
    assert size < 20 * 2**20
    from vismemo_hf.eval.loading import load_model

    model, processor = load_model(docqa.MODEL_NAME)
    assert model.config.model_type == "qwen2_vl" and processor.tokenizer.eos_token == "<|im_end|>"


def test_full_prefill_reads_held_out_pages_of_every_type():
    """Issue D's bar: full-prefill ANLS >= 0.9 on held-out pages of every page type it was trained on."""
    from vismemo_hf.eval.quality import reading_by_type

    model, processor = docqa_reader()
    reading = reading_by_type(model, processor, per_type=12)
    assert set(reading) == set(synthdoc.STYLES) | {"all"}
    for style, r in reading.items():
        assert r["n"] > 0 and r["anls"] >= 0.9, (style, r)


def test_naive_reuse_answers_stale_values_that_full_prefill_gets_right():
    model, processor = docqa_reader()
    requests = synthdoc.stream(77, n_bases=12)
    ref = evaluate(model, processor, requests, policy="full", max_new_tokens=6)
    naive = evaluate(model, processor, requests, policy="naive", max_new_tokens=6)
    full_s, naive_s = summarise(ref), summarise(naive, ref)
    assert full_s["anls_edited_value"] >= 0.9 and naive_s["anls_edited_value"] <= 0.5
    assert naive_s["stale_rate"] >= 0.5  # naive reuse answers the value from before the edit
    edited = [i for i, r in enumerate(requests) if r.about_edit]
    right = lambda scored: sum(scored[i].prediction == requests[i].answers[0] for i in edited)  # noqa: E731
    assert right(naive) <= right(ref)


def test_quality_report_writes_table_and_sweeps(tmp_path):
    from vismemo_hf.cli import main

    args = ["report", "quality", "--streams", "1", "--bases", "2", "--policies", "full,naive,vismemo",
            "--sweep-rho", "0.3,1.0", "--sweep-beta", "0.1", "--heldout", "2", "--heldout-bases", "1",
            "--out", str(tmp_path)]
    assert main(args) == 0
    table = (tmp_path / "table1.md").read_text()
    assert "| naive |" in table and "| vismemo |" in table and "Command: `vismemo report quality" in table
    assert (tmp_path / "sweep_recompute_ratio.png").stat().st_size > 1000
    import json

    data = json.loads((tmp_path / "quality.json").read_text())
    assert data["policies"]["full"]["first_token_agreement"] == 1.0
    assert set(data["reader"]) == set(synthdoc.STYLES) | {"all"} and data["reader"]["all"]["n"] == 2 * len(synthdoc.STYLES)
    assert "## The reader: full prefill on held-out pages" in table and "ANLS by variant" in table
    assert "## Held-out streams" in table and set(data["heldout"]) == {"stream", "perturbations"}
    assert (tmp_path / "sweep_attend-deviate_recompute_ratio.png").stat().st_size > 1000
    assert data["policies"]["vismemo"]["n_approximate"] > 0
    cells = data["policies"]["vismemo"]["answer_cells"]
    assert set(cells) == {"R", "B", "M"} and abs(sum(cells.values()) - 1.0) < 1e-9


def test_quality_report_takes_seeds_the_default_policy_and_no_sweeps(tmp_path):
    import json

    from vismemo_hf.cli import main
    from vismemo_hf.runtime.cache import DEFAULT_POLICY

    args = ["report", "quality", "--seeds", "7123,7124", "--bases", "1", "--policies", "full,default", "--no-sweeps",
            "--heldout", "0", "--heldout-bases", "0", "--out", str(tmp_path)]
    assert main(args) == 0
    data = json.loads((tmp_path / "quality.json").read_text())
    assert data["seeds"] == [7123, 7124] and set(data["policies"]) == {"full", DEFAULT_POLICY}
    assert all(not sweep for sweep in data["sweeps"].values()) and not list(tmp_path.glob("sweep_*.png"))
    assert data["visual_tokens"] == data["policies"]["full"]["visual_tokens"] > 0
    assert "--seeds 7123,7124" in data["command"] and "--no-sweeps" in data["command"]
    assert main(args[:2] + ["--seeds", "a,b", "--out", str(tmp_path)]) == 2
    calibrated = tmp_path / "calibrated"
    assert main(args[:-1] + [str(calibrated), "--thresholds", "vismemo-docqa-tiny"]) == 0  # every cache takes it
    data = json.loads((calibrated / "quality.json").read_text())
    assert data["thresholds"] == "vismemo-docqa-tiny" and data["command"].endswith("--thresholds vismemo-docqa-tiny")
    assert "calibrated preset `vismemo-docqa-tiny`" in (calibrated / "table1.md").read_text()
    assert main(args[:-1] + [str(calibrated), "--thresholds", "no-such-preset"]) == 2  # reaches the caches


def test_demo_hit_kinds_with_the_reading_model(capsys):
    import json

    from vismemo_hf.cli import main

    assert main(["demo", "--json", "--new-tokens", "4"]) == 0
    kinds = [r["kind"] for r in json.loads(capsys.readouterr().out)["requests"]]
    assert kinds == ["miss", "exact", "approximate", "approximate", "miss"]


def test_answer_cell_routing_counts_the_asked_cells():
    import torch

    from vismemo_hf.core.plan import HitKind, ImagePlan
    from vismemo_hf.eval.quality import answer_cell_routing

    page = synthdoc.random_form(3)
    key = page.rows[2][0]
    request = synthdoc.Request("r", page, synthdoc.question_for(key), [page.answer(key)], "approximate", "shift")
    cells = [2 * synthdoc.COLS + synthdoc.VALUE_COL + j for j in range(4)]  # row 2's value
    others = [i for i in range(48) if i not in cells]
    plan = ImagePlan(HitKind.APPROXIMATE, 48, 3, torch.tensor(cells[:3]), torch.tensor([cells[3]] + others[:5]),
                     torch.tensor(others[5:]), "alias")
    assert answer_cell_routing(request, plan) == {"R": 3, "B": 1, "M": 0}


def test_pareto_report_sweeps_policies_and_marks_the_front(tmp_path):
    import json

    from vismemo_hf.cli import main

    args = ["report", "pareto", "--seeds", "7200", "--bases", "2", "--policies", "full,naive,cacheblend",
            "--floor-preset", "tiny", "--floor-tokens", "64", "--out", str(tmp_path)]
    assert main(args) == 0
    data = json.loads((tmp_path / "pareto.json").read_text())
    points = data["readers"]["vismemo-docqa-tiny"]["points"]
    assert [p["label"] for p in points][:3] == ["full", "naive", "cacheblend recompute=0.05"]
    assert len(points) == 2 + 5 and any(p["front"] for p in points)
    naive = points[1]
    assert naive["anls_edited_value"] < 0.5 and naive["stale_rate"] > 0  # naive reuse answers the old value
    assert all(p["floor_ratio"] is None or 0 < p["floor_ratio"] <= 1.0 for p in points)
    assert points[0]["floor_ratio"] == 1.0 and points[1]["floor_ratio"] < points[-1]["floor_ratio"]
    assert (tmp_path / "pareto.png").stat().st_size > 1000 and "| naive |" in (tmp_path / "pareto.md").read_text()


def test_docpage_streams_hold_every_near_duplicate_kind_and_run_through_the_evaluation():
    import vismemo_hf
    from vismemo_hf.eval import docpage, docqa_base, docstream

    rows = docstream.stream(11, n_bases=10)
    by_id = {r.id: r for r in rows}
    assert len(rows) == 50 and {r.variant for r in rows} >= set(docstream.KINDS)
    assert rows[0].intended == "miss" and {r.intended for r in rows} == {"miss", "exact", "approximate"}
    for r in rows:
        base = by_id[r.id.split("v")[0]]
        assert r.answers == [r.asked.answer] and r.prefix == r.asked.instruction
        if r.variant in ("same", "instruction"):
            assert r.page == base.page and r.intended == "exact"
        if r.variant == "instruction":
            assert r.prefix and r.prefix != base.prefix
        if r.variant.startswith("edit"):
            assert r.stale is not None and r.stale != r.answers[0] and r.about_edit
        assert docpage.render(r.page).size == (docpage.SIZE, docpage.SIZE) and r.answer_tokens()
    processor = docqa_base.new_processor()
    model = docqa_base.new_model(processor.tokenizer).eval()
    vismemo_hf.enable(model)
    scored = evaluate(model, processor, rows[:6], "full", max_new_tokens=2)
    assert [s.kind for s in scored][0] == "miss" and all(s.visual_tokens == 256 for s in scored)


def test_the_joint_choice_is_the_cheapest_point_acceptable_on_every_reader():
    from vismemo_hf.bench.pareto import choice, joint_choice

    def point(label, anls, stale, floor, plain):
        return {"label": label, "policy": label.split()[0], "options": {}, "anls_approximate": anls,
                "plain_anls_on_hits": plain, "stale_rate": stale, "floor_ratio": floor}

    a = {"points": [point("full", 1.0, 0.0, 1.0, 1.0), point("cheap", 1.0, 0.0, 0.1, 1.0),
                    point("mid", 0.995, 0.0, 0.3, 1.0), point("stale", 1.0, 0.25, 0.05, 1.0)]}
    b = {"points": [point("full", 0.9, 0.0, 1.0, 0.9), point("cheap", 0.85, 0.0, 0.1, 0.9),
                    point("mid", 0.9, 0.0, 0.35, 0.9), point("stale", 0.9, 0.0, 0.05, 0.9)]}
    assert choice(a, "floor_ratio")["label"] == "cheap" and choice(b, "floor_ratio")["label"] == "stale"
    pick = joint_choice({"a": a, "b": b}, "floor_ratio")
    assert pick["label"] == "mid" and pick["floor_ratio"] == 0.35  # the dearer of its two readers' costs


def test_calibration_pairs_on_docpage_pages_hold_every_near_duplicate_kind_of_its_streams(tmp_path):
    import json

    from vismemo_hf.cli import main
    from vismemo_hf.eval.calibrate import docpage_pairs

    pairs = docpage_pairs(3, 2)
    kinds = {what for _, _, near, what in pairs if near}
    assert kinds == {f"docpage {k}" for k in ("edit cell", "edit cells", "scroll", "crop", "popup", "widget",
                                              "rescan", "shift", "invert", "recolour", "insert row")}
    assert all(a.size == b.size for a, b, _, _ in pairs) and sum(not near for *_, near, _ in pairs) == 2
    assert all(a.tobytes() != b.tobytes() for a, b, _, _ in pairs)
    out = tmp_path / "preset.yaml"
    assert main(["calibrate", "--model", "tiny", "--family", "qwen2_5_vl", "--pages", "docpage", "--pairs-per-kind",
                 "1", "--out", str(out), "--report-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "tiny-qwen2_5_vl.json").read_text())
    assert "docpage" in report["heldout"]["by_source"] and "--pages docpage" in report["command"]
    assert "docpage scroll" in report["heldout"]["recall_by_kind"] and out.is_file()


def test_the_prefix_report_measures_docpage_pages_and_their_questions():
    import vismemo_hf
    from vismemo_hf.bench.prefix import docpage_question, measure, random_text
    from vismemo_hf.eval import docpage, docqa_base

    processor = docqa_base.new_processor()
    model = docqa_base.new_model(processor.tokenizer).eval()
    vismemo_hf.enable(model)
    pages = [docpage.random_page(5, layout="table"), docpage.random_page(6, layout="form")]
    assert docpage_question(pages[0], 0).endswith("?") and " " in docpage_question(pages[0], 0)  # a cell
    assert docpage_question(pages[1], 0).startswith("=")  # one column: value -> key
    out = measure(model, processor, pages, [0, 12], lambda n, i: (random_text(8, i), random_text(n, 9 + i)),
                  docpage_question)
    for routing in ("reuse", "check"):
        assert set(out[routing]) == {0, 12} and all(r["pages"] == 2 for r in out[routing].values())
    assert out["check"][12]["recomputed"] > 0  # the changed text is checked, not reused blindly

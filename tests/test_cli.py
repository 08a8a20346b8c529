"""The command line: the demo's five requests and the VL-Cache profile command."""

import json

import yaml

import vismemo_hf
from vismemo_hf.cli import main

from conftest import build_inputs, generate, stored


def test_demo_runs_the_five_requests(capsys):
    assert main(["demo", "--json", "--new-tokens", "6"]) == 0  # the packaged reader
    out = json.loads(capsys.readouterr().out)
    assert [r["kind"] for r in out["requests"]] == ["miss", "exact", "approximate", "approximate", "miss"]
    assert all(r["answer"] == r["expected"] for r in out["requests"])
    approx = out["requests"][2]
    assert approx["R"] + approx["B"] + approx["M"] == approx["N"] and approx["alias"] == out["requests"][1]["alias"]
    # every page an approximate hit served becomes an entry of its own (computed in full, or completed off the
    # request's path)
    assert out["store"]["entries"] == 2 + sum(r["kind"] == "approximate" for r in out["requests"])


def test_demo_on_a_random_tower_aliases_the_edit_only(capsys):
    """Centred lookup: on random weights a shifted page moves every token, so only the edited copy is reused."""
    assert main(["demo", "--json", "--new-tokens", "2", "--model", "tiny"]) == 0
    kinds = [r["kind"] for r in json.loads(capsys.readouterr().out)["requests"]]
    assert kinds[:3] == ["miss", "exact", "approximate"] and kinds[4] == "miss"


def test_profile_vlcache_writes_a_profile_the_policy_reads(tmp_path, qwen2, pages):
    path = tmp_path / "profile.yaml"
    assert main(["profile-vlcache", "--model", "tiny", "--pairs", "2", "--out", str(path)]) == 0
    data = yaml.safe_load(path.read_text())
    model, processor = qwen2
    assert data["layers"] == model.config.text_config.num_hidden_layers == len(data["sensitivity"])
    assert all(x >= 0 for x in data["sensitivity"])
    store = stored(model, processor, pages["base"])
    cache = vismemo_hf.VisMemoCache(store=store, policy="vlcache", profile=str(path), recompute_ratio=0.4)
    generate(model, build_inputs(processor, [pages["edit"]]), cache, 1)
    plan = cache.events[0].plan
    counts = [plan.computed_at(layer).numel() for layer in range(data["layers"])]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1] >= 0
    assert abs(sum(counts) / len(counts) / plan.n_tokens - 0.4) < 0.05


def test_committed_tiny_profile_is_found_by_name():
    ratios = vismemo_hf.get_policy("vlcache", profile="tiny-qwen2_vl", recompute_ratio=0.3).ratios()
    assert len(ratios) == 6 and abs(sum(ratios) / 6 - 0.3) < 1e-6


def test_bench_store_runs_small(tmp_path):
    args = ["bench", "store", "--tokens", "16", "--layers", "4", "--kv-heads", "2", "--head-dim", "8",
            "--embed-dim", "16", "--repeats", "1", "--trace-requests", "300", "--capacities", "5,10",
            "--out", str(tmp_path)]
    assert main(args) == 0
    data = json.loads((tmp_path / "store.json").read_text())
    sparse = {r["tier"]: r for r in data["sparse_io"]}
    assert sparse["disk"]["ranges"] == sparse["disk"]["tokens_read"]
    assert sparse["host"]["bytes_read"] == sparse["disk"]["bytes_read"]
    assert abs(sparse["disk"]["read_over_kv"] - sparse["disk"]["floor"]) < 0.1
    assert (tmp_path / "store.md").read_text().startswith("# Store benchmark")


def test_approximate_hits_record_fetch_and_remaining_wait(qwen2, pages, monkeypatch):
    """The prefetch runs while warmup runs: a slow read shows as ``fetch`` and, what warmup did not hide, as
    ``fetch_wait``."""
    import time

    model, processor = qwen2
    store = stored(model, processor, pages["base"])
    read = store.get_tokens
    monkeypatch.setattr(store, "get_tokens", lambda *a, **k: (time.sleep(0.3), read(*a, **k))[1])
    cache = vismemo_hf.VisMemoCache(store=store)
    generate(model, build_inputs(processor, [pages["edit"]]), cache, 1)
    timings = cache.events[0].timings
    assert cache.events[0].reused > 0 and timings["fetch"] >= 300
    assert 0 < timings["fetch_wait"] <= timings["fetch"] + 5 and timings["fetch_wait"] >= 300 - timings["warmup"] - 50


def test_errors_are_one_line_with_exit_status_2(capsys):
    assert main(["demo", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vismemo demo: error:") and "\n" not in err and "no-such-model" in err


def test_version_tasks_path_and_help_on_every_option(capsys):
    import argparse
    from pathlib import Path

    from vismemo_hf.cli import parser

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"vismemo-hf {vismemo_hf.__version__}"
    assert main(["tasks-path"]) == 0
    tasks = Path(capsys.readouterr().out.strip())
    assert {p.name for p in tasks.glob("*/*.yaml")} >= {"vismemo_synthdoc.yaml", "vismemo_docvqa.yaml"}

    def actions(p):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    yield from actions(child)
            elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                yield p.prog, action

    missing = [f"{prog} {a.dest}" for prog, a in actions(parser()) if not a.help]
    assert not missing, missing


def test_every_command_defines_the_arguments_its_code_reads():
    """Each subcommand's parser has every ``args.NAME`` its module's code reads (a shared helper that gives another
    option, ``--model`` for ``--preset`` say, breaks the command at its first use otherwise)."""
    import argparse
    import importlib
    import inspect
    import re

    from vismemo_hf.cli import parser

    def leaves(p, path=()):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    yield from leaves(child, (*path, name))
        if path and not any(isinstance(a, argparse._SubParsersAction) for a in p._actions):
            yield path, p

    checked = 0
    for path, sub in leaves(parser()):
        func = sub.get_default("func")
        closure = dict(zip(func.__code__.co_freevars, (c.cell_contents for c in func.__closure__ or ())))
        if "name" not in closure:  # a command defined in cli.py itself: its options are read there
            continue
        source = inspect.getsource(importlib.import_module(f"vismemo_hf.bench.{closure['name']}"))
        read = set(re.findall(r"\bargs\.([a-z_]+)\b", source))
        dests = {a.dest for a in sub._actions} | set(sub._defaults)
        assert read <= dests, (" ".join(path), sorted(read - dests))
        checked += 1
    assert checked >= 8


def test_every_row_of_table1_names_a_policy_the_report_accepts():
    """``vismemo report quality --policies all`` checks its names before a model loads: every row of Table 1,
    ``NAME@store-options`` ones by their NAME, must pass that check."""
    from vismemo_hf.bench.table1 import HELDOUT_POLICIES, POLICIES
    from vismemo_hf.policies import get_policy

    for name in POLICIES + HELDOUT_POLICIES:
        get_policy(name.partition("@")[0])

"""Benchmarks of per-request ratios to plain transformers in arms (``benchmarks/keys_ahead.py``,
``benchmarks/writer_contention.py``): a stream of misses to start from and the command line they share. Not a
``vismemo bench`` command: the scripts in ``benchmarks/`` run it."""

from __future__ import annotations

import copy
import statistics
from pathlib import Path

from vismemo_hf import VisMemoCache, VisMemoStore, enable
from vismemo_hf.bench.report import header, machine, write
from vismemo_hf.bench.workload import _generate, _inputs, image_size, load
from vismemo_hf.eval import workload


def miss_stream(spec: str, requests: int = 12, seed: int = 0):
    """(the enabled model, a never-enabled copy, the first ``requests`` inputs of the mixed stream), both models
    warmed up: what a benchmark of misses starts from (it makes each request's image new itself)."""
    model, processor, tokens = load(spec, seed)
    plain = copy.deepcopy(model)
    stream = workload.build("mixed", image_size(spec, model, tokens), seed)[:requests]
    inputs = [_inputs(processor, request, model.device) for request in stream]
    for x in inputs[:3]:
        _generate(plain, x, None, 1)
    enable(model)
    for x in inputs[:3]:
        _generate(model, x, VisMemoCache(store=VisMemoStore()), 1)
    return model, plain, inputs


def arms_main(script: str, doc: str, title: str, intro: str, column: str, measure, out_name: str) -> int:
    """The command line of a benchmark of per-request ratios to plain in arms (``benchmarks/keys_ahead.py``,
    ``writer_contention.py``): ``--models``, ``--repeats``, ``--out``; ``measure(spec, repeats)`` -> arm -> ratios;
    ``intro`` may name ``{repeats}``. Writes ``out_name`` in ``--out``: p50 and mean per model and arm."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--models", default="tiny:qwen2_vl,vismemo-docqa-tiny")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", default="results/perf")
    args = parser.parse_args()
    command = f"python benchmarks/{script} --models {args.models} --repeats {args.repeats}"
    lines = header(title, command, machine("cpu")) + [intro.format(repeats=args.repeats), "",
                                                      f"| model | {column} | requests | p50 | mean |",
                                                      "| --- | --- | --- | --- | --- |"]
    for spec in args.models.split(","):
        for arm, v in measure(spec, args.repeats).items():
            lines.append(f"| {spec} | {arm} | {len(v)} | {statistics.median(v):.3f} | {statistics.fmean(v):.3f} |")
            print(lines[-1], flush=True)
    write(lines + [""], Path(args.out) / out_name)
    return 0

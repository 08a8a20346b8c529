"""``vismemo bench lookup``: approximate-lookup latency against 10^3..10^5 cached entries (descriptors only)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from vismemo_hf.bench.report import command as report_command
from vismemo_hf.bench.report import header, machine
from vismemo_hf.store.store import DescriptorIndex


def run(sizes, dim: int, queries: int, tau: float, top_k: int, groups: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    records = []
    for n in sizes:
        index = DescriptorIndex()
        base = torch.nn.functional.normalize(torch.randn(n, 4, dim, generator=g), dim=-1)
        for i in range(n):  # entries spread over a few grids, as pages of a few sizes would be
            index.add("fp", (1, 32, 32 + 2 * (i % groups)), f"k{i}", base[i])
        times = []
        for q in range(queries):
            target = base[q % n]
            probe = torch.nn.functional.normalize(target + 0.05 * torch.randn(4, dim, generator=g), dim=-1)
            t0 = time.perf_counter()
            index.search("fp", (1, 32, 32 + 2 * (q % n % groups)), probe, tau, top_k)
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        records.append({"entries": n, "median_ms": statistics.median(times),
                        "p99_ms": times[min(len(times) - 1, int(0.99 * len(times)))], "queries": queries})
    return records


def main(args) -> int:
    sizes = [int(x) for x in args.sizes.split(",")]
    records = run(sizes, args.dim, args.queries, args.tau, args.top_k, args.groups)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = report_command("bench lookup", args, ["sizes", "dim", "queries", "tau", "top_k", "groups"])
    mach = machine()
    (out / "lookup.json").write_text(json.dumps({"command": command, "machine": mach, "records": records}, indent=2))
    lines = header("Coarse approximate lookup vs number of cached entries", command, mach) + [
             f"Descriptor index only (4 region descriptors of dimension {args.dim} per entry, spread over "
             f"{args.groups} grids; every query is a noisy copy of a stored entry). The fine stage reads the "
             "encoder output of at most top-k candidates and is not included.", "",
             "| entries | median ms | p99 ms |", "| --- | --- | --- |"]
    lines += [f"| {r['entries']:,} | {r['median_ms']:.3f} | {r['p99_ms']:.3f} |" for r in records]
    (out / "lookup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0

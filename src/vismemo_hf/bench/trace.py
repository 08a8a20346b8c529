"""``vismemo bench trace``: a synthetic request trace replayed through the tiered store at several capacities.

Trace (``bench.store.synthetic_trace``): repeats of past images chosen by a Zipf law over recency rank
(long-tailed reuse intervals), near-duplicate variants of Pareto-popular page families (approximate
hits when the family's base is stored), and new images. Capacity is split 10 % device, 30 % host,
60 % disk. Reported: hit rate by kind, hits by tier, exact-priority vs plain LRU.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from vismemo_hf.bench.report import command as report_command
from vismemo_hf.bench.report import header, machine
from vismemo_hf.bench.store import _tiny_entry, replay_into, synthetic_trace
from vismemo_hf.progress import progress as progress_bar
from vismemo_hf.store import blob
from vismemo_hf.store.store import VisMemoStore


def replay(trace, capacity: int, protect: int, tmp: Path) -> dict:
    one = _tiny_entry("x")
    blob_bytes = len(blob.encode(one))
    store = VisMemoStore(device_bytes=int(0.1 * capacity) * one.nbytes, host_bytes=int(0.3 * capacity) * blob_bytes,
                         disk_dir=tmp / f"c{capacity}p{protect}", disk_bytes=int(0.6 * capacity) * blob_bytes,
                         protect=protect)
    rates = replay_into(store, trace)
    stats = store.stats()
    store.close()
    return {"hit_rate": rates, "hits_by_tier": stats["hits_by_tier"]}


def main(args) -> int:
    import matplotlib  # the plot's extra, before the replays

    trace = synthetic_trace(args.requests, seed=args.seed)
    capacities = [int(c) for c in args.capacities.split(",")]
    results: dict[int, dict[str, dict]] = {}
    runs = [(c, name, protect) for c in capacities for name, protect in (("plain", 0), ("exact_priority", 2))]
    with tempfile.TemporaryDirectory() as tmp:
        for capacity, name, protect in progress_bar(runs, desc="trace", unit="replay"):
            results.setdefault(capacity, {})[name] = replay(trace, capacity, protect, Path(tmp))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = report_command("bench trace", args, ["requests", "capacities", "seed"])
    mach = machine()
    (out / "trace.json").write_text(json.dumps({"command": command, "machine": mach, "results": results}, indent=2))
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for name in ("plain", "exact_priority"):
        for kind, style in (("exact", "-"), ("approximate", "--")):
            ax.plot(capacities, [results[c][name]["hit_rate"][kind] for c in capacities], style, marker="o",
                    label=f"{kind} ({name})")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (entries, all tiers)")
    ax.set_ylabel("hit rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "trace.png", dpi=110)
    plt.close(fig)
    lines = header("Trace replay: hit rate vs capacity", command, mach) + [
             f"{len(trace)} requests; capacity split 10 % device / 30 % host / 60 % disk; tiny entries (the "
             "policy decisions do not depend on entry size).", "",
             "| capacity | LRU | exact | approximate | miss | hits device / host / disk |",
             "| --- | --- | --- | --- | --- | --- |"]
    for c in capacities:
        for name, r in results[c].items():
            h, t = r["hit_rate"], r["hits_by_tier"]
            lines.append(f"| {c} | {name} | {h['exact']:.3f} | {h['approximate']:.3f} | {h['miss']:.3f} | "
                         f"{t['device']} / {t['host']} / {t['disk']} |")
    lines += ["", "![capacity curve](trace.png)"]
    (out / "trace.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0

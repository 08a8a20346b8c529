"""``vismemo bench capacity``: entries per GiB and the trace's hit rate at a fixed byte budget, per stored K/V format.

The bytes of one entry are measured by encoding a Qwen3-VL-8B-geometry entry in each format
(the blob a host, disk or remote tier holds): bf16, 8-bit (int8, fp8) and compressed entries
(docs/METHOD.md §4: the K/V of a share of the tokens). At a byte budget a store holds budget // bytes
entries, so the hit rate at that budget is the trace's hit rate through a store of that many
entries (``bench.store.synthetic_trace`` replayed with exact-priority LRU). Quality of 8-bit
entries is in Table 1 (``vismemo report quality``, policies ``NAME@int8`` / ``NAME@fp8``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vismemo_hf.bench.report import command as report_command
from vismemo_hf.bench.report import header, machine
from vismemo_hf.bench.store import replay, synthetic_entry, synthetic_trace
from vismemo_hf.progress import progress as progress_bar
from vismemo_hf.store import blob

#: (label, kv_format, keep_ratio) of the stored variants compared
VARIANTS = (("bf16", None, None), ("int8", "int8", None), ("fp8", "fp8", None),
            ("compressed, keep 0.5", None, 0.5), ("compressed, keep 0.25", None, 0.25),
            ("int8 + compressed, keep 0.5", "int8", 0.5))


def run(args) -> dict:
    entry = synthetic_entry("capacity", n_tokens=args.tokens, layers=args.layers, heads=args.kv_heads,
                            head_dim=args.head_dim, embed_dim=args.embed_dim)
    trace = synthetic_trace(args.requests, seed=args.seed)
    budget = int(args.budget_gib * 2**30)
    assert entry.kv is not None  # synthetic entries always carry their K/V
    rows = []
    for label, kv_format, keep in progress_bar(VARIANTS, desc="capacity", unit="format"):
        stored = entry if keep is None else entry.compressed(torch.topk(entry.entropy, round(keep * args.tokens)).indices)
        size = len(blob.encode(stored, kv_format))
        kv = blob.round_trip(entry.kv, kv_format).float()
        error = float((kv - entry.kv.float()).norm() / entry.kv.float().norm())
        capacity = budget // size
        one = synthetic_entry("x", 4, 2, 1, 4, 4)  # the trace's tiny stand-in: decisions do not depend on size
        rates = replay(trace, capacity, protect=2, entry_bytes_of=one.nbytes)
        rows.append({"format": label, "kv_format": kv_format, "keep_ratio": keep, "entry_bytes": size,
                     "entries_per_gib": 2**30 / size, "entries_at_budget": capacity, "kv_relative_error": error,
                     "hit_rate": rates})
    return {"budget_bytes": budget, "requests": len(trace), "rows": rows}


def main(args) -> int:
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = report_command("bench capacity", args, ["tokens", "layers", "kv_heads", "head_dim", "embed_dim",
                                                      "budget_gib", "requests", "seed"])
    mach = machine()
    (out / "capacity.json").write_text(json.dumps({"command": command, "machine": mach, **result}, indent=2))
    lines = header("Capacity: entries per GiB and hit rate at a fixed byte budget", command, mach) + [
        f"Entry: {args.tokens} visual tokens x {args.layers} layers x {args.kv_heads} KV heads x {args.head_dim} "
        f"head dim (Qwen3-VL-8B), encoder output width {args.embed_dim}, bf16, as a blob (K/V with per-layer "
        "hashes, encoder output, descriptors, sketches). Budget "
        f"{args.budget_gib} GiB; hit rates of {result['requests']} synthetic requests through a store of that many "
        "entries (exact-priority LRU). K/V error: relative L2 error of the stored tokens' K/V (random normal values). "
        "A compressed entry keeps the encoder output and lookup data of every token; a hit on it masks (or "
        "recomputes) the tokens it lacks, so its hits cost quality or compute that the hit rate does not show "
        "(Table 1, `@keep0.5`).", "",
        "| stored K/V | bytes / entry | entries / GiB | entries in budget | K/V error | exact | approximate | miss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        h = r["hit_rate"]
        lines.append(f"| {r['format']} | {r['entry_bytes']:,} | {r['entries_per_gib']:.2f} | {r['entries_at_budget']} "
                     f"| {r['kv_relative_error']:.4f} | {h['exact']:.3f} | {h['approximate']:.3f} | {h['miss']:.3f} |")
    (out / "capacity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0

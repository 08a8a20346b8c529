"""``vismemo bench latency``: prefill time of a miss, an exact and an approximate hit by visual length.

Per length, the runs are interleaved (miss, exact, then each policy's approximate hit) after a
warm-up round, and the median is reported with the stage breakdown from the cache events and
the analytic FLOP floor of the plan. Prefill time excludes the vision encoder for every kind
(the encoder has its own line); misses are timed without storing their entry.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from vismemo_hf import VisMemoCache, VisMemoStore, enable
from vismemo_hf.bench.report import command as report_command
from vismemo_hf.bench.report import header, machine
from vismemo_hf.eval import synthetic
from vismemo_hf.eval.loading import load_model

STAGES = ("lookup", "encoder", "warmup", "fetch_wait", "plan", "recompute")


def layer_flops(config, queries: int, keys: int) -> float:
    """Forward FLOPs of one decoder layer: projections and MLP for ``queries`` tokens, attention over ``keys``."""
    t = config.text_config
    d, heads, kv, ffn = t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.intermediate_size
    head_dim = getattr(t, "head_dim", None) or d // heads
    linear = 2 * queries * (d * heads * head_dim * 2 + 2 * d * kv * head_dim + 3 * d * ffn)
    attention = 4 * heads * head_dim * queries * keys
    return linear + attention


def plan_flops(config, length: int, start: int, plan) -> float:
    """FLOPs of a prefill of ``length`` columns whose image (at column ``start``) is routed by ``plan``: at each
    layer the text and the plan's computed tokens are queries, and each query attends to exactly the keys it
    sees (text, computed and reused tokens at or before its column; masked tokens are no keys)."""
    n = plan.n_tokens
    per_layout = {}
    total = 0.0
    for layer in range(config.text_config.num_hidden_layers):
        computed, reused = plan.computed_at(layer), plan.reused_at(layer)
        layout = (computed.numel(), reused.numel())  # the sets nest with depth: their sizes name them
        if layout not in per_layout:
            query = torch.ones(length, dtype=torch.bool)
            query[start : start + n] = False
            query[start + computed] = True
            key = query.clone()
            key[start + reused] = True
            pairs = int(key.long().cumsum(0)[query].sum())
            queries = int(query.sum())
            per_layout[layout] = layer_flops(config, queries, pairs / queries)
        total += per_layout[layout]
    return total


def page_pair(tokens: int, family_patch: int, seed: int = 1):
    """A synthetic page whose processed grid gives about ``tokens`` visual tokens (square-ish)."""
    side = int(round(tokens ** 0.5))
    px = 2 * family_patch
    width, height = side * px, max(1, tokens // side) * px
    return synthetic.page(seed, size=(width, height)), synthetic.edited(seed, row=2, value="9999", size=(width, height))


def request_inputs(processor, image, question="What is the value of the third row?"):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor(text=[text], images=[image], return_tensors="pt")


@torch.no_grad()
def timed_prefill(model, inputs, cache) -> dict:
    model(**inputs.to(model.device), cache=cache, use_cache=True)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    (event,) = cache.events
    t = dict(event.timings)
    t["prefill"] = t["prefill"] - t.get("encoder", 0.0)
    return {"timings": t, "kind": str(event.kind), "recomputed": event.recomputed, "reused": event.reused,
            "masked": event.masked, "n_tokens": event.n_tokens, "bytes_read": event.bytes_read, "plan": event.plan}


def run(model, processor, lengths, policies, repeats: int, progress=None) -> list[dict]:
    family = model.config.model_type
    patch = model.config.vision_config.patch_size
    records = []
    for n in lengths:
        base, edited = page_pair(n, patch)
        miss_in, edit_in = request_inputs(processor, base), request_inputs(processor, edited)
        seeded = VisMemoStore()
        timed_prefill(model, miss_in, VisMemoCache(store=seeded))  # the alias entry every hit reads
        runs = {("miss", "-"): [], ("exact", "-"): []}
        for policy in policies:
            runs[("approximate", policy)] = []
        for rep in range(repeats + 1):  # round 0 warms up
            for (kind, policy) in runs:
                if kind == "miss":
                    out = timed_prefill(model, miss_in, VisMemoCache(store=VisMemoStore(), store_misses=False))
                elif kind == "exact":
                    out = timed_prefill(model, miss_in, VisMemoCache(store=seeded))
                else:
                    out = timed_prefill(model, edit_in, VisMemoCache(store=seeded, policy=policy, store_misses=False))
                if out["kind"] != kind:
                    raise RuntimeError(f"expected a {kind} hit at {n} tokens, got {out['kind']}")
                if rep:
                    runs[(kind, policy)].append(out)
                if progress is not None:
                    progress.update(1)
        ids = miss_in["input_ids"][0]
        is_image = ids == model.config.image_token_id
        n_text, start = int((~is_image).sum()), int(is_image.nonzero()[0])
        n_visual = runs[("miss", "-")][0]["n_tokens"]
        miss_ms = statistics.median(r["timings"]["prefill"] for r in runs[("miss", "-")])
        miss_flops = plan_flops(model.config, ids.numel(), start, runs[("miss", "-")][0]["plan"])
        for (kind, policy), outs in runs.items():
            first = outs[0]
            r, b = first["recomputed"], first["reused"]
            floor = plan_flops(model.config, ids.numel(), start, first["plan"]) / miss_flops
            median = {s: statistics.median(o["timings"].get(s, 0.0) for o in outs) for s in STAGES + ("prefill",)}
            records.append({
                "visual_tokens": n_visual, "text_tokens": n_text, "family": family, "kind": kind, "policy": policy,
                "prefill_ms": median["prefill"], "ratio_to_miss": median["prefill"] / miss_ms, "floor_ratio": floor,
                "recomputed": r, "reused": b, "masked": first["masked"], "bytes_read": first["bytes_read"],
                "breakdown_ms": {s: median[s] for s in STAGES},
                "repeats": len(outs),
            })
    return records


def _plot(records, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6))
    series = sorted({(r["kind"], r["policy"]) for r in records})
    for kind, policy in series:
        rs = sorted((r for r in records if (r["kind"], r["policy"]) == (kind, policy)), key=lambda r: r["visual_tokens"])
        label = kind if kind != "approximate" else f"approximate ({policy})"
        ax.plot([r["visual_tokens"] for r in rs], [r["prefill_ms"] for r in rs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("visual tokens")
    ax.set_ylabel("prefill ms (median, encoder excluded)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    longest = max(r["visual_tokens"] for r in records)
    rows = [r for r in records if r["visual_tokens"] == longest]
    bottom = [0.0] * len(rows)
    for stage in STAGES:
        vals = [r["breakdown_ms"][stage] for r in rows]
        bx.bar(range(len(rows)), vals, bottom=bottom, label=stage)
        bottom = [a + b for a, b in zip(bottom, vals)]
    bx.set_xticks(range(len(rows)), [r["kind"] if r["kind"] != "approximate" else r["policy"] for r in rows],
                  rotation=30, fontsize=7)
    bx.set_ylabel("ms")
    bx.set_title(f"breakdown at {longest} visual tokens", fontsize=9)
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    from tqdm import tqdm

    dtype = getattr(torch, args.dtype)
    model, processor = load_model(args.preset, args.family, dtype=dtype, device=args.device)
    enable(model)
    if hasattr(processor, "image_processor"):
        patch = model.config.vision_config.patch_size
        processor.image_processor.size = {"shortest_edge": 4 * (2 * patch) ** 2, "longest_edge": 20000 * (2 * patch) ** 2}
    lengths = [int(x) for x in args.lengths.split(",")]
    policies = args.policies.split(",")
    total = len(lengths) * (args.repeats + 1) * (2 + len(policies))
    with tqdm(total=total, desc="latency") as bar:
        records = run(model, processor, lengths, policies, args.repeats, bar)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = report_command("bench latency", args, ["preset", "lengths", "policies", "repeats", "dtype", "device"])
    mach = machine(args.device)
    (out / "latency.json").write_text(json.dumps({"command": command, "machine": mach, "records": records}, indent=2))
    _plot(records, out / "latency.png")
    lines = header(f"Prefill latency by hit kind ({args.preset})", command, mach) + [
             "Median prefill of the language model (vision encoder excluded for every kind; its time is in the "
             f"`encoder` column) over {args.repeats} interleaved runs after a warm-up round; random weights. "
             "`floor` is the plan's analytic FLOP ratio to a miss (`bench.latency.plan_flops`: projections and MLP of "
             "the computed tokens, attention over exactly the keys each query sees); `/ floor`: measured over floor; "
             "`R / B / M`: "
             "visual tokens recomputed, reused and masked; `MB read`: alias K/V the hit read from the store.", "",
             "| visual tokens | kind | policy | prefill ms | / miss | floor | / floor | R / B / M | MB read | lookup | "
             "encoder | warmup | fetch wait | plan | recompute |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        b = r["breakdown_ms"]
        lines.append(f"| {r['visual_tokens']} | {r['kind']} | {r['policy'] if r['kind'] == 'approximate' else '-'} | "
                     f"{r['prefill_ms']:.1f} | {r['ratio_to_miss']:.3f} | {r['floor_ratio']:.3f} | "
                     f"{r['ratio_to_miss'] / r['floor_ratio']:.2f} | {r['recomputed']} / {r['reused']} / {r['masked']} | "
                     f"{r['bytes_read'] / 2**20:.1f} | {b['lookup']:.1f} | "
                     f"{b['encoder']:.1f} | {b['warmup']:.1f} | {b['fetch_wait']:.1f} | {b['plan']:.1f} | "
                     f"{b['recompute']:.1f} |")
    lines += ["", "![latency](latency.png)"]
    (out / "latency.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0

"""``vismemo report quality``: every policy on the same synthetic streams -> results/quality/.

Table 1 (overall / exact / approximate ANLS, edited-value ANLS and stale answers, fidelity to a
full prefill) and the recompute-ratio / reuse-ratio sweeps of VisMemo as PNG plots.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from .. import enable, synthdoc
from ..quality import evaluate, reading_by_type, summarise

POLICIES = ["full", "naive", "cacheblend", "vlcache", "attention-only", "pixel-patch", "vismemo",
            "vismemo-no-entropy", "vismemo-no-head-norm", "vismemo-no-mask", "vismemo-no-guard"]


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False)


def run(model, processor, requests, policies, sweep_rho, sweep_beta, max_new_tokens: int, heldout: int = 0) -> dict:
    results, scored_by = {}, {}
    reading = reading_by_type(model, processor, heldout, max_new_tokens,
                              progress=_progress(heldout * len(synthdoc.STYLES), "reader")) if heldout else None
    reference = evaluate(model, processor, requests, "full", max_new_tokens=max_new_tokens,
                         progress=_progress(len(requests), "full (reference)"))
    scored_by["full"] = reference
    for policy in policies:
        if policy not in scored_by:
            scored_by[policy] = evaluate(model, processor, requests, policy, max_new_tokens=max_new_tokens,
                                         progress=_progress(len(requests), policy))
        results[policy] = summarise(scored_by[policy], reference)
    sweeps = {"recompute_ratio": {}, "reuse_ratio": {}}
    for rho in sweep_rho:
        scored = evaluate(model, processor, requests, "vismemo", recompute_ratio=rho, max_new_tokens=max_new_tokens,
                          progress=_progress(len(requests), f"vismemo rho={rho}"))
        sweeps["recompute_ratio"][rho] = summarise(scored, reference)
    for beta in sweep_beta:
        scored = evaluate(model, processor, requests, "vismemo", reuse_ratio=beta, max_new_tokens=max_new_tokens,
                          progress=_progress(len(requests), f"vismemo beta={beta}"))
        sweeps["reuse_ratio"][beta] = summarise(scored, reference)
    examples = [{"id": s.request.id, "variant": s.request.variant, "question": s.request.question,
                 "answer": s.request.answers[0], "stale": s.request.stale,
                 **{p: scored_by[p][i].prediction for p in ("full", "naive", "vismemo") if p in scored_by}}
                for i, s in enumerate(reference) if s.request.about_edit][:8]
    return {"reader": reading, "policies": results, "sweeps": sweeps, "edited_examples": examples}


def _fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def _plot(sweep: dict, name: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = sorted(sweep)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for metric, label in (("anls_approximate", "approximate-hit ANLS"), ("anls", "overall ANLS"),
                          ("anls_edited_value", "edited-value ANLS")):
        ax.plot(xs, [sweep[x][metric] if sweep[x][metric] is not None else float("nan") for x in xs], marker="o",
                label=label)
    ax.set_xlabel(name)
    ax.set_ylabel("ANLS")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"VisMemo: {name} sweep (synthetic forms)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    from ..models import load_model

    torch.manual_seed(0)
    model, processor = load_model(args.model)
    enable(model)
    requests = [r for seed in range(args.streams) for r in synthdoc.stream(1000 + seed, n_bases=args.bases)]
    policies = POLICIES if args.policies == "all" else args.policies.split(",")
    rho = [float(x) for x in args.sweep_rho.split(",")] if args.sweep_rho else []
    beta = [float(x) for x in args.sweep_beta.split(",")] if args.sweep_beta else []
    t0 = time.time()
    result = run(model, processor, requests, policies, rho, beta, args.max_new_tokens, args.heldout)
    command = (f"vismemo report quality --model {args.model} --streams {args.streams} --bases {args.bases} "
               f"--policies {args.policies} --sweep-rho {args.sweep_rho} --sweep-beta {args.sweep_beta} "
               f"--max-new-tokens {args.max_new_tokens} --heldout {args.heldout}")
    kinds = {k: sum(r.intended == k for r in requests) for k in ("miss", "exact", "approximate")}
    result.update(command=command, model=args.model, requests=len(requests), intended=kinds,
                  machine=f"{platform.machine()}, torch {torch.__version__}, CPU fp32", seconds=round(time.time() - t0))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Table 1: quality of each policy on synthetic document streams", "",
        f"Command: `{command}`  ", f"Model: `{args.model}` (Qwen2-VL architecture, trained here to read synthetic "
        f"pages), {result['machine']}; {len(requests)} requests in stream order ({kinds['miss']} new pages of the "
        f"five page types, {kinds['exact']} same page with another question or another text before the image, "
        f"{kinds['approximate']} near-duplicates: edited value, shift, JPEG / brightness, switched status light), "
        "one store per policy, greedy answers. Reference for fidelity: `full`.", "",
        "| policy | ANLS | exact | approximate | edited value | stale answers | first-token agree | sequence match | "
        "first-token KL |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in result["policies"].items():
        lines.append(f"| {name} | {_fmt(r['anls'])} | {_fmt(r['anls_exact'])} | {_fmt(r['anls_approximate'])} | "
                     f"{_fmt(r['anls_edited_value'])} | {_fmt(r['stale_rate'])} | {_fmt(r['first_token_agreement'])} | "
                     f"{_fmt(r['sequence_match'])} | {_fmt(r['first_token_kl'], 4)} |")
    variants = sorted({v for r in result["policies"].values() for v in r["anls_by_variant"]})
    lines += ["", "ANLS by variant (the follow-ups' kind of change; `base-*`: the first request of a page):", "",
              "| policy | " + " | ".join(variants) + " |", "| --- |" + " --- |" * len(variants)]
    for name, r in result["policies"].items():
        lines.append(f"| {name} | " + " | ".join(_fmt(r["anls_by_variant"].get(v)) for v in variants) + " |")
    lines += ["", "Where each policy's plans put the tokens of the asked value on approximate hits (share of "
              "those cells recomputed R / reused B / masked M; `quality.answer_cell_routing`):", "",
              "| policy | R | B | M |", "| --- | --- | --- | --- |"]
    for name, r in result["policies"].items():
        cells = r.get("answer_cells")
        if cells:
            lines.append(f"| {name} | {_fmt(cells['R'])} | {_fmt(cells['B'])} | {_fmt(cells['M'])} |")
    counts = result["policies"].get("vismemo") or next(iter(result["policies"].values()))
    lines += ["", f"Hit kinds seen (vismemo run): exact {counts['n_exact']}, approximate {counts['n_approximate']}, "
              f"miss {counts['n_miss']}. \"edited value\": questions about the value that changed; \"stale answers\": "
              "share of those answered with the value before the edit.", ""]
    if result["reader"]:
        lines += ["## The reader: full prefill on held-out pages", "",
                  f"`quality.heldout_pages`: {args.heldout} pages per type that no training step drew, one "
                  "question each, answered with a plain `DynamicCache` (no VisMemo).", "",
                  "| page type | ANLS | exact match | pages |", "| --- | --- | --- | --- |"]
        for style, r in result["reader"].items():
            lines.append(f"| {style} | {_fmt(r['anls'])} | {_fmt(r['exact_match'])} | {r['n']} |")
        lines.append("")
    for name, sweep in result["sweeps"].items():
        if not sweep:
            continue
        _plot({float(k): v for k, v in sweep.items()}, name, out / f"sweep_{name}.png")
        lines += [f"## VisMemo {name} sweep (![plot](sweep_{name}.png))", "",
                  f"| {name} | ANLS | approximate | edited value | stale answers |", "| --- | --- | --- | --- | --- |"]
        for x, r in sorted(sweep.items()):
            lines.append(f"| {x} | {_fmt(r['anls'])} | {_fmt(r['anls_approximate'])} | {_fmt(r['anls_edited_value'])} | "
                         f"{_fmt(r['stale_rate'])} |")
        lines.append("")
    if result["edited_examples"]:
        lines += ["## Examples of edited-value questions", "", "| id | question | answer | stale | full | naive | vismemo |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for e in result["edited_examples"]:
            lines.append(f"| {e['id']} | {e['question']} | {e['answer']} | {e['stale']} | {e.get('full')} | "
                         f"{e.get('naive')} | {e.get('vismemo')} |")
    (out / "table1.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0

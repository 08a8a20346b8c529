"""``vismemo report pareto``: quality against speed for every policy swept over its budget (docs/METHOD.md §6).

Each point is a policy with one budget: approximate-hit ANLS, edited-value ANLS, stale answers and first-token KL
against plain transformers on a reader's streams, the measured time to the first token of its approximate hits
against plain transformers on the same requests (the reader's geometry), and the point's FLOP floor on a
large-model geometry (``--floor-preset`` at ``--floor-tokens`` visual tokens, random weights: the share of a
miss's FLOPs, the vision encoder's included, the point's hit runs there, the mean over an edited value, a shifted
page and a rescan). A point
is on the front when no other point of the same reader is at least as good on approximate-hit ANLS and at least as
cheap, and better on one; cost is the FLOP floor on the large geometry when it was computed (at a reader's few dozen
tokens, fixed costs hide what a budget saves), else the measured TTFT ratio. ``recomputed``: the mean share of an
image's tokens the point's plans recomputed on the reader's approximate hits (what a budget that follows the evidence
spends on these streams' changes).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from vismemo_hf import VisMemoCache, VisMemoStore, enable
from vismemo_hf.bench.report import machine
from vismemo_hf.eval import docstream, synthdoc
from vismemo_hf.eval.quality import evaluate, summarise
from vismemo_hf.progress import progress as progress_bar
from vismemo_hf.runtime.cache import DEFAULT_POLICY

#: every policy's budget grid: (policy, options) points
SWEEPS: dict[str, list[dict]] = {
    "full": [{}],
    "naive": [{}],
    "pixel-patch": [{}],
    "cacheblend": [{"recompute_ratio": r} for r in (0.05, 0.1, 0.15, 0.3, 0.5)],
    "vlcache": [{"recompute_ratio": r} for r in (0.05, 0.1, 0.2, 0.3, 0.5)],
    "attend-deviate": [{"recompute_ratio": r} for r in (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)],
    "vismemo": ([{"recompute_ratio": r, "reuse_ratio": 0.1} for r in (0.1, 0.2, 0.3, 0.5)]
                + [{"recompute_ratio": 0.3, "reuse_ratio": b} for b in (0.0, 0.4)]
                + [{"recompute_ratio": 0.3, "reuse_ratio": 0.1, "warmup_layers": w} for w in (1, 2)]),
}


def _label(policy: str, options: dict) -> str:
    return policy + "".join(f" {k.split('_')[0]}={v}" for k, v in options.items())


#: the changes of the floor's page: an edited value, a 2 px shift, a JPEG rescan (a miss counts as 1.0)
FLOOR_CHANGES = ("edit", "shift", "rescan")


def _changed(base, edited, change: str):
    from vismemo_hf.eval import synthetic

    if change == "edit":
        return edited
    return synthetic.shifted(base, 2, 0) if change == "shift" else synthdoc.reencode_image(base, 75)


def floors(preset: str, tokens: int, points: list[tuple[str, dict]]) -> dict:
    """Each point's FLOPs over a miss's on ``preset`` (random weights) at about ``tokens`` visual tokens, the vision
    encoder included over the tokens the hit encodes (all of them, or a hit found by its pixels its changed tokens
    and their context: ``bench.flops.kind_floor``), per change of
    ``FLOOR_CHANGES`` and their mean (a change the point serves as a miss costs a miss)."""
    from vismemo_hf.bench.flops import kind_floor, patches_of
    from vismemo_hf.bench.latency import any_size, page_pair, request_inputs, timed_prefill
    from vismemo_hf.eval.loading import load_model

    model, processor = load_model(preset)
    enable(model)
    any_size(processor, model)
    base, edited = page_pair(tokens, model)
    miss_in = request_inputs(processor, base)
    changed = {c: request_inputs(processor, _changed(base, edited, c)) for c in FLOOR_CHANGES}
    store = VisMemoStore()
    miss = timed_prefill(model, miss_in, VisMemoCache(store=store))
    store.flush()
    ids = miss_in["input_ids"][0]
    start = int((ids == model.config.image_token_id).nonzero()[0])
    patches = patches_of(model.config, miss["n_tokens"])
    miss_flops = kind_floor(model.config, ids.numel(), start, miss["plan"], patches)
    out, by_change = {}, {}
    for policy, options in progress_bar(points, desc=f"pareto: FLOP floor ({preset})", unit="point"):
        label = _label(policy, options)
        if policy == "full":
            out[label], by_change[label] = 1.0, dict.fromkeys(FLOOR_CHANGES, 1.0)
            continue
        per = {}
        for change, inputs in changed.items():
            hit = timed_prefill(model, inputs, VisMemoCache(store=store, policy=policy, store_misses=False,
                                                           **{"approximate": "always", **options}))
            encoded = hit["n_tokens"] if hit["encoded_tokens"] < 0 else hit["encoded_tokens"]
            per[change] = (kind_floor(model.config, ids.numel(), start, hit["plan"],
                                      encoded and patches_of(model.config, encoded)) / miss_flops
                           if hit["kind"] == "approximate" else 1.0)
        out[label], by_change[label] = sum(per.values()) / len(per), per
    return {"preset": preset, "visual_tokens": miss["n_tokens"], "floor": out, "by_change": by_change}


def reader_points(model, processor, requests, points, max_new_tokens: int, desc: str = "pareto") -> dict:
    """Quality and measured speed of every point on one reader's requests, against plain transformers (a bar,
    ``desc``, counts the requests answered)."""
    bar = progress_bar(total=(1 + len(points)) * len(requests), desc=desc, unit="request")
    bar.set_postfix_str("plain")
    plain = evaluate(model, processor, requests, "plain", max_new_tokens=max_new_tokens, progress=bar)
    full = summarise(plain)
    rows = []
    for policy, options in points:
        bar.set_postfix_str(_label(policy, options))
        scored = evaluate(model, processor, requests, policy, max_new_tokens=max_new_tokens, progress=bar, **options)
        summary = summarise(scored, plain)
        approximate = [i for i, s in enumerate(scored) if s.kind == "approximate"]
        speed = (statistics.median(scored[i].ttft_ms for i in approximate)
                 / statistics.median(plain[i].ttft_ms for i in approximate)) if approximate else None
        on_hits = sum(plain[i].anls for i in approximate) / len(approximate) if approximate else None
        rows.append({"label": _label(policy, options), "policy": policy, "options": options,
                     "anls_approximate": summary["anls_approximate"], "plain_anls_on_hits": on_hits,
                     "anls_edited_value": summary["anls_edited_value"],
                     "stale_rate": summary["stale_rate"], "first_token_kl": summary["first_token_kl"],
                     "n_approximate": summary["n_approximate"], "ttft_ratio_to_plain": speed,
                     "recomputed_share": summary["recomputed_share_approximate"]})
    bar.close()
    near = [s.anls for s in plain if s.request.intended == "approximate"]  # plain on the near-duplicate requests
    return {"full_anls": full["anls"], "full_anls_approximate": sum(near) / len(near) if near else None,
            "visual_tokens": full["visual_tokens"], "requests": len(requests), "points": rows}


def _mark_front(rows: list[dict], cost: str) -> None:
    scored = [r for r in rows if r["anls_approximate"] is not None and r[cost] is not None]
    for r in rows:
        r["front"] = r in scored and not any(
            o is not r and o["anls_approximate"] >= r["anls_approximate"] and o[cost] <= r[cost]
            and (o["anls_approximate"] > r["anls_approximate"] or o[cost] < r[cost]) for o in scored)


def acceptable(point: dict) -> bool:
    """Approximate-hit ANLS within 0.01 of plain transformers' on the same requests (the lookup decides which
    near-duplicates become hits), and no stale answer."""
    plain = point["plain_anls_on_hits"]
    return (point["anls_approximate"] is not None and plain is not None
            and point["anls_approximate"] >= plain - 0.01 and not point["stale_rate"])


def choice(reader: dict, cost: str) -> dict | None:
    """The cheapest acceptable point of one reader."""
    ok = [r for r in reader["points"] if r[cost] is not None and acceptable(r)]
    return min(ok, key=lambda r: r[cost]) if ok else None


def joint_choice(readers: dict, cost: str) -> dict | None:
    """The cheapest point acceptable on every reader (cost: the most any reader measured for it): the default's
    rule (docs/METHOD.md §6)."""
    best = None
    for point in next(iter(readers.values()))["points"]:
        same = [next((r for r in reader["points"] if r["label"] == point["label"]), None) for reader in readers.values()]
        found = [r for r in same if r is not None]
        if len(found) < len(same) or any(r[cost] is None or not acceptable(r) for r in found):
            continue
        worst = max(r[cost] for r in found)
        if best is None or worst < best[cost]:
            best = {"label": point["label"], "policy": point["policy"], "options": point["options"], cost: worst}
    return best


def ordering(reader: dict) -> list[str]:
    """Whether VisMemo > VLCache > CacheBlend on approximate-hit ANLS holds at each shared recompute ratio."""
    by = {(r["policy"], r["options"].get("recompute_ratio")): r["anls_approximate"] for r in reader["points"]
          if set(r["options"]) <= {"recompute_ratio", "reuse_ratio"} and r["options"].get("reuse_ratio", 0.1) == 0.1}
    lines = []
    for rho in sorted({k[1] for k in by if k[1] is not None}):
        v, lc, cb = (by.get((p, rho)) for p in ("vismemo", "vlcache", "cacheblend"))
        if v is None or lc is None or cb is None:
            continue
        holds = v > lc > cb
        lines.append(f"recompute ratio {rho}: vismemo {v:.3f}, vlcache {lc:.3f}, cacheblend {cb:.3f}: the paper's "
                     f"ordering {'holds' if holds else 'does not hold'}")
    return lines


def _plot(readers: dict, path: Path, cost: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(readers), figsize=(5.5 * len(readers), 3.8), squeeze=False)
    for ax, (name, reader) in zip(axes[0], readers.items()):
        for policy in SWEEPS:
            pts = sorted((r for r in reader["points"] if r["policy"] == policy and r[cost] is not None
                          and r["anls_approximate"] is not None), key=lambda r: r[cost])
            if pts:
                ax.plot([r[cost] for r in pts], [r["anls_approximate"] for r in pts], marker="o",
                        label=policy + (" (default)" if policy == DEFAULT_POLICY else ""))
        ax.axhline(reader["full_anls_approximate"] or 0, color="k", lw=0.8, ls="--")
        ax.set_xlabel("plan FLOPs / a miss's (floor)" if cost == "floor_ratio" else "approximate-hit TTFT / plain")
        ax.set_ylabel("approximate-hit ANLS")
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    from vismemo_hf.eval.loading import load_model

    names = args.policies.split(",") if args.policies != "all" else list(SWEEPS)
    unknown = [p for p in names if p not in SWEEPS]
    if unknown:
        raise ValueError(f"unknown policy(ies) {unknown} for the Pareto sweep; policies: {', '.join(SWEEPS)}")
    points = [(p, o) for p in names for o in SWEEPS[p]]
    t0 = time.time()
    readers = {}
    for name in args.models.split(","):
        model, processor = load_model(name)
        enable(model)
        _, stream = docstream.reader_pages(name, args.pages)
        requests = [r for seed in args.seeds for r in stream(seed, n_bases=args.bases)]
        readers[name] = reader_points(model, processor, requests, points, args.max_new_tokens, f"pareto: {name}")
    floor = floors(args.floor_preset, args.floor_tokens, points) if args.floor_tokens else None
    cost = "floor_ratio" if floor else "ttft_ratio_to_plain"
    for reader in readers.values():
        for r in reader["points"]:
            r["floor_ratio"] = floor["floor"].get(r["label"]) if floor else None
        _mark_front(reader["points"], cost)
    command = (f"vismemo report pareto --models {args.models} --pages {args.pages} "
               f"--seeds {','.join(map(str, args.seeds))} "
               f"--bases {args.bases} --policies {args.policies} --floor-preset {args.floor_preset} "
               f"--floor-tokens {args.floor_tokens}")
    result = {"command": command, "machine": machine(note="fp32"), "readers": readers, "floor": floor,
              "cost": cost, "choice": {n: choice(r, cost) for n, r in readers.items()},
              "joint_choice": joint_choice(readers, cost),
              "seconds": round(time.time() - t0)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pareto.json").write_text(json.dumps(result, indent=2))
    _plot(readers, out / "pareto.png", cost)
    (out / "pareto.md").write_text("\n".join(_report(result)) + "\n")
    print((out / "pareto.md").read_text())
    return 0


def _fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def _report(result) -> list[str]:
    floor = result["floor"]
    lines = ["# Quality against speed: every policy over its budget", "", f"Command: `{result['command']}`  ",
             f"{result['machine']}. Speed: median time to the first token of the approximate hits over plain "
             "transformers on the same requests (the reader's geometry); floor: the point's FLOPs (vision encoder and "
             "plan) over a miss's "
             + (f"on `{floor['preset']}` at {floor['visual_tokens']} visual tokens (random weights), the mean over "
                "an edited value, a 2 px shift and a JPEG rescan of one page (a change served as a miss costs 1)"
                if floor else
                "(not computed)") + ". Quality against plain transformers; `front`: on the reader's Pareto front of "
             "approximate-hit ANLS against " + ("the floor" if floor else "TTFT") + ".",
             "", "![pareto](pareto.png)", ""]
    for name, reader in result["readers"].items():
        lines += [f"## {name} ({reader['requests']} requests, {_fmt(reader['visual_tokens'], 1)} visual tokens each; "
                  f"plain ANLS on every near-duplicate request {_fmt(reader['full_anls_approximate'])}; `plain on its "
                  "hits`: plain transformers on the requests the point served as approximate hits)", "",
                  "| point | approximate ANLS | plain on its hits | edited value | stale | first-token KL | recomputed | "
                  "TTFT / plain | floor | front |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in reader["points"]:
            lines.append(f"| {r['label']} | {_fmt(r['anls_approximate'])} | {_fmt(r.get('plain_anls_on_hits'))} | "
                         f"{_fmt(r['anls_edited_value'])} | "
                         f"{_fmt(r['stale_rate'])} | {_fmt(r['first_token_kl'], 4)} | {_fmt(r.get('recomputed_share'))} | "
                         f"{_fmt(r['ttft_ratio_to_plain'])} | "
                         f"{_fmt(r['floor_ratio'])} | {'yes' if r['front'] else ''} |")
        pick = result["choice"][name]
        lines += ["", f"Cheapest point ({'floor' if result['cost'] == 'floor_ratio' else 'TTFT / plain'}) within 0.01 "
                  "of plain's ANLS on its approximate hits with no stale answer: "
                  + (f"`{pick['label']}` (floor {_fmt(pick['floor_ratio'])}, TTFT {_fmt(pick['ttft_ratio_to_plain'])} "
                     "x plain)." if pick else "none."), ""]
        lines += [f"- {line}" for line in ordering(reader)] + [""]
    pick = result.get("joint_choice")
    if len(result["readers"]) > 1:
        lines += ["## On every reader", "", "Cheapest point acceptable on every reader (within 0.01 of plain's ANLS "
                  "on its approximate hits, no stale answer; cost: the largest of its readers'): "
                  + (f"`{pick['label']}` ({_fmt(pick[result['cost']])})." if pick else "none."), ""]
    return lines

"""``vismemo report context``: reuse whatever came before the image and however little the page changed ->
results/quality/context.*

For each class of ``eval/context.py`` (another instruction text of 1-300 characters before an exact or an
approximate hit, another page before it, one-character edits, small rotations and rescales, inserted rows, erased
cells) a page is stored by one request and asked about by another, three questions per page, on both readers. Each
answer is compared with plain transformers' (a never-enabled copy of the weights, ``DynamicCache``) on the same
request: agreement of the whole greedy answer, ANLS against the page's truth (plain's next to it), stale answers
(the value before an edit), the hit kinds the lookup made, the share of the image's tokens recomputed (a miss or a
counted fallback recomputes every token) and the time to the first token against plain's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from transformers import DynamicCache, StoppingCriteriaList

from vismemo_hf import VisMemoCache, VisMemoStore, enable
from vismemo_hf.bench.report import command as report_command
from vismemo_hf.bench.report import header, machine
from vismemo_hf.eval import context
from vismemo_hf.eval.quality import TokenClock, anls
from vismemo_hf.progress import progress as progress_bar

#: the routings compared: the library's default and the two published baselines under the same lookup and store
#: (``--policies all``), and on request the default with each image's whole encode (no encoder reuse)
POLICIES = {"default": {}, "cacheblend": {"policy": "cacheblend"}, "vismemo": {"policy": "vismemo"},
            "whole-encode": {"policy": "attend-deviate-whole-encode"}}
ALL = ("default", "cacheblend", "vismemo")
#: the front of the context check (``--front``): the size of a small context change (``ContextRouting.small_change``,
#: tokens) swept, larger changes checked instead of computed in full (``check_large``), the default with its
#: confidence guard off, the check layer alone (no probes, no guard) and every token computed
FRONT: dict[str, dict] = {"small <= 8, larger in full (default)": {},
         "small <= 16, larger in full": {"context": {"small_change": 16}},
         "small <= 32, larger in full": {"context": {"small_change": 32}},
         "small <= 8, larger checked": {"context": {"check_large": True}},
         "small <= 0, every change checked": {"context": {"small_change": 0, "check_large": True}},
         "small <= 16, no guard": {"context": {"small_change": 16, "min_confidence": 0.0, "watch_tokens": 0}},
         "check layer only": {"context": {"small_change": 0, "check_large": True, "probe_share": 0.0,
                                          "min_confidence": 0.0}},
         "every token (full)": {"policy": "full"}}
#: labels an earlier ``context.json``'s front used for the same options (``--front-from``)
FRONT_ALIASES = {"small <= 8": "small <= 8, larger checked", "small <= 8 (default)": "small <= 8, larger checked",
                 "small <= 0 (every change checked in full)": "small <= 0, every change checked"}
FRONT_CLASSES = tuple(c for c in context.CLASSES if c.startswith(("text-", "image-", "images-", "agent-")))
READERS = {"vismemo-docqa-base": "docpage", "vismemo-docqa-tiny": "synthdoc"}
#: the routings ``vismemo calibrate --context`` chooses from: the front's context routings that keep their guards
#: (probes, confidence guard, watch) and the strictest, every change computed in full (chosen when none of the others
#: agrees on every class). Each is passed as a ``context``, the default's empty: no model's calibrated tolerance
#: replaces it while it is measured
CANDIDATES: dict[str, dict[str, dict]] = {
    **{label: {"context": FRONT[label].get("context", {})} for label in (
        "small <= 8, larger in full (default)", "small <= 16, larger in full", "small <= 32, larger in full",
        "small <= 8, larger checked", "small <= 0, every change checked")},
    "every change in full": {"context": {"small_change": 0}}}
DEFAULT_CANDIDATE, STRICTEST = next(iter(CANDIDATES)), "every change in full"


@torch.no_grad()
def answer(model, processor, parts, question: str, cache, max_new_tokens: int) -> tuple[str, float]:
    """(greedy answer, ms to the first token) of one request."""
    messages, images = context.chat(parts, question)
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=images, return_tensors="pt").to(model.device)
    clock = TokenClock(model.device)
    t0 = time.perf_counter()
    out = model.generate(**inputs, cache=cache, max_new_tokens=max_new_tokens, do_sample=False,
                         stopping_criteria=StoppingCriteriaList([clock]))
    tokens = out[0, inputs["input_ids"].shape[1]:]
    return processor.tokenizer.decode(tokens, skip_special_tokens=True).strip(), (clock.times[0] - t0) * 1e3


def run_case(model, plain, processor, case: context.Case, policies: dict, max_new_tokens: int = 6) -> list[dict]:
    """Rows (one per policy and question) of one case: the page stored by ``case.stored`` in a fresh store, then each
    question asked by ``case.asked`` with a cache that stores nothing (the store stays as the first request left it)."""
    refs = [answer(plain, processor, case.asked, q.question, DynamicCache(), max_new_tokens) for q in case.questions]
    rows = []
    for name, options in policies.items():
        store = VisMemoStore()
        answer(model, processor, case.stored, case.questions[0].question, VisMemoCache(store=store, **options),
               max_new_tokens)
        store.flush()  # the stored page written, so that what is measured does not depend on the writer's timing
        for q, (ref, ref_ms) in zip(case.questions, refs):
            cache = VisMemoCache(store=store, store_misses=False, **{"approximate": "always", **options})
            pred, ms = answer(model, processor, case.asked, q.question, cache, max_new_tokens)
            event = cache.events[-1]  # the page's (another page may come first)
            rows.append({"class": case.cls, "policy": name, "question": q.question, "prediction": pred,
                         "plain": ref, "answers": list(q.answers), "agree": pred == ref,
                         "anls": anls(pred, list(q.answers)), "plain_anls": anls(ref, list(q.answers)),
                         "stale": q.stale is not None and pred == q.stale and ref != q.stale,
                         "kind": str(event.kind), "intended": case.intended,
                         "recomputed_share": event.recomputed / event.n_tokens if event.n_tokens else 0.0,
                         "encoded_share": event.encoded_tokens / event.n_tokens if event.n_tokens else 0.0,
                         "prefix_changed": event.prefix_changed, "context_change": event.context_change,
                         "fallback": event.fallback,
                         "verify_estimate": event.verify_estimate,
                         "ttft_ms": ms, "plain_ttft_ms": ref_ms})
    return rows


def summarise(rows: list[dict]) -> dict:
    """{class: {policy: figures}} over the rows."""
    out: dict = {}
    for row in rows:
        out.setdefault(row["class"], {}).setdefault(row["policy"], []).append(row)

    def mean(xs):
        return sum(xs) / len(xs) if xs else float("nan")

    for by_policy in out.values():
        for name, rs in by_policy.items():
            kinds: dict[str, int] = {}
            for r in rs:
                label = r["fallback"] or r["kind"]
                kinds[label] = kinds.get(label, 0) + 1
            by_policy[name] = {
                "n": len(rs), "agreement": mean([r["agree"] for r in rs]), "anls": mean([r["anls"] for r in rs]),
                "plain_anls": mean([r["plain_anls"] for r in rs]), "stale": sum(r["stale"] for r in rs),
                "recomputed_share": mean([r["recomputed_share"] for r in rs]), "kinds": kinds,
                "encoded_share": mean([r.get("encoded_share", float("nan")) for r in rs]),
                "ttft_ratio": mean([r["ttft_ms"] / r["plain_ttft_ms"] for r in rs])}
    return out


def measure(reader: str, seed: int, per_class: int, policies: dict, classes=context.CLASSES, max_new_tokens: int = 6,
            desc: str | None = None, quiet: bool = False, family: str | None = None,
            weight_seed: int = 0) -> tuple[list[dict], dict]:
    """(rows, summary) of ``reader`` (a reader, a checkpoint, or a preset with ``family`` and ``weight_seed``) on
    ``per_class`` cases of every class, from ``seed`` (docpage pages for any model but the tiny reader); a bar
    (``desc``, default the reader; none when ``quiet``) counts the cases."""
    from vismemo_hf.eval.loading import load_model

    model, processor = load_model(reader, family, seed=weight_seed)
    plain, _ = load_model(reader, family, seed=weight_seed)  # never enabled: plain transformers
    enable(model)
    cases = context.cases(READERS.get(reader, "docpage"), seed, per_class, classes)
    answer(model, processor, cases[0].stored, cases[0].questions[0].question, DynamicCache(), 1)  # warm up
    rows = []
    for case in progress_bar(cases, desc=desc or reader, unit="case", disable=quiet):
        rows.extend(run_case(model, plain, processor, case, policies, max_new_tokens))
    return rows, summarise(rows)


def _table(summary: dict, policies: list[str]) -> list[str]:
    head = "| class | plain ANLS | " + " | ".join(
        f"{p}: agreement | {p}: ANLS | {p}: stale | {p}: recomputed | {p}: encoded | {p}: TTFT / plain | {p}: kinds"
        for p in policies)
    lines = [head, "| " + " | ".join(["---"] * (2 + 7 * len(policies))) + " |"]
    for cls, by_policy in summary.items():
        first = by_policy[policies[0]]
        cells = [cls, f"{first['plain_anls']:.3f}"]
        for p in policies:
            s = by_policy[p]
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(s["kinds"].items()))
            cells += [f"{s['agreement']:.3f}", f"{s['anls']:.3f}", str(s["stale"]), f"{s['recomputed_share']:.3f}",
                      f"{s['encoded_share']:.3f}", f"{s['ttft_ratio']:.2f}", kinds]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(args) -> int:
    torch.manual_seed(0)
    readers = [r for r in args.readers.split(",") if r]
    unknown = [r for r in readers if r not in READERS]
    if unknown:
        raise ValueError(f"unknown reader(s) {unknown}; readers: {', '.join(READERS)}")
    names = list(ALL) if args.policies == "all" else args.policies.split(",")
    bad = [p for p in names if p not in POLICIES]
    if bad:
        raise ValueError(f"unknown policy label(s) {bad}; labels: {', '.join(POLICIES)}")
    classes = context.CLASSES if args.classes == "all" else tuple(args.classes.split(","))
    unknown = [c for c in classes if c not in context.CLASSES]
    if unknown:  # before any model loads
        raise ValueError(f"unknown context class(es) {unknown}; classes: {', '.join(context.CLASSES)}")
    policies = {p: POLICIES[p] for p in names}
    t0 = time.time()
    results, all_rows = {}, {}
    for reader in readers:
        rows, summary = measure(reader, args.seed, args.pairs, policies, classes, args.max_new_tokens,
                                quiet=args.quiet)
        results[reader], all_rows[reader] = summary, rows
    command = report_command("report context", args, ["readers", "pairs", "seed", "policies", "classes", "front_pairs"]
                             + (["front_from"] if getattr(args, "front_from", None) else [])
                             + (["heldout_seeds"] if getattr(args, "heldout_seeds", "") else []))
    mach = machine(note="fp32")
    report = {"command": command, "machine": mach, "seconds": round(time.time() - t0),
              "results": results, "rows": all_rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "context.json").write_text(json.dumps(report, indent=1))
    lines = header("Reuse after another context and small changes", command, mach) + [
        "Each page is stored by one request and asked about by another, three questions per page "
        "(`src/vismemo_hf/eval/context.py`: the first about what changed, where something did). Agreement: the "
        "whole greedy answer equals plain transformers' on the same request (a never-enabled copy of the weights); "
        "ANLS against the page's truth (plain's in the second column); stale: answers that give the value before "
        "an edit (plain does not); recomputed: the share of the image's tokens computed after the warmup (a miss "
        "or a fallback computes every one); encoded: the share of the image's tokens the vision tower ran for (0 on "
        "an exact hit; above 1 when a fallback encoded the whole image after a partial encode); TTFT / plain: time "
        "to the first token against plain's on the same "
        "request (CPU, a few ms each, noisy); kinds: the events (exact, approximate, miss, or the fallback that "
        "computed the image in full)."]
    for reader, summary in results.items():
        lines += ["", f"## {reader}", ""] + _table(summary, names)
    (out / "context.md").write_text("\n".join(lines) + "\n")  # the main part kept if the front is interrupted
    front, note = _front(args, readers)
    if front is not None:
        report["front"] = front
        (out / "context.json").write_text(json.dumps(report, indent=1))
        lines += _front_lines(front, args, note)
        (out / "context.md").write_text("\n".join(lines) + "\n")
    seeds = [int(s) for s in getattr(args, "heldout_seeds", "").split(",") if s]
    if seeds:
        heldout = {reader: {seed: measure(reader, seed, args.pairs, {"default": {}}, classes,
                                          args.max_new_tokens, desc=f"{reader} (seed {seed})",
                                          quiet=args.quiet)[1] for seed in seeds} for reader in readers}
        report["heldout"] = heldout
        (out / "context.json").write_text(json.dumps(report, indent=1))
        lines += _heldout_lines(heldout, classes, args.pairs)
    (out / "context.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def choose(summary: dict, classes, min_agreement: float, excluded=()) -> tuple[str, dict]:
    """(label, figures per candidate) of the ``CANDIDATES`` routing that recomputes least (mean share over the
    classes; the default on a tie) among those agreeing with a full prefill on at least ``min_agreement`` of every
    class's answers with no stale answer, but for the ``excluded``; ``STRICTEST`` when none does."""
    figures = {}
    for label in CANDIDATES:
        got = [summary[c][label] for c in classes]
        worst, stale = min(g["agreement"] for g in got), sum(g["stale"] for g in got)
        figures[label] = {"worst_agreement": worst, "stale": stale,
                          "recomputed": sum(g["recomputed_share"] for g in got) / len(got),
                          "passes": worst >= min_agreement and stale == 0}
    passing = [label for label in CANDIDATES if figures[label]["passes"] and label not in excluded]
    if not passing:
        return STRICTEST, figures
    return min(passing, key=lambda label: (round(figures[label]["recomputed"], 3), label != DEFAULT_CANDIDATE)), figures


def calibrate_context(model: str, pairs: int, seed: int, min_agreement: float, quiet: bool = False,
                      family: str | None = None, weight_seed: int = 0, heldout: int = 2) -> dict:
    """``vismemo calibrate --context``: every ``CANDIDATES`` routing on ``pairs`` cases of each context class
    (``FRONT_CLASSES``) of ``model`` from ``seed``, the one chosen (``choose``), and that one again on ``heldout``
    other seeds (``seed + 1`` on): where it fails there (a class below ``min_agreement`` or a stale answer on any
    seed), it is left out and the next is chosen and checked in turn, down to ``STRICTEST`` (every change computed
    in full, which agrees by construction). ``heldout``: the figures of each routing checked."""
    def run(policies: dict, case_seed: int, label: str) -> dict:
        return measure(model, case_seed, pairs, policies, FRONT_CLASSES, desc=f"{model} ({label}, seed {case_seed})",
                       quiet=quiet, family=family, weight_seed=weight_seed)[1]

    summary = run(CANDIDATES, seed, "context")
    excluded: list[str] = []
    checked: dict[str, dict] = {}
    chosen, figures = choose(summary, FRONT_CLASSES, min_agreement)
    while chosen != STRICTEST:
        held = [run({chosen: CANDIDATES[chosen]}, seed + k, "held out") for k in range(1, heldout + 1)]
        got = [by_class[c][chosen] for by_class in held for c in FRONT_CLASSES]
        worst, stale = min(g["agreement"] for g in got), sum(g["stale"] for g in got)
        checked[chosen] = {"seeds": [seed + k for k in range(1, heldout + 1)], "worst_agreement": worst,
                           "stale": stale, "passes": worst >= min_agreement and stale == 0}
        if checked[chosen]["passes"]:
            break
        excluded.append(chosen)
        chosen, figures = choose(summary, FRONT_CLASSES, min_agreement, excluded)
    return {"chosen": chosen, "options": CANDIDATES[chosen]["context"], "figures": figures, "summary": summary,
            "heldout": checked}


def calibration_lines(report: dict, min_agreement: float) -> list[str]:
    """The calibration's table: per candidate, the worst agreement, stale answers, mean recomputed share and each
    class's agreement / recomputed share; the chosen one marked."""
    summary = report["summary"]
    lines = ["| routing | passes | worst agreement | stale | recomputed | " + " | ".join(
        f"{c}: agreement / recomputed" for c in FRONT_CLASSES) + " |", "| " + " | ".join(
        ["---"] * (5 + len(FRONT_CLASSES))) + " |"]
    for label, f in report["figures"].items():
        cells = [f"{summary[c][label]['agreement']:.3f} / {summary[c][label]['recomputed_share']:.2f}"
                 for c in FRONT_CLASSES]
        name = f"**{label} (chosen)**" if label == report["chosen"] else label
        lines.append(f"| {name} | {'yes' if f['passes'] else 'no'} | {f['worst_agreement']:.3f} | {f['stale']} | "
                     f"{f['recomputed']:.2f} | " + " | ".join(cells) + " |")
    lines += ["", f"Passes: agreement >= {min_agreement} on every class and no stale answer. Each routing chosen was "
              "checked on held-out case seeds (other pages, texts and edits) and left out where it failed there:", "",
              "| routing | held-out seeds | worst agreement | stale | passes |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {label} | {', '.join(map(str, h['seeds']))} | {h['worst_agreement']:.3f} | {h['stale']} | "
              f"{'yes' if h['passes'] else 'no'} |" for label, h in report["heldout"].items()]
    return lines


def _front(args, readers: list[str]) -> tuple[dict | None, str]:
    """(front, a note on where it came from): measured, or read from an earlier run's json (``--front-from``)."""
    if getattr(args, "front_from", None):  # the front of an earlier run (its options named, not the default's)
        earlier = json.loads(Path(args.front_from).read_text())
        front = {reader: {cls: {FRONT_ALIASES.get(k, k): v for k, v in by.items()} for cls, by in summary.items()}
                 for reader, summary in earlier["front"].items() if reader in readers}
        missing = [(r, c, n) for r in readers for c in FRONT_CLASSES for n in FRONT
                   if n not in front.get(r, {}).get(c, {})]
        if missing:
            raise ValueError(f"{args.front_from} lacks front points {missing[:3]}")
        return front, f" Measured by `{earlier['command']}` (its options as labelled here)."
    if args.front_pairs:
        return {reader: measure(reader, args.seed + 1, args.front_pairs, FRONT, FRONT_CLASSES, args.max_new_tokens,
                                desc=f"{reader} (front)", quiet=args.quiet)[1] for reader in readers}, ""
    return None, ""


def _front_lines(front: dict, args, note: str) -> list[str]:
    lines = ["", "## The context check's front", "",
             f"The classes of another text or page before the image (seed {args.seed + 1}, "
             f"{args.front_pairs} pages per class, three questions each). Swept: the largest context change "
             "(in tokens of text, `context.small_change`) checked as a small one (the 15 % whose K/V deviate "
             "most at the check layer recomputed, the rest verified by probes against "
             "`context.small_tolerance` and by the confidence guard); larger changes computed in full (the "
             "default) or checked (`context.check_large`: the tokens past `context.tolerance` at the check layer "
             "recomputed, probes against `context.probe_tolerance`, more than `context.miss_ratio` of the image "
             "computes it all); at 16, without the confidence guard and watch (`context.min_confidence=0`, "
             "`context.watch_tokens=0`); the check layer alone (no probes, no guard) and the `full` policy (every "
             "token computed). Worst: the lowest agreement over the classes; recomputed: the mean share of an "
             "image's tokens computed (a fallback computes all)." + note]
    for reader, summary in front.items():
        lines += ["", f"### {reader}", "", "| routing | worst agreement | stale | " + " | ".join(
            f"{c}: agreement / recomputed" for c in FRONT_CLASSES) + " |",
                  "| " + " | ".join(["---"] * (3 + len(FRONT_CLASSES))) + " |"]
        for name in FRONT:
            worst = min(summary[c][name]["agreement"] for c in FRONT_CLASSES)
            stale = sum(summary[c][name]["stale"] for c in FRONT_CLASSES)
            cells = [f"{summary[c][name]['agreement']:.3f} / {summary[c][name]['recomputed_share']:.2f}"
                     for c in FRONT_CLASSES]
            lines.append(f"| {name} | {worst:.3f} | {stale} | " + " | ".join(cells) + " |")
    return lines


def _heldout_lines(heldout: dict, classes, pairs: int) -> list[str]:
    """The default on other case seeds: agreement / recomputed share per class and seed, the worst agreement and
    the stale answers over them."""
    lines = ["", "## The default on held-out seeds", "",
             f"The same classes drawn from other case seeds ({pairs} pages per class, three questions each: other "
             "pages, texts, lengths and edits); agreement / recomputed share per seed, the worst agreement and the "
             "stale answers over the seeds."]
    for reader, by_seed in heldout.items():
        seeds = list(by_seed)
        lines += ["", f"### {reader}", "", "| class | " + " | ".join(f"seed {s}" for s in seeds) + " | worst | stale |",
                  "| " + " | ".join(["---"] * (3 + len(seeds))) + " |"]
        for cls in classes:
            got = [by_seed[s][cls]["default"] for s in seeds]
            cells = [f"{g['agreement']:.3f} / {g['recomputed_share']:.2f}" for g in got]
            lines.append(f"| {cls} | " + " | ".join(cells) + f" | {min(g['agreement'] for g in got):.3f} | "
                         f"{sum(g['stale'] for g in got)} |")
    return lines


"""The ``vismemo`` command line (``parser``: one builder per command; ``main``: one-line errors)."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import textwrap
import warnings
from typing import Any, cast

from vismemo_hf.defaults import DEFAULT_POLICY, FAMILY_NAMES


def _demo_requests():
    """Five requests on synthetic forms: (name, page, question, expected answer)."""
    import random

    from vismemo_hf.eval import synthdoc

    base = synthdoc.random_form(11)
    edited = synthdoc.edit_value(base, 2, random.Random(0))
    other = synthdoc.random_form(12)
    ask = lambda page, row: (synthdoc.question_for(page.rows[row][0]), page.rows[row][1])  # noqa: E731
    return [
        ("base page", base, *ask(base, 0)),
        ("same page, other question", base, *ask(base, 4)),
        ("edited copy, edited value", edited, *ask(edited, 2)),
        ("shifted copy", synthdoc.shift(base, 2, 1), *ask(base, 1)),
        ("unrelated page", other, *ask(other, 3)),
    ]


def demo(args) -> int:
    import torch

    from vismemo_hf import VisMemoCache, VisMemoStore, enable, get_policy
    from vismemo_hf.eval import synthdoc
    from vismemo_hf.eval.docqa import messages
    from vismemo_hf.eval.loading import load_model

    get_policy(args.policy)  # a bad policy is an error before the model loads
    torch.manual_seed(0)
    model, processor = load_model(args.model, args.family)
    enable(model)
    store = VisMemoStore()
    rows = []
    for name, page, question, expected in _demo_requests():
        text = processor.apply_chat_template(messages(question), add_generation_prompt=True)
        inputs = processor(text=[text], images=[synthdoc.render(page)], return_tensors="pt")
        cache = VisMemoCache(store=store, policy=args.policy)
        with torch.no_grad():
            out = model.generate(**inputs, cache=cache, max_new_tokens=args.new_tokens, do_sample=False)
        store.flush()  # the entry's write and an approximate hit's completion finish between the requests shown
        (event,) = cache.events
        answer = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        rows.append({
            "request": name, "question": question, "expected": expected, "answer": answer,
            "kind": str(event.kind), "alias": event.alias[:8] if event.alias else "-",
            "R": event.recomputed, "B": event.reused, "M": event.masked, "N": event.n_tokens,
            "prefill_ms": round(event.timings["prefill"], 1),
        })
    if args.json:
        print(json.dumps({"model": args.model, "requests": rows, "store": store.stats()}, indent=2, default=str))
        return 0
    print(f"vismemo demo: model {args.model!r} on CPU, policy {args.policy!r}, synthetic forms")
    header = (f"{'request':<27} {'question':<8} {'expected':<8} {'answer':<8} {'hit':<12} {'alias':<9} "
              f"{'R/B/M of N':<13} {'prefill ms':>10}")
    print(header)
    print("-" * len(header))
    for r in rows:
        rbm = f"{r['R']}/{r['B']}/{r['M']} of {r['N']}"
        print(f"{r['request']:<27} {r['question']:<8} {r['expected']:<8} {r['answer']:<8} {r['kind']:<12} "
              f"{r['alias']:<9} {rbm:<13} {r['prefill_ms']:>10.1f}")
    s = store.stats()
    print(f"store: {s['entries']} entries, {s['bytes'] / 1024:.0f} KiB; hits {s['hits']} (each request timed after "
          "the store's background work for the one before it finished; streams: vismemo bench workload)")
    return 0


def tasks_path(args) -> int:
    from importlib.resources import files

    print(files("vismemo_hf.eval_tasks"))
    return 0


def list_presets(args) -> int:
    from vismemo_hf import presets

    print("search path: " + ", ".join(str(d) for d in presets.search_path()))
    for kind in [args.kind] if args.kind else list(presets.KINDS):
        print(f"\n{kind} ({presets.KINDS[kind]}s):")
        found = presets.listing(kind)
        width = max((len(name) for name, _, _ in found), default=0)
        for name, path, shadowed in found:
            print(f"  {name:<{width}}  {path}" + (f"  (shadows {', '.join(map(str, shadowed))})" if shadowed else ""))
    return 0


def profile_vlcache(args) -> int:
    from pathlib import Path

    import yaml

    from vismemo_hf import presets
    from vismemo_hf.eval.loading import load_model
    from vismemo_hf.eval.vlcache_profile import layer_sensitivity

    model, processor = load_model(args.model, args.family)
    sensitivity = layer_sensitivity(model, processor, pairs=args.pairs, seed=args.seed)
    name = args.name or f"{Path(args.model).name}-{model.config.model_type}"
    out = Path(args.out) if args.out else presets.write_path("vlcache", name)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = ("vismemo profile-vlcache " + " ".join(sys.argv[sys.argv.index("profile-vlcache") + 1:])
               if args.record_argv and "profile-vlcache" in sys.argv else None)  # global options left out
    data = {
        "model": args.model,
        "family": model.config.model_type,
        "layers": len(sensitivity),
        "pairs": args.pairs,
        "command": command,
        "sensitivity": [round(x, 8) for x in sensitivity],
    }
    out.write_text("# VL-Cache layer-sensitivity profile (relative K/V deviation of reuse per layer)\n"
                   + yaml.safe_dump(data, sort_keys=False))
    print(f"wrote {out} ({len(sensitivity)} layers)")
    return 0


def calibrate_context(args) -> int:
    """``vismemo calibrate --context``: the model's context tolerance into ``configs/context/NAME.yaml``."""
    import json
    from pathlib import Path

    import yaml

    from vismemo_hf import presets
    from vismemo_hf.bench import context as report
    from vismemo_hf.bench.report import header, machine
    from vismemo_hf.eval.loading import load_model
    from vismemo_hf.families.base import model_fingerprint
    from vismemo_hf.policies import tolerance

    model, _ = load_model(args.model, args.family, seed=args.seed)
    fingerprint = model_fingerprint(model)
    del model
    found = report.calibrate_context(args.model, args.context_pairs, args.context_seed, args.min_agreement,
                                     family=args.family, weight_seed=args.seed, heldout=args.heldout_seeds)
    name = args.name or (Path(args.model).name if args.family is None else f"{Path(args.model).name}-{args.family}")
    out = Path(args.out) if args.out else presets.write_path(tolerance.KIND, name)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = (f"vismemo calibrate --context --model {args.model}" + (f" --family {args.family}" if args.family else "")
               + f" --context-pairs {args.context_pairs} --context-seed {args.context_seed}"
               + f" --min-agreement {args.min_agreement} --heldout-seeds {args.heldout_seeds}"
               + (f" --name {args.name}" if args.name else ""))
    chosen = found["figures"][found["chosen"]]
    preset = {"fingerprint": fingerprint, "context": found["options"],
              "calibration": {"model": args.model, "command": command, "routing": found["chosen"],
                              "worst_agreement": round(chosen["worst_agreement"], 4),
                              "recomputed": round(chosen["recomputed"], 4), "cases_per_class": args.context_pairs,
                              **({"heldout_worst_agreement": round(found["heldout"][found["chosen"]]["worst_agreement"], 4)}
                                 if found["chosen"] in found["heldout"] else {})}}
    out.write_text("# context tolerance of one model (vismemo calibrate --context): any VisMemoCache serving it uses\n"
                   "# these ContextRouting fields over its routing's default (none: the default)\n"
                   + yaml.safe_dump(preset, sort_keys=False))
    tolerance.forget()
    results = Path(args.report_dir or "results/quality/context-calibration")
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps({"command": command, **preset, **found}, indent=1))
    lines = header(f"Context tolerance of {args.model}", command, machine(note="fp32")) + [
        f"Preset: `{out}` (routing: {found['chosen']}; `context: {found['options']}`). Each candidate routing answers "
        f"{args.context_pairs} cases of every context class of `vismemo report context` (three questions each: "
        "another text of 1-300 characters before the page, exact and edited; 1-3 other pages before it; an "
        "agent's window of 2-3 screenshots slid by one). Agreement: the greedy answer equals plain transformers'; "
        "recomputed: the mean share of the page's tokens computed (a fallback computes all). The chosen routing is "
        "the one that recomputes least among those that pass, on this seed and on the held-out seeds; where none "
        "does, every change is computed in full.",
        ""] + report.calibration_lines(found, args.min_agreement)
    (results / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}")
    return 0


def calibrate(args) -> int:
    import json
    from pathlib import Path

    import yaml

    from vismemo_hf import presets

    if args.context:
        return calibrate_context(args)
    from vismemo_hf.bench.report import header, machine
    from vismemo_hf.eval.calibrate import calibrate as measure
    from vismemo_hf.eval.docstream import reader_pages
    from vismemo_hf.eval.loading import load_model

    model, _ = load_model(args.model, args.family, seed=args.seed)
    pages, _ = reader_pages(args.model, args.pages)
    report = measure(model, per_kind=args.pairs_per_kind, pages=pages)
    name = args.name or (Path(args.model).name if args.family is None else f"{Path(args.model).name}-{args.family}")
    out = Path(args.out) if args.out else presets.write_path("lookup", name)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = (f"vismemo calibrate --model {args.model}" + (f" --family {args.family}" if args.family else "")
               + f" --pages {args.pages} --pairs-per-kind {args.pairs_per_kind} --seed {args.seed}"
               + (f" --name {args.name}" if args.name else ""))
    summary = {k: report[k] for k in ("calibration", "heldout", "heldout_from_sketches", "heldout_without_pixel_stage",
                                      "defaults", "defaults_without_pixel_stage", "uncentred_rule")}
    pixel = {k: report[k] for k in ("tau_pixel", "tau_near") if report[k] is not None}
    preset = {"tau": report["tau"], "tau_fine": report["tau_fine"], **pixel, "fingerprint": report["fingerprint"],
              "calibration": {"model": args.model, "family": model.config.model_type, "command": command,
                              "heldout_recall": round(report["heldout"]["recall"], 4),
                              "heldout_fpr": round(report["heldout"]["fpr"], 4),
                              "sketch_agreement": round(report["sketch_agreement"], 4)}}
    out.write_text("# lookup thresholds for one model: VisMemoCache(thresholds=NAME or PATH)\n"
                   + yaml.safe_dump(preset, sort_keys=False))
    results = Path(args.report_dir or "results/lookup")
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps({"command": command, **preset, **summary,
                                                      "sketch_agreement": report["sketch_agreement"],
                                                      "max_unrelated_fine": report["max_unrelated_fine"],
                                                      "max_unrelated_pixel": report["max_unrelated_pixel"]}, indent=2))
    lines = header(f"Lookup thresholds for {args.model}" + (f" ({args.family})" if args.family else ""), command,
                   machine()) + [
        f"Preset: `{out.name}` (tau {report['tau']}, tau_fine {report['tau_fine']}"
        + (f"; pixel stage: tau_pixel {pixel['tau_pixel']} for fine scores from tau_near {pixel['tau_near']}"
           if pixel else "; no pixel stage")
        + f"; the closest unrelated calibration pairs: fine {report['max_unrelated_fine']:.4f}, pixel "
          f"{report['max_unrelated_pixel']:.4f}). Pairs: synthetic documents "
        + ("(`docpage` pages of the five layouts with the near-duplicate kinds of `docstream`, and `synthdoc` "
           "forms of five page styles)" if pages == "docpage" else "(five page styles)")
        + ", text pages, forms of one template, screens, photos and textures; near-duplicates are "
        "small changes of one image, unrelated pairs two images of the same kind and size. Calibration seed 1, "
        "held-out seed 2. Sketch agreement: the fine "
        f"decision from 32-d token sketches equals the full-width one on {report['sketch_agreement']:.3f} of pairs.",
        "", "| rule | pairs | recall | false-positive rate |", "| --- | --- | --- | --- |"]
    for label, key in (("calibrated, calibration pairs", "calibration"), ("calibrated, held-out pairs", "heldout"),
                       ("calibrated, held-out, from sketches", "heldout_from_sketches"),
                       ("calibrated, held-out, without the pixel stage", "heldout_without_pixel_stage"),
                       ("defaults (pixel-first, derived pixel stage, centred, adaptive tau_fine), held-out", "defaults"),
                       ("defaults without the derived pixel stage (derive_pixel=False), held-out",
                        "defaults_without_pixel_stage"),
                       ("uncentred cosines at 0.8 / 0.8 (docs/METHOD.md §1), held-out", "uncentred_rule")):
        r = summary[key]
        lines.append(f"| {label} | {r['near_pairs']} + {r['unrelated_pairs']} | {r['recall']:.3f} | {r['fpr']:.3f} |")
    lines += ["", "Held-out pairs by source (calibrated thresholds):", "",
              "| source | pairs | recall | false-positive rate |", "| --- | --- | --- | --- |"]
    lines += [f"| {k} | {v['near_pairs']} + {v['unrelated_pairs']} | {v['recall']:.3f} | {v['fpr']:.3f} |"
              for k, v in summary["heldout"]["by_source"].items()]
    lines += ["", "Held-out recall by kind of change: calibrated thresholds, defaults (derived pixel stage: tau_pixel "
              f"{report['default_pixel_stage']}), defaults without it:", "",
              "| change | calibrated | defaults | without the derived pixel stage |", "| --- | --- | --- | --- |"]
    lines += [f"| {k} | {v:.2f} | {summary['defaults']['recall_by_kind'][k]:.2f} | "
              f"{summary['defaults_without_pixel_stage']['recall_by_kind'][k]:.2f} |"
              for k, v in summary["heldout"]["recall_by_kind"].items()]
    (results / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}")
    return 0


def _at_least(least: int):
    """An argparse type: an integer of at least ``least`` (a smaller one is a one-line usage error)."""

    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"an integer expected, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"at least {least} expected, got {value}")
        return value

    return check


#: a count of at least 1, and one that may be 0
positive, nonnegative = _at_least(1), _at_least(0)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers expected, got {text!r}") from None


def _checked_list(cast, what: str):
    """An argparse type: a comma-separated list of ``what`` checked by ``cast``, kept as the text the commands
    parse (a bad item is a usage error naming the option, before anything runs)."""
    def check(text: str) -> str:
        if not text:  # an empty list (e.g. no sweep)
            return text
        try:
            [cast(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"comma-separated {what} expected, got {text!r}") from None
        return text

    return check


INTS, NUMBERS = _checked_list(int, "integers"), _checked_list(float, "numbers")


def _preset_options(p: argparse.ArgumentParser, preset: str) -> None:
    p.add_argument("--preset", default=preset, help="model preset (random weights)")
    p.add_argument("--family", default=None, choices=FAMILY_NAMES, help="family of family-agnostic presets")


def _device_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="float32", help="model dtype")
    p.add_argument("--device", default="cpu", help="torch device")


#: optional modules a command imports only after some of its work (plots, the Redis client): checked before it
#: starts, so that a missing extra is one line at once rather than after a sweep (``main``)
NEEDS = {"latency": ("matplotlib",), "trace": ("matplotlib",), "soak": ("matplotlib", "redis"),
         "table1": ("matplotlib",), "pareto": ("matplotlib",)}


def _bench(name: str):
    def run(args) -> int:
        import importlib

        return importlib.import_module(f"vismemo_hf.bench.{name}").main(args)

    cast(Any, run).needs = NEEDS.get(name, ())  # the optional modules it imports
    return run


def _needs(args) -> list[str]:
    """The optional modules this run of a command imports."""
    needs = list(getattr(args.func, "needs", ()))
    if args.command == "build-stream":
        needs.append("datasets")
    if getattr(args, "remote", None):
        needs.append("redis")
    return needs


def train_docqa(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    out = args.out or f"checkpoints/docqa-{args.reader}"
    if args.reader == "base":
        from vismemo_hf.eval.docqa_base import train as train_base

        options = {k: v for k, v in (("batch_size", args.batch_size), ("lr", args.lr),
                                     ("total_steps", args.total_steps)) if v is not None}
        result = train_base(out, minutes=args.minutes, max_steps=args.max_steps, seed=args.seed, **options)
        print(f"step {result['step']}: latest state in {out}/state, best model in {out}/model "
              f"(held-out exact {result['best']:.3f})")
        return 0
    from vismemo_hf.eval.docqa import train as train_tiny

    result = train_tiny(out, minutes=args.minutes, max_steps=args.max_steps, batch_size=args.batch_size or 32,
                        seed=args.seed, lr=args.lr or 2e-3, resume=args.resume)
    print(f"saved the best checkpoint to {out} after {result['steps']} steps")
    return 0


def build_stream(args) -> int:
    from collections import Counter

    from vismemo_hf.eval import synthdoc

    out = args.out or f".cache/vismemo-data/{args.task}/test.parquet"
    if args.task == "synthdoc":
        requests = [r for seed in args.seeds.split(",") for r in synthdoc.stream(int(seed), n_bases=args.bases)]
        rows = synthdoc.request_rows(requests)
    else:
        pages = _real_pages(args)
        near = {}
        if args.near_model:
            from vismemo_hf.eval.loading import load_model

            model, processor = load_model(args.near_model)
            near = synthdoc.near_duplicates({pid: image for pid, image, _ in pages}, model, processor)
        rows = synthdoc.page_stream(pages, seed=args.seed, near=near)
    path = synthdoc.save_rows(rows, out)
    kinds = Counter(r["intended"] for r in rows)
    variants = Counter(r["variant"] for r in rows)
    print(f"wrote {len(rows)} requests to {path}")
    print("intended hit kinds: " + ", ".join(f"{k} {kinds.get(k, 0)}" for k in ("miss", "exact", "approximate")))
    print("variants: " + ", ".join(f"{k} {v}" for k, v in sorted(variants.items())))
    return 0


#: columns naming the page image of a row, most specific first (DocVQA: docId; InfographicVQA: image_url)
PAGE_COLUMNS = ("docId", "image_url", "image_id", "questionId")
#: columns naming the document a page belongs to (DocVQA: ucsf_document_id)
DOCUMENT_COLUMNS = ("ucsf_document_id",)


def _real_pages(args) -> list[tuple[str, object, list[tuple[str, list[str]]]]]:
    """(page id, image, [(question, answers)]) from a local DocVQA / InfographicVQA copy: parquet files or a
    dataset in the HF datasets cache (HF_DATASETS_OFFLINE=1 keeps it offline). Pages of one document come
    together (other pages of a document or template are natural near-duplicate candidates)."""
    import glob

    import datasets

    if args.source is None:
        raise ValueError(f"{args.task} needs --source: parquet files or a cached HF dataset name")
    files = sorted(glob.glob(args.source))
    if files:
        data = datasets.load_dataset("parquet", data_files={"data": files}, split="data")
    else:
        data = datasets.load_dataset(args.source, split=args.split)
    missing = {"question", "answers", "image"} - set(data.column_names)
    if missing:
        raise ValueError(f"{args.source}: no column(s) {sorted(missing)}; expected the DocVQA / InfographicVQA schema")
    page_col = next(c for c in PAGE_COLUMNS if c in data.column_names) if any(
        c in data.column_names for c in PAGE_COLUMNS) else None
    doc_col = next((c for c in DOCUMENT_COLUMNS if c in data.column_names), None)
    pages: dict = {}
    for i, row in enumerate(data):
        page_id = str(row[page_col]) if page_col else str(i)
        if page_id not in pages and len(pages) == args.pages:
            break
        entry = pages.setdefault(page_id, [row["image"], [], str(row[doc_col]) if doc_col else page_id])
        entry[1].append((row["question"], list(row["answers"])))
    by_document: dict = {}
    for pid, (image, qas, doc) in pages.items():
        by_document.setdefault(doc, []).append((pid, image, qas))
    return [page for group in by_document.values() for page in group]


# -- the parser: one builder per command, shared option groups ----------------------------------------------
def _model_options(p, default="vismemo-docqa-tiny") -> None:
    p.add_argument("--model", default=default,
                   help="vismemo-docqa-tiny / vismemo-docqa-base (packaged readers), a checkpoint folder, a cached hub "
                        "id, or a model preset (random weights; vismemo presets models)")
    p.add_argument("--family", default=None, choices=FAMILY_NAMES,
                   help="family of family-agnostic presets such as tiny (default qwen2_vl)")


def _geometry_options(p) -> None:
    p.add_argument("--tokens", type=positive, default=1024, help="visual tokens per entry")
    p.add_argument("--layers", type=positive, default=36, help="decoder layers")
    p.add_argument("--kv-heads", type=positive, default=8, help="K/V heads per layer")
    p.add_argument("--head-dim", type=positive, default=128, help="head width")
    p.add_argument("--embed-dim", type=positive, default=4096, help="encoder output width")


def _out_option(p, default: str, what: str = "reports") -> None:
    p.add_argument("--out", default=default, help=f"folder for the {what} (default {default})")


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="five document requests through the packaged reading model (no downloads, no GPU)")
    _model_options(p)
    p.add_argument("--policy", default=DEFAULT_POLICY, help="routing policy name, preset or YAML path")
    p.add_argument("--new-tokens", type=positive, default=6, help="tokens generated per request")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(func=demo)


def _add_tasks_path(sub) -> None:
    p = sub.add_parser("tasks-path", help="print the folder of the lmms-eval tasks (for lmms-eval --include_path)")
    p.set_defaults(func=tasks_path)


def _add_presets(sub) -> None:
    from vismemo_hf.presets import KINDS

    p = sub.add_parser("presets", help="list the presets (models, policies, stores, lookup thresholds, VL-Cache "
                                       "profiles) found on the search path")
    p.add_argument("kind", nargs="?", choices=sorted(KINDS), help="only this kind (default: all)")
    p.set_defaults(func=list_presets)


def _add_profile(sub, argv) -> None:
    p = sub.add_parser("profile-vlcache", help="compute VL-Cache's per-layer sensitivity profile on calibration pairs")
    _model_options(p, default="tiny")
    p.add_argument("--pairs", type=positive, default=4, help="calibration image pairs")
    p.add_argument("--seed", type=int, default=0, help="pair and weight seed")
    p.add_argument("--name", default=None, help="profile name (default MODEL-FAMILY)")
    p.add_argument("--out", default=None, help="output YAML (default ./configs/vlcache/NAME.yaml)")
    p.set_defaults(func=profile_vlcache, record_argv=argv is None)


def _add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="measure lookup thresholds for one model and write a lookup preset")
    _model_options(p)
    p.add_argument("--seed", type=int, default=0, help="weight seed of random-weight presets")
    p.add_argument("--pages", default="auto", choices=("auto", "synthdoc", "docpage"),
                   help="document pairs (auto: docpage pages too for vismemo-docqa-base and its checkpoints)")
    p.add_argument("--pairs-per-kind", type=positive, default=10, help="image pairs per kind of change")
    p.add_argument("--name", default=None, help="preset name (default: the model's)")
    p.add_argument("--out", default=None, help="output YAML (default ./configs/lookup/NAME.yaml)")
    p.add_argument("--report-dir", default=None,
                   help="folder for the calibration report (default results/lookup; with --context "
                        "results/quality/context-calibration)")
    p.add_argument("--context", action="store_true",
                   help="measure the model's context tolerance instead (how much of a hit after another text, other "
                        "pages or a slid agent window it lets be reused) and write ./configs/context/NAME.yaml")
    p.add_argument("--context-pairs", type=positive, default=10, help="--context: cases per context class")
    p.add_argument("--context-seed", type=int, default=9100, help="--context: the cases' seed")
    p.add_argument("--min-agreement", type=float, default=0.98,
                   help="--context: the least agreement with a full prefill on every class")
    p.add_argument("--heldout-seeds", type=int, default=2,
                   help="--context: other case seeds the chosen routing must pass too (else the next is chosen)")
    p.set_defaults(func=calibrate)


def _add_train(sub) -> None:
    p = sub.add_parser("train-docqa", help="train a reading model on synthetic pages (CPU): vismemo-docqa-tiny or -base")
    p.add_argument("--reader", choices=["tiny", "base"], default="tiny",
                   help="tiny: 4 layers on one-glyph-per-token forms; base: 8 layers on 256-token realistic pages")
    p.add_argument("--minutes", type=float, default=55.0, help="wall-clock budget of this run")
    p.add_argument("--max-steps", type=positive, default=20000,
                   help="stop at this step (counted over resumed runs for base)")
    p.add_argument("--batch-size", type=positive, default=None, help="default: 32 (tiny), 16 (base)")
    p.add_argument("--threads", type=positive, default=2, help="torch CPU threads")
    p.add_argument("--total-steps", type=positive, default=None,
                   help="base: length of the cosine schedule (kept in the checkpoint; default 12000 for a new run)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate; default: 2e-3 (tiny), 1.5e-3 (base)")
    p.add_argument("--resume", default=None,
                   help="tiny: continue a saved checkpoint (all rows filled, fresh optimizer); base resumes from --out")
    p.add_argument("--seed", type=int, default=0, help="weight and data seed")
    p.add_argument("--out", default=None, help="checkpoint folder (default: ./checkpoints/docqa-READER)")
    p.set_defaults(func=train_docqa)


def _add_build_stream(sub) -> None:
    p = sub.add_parser("build-stream", help="write a request stream as parquet for the lmms-eval tasks")
    p.add_argument("task", choices=["synthdoc", "docvqa", "infovqa"], help="which task's data to write")
    p.add_argument("--source", default=None, help="docvqa/infovqa: parquet glob or cached HF dataset name")
    p.add_argument("--split", default="validation", help="docvqa/infovqa: dataset split")
    p.add_argument("--pages", type=positive, default=100, help="docvqa/infovqa: pages to use")
    p.add_argument("--seeds", type=INTS, default="0", help="synthdoc: stream seeds, comma separated")
    p.add_argument("--bases", type=positive, default=20, help="synthdoc: new pages per stream")
    p.add_argument("--seed", type=int, default=0, help="docvqa/infovqa: seed of the near-duplicate copies")
    p.add_argument("--near-model", default=None,
                   help="docvqa/infovqa: a model (checkpoint, preset or vismemo-docqa-tiny) whose lookup descriptors "
                        "find natural near-duplicate pages, placed after the page they resemble")
    p.add_argument("--out", default=None, help="default .cache/vismemo-data/TASK/test.parquet (what the tasks read)")
    p.set_defaults(func=build_stream)


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (reports under results/)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    p = bench_sub.add_parser("compression", help="decoding KV bytes and decode time vs VL-Cache ratio")
    p.add_argument("--preset", default="medium", help="model preset (random weights)")
    p.add_argument("--family", default="qwen2_vl", choices=FAMILY_NAMES, help="model family")
    p.add_argument("--ratios", type=NUMBERS, default="0.1,0.25,0.5,1.0", help="kept shares of the visual tokens")
    p.add_argument("--new-tokens", type=positive, default=24, help="decoded tokens per request")
    p.add_argument("--repeats", type=positive, default=3, help="timed rounds")
    p.add_argument("--width", type=positive, default=448, help="image width, px")
    p.add_argument("--height", type=positive, default=336, help="image height, px")
    _out_option(p, "results/compression")
    p.set_defaults(func=_bench("compression"))
    p = bench_sub.add_parser("store", help="sparse vs full I/O, disk throughput, exact-priority vs plain LRU")
    _geometry_options(p)
    p.add_argument("--beta", type=float, default=0.1, help="share of tokens a sparse read fetches")
    p.add_argument("--warmup", type=nonnegative, default=3, help="warmup layers a sparse read skips")
    p.add_argument("--repeats", type=positive, default=5, help="timed rounds")
    p.add_argument("--trace-requests", type=positive, default=4000, help="requests of the eviction trace")
    p.add_argument("--capacities", type=INTS, default="25,50,100,200", help="store capacities (entries) of the trace")
    p.add_argument("--seed", type=int, default=0, help="trace seed")
    p.add_argument("--remote", action="append", default=None, metavar="URL",
                   help="also time the shared Redis tier (redis://host:port/db; a cluster is found by asking it) "
                        "against the local disk tier; repeat it to put one server and a cluster side by side")
    _out_option(p, "results/store")
    p.set_defaults(func=_bench("store"))
    p = bench_sub.add_parser("latency", help="TTFT, decoding and generate of miss / exact / approximate hits against "
                                             "plain transformers, by visual length")
    _preset_options(p, "qwen3-vl-8b-narrow")
    p.add_argument("--lengths", type=INTS, default="256,512,1024,2048,4096", help="visual tokens per image")
    p.add_argument("--policies", default="attend-deviate,vismemo,cacheblend",
                   help="policies of the approximate hits (none: no approximate hits, for families without them)")
    p.add_argument("--repeats", type=positive, default=3, help="timed rounds")
    p.add_argument("--new-tokens", type=positive, default=32, help="tokens of every timed generate")
    p.add_argument("--long-tokens", type=nonnegative, default=256, help="tokens of one longer generate per kind (0: none)")
    p.add_argument("--store-device", default="cpu", help="where the stores keep decoded entries: cpu, a device, "
                                                          "model (the model's device), or disk (the disk tier alone)")
    p.add_argument("--unstored-miss", action="store_true", help="also a miss that stores nothing (what writing a "
                                                                "miss's entry costs)")
    _device_options(p)
    _out_option(p, "results/perf")
    p.set_defaults(func=_bench("latency"))
    _add_workload(bench_sub)
    p = bench_sub.add_parser("overhead", help="host syncs, fixed cost per layer and time outside the kernels of "
                                              "each kind, against plain transformers, at two depths")
    _preset_options(p, "medium")
    p.add_argument("--layers", type=INTS, default="4,12,36",
                   help="decoder depths (the preset's other dimensions kept; syncs compared at the first and last)")
    p.add_argument("--lengths", type=INTS, default="64,256,1024",
                   help="visual tokens per image (host syncs counted at the first)")
    p.add_argument("--policies", default=DEFAULT_POLICY, help="policies of the approximate hits")
    p.add_argument("--repeats", type=positive, default=5, help="timed prefills per kind and size")
    p.add_argument("--sites", type=positive, default=8, help="code sites listed per kind")
    _device_options(p)
    _out_option(p, "results/perf/overhead")
    p.set_defaults(func=_bench("overhead"))
    p = bench_sub.add_parser("lookup", help="coarse-lookup latency, memory and recall vs number of cached entries")
    p.add_argument("--sizes", type=NUMBERS, default="1000,10000,100000", help="entry counts (1e5 style accepted)")
    p.add_argument("--dim", type=positive, default=4096, help="descriptor width")
    p.add_argument("--queries", type=positive, default=200, help="timed queries per size")
    p.add_argument("--recall-queries", type=nonnegative, default=100, help="queries checked against the exact rule")
    p.add_argument("--tau", type=float, default=0.8, help="coarse threshold")
    p.add_argument("--top-k", type=positive, default=5, help="candidates per query")
    p.add_argument("--groups", type=positive, default=4, help="model fingerprints sharing the index")
    _out_option(p, "results/perf")
    p.set_defaults(func=_bench("lookup"))
    p = bench_sub.add_parser("capacity", help="entries per GiB and hit rate at a byte budget per stored K/V format")
    _geometry_options(p)
    p.add_argument("--budget-gib", type=float, default=8.0, help="store budget, GiB")
    p.add_argument("--requests", type=positive, default=3000, help="requests of the trace")
    p.add_argument("--seed", type=int, default=0, help="trace seed")
    _out_option(p, "results/store")
    p.set_defaults(func=_bench("capacity"))
    p = bench_sub.add_parser("trace", help="synthetic trace through the tiered store at several capacities")
    p.add_argument("--requests", type=positive, default=3000, help="requests of the trace")
    p.add_argument("--capacities", type=INTS, default="20,50,100,200,400", help="store capacities (entries)")
    p.add_argument("--seed", type=int, default=0, help="trace seed")
    _out_option(p, "results/perf")
    p.set_defaults(func=_bench("trace"))
    _add_soak(bench_sub)


def _add_workload(bench_sub) -> None:
    p = bench_sub.add_parser("workload", help="streams as users send them (chat, agent loops, mixed traffic, the "
                                              "readers' streams) back to back against plain transformers")
    p.add_argument("--models", default="all", help="comma-separated tiny:FAMILY, presets or readers (all: the tiny "
                                                   "model of each family, the stand-ins and both readers)")
    p.add_argument("--streams", default="all", help="comma-separated chat, agent-1, agent-2, agent-3, mixed, reader")
    p.add_argument("--rounds", type=positive, default=2, help="rounds of each stream, a fresh store each")
    p.add_argument("--new-tokens", type=positive, default=4, help="greedy tokens of every request")
    p.add_argument("--seed", type=nonnegative, default=0, help="seed of the streams' pages and questions")
    p.add_argument("--idle-ms", type=nonnegative, default=0,
                   help="ms between a request's answer and the next request (an agent acting on its answer, a user "
                        "reading it): 0 sends them back to back")
    _device_options(p)
    _out_option(p, "results/perf")
    p.set_defaults(func=_bench("workload"))


def _add_soak(bench_sub) -> None:
    p = bench_sub.add_parser("soak", help="processes sharing a disk directory and a local Redis Cluster under injected "
                                          "faults (worker SIGKILLs, node kills, ENOSPC, maxmemory, damaged blobs "
                                          "and index), every answer checked against plain transformers")
    p.add_argument("--processes", type=positive, default=4, help="serving processes")
    p.add_argument("--requests", type=positive, default=2000, help="requests of the stream, all processes together")
    p.add_argument("--seed", type=int, default=0, help="stream and fault-schedule seed")
    p.add_argument("--kills", type=nonnegative, default=20, help="workers SIGKILLed in the middle of a disk write")
    p.add_argument("--node-kills", type=nonnegative, default=5, help="cluster nodes killed and restarted")
    p.add_argument("--disk-full", type=nonnegative, default=2, help="disk-full (ENOSPC) periods")
    p.add_argument("--redis-full", type=nonnegative, default=2, help="Redis maxmemory periods")
    p.add_argument("--blob-faults", type=nonnegative, default=3, help="blobs truncated, and as many overwritten")
    p.add_argument("--db-faults", type=nonnegative, default=1, help="cache.db overwritten in place, and as many replaced")
    p.add_argument("--preset", default="tiny", help="model preset (random weights, the same in every process)")
    p.add_argument("--family", default="qwen2_vl", choices=FAMILY_NAMES, help="family of the preset")
    p.add_argument("--max-new-tokens", type=positive, default=3, help="tokens generated per request")
    p.add_argument("--device-kib", type=nonnegative, default=256, help="device-tier budget per process, KiB")
    p.add_argument("--host-kib", type=nonnegative, default=512, help="host-tier budget per process, KiB")
    p.add_argument("--disk-mib", type=positive, default=192, help="the shared directory's budget, MiB")
    p.add_argument("--tmpfs-mib", type=positive, default=320, help="size of the tmpfs the directory is mounted on, MiB")
    p.add_argument("--node-down-s", type=float, default=3.0, help="seconds a killed node stays down")
    p.add_argument("--fault-s", type=float, default=3.0, help="seconds a disk-full or maxmemory period lasts")
    p.add_argument("--grace-s", type=float, default=3.0, help="seconds after a fault its misses are attributed to it")
    p.add_argument("--arm-timeout", type=float, default=20.0, help="seconds to wait for an armed worker's write")
    p.add_argument("--baseline-alongside", action="store_true",
                   help="run the single-process baseline while the soak runs (short runs; TTFTs then share the CPU)")
    p.add_argument("--pace-ms", type=nonnegative, default=0,
                   help="pause of every worker after each request, ms (short runs)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (results, logs, directory)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    _out_option(p, "results/soak")
    p.set_defaults(func=_bench("soak"))


def _add_report(sub) -> None:
    report = sub.add_parser("report", help="reports (under results/)")
    report_sub = report.add_subparsers(dest="report", required=True)
    p = report_sub.add_parser("quality", help="Table 1: every policy on the same synthetic streams, ANLS and fidelity")
    p.add_argument("--model", default="vismemo-docqa-tiny", help="packaged model name, preset or checkpoint folder")
    p.add_argument("--pages", default="auto", choices=("auto", "synthdoc", "docpage"),
                   help="the streams' pages (auto: docpage for vismemo-docqa-base and its checkpoints)")
    p.add_argument("--streams", type=positive, default=2, help="request streams (the first N of the default seeds)")
    p.add_argument("--seeds", type=INTS, default=None, help="explicit stream seeds, comma-separated (instead of --streams)")
    p.add_argument("--bases", type=positive, default=20, help="new pages per stream (each with 4 follow-ups)")
    p.add_argument("--policies", default="all",
                   help="comma-separated policy names (`default` names the library's default routing), or all")
    p.add_argument("--no-sweeps", action="store_true", help="skip the recompute and reuse ratio sweeps")
    p.add_argument("--thresholds", default=None,
                   help="lookup thresholds preset or path (vismemo calibrate) for every cache; default: the defaults")
    p.add_argument("--sweep-rho", type=NUMBERS, default="0.1,0.2,0.3,0.5,0.8", help="recompute ratios of the sweep")
    p.add_argument("--sweep-beta", type=NUMBERS, default="0,0.05,0.1,0.2,0.4", help="reuse ratios of the sweep")
    p.add_argument("--max-new-tokens", type=positive, default=6, help="tokens generated per answer")
    p.add_argument("--heldout", type=nonnegative, default=40,
                   help="held-out pages per page type for the reader's own accuracy")
    p.add_argument("--heldout-bases", type=nonnegative, default=15,
                   help="new pages per held-out stream (seeds that informed no design choice); 0 skips them")
    _out_option(p, "results/quality")
    p.set_defaults(func=_bench("table1"))
    p = report_sub.add_parser("pareto", help="quality against speed: every policy swept over its budget, per reader")
    p.add_argument("--models", default="vismemo-docqa-tiny", help="comma-separated readers (names or folders)")
    p.add_argument("--pages", default="auto", choices=["auto", "synthdoc", "docpage"],
                   help="the streams' pages (auto: docpage for vismemo-docqa-base and its checkpoints)")
    p.add_argument("--seeds", type=_int_list, default=[7000], help="stream seeds, comma-separated (default: 7000)")
    p.add_argument("--bases", type=positive, default=12, help="new pages per stream (each with 4 follow-ups)")
    p.add_argument("--policies", default="all", help="comma-separated policies of bench/pareto.py SWEEPS, or all")
    p.add_argument("--max-new-tokens", type=positive, default=6, help="tokens generated per answer")
    p.add_argument("--floor-preset", default="qwen3-vl-8b-narrow", help="model preset of the FLOP floor")
    p.add_argument("--floor-tokens", type=nonnegative, default=4096, help="visual tokens of the FLOP floor (0: none)")
    _out_option(p, "results/quality")
    p.set_defaults(func=_bench("pareto"))
    p = report_sub.add_parser("prefix", help="exact hits after another text before the image vs a full prefill")
    p.add_argument("--pages", type=positive, default=20, help="pages per family")
    p.add_argument("--lengths", type=INTS, default="0,10,50,100,200,400", help="token counts of the changed text")
    p.add_argument("--seed", type=int, default=4000, help="page seed")
    p.add_argument("--base-model", default="vismemo-docqa-base",
                   help="the docpage reader (packaged name or checkpoint folder)")
    _out_option(p, "results/quality")
    p.set_defaults(func=_bench("prefix"))
    p = report_sub.add_parser("context", help="reuse after another text or page before the image, and small changes, "
                                              "vs a full prefill")
    p.add_argument("--readers", default="vismemo-docqa-base,vismemo-docqa-tiny", help="comma-separated readers")
    p.add_argument("--pairs", type=positive, default=20, help="pages per class (three questions each)")
    p.add_argument("--seed", type=int, default=9000, help="case seed (pages, texts, edits)")
    p.add_argument("--policies", default="all",
                   help="comma-separated of default, cacheblend, vismemo, whole-encode; or all (the first three)")
    p.add_argument("--classes", default="all", help="comma-separated classes of eval/context.py CLASSES, or all")
    p.add_argument("--front-pairs", type=nonnegative, default=0,
                   help="pages per class of the context check's front (its options swept on the seed after --seed; "
                        "0: none)")
    p.add_argument("--front-from", default=None,
                   help="the front of an earlier run's context.json instead of measuring it (same options)")
    p.add_argument("--heldout-seeds", default="",
                   help="comma-separated case seeds on which the default is measured again (--pairs pages per class "
                        "each), reported per seed; none by default")
    p.add_argument("--max-new-tokens", type=positive, default=6, help="tokens generated per answer")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    _out_option(p, "results/quality")
    p.set_defaults(func=_bench("context"))


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (paragraphs kept) and every option's default, unless its help already says it or it
    has none (None, a flag)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.default is None or action.default is False or action.default == argparse.SUPPRESS
                or re.search(r"(^|\(|; |, )default[ :]", text) or not action.option_strings
                or isinstance(action, argparse._VersionAction)):
            return text
        return f"{text} (default: %(default)s)"


#: what a command writes and where, shown by ``vismemo COMMAND --help`` under its one-line help
WRITES = {
    "demo": "Prints one row per request (answer, hit kind, alias, recomputed / reused / masked tokens, prefill ms); "
            "writes nothing.",
    "tasks-path": "Prints the folder of the installed lmms-eval tasks: lmms-eval --include_path \"$(vismemo "
                  "tasks-path)\".",
    "presets": "Prints the presets found on the search path (./configs/KIND/, $XDG_CONFIG_HOME/vismemo/KIND/, then "
               "the package's) and where each lives; a name found twice is read from the first place.",
    "calibrate": "Writes the lookup preset ./configs/lookup/NAME.yaml (the first place of the preset search path, "
                 "so thresholds=NAME finds it from this directory) and a report NAME.md / NAME.json in --report-dir.",
    "profile-vlcache": "Writes the VL-Cache profile ./configs/vlcache/NAME.yaml (found by policy=\"vlcache\", "
                       "profile=NAME from this directory).",
    "train-docqa": "Writes checkpoints to --out (base: OUT/state to resume, OUT/model the best so far).",
    "build-stream": "Writes the request stream as parquet, by default where the lmms-eval tasks read it "
                    "(.cache/vismemo-data/TASK/test.parquet under the directory lmms-eval runs in).",
    "bench": "Each benchmark writes NAME.md, NAME.json (and a PNG where it plots) to --out.",
    "report": "Each report writes NAME.md, NAME.json (and PNGs where it plots) to --out.",
}


def _format(p: argparse.ArgumentParser, name: str = "") -> None:
    """The help formatter on ``p`` and its subcommands, each with its description and what it writes."""
    p.formatter_class = _HelpFormatter
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for sub_name, sub in action.choices.items():
                if sub.description is None:
                    parts = (helps.get(sub_name), WRITES.get(sub_name))
                    sub.description = "\n\n".join(textwrap.fill(x, 100) for x in parts if x)
                _format(sub, sub_name)


DESCRIPTION = """Approximate visual KV-cache reuse for vision-language models (Qwen-VL, GLM-4V, LLaVA-OneVision)
in transformers.

  vismemo demo                 five document requests through the packaged reader (no downloads, no GPU)
  vismemo COMMAND --help       what a command does, its options and defaults, what it writes and where"""


def parser(argv=None) -> argparse.ArgumentParser:
    from vismemo_hf import __version__

    top = argparse.ArgumentParser(prog="vismemo", description=DESCRIPTION)
    top.add_argument("--version", action="version", version=f"vismemo-hf {__version__}")
    top.add_argument("-q", "--quiet", action="store_true", dest="quiet_all",
                     help="no progress bars or progress lines (for scripts): warnings, errors and the command's "
                          "output only; VISMEMO_QUIET=1 turns the bars off too")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_demo, _add_tasks_path, _add_presets, _add_calibrate, _add_train, _add_build_stream, _add_bench,
                _add_report):
        add(sub)
    _add_profile(sub, argv)
    _format(top)
    return top


#: errors of a bad argument or input: one line and exit status 2, not a traceback
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, NotADirectoryError, KeyError)
#: optional modules -> the extra of pyproject.toml that installs them
EXTRAS = {"datasets": "eval", "matplotlib": "eval", "lmms_eval": "eval", "tqdm": "eval", "pyarrow": "eval",
          "pandas": "eval", "redis": "remote"}


def missing_extra(err: ModuleNotFoundError) -> str | None:
    """The one-line message of an optional module that is not installed (None for any other missing module)."""
    top = (err.name or "").split(".")[0]
    extra = EXTRAS.get(top)
    return None if extra is None else f"{top} is not installed; it comes with pip install 'vismemo-hf[{extra}]'"


def main(argv=None) -> int:
    """Run one command and return its exit status (0, or 2 for a bad argument, also one argparse refuses)."""
    try:
        args = parser(argv).parse_args(argv)
    except SystemExit as done:  # --help, --version or argparse's own one-line error: its status, not an exception
        return done.code if isinstance(done.code, int) else 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from vismemo_hf import progress

    # report context --quiet too; VISMEMO_QUIET=1 does all that --quiet does (other libraries' bars included)
    progress.configure(quiet=args.quiet_all or getattr(args, "quiet", False) or progress.quiet_by_environment())
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notices
    name = " ".join(x for x in (args.command, getattr(args, "bench", None), getattr(args, "report", None)) if x)
    import importlib.util

    for module in _needs(args):
        if importlib.util.find_spec(module) is None:
            print(f"vismemo {name}: error: {missing_extra(ModuleNotFoundError(name=module))}", file=sys.stderr)
            return 2
    try:
        return args.func(args)
    except USER_ERRORS as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"vismemo {name}: error: {message}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        message = missing_extra(err)
        if message is None:
            raise
        print(f"vismemo {name}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

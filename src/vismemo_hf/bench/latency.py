"""``vismemo bench latency``: a miss, an exact and an approximate hit against plain transformers, by visual length.

Every kind runs ``generate`` on the enabled model, and ``plain`` runs it on a never-enabled copy of the same
weights with its own DynamicCache and the same attention implementation. Per length the runs are interleaved
(plain, miss, exact, then each policy's approximate hit) after a warm-up round; medians are reported. A clock in
``generate``'s stopping criteria gives the time to the first token (vision encoder, prefill and first token: TTFT)
and each decoding step; whole ``generate`` times are taken at ``new_tokens`` and, once per kind, at
``long_tokens``. The cache events add the prefill's stage breakdown (encoder excluded) and the plan's analytic
FLOP floor; plain transformers' language model, run on each plan's layer layouts, what its own layers take for the
same work (``plain_kernels_ms``). Misses store their entry, as in serving.
"""

from __future__ import annotations

import copy
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from transformers import StoppingCriteriaList

from vismemo_hf import VisMemoCache, VisMemoStore, enable
from vismemo_hf.bench.flops import (
    encoder_flops,
    encoder_share,
    entry_bytes,
    kind_floor,
    partial_encoder_flops,
    patches_of,
    plan_flops,
    plan_layouts,
    real_configs,
)
from vismemo_hf.bench.report import command as report_command
from vismemo_hf.bench.report import header, machine
from vismemo_hf.eval import synthetic
from vismemo_hf.eval.loading import load_model
from vismemo_hf.eval.quality import TokenClock

STAGES = ("lookup", "encoder", "warmup", "fetch_wait", "plan", "recompute")


def page_pair(tokens: int, model, seed: int = 1):
    """A synthetic page that ``model``'s family processes into about ``tokens`` visual tokens, and a copy with one
    value edited (``ModelAdapter.bench_image_size``)."""
    from vismemo_hf.families import FAMILIES

    size = FAMILIES[model.config.model_type].bench_image_size(model.config, tokens)
    return synthetic.page(seed, size=size), synthetic.edited(seed, row=2, value="9999", size=size)


def any_size(processor, model) -> None:
    """Let the processor keep an image's size: the benchmarks choose their visual lengths
    (``ModelAdapter.free_image_size``)."""
    from vismemo_hf.families import FAMILIES

    FAMILIES[model.config.model_type].free_image_size(processor, model.config)


def request_inputs(processor, image, question="What is the value of the third row?"):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor(text=[text], images=[image], return_tensors="pt")


@torch.no_grad()
def timed_prefill(model, inputs, cache) -> dict:
    """One forward (the prefill alone) through ``cache``: its event's timings (encoder excluded) and plan."""
    model(**inputs.to(model.device), cache=cache, use_cache=True)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    (event,) = cache.events
    t = dict(event.timings)
    t["prefill"] = t["prefill"] - t.get("encoder", 0.0)
    return {"timings": t, "kind": str(event.kind), "recomputed": event.recomputed, "reused": event.reused,
            "masked": event.masked, "n_tokens": event.n_tokens, "bytes_read": event.bytes_read, "plan": event.plan,
            "encoded_tokens": event.encoded_tokens, "found_by": event.found_by}


@torch.no_grad()
def timed_generate(model, inputs, cache, new_tokens: int) -> dict:
    """TTFT, median decoding step and whole time (ms) of one greedy ``generate`` of exactly ``new_tokens``, and the
    cache's event (None for plain transformers: ``cache=None``)."""
    clock = TokenClock(model.device)
    inputs = inputs.to(model.device)
    if clock.cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(**inputs, **({"cache": cache} if cache is not None else {}), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, stopping_criteria=StoppingCriteriaList([clock]))
    if clock.cuda:
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    steps = [(b - a) * 1e3 for a, b in zip(clock.times, clock.times[1:])]
    out: dict[str, object] = {"ttft_ms": (clock.times[0] - t0) * 1e3, "step_ms": statistics.median(steps) if steps else 0.0,
           "total_ms": total * 1e3, "event": None}
    if cache is not None:
        (event,) = cache.events
        t = dict(event.timings)
        t["prefill"] = t["prefill"] - t.get("encoder", 0.0)
        out["event"] = {"timings": t, "kind": str(event.kind), "recomputed": event.recomputed, "reused": event.reused,
                        "masked": event.masked, "n_tokens": event.n_tokens, "bytes_read": event.bytes_read,
                        "plan": event.plan, "encoded_tokens": event.encoded_tokens, "found_by": event.found_by}
    return out


@torch.no_grad()
def plain_kernels_ms(plain, layouts: dict[tuple[int, int], int], repeats: int = 2,
                     memo: dict | None = None) -> float:
    """Milliseconds plain transformers' own decoder layers spend on a plan's work: for each (queries, keys) layout
    of ``plan_layouts``, its language model runs ``queries`` tokens over a DynamicCache of ``keys - queries``
    (the queries last, each seeing every key: SDPA computes a masked pair too), timed whole (median of
    ``repeats`` after a warm-up) and counted for the layers of that layout. A hit's prefill over this is what
    its bookkeeping costs beyond the arithmetic as plain transformers' kernels run it: unlike the FLOP floor, it
    charges a few queries what their weight and K/V reads cost. ``memo`` keeps measured layouts between calls."""
    from transformers import DynamicCache

    from vismemo_hf.families.base import base_model

    memo = {} if memo is None else memo
    text = base_model(plain).language_model
    width, layers = plain.config.text_config.hidden_size, plain.config.text_config.num_hidden_layers
    generator = torch.Generator().manual_seed(0)

    def embeds(count: int) -> torch.Tensor:
        return (torch.randn(1, count, width, generator=generator) * 0.02).to(plain.device, plain.dtype)

    def synced() -> float:
        if plain.device.type == "cuda":
            torch.cuda.synchronize(plain.device)
        return time.perf_counter()

    by_keys: dict[int, list[int]] = {}
    for queries, keys in layouts:
        if (queries, keys) not in memo:
            by_keys.setdefault(keys, []).append(queries)
    for keys, queries_list in by_keys.items():
        cache = DynamicCache(config=plain.config)
        for queries in sorted(queries_list):  # one cache per key count, cropped back to each layout's past
            past = keys - queries
            if cache.get_seq_length() > past:
                cache.crop(past - cache.get_seq_length())
            if cache.get_seq_length() < past:
                text(inputs_embeds=embeds(past - cache.get_seq_length()), past_key_values=cache, use_cache=True)
            times = []
            for _ in range(repeats + 1):
                t0 = synced()
                text(inputs_embeds=embeds(queries), past_key_values=cache, use_cache=True)
                times.append((synced() - t0) * 1e3)
                cache.crop(-queries)
            memo[(queries, keys)] = statistics.median(times[1:])
    return sum(memo[layout] * count / layers for layout, count in layouts.items())


def new_store(store_device: str) -> VisMemoStore:
    """A store keeping decoded entries on ``store_device``, or (``"disk"``) only on disk, in a temporary directory
    removed with the store: what reading an alias from the disk tier costs."""
    if store_device != "disk":
        return VisMemoStore(device=store_device)
    import tempfile

    folder = tempfile.TemporaryDirectory(prefix="vismemo-bench-")
    store = VisMemoStore(device_bytes=0, disk_dir=folder.name)
    cast(Any, store).bench_folder = folder  # removed when the store is
    return store


def _cases(model, plain, miss_in, edit_in, seeded: VisMemoStore, policies, store_device: str = "cpu",
           unstored_miss: bool = False):
    """(kind, policy) -> what runs it: ``(model, inputs, cache factory)``; ``unstored_miss`` adds a miss that stores
    nothing (``store_misses=False``), which tells what writing a miss's entry costs."""
    cases: dict[tuple[str, str], tuple[object, object, Callable[[], VisMemoCache | None]]]
    cases = {("plain", "-"): (plain, miss_in, lambda: None),
             ("miss", "-"): (model, miss_in, lambda: VisMemoCache(store=new_store(store_device))),
             ("exact", "-"): (model, miss_in, lambda: VisMemoCache(store=seeded))}
    if unstored_miss:
        cases[("miss", "not stored")] = (model, miss_in, lambda: VisMemoCache(store=new_store(store_device),
                                                                             store_misses=False))
    for policy in policies:  # store_misses off: a complete plan would store the edited page and make it exact
        cases[("approximate", policy)] = (model, edit_in, functools.partial(VisMemoCache, store=seeded, policy=policy,
                                                                            store_misses=False, approximate="always"))
    return cases


def _run_case(case, kind: str, n: int, new_tokens: int) -> dict:
    runner, inputs, make = case
    cache = make()
    out = timed_generate(runner, inputs, cache, new_tokens)
    if cache is not None:
        cache.store.flush()  # the miss's entry lands before the next timed run starts
        if out["event"]["kind"] != kind:
            raise RuntimeError(f"expected a {kind} hit at {n} tokens, got {out['event']['kind']}")
    return out


def run(model, plain, processor, lengths, policies, repeats: int, new_tokens: int = 32, long_tokens: int = 256,
        progress=None, store_device: str = "cpu", unstored_miss: bool = False) -> list[dict]:
    """Records of every kind at every length; ``store_device``: where the stores keep decoded entries (their device
    tier), ``"model"`` for the model's own device."""
    family = model.config.model_type
    if store_device == "model":
        store_device = str(model.device)
    records = []
    for n in lengths:
        base, edited = page_pair(n, model)
        miss_in, edit_in = request_inputs(processor, base), request_inputs(processor, edited)
        seeded = new_store(store_device)
        timed_generate(model, miss_in, VisMemoCache(store=seeded), 1)  # the alias entry every hit reads
        seeded.flush()
        cases = _cases(model, plain, miss_in, edit_in, seeded, policies, store_device, unstored_miss)
        runs: dict[tuple[str, str], list[dict]] = {c: [] for c in cases}
        for rep in range(repeats + 1):  # round 0 warms up
            for (kind, policy), case in cases.items():
                out = _run_case(case, kind, n, new_tokens)
                if rep:
                    runs[(kind, policy)].append(out)
                if progress is not None:
                    progress.update(1)
        long = {}
        for (kind, policy), case in cases.items():
            long[(kind, policy)] = _run_case(case, kind, n, long_tokens)["total_ms"] if long_tokens else None
            if progress is not None:
                progress.update(1)
        kernels = _kernels(plain, model.config, miss_in, runs, repeats)
        records += _records(model.config, miss_in, runs, long, family, new_tokens, long_tokens, kernels)
    return records


def _kernels(plain, config, miss_in, runs: dict, repeats: int) -> dict:
    """(kind, policy) -> what plain transformers' layers spend on that kind's plan (``plain_kernels_ms``)."""
    ids = miss_in["input_ids"][0]
    start = int((ids == config.image_token_id).nonzero()[0])
    memo: dict = {}
    return {case: plain_kernels_ms(plain, plan_layouts(config, ids.numel(), start, outs[0]["event"]["plan"]),
                                   repeats, memo)
            for case, outs in runs.items() if outs and outs[0]["event"] is not None}


def _records(config, miss_in, runs: dict, long: dict, family: str, new_tokens: int, long_tokens: int,
             kernels: dict | None = None) -> list[dict]:
    ids = miss_in["input_ids"][0]
    is_image = ids == config.image_token_id
    n_text, start = int((~is_image).sum()), int(is_image.nonzero()[0])
    miss = runs[("miss", "-")]
    n_visual = miss[0]["event"]["n_tokens"]
    miss_ms = statistics.median(r["event"]["timings"]["prefill"] for r in miss)
    miss_flops = plan_flops(config, ids.numel(), start, miss[0]["event"]["plan"])
    # the TTFT floor, encoder included, here and at the real models' geometry (the same plan priced there)
    geometries = {"stand-in": config, **real_configs()}
    plain_floor = {g: kind_floor(c, ids.numel(), start, miss[0]["event"]["plan"], patches_of(c, n_visual))
                   for g, c in geometries.items()}
    shares = {g: encoder_share(c, ids.numel(), start, n_visual) for g, c in geometries.items()}
    sizes = {g: entry_bytes(c, n_visual) for g, c in geometries.items()}  # bf16 entries
    med = lambda outs, key: statistics.median(o[key] for o in outs)  # noqa: E731
    plain = runs[("plain", "-")]
    plain_ttft, plain_step, plain_total = med(plain, "ttft_ms"), med(plain, "step_ms"), med(plain, "total_ms")
    out = []
    for (kind, policy), outs in runs.items():
        record = {"visual_tokens": n_visual, "text_tokens": n_text, "family": family, "kind": kind, "policy": policy,
                  "ttft_ms": med(outs, "ttft_ms"), "decode_step_ms": med(outs, "step_ms"),
                  "generate_ms": med(outs, "total_ms"), "new_tokens": new_tokens,
                  "generate_long_ms": long[(kind, policy)], "long_tokens": long_tokens, "repeats": len(outs)}
        record["ratio_to_plain"] = record["ttft_ms"] / plain_ttft
        record["decode_ratio_to_plain"] = record["decode_step_ms"] / plain_step
        record["generate_ratio_to_plain"] = record["generate_ms"] / plain_total
        if long_tokens:
            record["generate_long_ratio_to_plain"] = record["generate_long_ms"] / long[("plain", "-")]
        if kind != "plain":
            first = outs[0]["event"]
            flops = plan_flops(config, ids.numel(), start, first["plan"])
            median = {s: statistics.median(o["event"]["timings"].get(s, 0.0) for o in outs) for s in STAGES + ("prefill",)}
            # the tokens the tower ran for: none on an exact hit, the changed ones and their context on a hit found
            # by its pixels, all on the others
            encoded = first.get("encoded_tokens", n_visual if kind != "exact" else 0)
            encoded = n_visual if encoded < 0 else encoded
            record["ttft_floor"] = {g: kind_floor(c, ids.numel(), start, first["plan"],
                                                  encoded and patches_of(c, encoded)) / plain_floor[g]
                                    for g, c in geometries.items()}
            record["encoder_share"] = shares
            record["entry_bytes"] = sizes
            miss_encoder = statistics.median(o["event"]["timings"].get("encoder", 0.0) for o in miss)
            record["encoded_tokens"], record["found_by"] = encoded, first.get("found_by")
            record["encoder_work"] = {
                "analytic": {g: partial_encoder_flops(c, patches_of(c, encoded), patches_of(c, n_visual))
                             / encoder_flops(c, patches_of(c, n_visual)) for g, c in geometries.items()},
                "measured": median["encoder"] / miss_encoder if miss_encoder > 0 else None}
            record.update({"prefill_ms": median["prefill"], "ratio_to_miss": median["prefill"] / miss_ms,
                           "floor_ratio": flops / miss_flops, "plan_gflops": flops / 1e9,
                           "recomputed": first["recomputed"], "reused": first["reused"], "masked": first["masked"],
                           "bytes_read": first["bytes_read"], "breakdown_ms": {s: median[s] for s in STAGES}})
            if kernels and (kind, policy) in kernels:
                record["plain_kernels_ms"] = kernels[(kind, policy)]
                record["ratio_to_kernels"] = median["prefill"] / kernels[(kind, policy)]
        out.append(record)
    return out


def fixed_cost_per_layer(records, layers: int) -> dict | None:
    """Least-squares fit of the enabled prefills' time against their plan's FLOPs: the intercept per layer is the
    loop's fixed cost (ms per layer, what a faster chip does not shrink), the slope the time per GFLOP."""
    points = [(r["plan_gflops"], r["prefill_ms"]) for r in records if r["kind"] in ("exact", "approximate")]
    if len(points) < 3:
        return None
    x = torch.tensor([p[0] for p in points], dtype=torch.float64)
    y = torch.tensor([p[1] for p in points], dtype=torch.float64)
    design = torch.stack([torch.ones_like(x), x], 1)
    intercept, slope = torch.linalg.lstsq(design, y[:, None]).solution.flatten().tolist()
    return {"ms_per_layer": intercept / layers, "ms_per_gflop": slope, "points": len(points)}


def _label(r) -> str:
    return r["kind"] if r["policy"] == "-" else f"{r['kind']} ({r['policy']})"


def _plot(records, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6))
    series = sorted({(r["kind"], r["policy"]) for r in records if r["kind"] != "plain"})
    for kind, policy in series:
        rs = sorted((r for r in records if (r["kind"], r["policy"]) == (kind, policy)), key=lambda r: r["visual_tokens"])
        xs = [r["visual_tokens"] for r in rs]
        line = ax.plot(xs, [r["ratio_to_plain"] for r in rs], marker="o", label=f"{_label(rs[0])}: TTFT")[0]
        ax.plot(xs, [r["decode_ratio_to_plain"] for r in rs], marker="x", ls="--", color=line.get_color(),
                label=f"{_label(rs[0])}: decode step")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("visual tokens")
    ax.set_ylabel("time / plain transformers (median)")
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    longest = max(r["visual_tokens"] for r in records)
    rows = [r for r in records if r["visual_tokens"] == longest and r["kind"] != "plain"]
    bottom = [0.0] * len(rows)
    for stage in STAGES:
        vals = [r["breakdown_ms"][stage] for r in rows]
        bx.bar(range(len(rows)), vals, bottom=bottom, label=stage)
        bottom = [a + b for a, b in zip(bottom, vals)]
    bx.set_xticks(range(len(rows)), [r["kind"] if r["kind"] != "approximate" else r["policy"] for r in rows],
                  rotation=30, fontsize=7)
    bx.set_ylabel("ms")
    bx.set_title(f"prefill breakdown at {longest} visual tokens", fontsize=9)
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    from vismemo_hf.progress import progress

    dtype = getattr(torch, args.dtype)
    plain, processor = load_model(args.preset, args.family, dtype=dtype, device=args.device)
    model = copy.deepcopy(plain)  # the same weights; only this copy is enabled
    enable(model)
    if hasattr(processor, "image_processor"):
        any_size(processor, model)
    lengths = [int(x) for x in args.lengths.split(",")]
    policies = [] if args.policies == "none" else [p for p in args.policies.split(",") if p]  # none: no approximate
    total = len(lengths) * (args.repeats + 2) * (3 + len(policies) + bool(getattr(args, "unstored_miss", False)))
    records: list[dict] = []
    with progress(total=total, desc="latency", unit="run") as bar:
        for n in lengths:  # the report is rewritten after each length: a run cut short keeps what it measured
            records += run(model, plain, processor, [n], policies, args.repeats, args.new_tokens, args.long_tokens, bar,
                           getattr(args, "store_device", "cpu"), getattr(args, "unstored_miss", False))
            _write(records, model, args)
    print((Path(args.out) / "latency.md").read_text())
    return 0


def _write(records: list[dict], model, args) -> None:
    """latency.json, latency.png and latency.md under ``args.out`` from the records measured so far."""
    fixed = fixed_cost_per_layer(records, model.config.text_config.num_hidden_layers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = report_command("bench latency", args, ["preset", "lengths", "policies", "repeats", "new_tokens",
                                                      "long_tokens", "dtype", "device"]
                             + (["family"] if getattr(args, "family", None) else [])
                             + (["store_device"] if getattr(args, "store_device", "cpu") != "cpu" else []),
                             " --unstored-miss" if getattr(args, "unstored_miss", False) else "")
    mach = machine(args.device)
    (out / "latency.json").write_text(json.dumps({"command": command, "machine": mach, "records": records,
                                                  "fixed_cost": fixed}, indent=2))
    _plot(records, out / "latency.png")
    (out / "latency.md").write_text("\n".join(_report(records, fixed, args, command, mach)) + "\n")


def _floors(records) -> list[str]:
    """The TTFT floors (encoder included) on the stand-in and at the real geometries, and the encoder's share."""
    hits = [r for r in records if r["kind"] != "plain" and "ttft_floor" in r]
    if not hits:
        return []
    names = list(hits[0]["ttft_floor"])
    lines = ["", "## TTFT floors, the vision encoder included", "",
             "The FLOPs each kind runs over plain transformers' (`bench.flops`: the vision encoder over the tokens the "
             "kind encodes -- none on an exact hit, the changed tokens and their context on a hit found by its pixels "
             "(`found by` pixels), all of them otherwise -- then the plan's decoder layers), on this stand-in and for "
             "the same plan at the real models' published geometry; `encoder share`: the encoder's part of a miss's "
             "FLOPs there; `encoder work`: the hit's encoder FLOPs over a full encode's (analytic, stand-in) and its "
             "measured encoder time over the miss's.", "",
             "| visual tokens | kind | policy | found by | encoded | encoder work (analytic / measured) | "
             "measured TTFT / plain | " + " | ".join(f"floor {n}" for n in names)
             + " | " + " | ".join(f"encoder share {n}" for n in names) + " |",
             "| --- | --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in names * 2) + " |"]
    for r in hits:
        work = r.get("encoder_work") or {}
        measured = work.get("measured")
        analytic = (work.get("analytic") or {}).get(names[0])
        work_text = "-" if analytic is None else \
            f"{analytic:.3f} / {measured:.3f}" if measured is not None else f"{analytic:.3f} / -"
        lines.append(f"| {r['visual_tokens']} | {r['kind']} | {r['policy']} | "
                     f"{r.get('found_by') or '-'} | {r.get('encoded_tokens', '-')} | {work_text} | "
                     f"{r['ratio_to_plain']:.3f} | " + " | ".join(f"{r['ttft_floor'][n]:.3f}" for n in names) + " | "
                     + " | ".join(f"{r['encoder_share'][n]:.0%}" for n in names) + " |")
    sized = {r["visual_tokens"]: r["entry_bytes"] for r in hits if "entry_bytes" in r}
    if sized:
        lines += ["", "Entry size per image in bf16 (`bench.flops.entry_bytes`): the language model's K/V / the "
                  "tower's K/V that encoder reuse keeps (`Entry.tower_kv`), MiB.", "",
                  "| visual tokens | " + " | ".join(names) + " |", "| --- | " + " | ".join("---" for _ in names) + " |"]
        for tokens, per in sized.items():
            lines.append(f"| {tokens} | " + " | ".join(f"{per[n][0] / 2**20:,.0f} / {per[n][1] / 2**20:,.0f}"
                                                        for n in names) + " |")
    return lines


def _report(records, fixed, args, command, mach) -> list[str]:
    long = f" and {args.long_tokens}" if args.long_tokens else ""
    lines = header(f"Latency against plain transformers ({args.preset})", command, mach) + [
        f"Each kind runs greedy `generate` of exactly {args.new_tokens}{long} new tokens; `plain` is a never-enabled "
        "copy of the same random weights with a DynamicCache. Medians over "
        f"{args.repeats} interleaved rounds after a warm-up round (the {args.long_tokens}-token runs: one round). "
        "TTFT: vision encoder, prefill and first token; `decode`: the median step after it; `gen`: the whole "
        "generate. Ratios are to plain at the same length.", "",
        "| visual tokens | kind | policy | TTFT ms | TTFT / plain | decode ms | decode / plain | "
        f"gen {args.new_tokens} / plain | gen {args.long_tokens or '-'} / plain |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        gl = f"{r['generate_long_ratio_to_plain']:.3f}" if args.long_tokens else "-"
        lines.append(f"| {r['visual_tokens']} | {r['kind']} | {r['policy']} | "
                     f"{r['ttft_ms']:.1f} | {r['ratio_to_plain']:.3f} | {r['decode_step_ms']:.2f} | "
                     f"{r['decode_ratio_to_plain']:.3f} | {r['generate_ratio_to_plain']:.3f} | {gl} |")
    lines += ["", "## Prefill by hit kind (cache events, vision encoder excluded)", "",
              "`floor` is the plan's analytic FLOP ratio to a miss (`bench.flops.plan_flops`: projections and MLP of "
              "the computed tokens, attention over exactly the keys each query sees); `/ floor`: measured over floor; "
              "`plain kernels`: what plain transformers' own decoder layers take for the same work (`bench.latency."
              "plain_kernels_ms`: its language model runs each layer layout's queries over a DynamicCache of the "
              "plan's other keys), and `/ kernels` the prefill over it: where the FLOP floor prices a few queries at "
              "a full prefill's throughput, this charges them the weight and K/V reads plain transformers pay too; "
              "`R / B / M`: visual tokens recomputed, reused and masked; `MB read`: alias K/V the hit read.", "",
              "| visual tokens | kind | policy | prefill ms | / miss | floor | / floor | plain kernels ms | / kernels | "
              "R / B / M | MB read | lookup | encoder | warmup | fetch wait | plan | recompute |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        if r["kind"] == "plain":
            continue
        b = r["breakdown_ms"]
        kernels = f"{r['plain_kernels_ms']:.1f} | {r['ratio_to_kernels']:.2f}" if "plain_kernels_ms" in r else "- | -"
        lines.append(f"| {r['visual_tokens']} | {r['kind']} | {r['policy']} | "
                     f"{r['prefill_ms']:.1f} | {r['ratio_to_miss']:.3f} | {r['floor_ratio']:.3f} | "
                     f"{r['ratio_to_miss'] / r['floor_ratio']:.2f} | {kernels} | "
                     f"{r['recomputed']} / {r['reused']} / {r['masked']} | "
                     f"{r['bytes_read'] / 2**20:.1f} | {b['lookup']:.1f} | {b['encoder']:.1f} | {b['warmup']:.1f} | "
                     f"{b['fetch_wait']:.1f} | {b['plan']:.1f} | {b['recompute']:.1f} |")
    lines += _floors(records)
    if fixed is not None:
        lines += ["", f"Fixed cost of the prefill loop: {fixed['ms_per_layer']:.2f} ms per layer, "
                  f"{fixed['ms_per_gflop']:.2f} ms per GFLOP (least squares of the {fixed['points']} hit prefills' time "
                  "against their plan's FLOPs, `bench.latency.fixed_cost_per_layer`)."]
    return lines + ["", "![latency](latency.png)"]

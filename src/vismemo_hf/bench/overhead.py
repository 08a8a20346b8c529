"""``vismemo bench overhead``: what a request spends outside the arithmetic, per kind, against plain transformers.

For each depth (``--layers``, the preset's other dimensions kept) and each kind (plain transformers on a
never-enabled copy of the same weights, a miss, an exact hit, an approximate hit of each policy):

- **host syncs** of one ``generate`` of one new token, counted by ``SyncCounter``: the calls that read a value of
  a tensor that would live on the accelerator (the model's, the request's and what is computed from them), or whose
  output size depends on one, with their code sites; next to them every value read, host copies included. A hit
  path shaped for a GPU decides from host copies and syncs a constant number of times per request, whatever the
  depth.
- **cost per layer**: prefill times (``forward`` of the whole prompt, vision encoder included) at every visual
  length and depth; per kind and length the slope over the depths (least squares) is what one more decoder layer
  costs, and at the shortest length, where a layer's arithmetic is small, the loop's fixed cost per layer (what a
  faster chip does not shrink). Each run's store is flushed before the next run (a miss's entry written): the
  writer's work is off the request's path and not timed as the next request's loop. The FLOPs of what each kind
  runs (``bench.flops``) are recorded next to the times.
- **outside the kernels**: at the largest length and depth, the share of the prefill's wall time not spent in
  matrix products and attention kernels (``torch.profiler``'s self times of those operators).
"""

from __future__ import annotations

import copy
import functools
import json
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from vismemo_hf import VisMemoCache, VisMemoStore, enable
from vismemo_hf.bench.flops import kind_floor, patches_of
from vismemo_hf.bench.latency import any_size, page_pair, request_inputs
from vismemo_hf.bench.report import command as report_command
from vismemo_hf.bench.report import header, machine
from vismemo_hf.bench.syncs import SyncCounter, short_site
from vismemo_hf.core.plan import CacheEvent, HitKind, ImagePlan

#: operators whose self time is the arithmetic (matrix products, attention kernels)
KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
           "aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::_flash", "aten::_efficient",
           "aten::convolution", "aten::_convolution", "aten::mkldnn_convolution")


def _family(args) -> str:
    """The family asked for, else the preset's own (``family:`` in its YAML), else qwen2_vl."""
    from vismemo_hf.presets import load_preset

    return args.family or load_preset(args.preset).get("family") or "qwen2_vl"


def _models(args, layers: int):
    from vismemo_hf.families import build_model
    from vismemo_hf.offline import offline_processor

    family = _family(args)
    processor = offline_processor(family)
    plain = build_model(args.preset, family, dtype=getattr(torch, args.dtype), tokenizer=processor.tokenizer,
                        device=args.device, num_hidden_layers=layers)
    model = copy.deepcopy(plain)
    enable(model)
    any_size(processor, model)
    return plain, model, processor


def _kinds(plain, model, base, edited, seeded, policies) -> dict:
    """kind label -> (model, inputs, cache factory, expected hit kind)."""
    kinds: dict[str, tuple[object, object, Callable[[], VisMemoCache | None], str | None]]
    kinds = {"plain": (plain, base, lambda: None, None),
             "miss": (model, base, lambda: VisMemoCache(store=VisMemoStore()), "miss"),
             "exact": (model, base, lambda: VisMemoCache(store=seeded), "exact")}
    for policy in policies:
        kinds[f"approximate {policy}"] = (model, edited, functools.partial(VisMemoCache, store=seeded, policy=policy,
                                                                           store_misses=False, approximate="always"),
                                          "approximate")
    return kinds


def _check(cache, expected, label: str) -> CacheEvent | None:
    if cache is None:
        return None
    (event,) = cache.events
    if str(event.kind) != expected and expected != "approximate":
        raise RuntimeError(f"{label}: expected a {expected} hit, got {event.kind}")
    return event  # a policy whose lookup finds no alias here is reported with the kind it got


def _device_entries(cache) -> list:
    """The K/V, embeddings and deepstack features the store's device tiers hold (on an accelerator they live
    there; the rest of an entry stays on the host)."""
    from vismemo_hf.store.tiers.device import DeviceTier

    store = getattr(cache, "store", None)
    tiers = [t for t in getattr(store, "tiers", ()) if isinstance(t, DeviceTier)]
    return [[e.kv, e.embeds, e.deepstack] for t in tiers for e in t.lru.values()]


@torch.no_grad()
def _syncs(case, label: str) -> tuple[SyncCounter, CacheEvent | None]:
    runner, inputs, make, expected = case
    cache = make()
    cuda = runner.device.type == "cuda"
    resident = [runner, dict(inputs), *_device_entries(cache)]
    with warnings.catch_warnings(record=True) as caught, SyncCounter(sites=True, resident=resident) as counter:
        warnings.simplefilter("always")
        if cuda:  # the driver's own count of the synchronising calls
            torch.cuda.set_sync_debug_mode("warn")
        try:
            runner.generate(**inputs, **({"cache": cache} if cache is not None else {}), max_new_tokens=1,
                            do_sample=False)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    counter.cuda_syncs = sum("synchroniz" in str(w.message) for w in caught) if cuda else None
    # where each of them was called from (the warning names the Python line), for the sites the count cannot name
    counter.cuda_sites = Counter(short_site(w.filename, w.lineno) for w in caught if "synchroniz" in str(w.message)) \
        if cuda else None
    return counter, _check(cache, expected, label)


#: allocations: memory from the caching allocator, no kernel
_ALLOCATIONS = ("aten::empty", "aten::new_empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty_strided")


def _launches(func) -> bool:
    """Whether an aten operator runs a kernel on its device: every operator but the views (whose returns alias an
    input without writing it: ``view``, ``t``, ``expand``, ``slice``, ``detach``...) and the allocations."""
    if func._schema.name in _ALLOCATIONS:
        return False
    returns = func._schema.returns
    return not returns or not all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


@torch.no_grad()
def _operators(case) -> int:
    """The aten operators one prefill's forward runs on the calling thread that launch a kernel (``_launches``),
    counted below Python (``TorchDispatchMode``): what a GPU would launch for the request, whatever Python does
    around them. The store's threads (a miss's entry build, reads ahead) are not the request's and not counted."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if _launches(func):
                self.n += 1
            return func(*args, **(kwargs or {}))

    runner, inputs, make, _ = case
    cache = make()
    with Count() as count:
        runner(**inputs, **({"cache": cache} if cache is not None else {}), use_cache=True)
    if cache is not None:
        cache.store.flush()
    return count.n


@torch.no_grad()
def _prefill_ms(case, label: str, repeats: int) -> tuple[float, CacheEvent | None]:
    runner, inputs, make, expected = case
    times, event = [], None
    for _ in range(repeats + 1):  # the first round warms up
        cache = make()
        kwargs = {"cache": cache} if cache is not None else {}
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner(**inputs, **kwargs, use_cache=True)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        event = _check(cache, expected, label)
        if cache is not None:
            cache.store.flush()  # a miss's entry is written before the next run, as in ``bench latency``: the writer's
            # work (off the request's path) is not timed as the next request's loop
    return statistics.median(times[1:] or times), event


@torch.no_grad()
def _outside_kernels(case) -> float:
    """Share of one prefill's wall time outside the ``KERNELS`` operators."""
    from torch.profiler import ProfilerActivity, profile

    runner, inputs, make, _ = case
    cache = make()
    kwargs = {"cache": cache} if cache is not None else {}
    cuda = runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        runner(**inputs, **kwargs, use_cache=True)
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e6

    def self_time(e) -> float:  # on a GPU the operators' kernel time, else their CPU time
        if cuda:
            device_time = getattr(e, "self_device_time_total", None)  # older torch: self_cuda_time_total
            return device_time if device_time else getattr(e, "self_cuda_time_total", 0.0)
        return e.self_cpu_time_total

    kernels = sum(self_time(e) for e in prof.key_averages() if e.key.startswith(KERNELS))
    return max(0.0, 1.0 - kernels / wall)


def _flops(config, inputs, event) -> float:
    """GFLOPs of the prefill: the vision encoder (not run by an exact hit) and the plan's decoder layers (plain
    transformers: every token computed, as a miss)."""
    ids = inputs["input_ids"][0].cpu()
    is_image = ids == config.image_token_id
    start, n = int(is_image.nonzero()[0]), int(is_image.sum())
    plan = event.plan if event is not None else ImagePlan.full(HitKind.MISS, n)
    exact = event is not None and str(event.kind) == "exact"
    return kind_floor(config, ids.numel(), start, plan, 0 if exact else patches_of(config, n)) / 1e9


def per_layer(rows: list[dict]) -> dict:
    """visual tokens -> ms per decoder layer: the slope of the prefill's time over the depths at that length (least
    squares). At a short length, where a layer's arithmetic is small, it is the loop's fixed cost per layer."""
    out = {}
    for n in sorted({r["visual_tokens"] for r in rows}):
        points = [(r["layers"], r["prefill_ms"]) for r in rows if r["visual_tokens"] == n]
        if len({p[0] for p in points}) < 2:
            continue
        x = torch.tensor([[1.0, p[0]] for p in points], dtype=torch.float64)
        y = torch.tensor([[p[1]] for p in points], dtype=torch.float64)
        out[n] = torch.linalg.lstsq(x, y).solution.flatten().tolist()[1]
    return out


def measure(args) -> dict:
    from vismemo_hf.progress import progress

    depths = [int(x) for x in args.layers.split(",")] if isinstance(args.layers, str) else list(args.layers)
    lengths = [int(x) for x in args.lengths.split(",")] if isinstance(args.lengths, str) else list(args.lengths)
    policies = args.policies.split(",") if isinstance(args.policies, str) else list(args.policies)
    syncs: dict[str, dict[int, int]] = {}
    operators: dict[str, dict[int, int]] = {}
    device_syncs: dict[str, dict[int, int]] = {}
    cuda_syncs: dict[str, dict[int, int]] = {}
    cuda_sites: dict[str, dict[int, dict[str, int]]] = {}
    sites: dict[str, dict[int, dict[str, int]]] = {}
    timings: dict[str, list[dict[str, float]]] = {}
    outside: dict[str, float] = {}
    got: dict[str, dict[int, str]] = {}
    with progress(total=len(depths) * len(lengths), desc="overhead", unit="size") as bar:
        for layers in depths:
            plain, model, processor = _models(args, layers)
            for n in lengths:
                base_img, edited_img = page_pair(n, model)
                base, edited = (request_inputs(processor, im).to(model.device) for im in (base_img, edited_img))
                seeded = VisMemoStore()
                with torch.no_grad():
                    model(**base, cache=VisMemoCache(store=seeded), use_cache=True)  # the alias entry
                seeded.flush()
                kinds = _kinds(plain, model, base, edited, seeded, policies)
                for label, case in kinds.items():
                    if n == lengths[0]:
                        counter, event = _syncs(case, label)
                        if event is not None and str(event.kind) != (case[3] or ""):
                            got.setdefault(label, {})[layers] = str(event.kind)
                        syncs.setdefault(label, {})[layers] = counter.total
                        device_syncs.setdefault(label, {})[layers] = counter.device_total
                        if counter.cuda_syncs is not None and counter.cuda_sites is not None:
                            cuda_syncs.setdefault(label, {})[layers] = counter.cuda_syncs
                            cuda_sites.setdefault(label, {})[layers] = dict(counter.cuda_sites.most_common(args.sites))
                        if label != "plain":
                            own = [(k, v) for k, v in counter.device_sites.most_common() if "vismemo_hf/" in k]
                            sites.setdefault(label, {})[layers] = dict(own[: args.sites])
                        operators.setdefault(label, {})[layers] = _operators(case)
                    ms, event = _prefill_ms(case, label, args.repeats)
                    gflop = _flops(model.config, case[1], event)
                    timings.setdefault(label, []).append({"layers": layers, "visual_tokens": n, "gflop": gflop,
                                                          "prefill_ms": ms})
                    if layers == depths[-1] and n == lengths[-1]:
                        outside[label] = _outside_kernels(case)
                bar.update(1)
            del plain, model
    fits = {label: per_layer(rows) for label, rows in timings.items()}
    return {"syncs": syncs, "operators": operators, "device_syncs": device_syncs, "cuda_syncs": cuda_syncs,
            "cuda_sites": cuda_sites, "sites": sites, "timings": timings,
            "fits": fits, "outside_kernels": outside, "depths": depths, "lengths": lengths, "got": got}


def _report(data: dict, args, command: str, mach: str) -> list[str]:
    depths = data["depths"]
    lines = header("Overhead of a request outside the arithmetic, against plain transformers", command, mach)
    lines += [f"Preset `{args.preset}` ({_family(args)}), {args.dtype}, random weights; depths "
              f"{', '.join(map(str, depths))} layers (the preset's other dimensions kept).", "",
              f"## Host syncs of one generate (one new token, {data['lengths'][0]} visual tokens)", "",
              "| kind | " + " | ".join(f"{d} layers" for d in depths) + " | per extra layer | over plain |",
              "| --- | " + " | ".join("---" for _ in depths) + " | --- | --- |"]
    lines[-2:-2] = ["Syncs: reads of tensors that live on the accelerator (the model's parameters, the request's "
                    "tensors, what is computed from them; `bench/syncs.py`), each of which drains the stream there; "
                    "value reads: every read of a tensor's value, host copies included (what decisions made on the "
                    "host read instead).", ""]
    lines[-2] = ("| kind | " + " | ".join(f"syncs at {d} layers" for d in depths) + " | per extra layer | over plain | "
                 + " | ".join(f"value reads at {d} layers" for d in depths) + " |")
    lines[-1] = "| --- | " + " | ".join("---" for _ in depths) + " | --- | --- | " + " | ".join("---" for _ in depths) + " |"
    device = data.get("device_syncs") or data["syncs"]
    plain = device["plain"]
    for label, counts in device.items():
        per = (counts[depths[-1]] - counts[depths[0]]) / max(1, depths[-1] - depths[0])
        over = max(counts[d] - plain[d] for d in depths)
        values = " | ".join(str(data["syncs"][label][d]) for d in depths)
        if label in data["got"]:
            at = ", ".join(f"{d} layers" for d in data["got"][label])
            label = f"{label} (its lookup: a {next(iter(data['got'][label].values()))} at {at})"
        lines.append(f"| {label} | " + " | ".join(str(counts[d]) for d in depths) + f" | {per:.2f} | {over:+d} | "
                     f"{values} |")
    if data["cuda_syncs"]:
        lines += ["", "CUDA's own count (`torch.cuda.set_sync_debug_mode`): " + "; ".join(
            f"{label} " + " / ".join(str(c[d]) for d in depths) for label, c in data["cuda_syncs"].items())]
    if data.get("operators"):
        ops = data["operators"]
        lines += ["", f"## Operators of one prefill ({data['lengths'][0]} visual tokens)", "",
                  "The aten operators the request's thread runs that launch a kernel (views and allocations left "
                  "out), counted below Python (`TorchDispatchMode`): what a GPU would launch for the prefill, "
                  "whatever the Python around them costs. `per extra layer`: the slope over the depths; `over "
                  "plain`: the most above plain transformers' at any depth; `x plain`: at the largest depth.", "",
                  "| kind | " + " | ".join(f"{d} layers" for d in depths) + " | per extra layer | over plain | x plain |",
                  "| --- | " + " | ".join("---" for _ in depths) + " | --- | --- | --- |"]
        base = ops["plain"]
        for label, counts in ops.items():
            per = (counts[depths[-1]] - counts[depths[0]]) / max(1, depths[-1] - depths[0])
            over = max(counts[d] - base[d] for d in depths)
            lines.append(f"| {label} | " + " | ".join(str(counts[d]) for d in depths) + f" | {per:.1f} | {over:+d} | "
                         f"{counts[depths[-1]] / max(1, base[depths[-1]]):.2f} |")
    lengths = data["lengths"]
    lines += ["", "## Cost per decoder layer (ms: the slope of the prefill's time over the depths, per length)", "",
              "At the shortest length a layer's arithmetic is small and the slope is the loop's fixed cost per layer; "
              "`over plain`: that slope minus plain transformers' at the same length. A miss's entry is written "
              "(on the store's writer thread) before the next run starts, as in `bench latency`.", "",
              "| kind | " + " | ".join(f"{n} tokens" for n in lengths) + f" | over plain at {lengths[0]} | "
              "outside the kernels |", "| --- | " + " | ".join("---" for _ in lengths) + " | --- | --- |"]
    plain_slope = data["fits"].get("plain", {})
    for label, slopes in data["fits"].items():
        share = data["outside_kernels"].get(label)
        share_s = f"{share:.0%}" if share is not None else "-"
        cells = " | ".join(f"{slopes[n]:.2f}" if n in slopes else "-" for n in lengths)
        over = (f"{slopes[lengths[0]] - plain_slope[lengths[0]]:+.2f}"
                if lengths[0] in slopes and lengths[0] in plain_slope else "-")
        lines.append(f"| {label} | {cells} | {over} | {share_s} |")
    lines += ["", f"Outside the kernels: share of one prefill at {data['lengths'][-1]} visual tokens and {depths[-1]} "
              "layers not spent in matrix products and attention kernels (torch.profiler self times).", "",
              "## Where the library's own code syncs (largest depth; the rest are transformers' own)", ""]
    for label, per_depth in data["sites"].items():
        top = list(per_depth[depths[-1]].items())[: args.sites]
        lines.append(f"- {label}: " + ("; ".join(f"{site} x{k}" for site, k in top) or "none"))
    if data.get("cuda_sites"):
        lines += ["", "## Where CUDA's own count syncs (largest depth; every caller, transformers' too)", ""]
        for label, per_depth in data["cuda_sites"].items():
            top = list(per_depth[depths[-1]].items())[: args.sites]
            lines.append(f"- {label}: " + ("; ".join(f"{site} x{k}" for site, k in top) or "none"))
    return lines



def main(args) -> int:
    data = measure(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    options = ["preset"] + (["family"] if args.family else []) + ["layers", "lengths", "policies", "repeats", "dtype",
                                                                  "device"]
    command = report_command("bench overhead", args, options)
    mach = machine(args.device)
    (out / "overhead.json").write_text(json.dumps({"command": command, "machine": mach, **data}, indent=2,
                                                  default=str))
    (out / "overhead.md").write_text("\n".join(_report(data, args, command, mach)) + "\n")
    print((out / "overhead.md").read_text())
    return 0

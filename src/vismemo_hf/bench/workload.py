"""``vismemo bench workload``: streams of requests as users send them (``eval.workload``), back to back in one process
with one store and no flush between requests, against plain transformers on a never-enabled copy of the weights.

Per model and stream, plain transformers answers the whole stream, then the enabled model answers it back to back
(one new ``VisMemoCache`` a request on the stream's store), the two in alternating order from round to round; each
round starts a fresh store (the stream's first request meets an empty one), and the store's background work is waited
for between the two (untimed: it never runs during plain transformers' requests). The first request of the process is
reported apart (its one-time setup), the whole stream's ratio is over every other request. Reported per stream:
whole-stream TTFT over plain's, p50 / p99 TTFT over plain's per hit kind, the share of the visual tokens reused (not
recomputed), the time requests waited on the store, and how many answers equal plain's.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import StoppingCriteriaList

from vismemo_hf import VisMemoCache, VisMemoStore, enable
from vismemo_hf.bench.report import header, machine, write
from vismemo_hf.eval import docpage, workload
from vismemo_hf.eval.loading import load_model
from vismemo_hf.eval.quality import TokenClock

#: the models of the default run: the tiny model of every family, the stand-ins at real depth, the two readers
DEFAULT_MODELS = ("tiny:qwen2_vl", "tiny:qwen2_5_vl", "tiny:qwen3_vl", "tiny:glm4v", "tiny:llava_onevision",
                  "qwen3-vl-8b-narrow", "qwen3-vl-8b-overhead", "vismemo-docqa-tiny", "vismemo-docqa-base")
READERS = ("vismemo-docqa-tiny", "vismemo-docqa-base")


@dataclass
class Served:
    """One request as the enabled model served it, and as plain transformers did."""

    label: str
    ttft_ms: float
    plain_ms: float
    kinds: list[str]
    visual: int
    reused: int
    same_answer: bool
    waited_ms: float
    #: ms the store spent, after this request, computing the next step's prefix ahead (``runtime.prefix.slide_later``)
    ahead_ms: float = 0.0


@dataclass
class StreamResult:
    requests: list[Served] = field(default_factory=list)
    first: Served | None = None  # the process's first enabled request


def _inputs(processor, request: workload.StreamRequest, device):
    text = processor.apply_chat_template(request.messages, add_generation_prompt=True)
    return processor(text=[text], images=request.images or None, return_tensors="pt").to(device)


@torch.no_grad()
def _generate(model, inputs, cache, new_tokens: int) -> tuple[float, list[int]]:
    clock = TokenClock(model.device)
    if clock.cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(**inputs, **({"cache": cache} if cache is not None else {}), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, stopping_criteria=StoppingCriteriaList([clock]))
    return (clock.times[0] - t0) * 1e3, out[0, inputs["input_ids"].shape[1]:].tolist()


def _reused(event) -> int:
    """Visual tokens of an image whose K/V were not recomputed (an exact hit's every one, none of a miss's)."""
    if str(event.kind) == "miss" or event.fallback:
        return 0
    return event.n_tokens - event.recomputed


def run_stream(model, plain, processor, requests, rounds: int, new_tokens: int, first: bool,
               store_factory=VisMemoStore, idle_ms: float = 0.0) -> StreamResult:
    """``requests`` back to back, ``rounds`` times with a fresh store each; ``first``: the process's first enabled
    request is this stream's first (reported apart). In each round plain transformers answers the whole stream and
    the enabled model answers it back to back, in alternating order; the store's background work is waited for
    between the two (untimed), so that it never runs during plain transformers' requests."""
    result = StreamResult()
    inputs = [_inputs(processor, request, model.device) for request in requests]
    for r in range(rounds):
        store = store_factory()
        plain_runs: list = []
        enabled_runs: list = []
        for phase in (("plain", "enabled") if r % 2 == 0 else ("enabled", "plain")):
            store.writer.drain()
            if phase == "plain":
                for x in inputs:
                    plain_runs.append(_generate(plain, x, None, new_tokens))
                    time.sleep(idle_ms / 1e3)  # plain transformers idles as long (a machine woken from idle is slower)
                continue
            for x in inputs:
                cache = VisMemoCache(store=store)
                waited = store.writer.wait_ms  # read as it is: stats() would wait for the pending writes first
                ttft, tokens = _generate(model, x, cache, new_tokens)
                ahead = store.prefixes.speculations["ms"] if store.prefixes is not None else 0.0
                if idle_ms:
                    time.sleep(idle_ms / 1e3)
                ahead = (store.prefixes.speculations["ms"] if store.prefixes is not None else 0.0) - ahead
                enabled_runs.append((ttft, tokens, list(cache.events), store.writer.wait_ms - waited, ahead))
        for i, (request, (plain_ms, plain_tokens), (ttft, tokens, events, waited, ahead)) in enumerate(
                zip(requests, plain_runs, enabled_runs)):
            served = Served(request.label, ttft, plain_ms, [str(e.kind) for e in events],
                            sum(e.n_tokens for e in events), sum(_reused(e) for e in events), tokens == plain_tokens,
                            waited, ahead)
            if first and r == 0 and i == 0:
                result.first = served
            else:
                result.requests.append(served)
        store.close()
    return result


def summary(result: StreamResult) -> dict:
    """The figures of one stream."""
    rows = result.requests
    by_kind: dict[str, list[float]] = defaultdict(list)
    for s in rows:
        kind = "miss" if not s.kinds or all(k == "miss" for k in s.kinds) else \
            "exact" if all(k == "exact" for k in s.kinds) else "approximate" if "approximate" in s.kinds else "mixed"
        by_kind[kind].append(s.ttft_ms / s.plain_ms)
    out: dict[str, object]
    out = {"requests": len(rows), "ttft_ratio": sum(s.ttft_ms for s in rows) / max(1e-9, sum(s.plain_ms for s in rows)),
           "ttft_ms": sum(s.ttft_ms for s in rows), "plain_ms": sum(s.plain_ms for s in rows),
           "reused_share": sum(s.reused for s in rows) / max(1, sum(s.visual for s in rows)),
           "waited_ms": sum(s.waited_ms for s in rows), "ahead_ms": sum(s.ahead_ms for s in rows),
           "same_answers": sum(s.same_answer for s in rows),
           "kinds": {k: {"n": len(v), "p50": statistics.median(v), "p99": _p99(v)} for k, v in sorted(by_kind.items())}}
    if result.first is not None:
        out["first"] = {"ttft_ms": result.first.ttft_ms, "plain_ms": result.first.plain_ms}
    # the later turns of a chat, the steps after the first screens of an agent
    later = rows[len(rows) // 2:]
    out["later_ratio"] = sum(s.ttft_ms for s in later) / max(1e-9, sum(s.plain_ms for s in later))
    return out


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def load(spec: str, seed: int = 0, dtype=torch.float32, device: str = "cpu"):
    """``(model, processor, visual tokens an image)`` of a model name: ``tiny:FAMILY``, a preset or a reader."""
    from vismemo_hf.bench.latency import any_size

    tokens: int | None
    if spec.startswith("tiny:"):
        model, processor = load_model("tiny", family=spec.split(":", 1)[1], seed=seed, dtype=dtype, device=device)
        tokens = 256
    else:
        model, processor = load_model(spec, seed=seed, dtype=dtype, device=device)
        tokens = None if spec in READERS else 1024
    if tokens is not None:
        any_size(processor, model)
    return model.eval(), processor, tokens


def image_size(spec: str, model, tokens: int | None) -> tuple[int, int]:
    """The page size that gives about ``tokens`` visual tokens (None: a reader's own page size)."""
    from vismemo_hf.eval import synthdoc
    from vismemo_hf.families import FAMILIES

    if tokens is None:
        return (docpage.SIZE, docpage.SIZE) if "docqa-base" in spec else synthdoc.PAGE_SIZE
    return FAMILIES[model.config.model_type].bench_image_size(model.config, tokens)


def measure(spec: str, streams: list[str], rounds: int, new_tokens: int, seed: int, dtype=torch.float32,
            device: str = "cpu", idle_ms: float = 0.0) -> dict:
    model, processor, tokens = load(spec, seed, dtype, device)
    plain = copy.deepcopy(model)  # the same weights, never enabled
    size = image_size(spec, model, tokens)
    built = {name: (workload.reader_stream(spec) if name == "reader" else workload.build(name, size, seed))
             for name in streams if name != "reader" or spec in READERS}
    for request in next(iter(built.values()))[:2]:  # plain transformers warmed up (the enabled model is not)
        _generate(plain, _inputs(processor, request, model.device), None, 1)
    t0 = time.perf_counter()
    enable(model)
    enable_ms = (time.perf_counter() - t0) * 1e3
    out = {"model": spec, "visual_tokens": tokens, "image_size": list(size), "enable_ms": enable_ms, "streams": {}}
    for k, (name, requests) in enumerate(built.items()):
        result = run_stream(model, plain, processor, requests, rounds, new_tokens, first=k == 0, idle_ms=idle_ms)
        out["streams"][name] = summary(result)
        out["streams"][name]["rows"] = [vars(s) for s in result.requests[:len(requests)]]
    return out


def _table(results: list[dict]) -> list[str]:
    lines = ["| model | stream | requests | TTFT / plain | later half | miss p50 / p99 | exact p50 / p99 | "
             "approximate p50 / p99 | reused | waited ms | ahead ms | answers = plain |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for res in results:
        for name, s in res["streams"].items():
            kinds = [_kind(s, k) for k in ("miss", "exact", "approximate")]
            lines.append(f"| {res['model']} | {name} | {s['requests']} | {s['ttft_ratio']:.3f} | {s['later_ratio']:.3f} "
                         f"| {' | '.join(kinds)} | {100 * s['reused_share']:.0f} % "
                         f"| {s['waited_ms']:.1f} | {s.get('ahead_ms', 0.0):.0f} | {s['same_answers']} / {s['requests']} |")
    return lines


def _kind(stream: dict, kind: str) -> str:
    v = stream["kinds"].get(kind)
    return f"{v['p50']:.2f} / {v['p99']:.2f} ({v['n']})" if v else "-"


def _plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the [eval] extra: the report is written without its plot
        return
    streams = sorted({n for r in results for n in r["streams"]})
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(results) * len(streams) / 3), 4))
    width = 0.8 / max(1, len(streams))
    for j, name in enumerate(streams):
        xs = [i + j * width for i, r in enumerate(results) if name in r["streams"]]
        ys = [r["streams"][name]["ttft_ratio"] for r in results if name in r["streams"]]
        ax.bar(xs, ys, width, label=name)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))])
    ax.set_xticklabels([r["model"].replace("tiny:", "tiny ") for r in results], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("whole-stream TTFT / plain transformers")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    models = DEFAULT_MODELS if args.models == "all" else tuple(args.models.split(","))
    streams = list(workload.STREAMS) + ["reader"] if args.streams == "all" else args.streams.split(",")
    results = []
    for spec in models:
        results.append(measure(spec, streams, args.rounds, args.new_tokens, args.seed,
                               getattr(torch, getattr(args, "dtype", "float32")), getattr(args, "device", "cpu"),
                               getattr(args, "idle_ms", 0)))
        print(f"{spec}: " + ", ".join(f"{n} {s['ttft_ratio']:.3f}" for n, s in results[-1]["streams"].items()),
              flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "workload.json").write_text(json.dumps(results, indent=1, default=str))
    _plot(results, out / "workload.png")
    idle = getattr(args, "idle_ms", 0)
    cmd = (f"vismemo bench workload --models {args.models} --streams {args.streams} --rounds {args.rounds} "
           f"--new-tokens {args.new_tokens} --seed {args.seed}" + (f" --idle-ms {idle}" if idle else "")
           + f" --out {args.out}")
    if getattr(args, "device", "cpu") != "cpu":
        cmd += f" --dtype {args.dtype} --device {args.device}"
    lines = header("Streams of requests against plain transformers", cmd, machine(getattr(args, "device", "cpu"))) + [
        ("Every stream runs back to back" if not idle else f"Every stream's requests come {idle} ms after the "
         "answer before them (an agent acting on its answer; untimed),") +
        " in one process with one store and no flush between requests (a fresh "
        f"store each round, {args.rounds} rounds); plain transformers (a never-enabled copy of the weights) "
        "answers the stream, and the enabled model answers it back to back, the two in alternating order from"
        " round to round. `TTFT / plain`: the stream's summed time to the first token over plain's; `later "
        "half`: the same over the stream's second half (a chat's later turns, an agent's later steps); per "
        "kind, p50 / p99 of each request's ratio (number of requests); `reused`: visual tokens whose K/V were"
        " not recomputed, of all; `waited ms`: time requests waited on the store; `ahead ms`: time the store "
        "spent between requests computing a sliding window's next prefix (`runtime/prefix.slide_later`); answers: the "
        f"{args.new_tokens} greedy tokens equal plain's. The process's first request is reported apart below.",
        "", *_table(results), "", "| model | enable ms | first request ms | plain ms |", "| --- | --- | --- | --- |"]
    for r in results:
        first = next((s["first"] for s in r["streams"].values() if "first" in s), None)
        if first:
            lines.append(f"| {r['model']} | {r['enable_ms']:.0f} | {first['ttft_ms']:.1f} | {first['plain_ms']:.1f} |")
    lines += ["", "![whole-stream TTFT over plain](workload.png)", ""]
    write(lines, out / "workload.md")
    return 0

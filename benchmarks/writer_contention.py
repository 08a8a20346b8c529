"""What the store's writer costs a request that runs while it works: a stream of new images (every request a miss,
no approximate lookup), each request right after another miss whose entry is still to be written. Per request, its
time to the first token over plain transformers', in two arms taken in turn: the writer drained before the request
(nothing runs beside it), and the writer as it is (the other miss's job starts between the two requests and runs
beside the second).

    python benchmarks/writer_contention.py --models tiny:qwen2_vl,vismemo-docqa-tiny --repeats 6

Writes results/perf/writer-contention.md.
"""

import argparse
import copy
import statistics
import sys
from pathlib import Path

from vismemo_hf import VisMemoCache, VisMemoStore, enable
from vismemo_hf.bench import workload as bench
from vismemo_hf.bench.report import header, machine, write
from vismemo_hf.eval import workload

ARMS = ("drained", "writing")


def measure(spec: str, repeats: int, new_tokens: int = 4) -> dict[str, list[float]]:
    model, processor, tokens = bench.load(spec)
    plain = copy.deepcopy(model)
    requests = workload.build("mixed", bench.image_size(spec, model, tokens), 0)[:12]
    inputs = [bench._inputs(processor, r, model.device) for r in requests]
    for x in inputs[:3]:
        bench._generate(plain, x, None, 1)
    enable(model)
    for x in inputs[:3]:
        bench._generate(model, x, VisMemoCache(store=VisMemoStore()), 1)
    store, ratios, n = VisMemoStore(), {arm: [] for arm in ARMS}, 0
    for repeat in range(repeats):
        for i, x in enumerate(inputs):
            n += 1
            x = {**x, "pixel_values": x["pixel_values"] + 1e-4 * n}  # a new image: a miss
            plain_ms = bench._generate(plain, x, None, new_tokens)[0]
            arm = ARMS[(i + repeat) % len(ARMS)]  # every request of the stream in every arm
            before = {**x, "pixel_values": x["pixel_values"] + 5e-5}  # another miss: its entry's job is left
            bench._generate(model, before, VisMemoCache(store=store, approximate="never"), 1)
            if arm == "drained":
                store.writer.drain()
            cache = VisMemoCache(store=store, approximate="never")
            ratios[arm].append(bench._generate(model, x, cache, new_tokens)[0] / plain_ms)
            store.writer.drain()  # untimed
    return ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny:qwen2_vl,vismemo-docqa-tiny")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", default="results/perf")
    args = parser.parse_args()
    cmd = f"python benchmarks/writer_contention.py --models {args.models} --repeats {args.repeats}"
    lines = header("The store's writer beside a request", cmd, machine("cpu")) + [
        "A miss's time to the first token over plain transformers', p50 and mean, right after another miss whose "
        "entry is still to be written (12 new images, "
        f"{args.repeats} times, every request in both arms): the writer drained first, or writing the other "
        "miss's entry beside it.", "",
        "| model | writer | requests | p50 | mean |", "| --- | --- | --- | --- | --- |"]
    for spec in args.models.split(","):
        for arm, values in measure(spec, args.repeats).items():
            lines.append(f"| {spec} | {arm} | {len(values)} | {statistics.median(values):.3f} | "
                         f"{statistics.fmean(values):.3f} |")
            print(lines[-1], flush=True)
    write(lines + [""], Path(args.out) / "writer-contention.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

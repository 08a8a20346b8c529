"""Whether hashing the exact keys ahead of the lookup (``runtime.keys``: on a key thread from the moment ``generate``
asks for the encoder output) shortens a miss on this machine: a stream of new images (every request a miss, no
approximate lookup), each answered by plain transformers and by the enabled model with the keys hashed ahead and
without (the two in alternating order), each request's time to the first token over plain's.

    python benchmarks/keys_ahead.py --models tiny:qwen2_vl,vismemo-docqa-tiny --repeats 6

Writes results/perf/keys-ahead.md. Keys are hashed ahead only for pixels on an accelerator (``keys.AHEAD_ON_HOST``).
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
from vismemo_hf.runtime import keys


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
    store, ratios, n = VisMemoStore(), {"ahead": [], "at the lookup": []}, 0
    before = keys.AHEAD_ON_HOST
    try:
        for _ in range(repeats):
            for x in inputs:
                n += 1
                x = {**x, "pixel_values": x["pixel_values"] + 1e-4 * n}  # a new image: a miss
                plain_ms = bench._generate(plain, x, None, new_tokens)[0]
                for j, mode in enumerate(("ahead", "at the lookup") if n % 2 else ("at the lookup", "ahead")):
                    keys.AHEAD_ON_HOST = mode == "ahead"
                    y = {**x, "pixel_values": x["pixel_values"] + 2e-5 * (j + 1)}
                    cache = VisMemoCache(store=store, approximate="never")
                    ratios[mode].append(bench._generate(model, y, cache, new_tokens)[0] / plain_ms)
                    store.writer.drain()  # untimed: no write of the last miss runs meanwhile
    finally:
        keys.AHEAD_ON_HOST = before
    return ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny:qwen2_vl,vismemo-docqa-tiny")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", default="results/perf")
    args = parser.parse_args()
    cmd = f"python benchmarks/keys_ahead.py --models {args.models} --repeats {args.repeats}"
    lines = header("Exact keys hashed ahead of the lookup, on the CPU", cmd, machine("cpu")) + [
        "A miss's time to the first token over plain transformers', p50 and mean over the requests (12 new images, "
        f"{args.repeats} times), with the keys hashed on a key thread from the moment `generate` asks for the encoder "
        "output and hashed at the lookup; the two in alternating order after each plain request.", "",
        "| model | keys | requests | p50 | mean |", "| --- | --- | --- | --- | --- |"]
    for spec in args.models.split(","):
        for mode, values in measure(spec, args.repeats).items():
            lines.append(f"| {spec} | {mode} | {len(values)} | {statistics.median(values):.3f} | "
                         f"{statistics.fmean(values):.3f} |")
            print(lines[-1], flush=True)
    write(lines + [""], Path(args.out) / "keys-ahead.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

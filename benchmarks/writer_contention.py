"""What the store's writer costs a request that runs while it works: a stream of new images (every request a miss,
no approximate lookup), each request right after another miss whose entry is still to be written. Per request, its
time to the first token over plain transformers', in two arms taken in turn: the writer drained before the request
(nothing runs beside it), and the writer as it is (the other miss's job starts between the two requests and runs
beside the second).

    python benchmarks/writer_contention.py --models tiny:qwen2_vl,vismemo-docqa-tiny --repeats 6

Writes results/perf/writer-contention.md.
"""

import sys

from vismemo_hf import VisMemoCache, VisMemoStore
from vismemo_hf.bench import arms
from vismemo_hf.bench import workload as bench

ARMS = ("drained", "writing")


def measure(spec: str, repeats: int, new_tokens: int = 4) -> dict[str, list[float]]:
    model, plain, inputs = arms.miss_stream(spec)
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
    return arms.arms_main(
        "writer_contention.py", __doc__, "The store's writer beside a request",
        "A miss's time to the first token over plain transformers', p50 and mean, right after another miss whose "
        "entry is still to be written (12 new images, {repeats} times, every request in both arms): the "
        "writer drained first, or writing the other miss's entry beside it.",
        "writer", measure, "writer-contention.md")


if __name__ == "__main__":
    sys.exit(main())

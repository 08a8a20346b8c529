"""Whether hashing the exact keys ahead of the lookup (``runtime.keys``: on a key thread from the moment ``generate``
asks for the encoder output) shortens a miss on this machine: a stream of new images (every request a miss, no
approximate lookup), each answered by plain transformers and by the enabled model with the keys hashed ahead and
without (the two in alternating order), each request's time to the first token over plain's.

    python benchmarks/keys_ahead.py --models tiny:qwen2_vl,vismemo-docqa-tiny --repeats 6

Writes results/perf/keys-ahead.md. Keys are hashed ahead only for pixels on an accelerator (``keys.AHEAD_ON_HOST``).
"""

import sys

from vismemo_hf import VisMemoCache, VisMemoStore
from vismemo_hf.bench import arms
from vismemo_hf.bench import workload as bench
from vismemo_hf.runtime import keys


def measure(spec: str, repeats: int, new_tokens: int = 4) -> dict[str, list[float]]:
    model, plain, inputs = arms.miss_stream(spec)
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
    return arms.arms_main(
        "keys_ahead.py", __doc__, "Exact keys hashed ahead of the lookup, on the CPU",
        "A miss's time to the first token over plain transformers', p50 and mean over the requests (12 new images, "
        "{repeats} times), with the keys hashed on a key thread from the moment `generate` asks for the encoder "
        "output and hashed at the lookup; the two in alternating order after each plain request.",
        "keys", measure, "keys-ahead.md")


if __name__ == "__main__":
    sys.exit(main())

"""Time to the first token on each reader's own request stream, by how the default served each request, against
plain transformers on the same request: what a user's stream costs a miss, a hit computed in full and a reused hit
once the store holds other pages (of the same layouts among them), not only an empty store's miss
(``vismemo bench latency``).

Each request of a reader's stream (``docstream`` pages for the base reader, ``synthdoc`` forms for the tiny one; a
held-out seed) is answered with one new token by plain transformers (a never-enabled copy of the weights), then by the
enabled model with the stream's store, then by plain again: its ratio is the enabled TTFT over the mean of the two
plain ones. The stream runs ``--rounds`` times, each with a fresh store (the first after a warm-up of plain
transformers); the table gives medians over every request of a kind. `lookup`: the lookup's own time (exact key,
pixel, coarse, fine and thumbnail stages; the encoder is not in it).

    python benchmarks/stream_latency.py --readers vismemo-docqa-base,vismemo-docqa-tiny --bases 12 --seed 7200

Writes results/perf/stream-latency.md.
"""

import argparse
import copy
import statistics
import sys
from collections import defaultdict

from transformers import DynamicCache

from vismemo_hf import VisMemoCache, VisMemoStore, enable
from vismemo_hf.bench.latency import timed_generate
from vismemo_hf.bench.report import header, machine, write
from vismemo_hf.eval.docstream import reader_pages
from vismemo_hf.eval.loading import load_model
from vismemo_hf.eval.quality import answer


def served(event) -> str:
    """How the default served a request: its hit kind, the stage that found an approximate hit, and why a hit was
    computed in full."""
    label = str(event.kind)
    if label == "approximate":
        label += f" by {event.found_by}"
    return label + (f", in full ({event.fallback})" if event.fallback else "")


def measure(name: str, bases: int, seed: int, rounds: int) -> dict:
    model, processor = load_model(name)
    plain = copy.deepcopy(model)  # the same weights, never enabled
    enable(model)
    _, stream = reader_pages(name, "auto")
    requests = stream(seed, n_bases=bases)

    def ttft(m, request, cache) -> float:
        return answer(m, processor, request, cache, 1)[4]

    for request in requests[:3]:  # warm-up
        ttft(plain, request, DynamicCache())
    alone = plain_alone(plain, processor, requests[0])
    rows = defaultdict(list)  # label -> (enabled ms, plain ms, lookup ms)
    totals = [0.0, 0.0]
    for _ in range(rounds):
        store = VisMemoStore()
        for request in requests:
            before = ttft(plain, request, DynamicCache())
            cache = VisMemoCache(store=store)
            enabled = ttft(model, request, cache)
            after = ttft(plain, request, DynamicCache())
            event = cache.events[0]
            rows[served(event)].append((enabled, (before + after) / 2, event.timings.get("lookup", 0.0)))
            totals[0] += enabled
            totals[1] += (before + after) / 2
    store.flush()  # its last entries written: the threads alive and idle, as between a server's requests
    after = plain_alone(plain, processor, requests[0])
    return {"rows": rows, "requests": len(requests), "total_ratio": totals[0] / totals[1],
            "visual_tokens": cache.events[0].n_tokens, "plain_before": alone, "plain_after": after, "store": store}


def plain_alone(plain, processor, request, rounds: int = 5) -> tuple[float, float]:
    """(TTFT, median decoding step) in ms of plain transformers answering ``request`` with 16 new tokens, medians
    over ``rounds``: before any enabled request of the process and after the stream (its store and threads alive),
    what the library costs a model it does not serve."""
    runs = [timed_generate(plain, request_inputs(processor, request), None, 16) for _ in range(rounds)]
    return statistics.median(r["ttft_ms"] for r in runs), statistics.median(r["step_ms"] for r in runs)


def request_inputs(processor, request):
    from vismemo_hf.eval.docqa import messages

    text = processor.apply_chat_template(messages(request.question, request.prefix), add_generation_prompt=True)
    return processor(text=[text], images=[request.image()], return_tensors="pt")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--readers", default="vismemo-docqa-base,vismemo-docqa-tiny")
    parser.add_argument("--bases", type=int, default=12, help="base pages of each stream (each with its follow-ups)")
    parser.add_argument("--seed", type=int, default=7200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="results/perf/stream-latency.md")
    args = parser.parse_args()
    command = "python benchmarks/stream_latency.py " + " ".join(sys.argv[1:])
    lines = header("Time to the first token on the readers' own streams, by how each request was served", command,
                   machine()) + [
        f"Each reader's stream (seed {args.seed}, {args.bases} base pages with their follow-ups), {args.rounds} "
        "rounds with a fresh store each; every request answered (one new token) by plain transformers, the enabled "
        "model and plain again. `TTFT / plain`: the median over the kind's requests of the enabled TTFT over the "
        "mean of the two plain ones; `lookup`: the lookup's stages, the encoder excluded.", ""]
    for name in args.readers.split(","):
        result = measure(name, args.bases, args.seed, args.rounds)
        lines += [f"## {name} ({result['requests']} requests a round, {result['visual_tokens']} visual tokens a page)",
                  "", "| served as | requests | TTFT ms | plain ms | TTFT / plain | lookup ms |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for label, v in sorted(result["rows"].items()):
            lines.append(f"| {label} | {len(v)} | {statistics.median(e for e, _, _ in v):.1f} | "
                         f"{statistics.median(p for _, p, _ in v):.1f} | "
                         f"{statistics.median(e / p for e, p, _ in v):.3f} | "
                         f"{statistics.median(x for _, _, x in v):.1f} |")
        (t0, s0), (t1, s1) = result["plain_before"], result["plain_after"]
        lines += ["", f"The whole stream: {result['total_ratio']:.3f} x plain transformers' summed TTFT.", "",
                  f"Plain transformers in the same process (the first request, 16 new tokens): TTFT {t0:.1f} ms and "
                  f"decoding step {s0:.2f} ms before any enabled request, {t1:.1f} ms and {s1:.2f} ms after the "
                  "stream with its store and the library's threads alive.", ""]
    write(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

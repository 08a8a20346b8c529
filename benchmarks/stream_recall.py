"""Lookup recall on the readers' own streams: per kind of follow-up, the share of the near-duplicate requests the
default serves as approximate hits, which stage found them (``pixels``: the pixel-first stage, ``thumbnail``: the
pixel stage, ``encoder``: the fine stage), how many of them the policy computed in full (``fallback``), and how many
requests meant to be misses (new pages) became approximate hits (an unrelated alias). The streams are the ones the
quality reports answer (``vismemo report quality``: seeds 1000 and 1001, and table 1's held-out streams, the tiny
reader's perturbation streams among them) with one store per stream, requests in stream order, one new token each
(the lookup does not depend on the answer).

    python benchmarks/stream_recall.py --readers vismemo-docqa-tiny,vismemo-docqa-base

Writes results/lookup/stream-recall.md.
"""

import argparse
import sys
from collections import Counter, defaultdict

from vismemo_hf import VisMemoCache, VisMemoStore, enable
from vismemo_hf.bench.report import header, machine, write
from vismemo_hf.bench.table1 import heldout_streams
from vismemo_hf.eval.docstream import reader_pages
from vismemo_hf.eval.loading import load_model
from vismemo_hf.eval.quality import answer

#: pages per stream of each reader's pages (the quality reports')
BASES = {"synthdoc": 15, "docpage": 10}
SEEDS = (1000, 1001)


def streams(pages: str, stream) -> list[list]:
    """The quality report's streams (``SEEDS``) and table 1's held-out ones, each a list of requests."""
    held = heldout_streams(BASES[pages], pages)
    return [stream(seed, n_bases=BASES[pages]) for seed in SEEDS] + [list(rs) for rs in held.values()]


def recall(name: str) -> dict:
    model, processor = load_model(name)
    enable(model)
    pages, stream = reader_pages(name, "auto")
    rows = defaultdict(Counter)
    for requests in streams(pages, stream):
        store = VisMemoStore()
        for request in requests:
            cache = VisMemoCache(store=store)
            answer(model, processor, request, cache, 1)
            event = cache.events[0]
            kind = str(event.kind)
            row = rows[request.variant if request.intended == "approximate" else f"({request.intended})"]
            row["requests"] += 1
            row[kind] += 1
            if kind == "approximate":
                row[f"by {event.found_by}"] += 1
                row["fallback"] += event.fallback is not None
    return dict(sorted(rows.items()))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--readers", default="vismemo-docqa-tiny,vismemo-docqa-base")
    parser.add_argument("--out", default="results/lookup/stream-recall.md")
    args = parser.parse_args()
    command = "python benchmarks/stream_recall.py " + " ".join(sys.argv[1:])
    lines = header("Lookup recall on the readers' streams (default thresholds and policy)", command, machine()) + [
        f"Per kind of follow-up of the readers' streams (seeds {', '.join(map(str, SEEDS))} and table 1's held-out "
        "streams; pages per stream: " + ", ".join(f"{k} {b}" for k, b in BASES.items())
        + "), one store per stream: requests, the share served as approximate hits (`recall`), how those were found "
        "(pixel-first `pixels`, pixel stage `thumbnail`, fine stage `encoder`), and how many the policy then computed "
        "in full (`fallback`: changed everywhere, a drift, a zoom). Rows in brackets are the requests meant to be "
        "misses (new pages: an approximate hit there is an unrelated alias) and exact hits.", ""]
    for name in args.readers.split(","):
        lines += [f"## {name}", "", "| kind | requests | recall | exact | miss | by pixels | by thumbnail | by encoder | "
                  "fallback |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for kind, c in recall(name).items():
            lines.append(f"| {kind} | {c['requests']} | {c['approximate'] / c['requests']:.2f} | {c['exact']} | "
                         f"{c['miss']} | {c['by pixels']} | {c['by thumbnail']} | {c['by encoder']} | {c['fallback']} |")
        lines.append("")
    write(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

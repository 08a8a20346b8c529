"""What the pixel-first rule sees on ``vismemo calibrate``'s held-out pairs: per kind of pair, the share of the
second image's tokens whose pixel hashes equal the first one's at the same place, over all tokens and over its
distinctive ones (``core.pixel_first``), min and max, and the share of its distinctive tokens outside the band or two
bands of token rows its changes lie in (``band_share``; pairs whose changes lie in more bands counted apart), apart for
one band that starts at the first row and for two bands. The rule takes an alias when both of the first reach
``same_pixels`` (0.75), or the region share reaches ``REGION_SAME`` (``REGION_SAME_TOP``, ``REGION_SAME_TWO``): this
is what it has to separate (near-duplicates
from unrelated pages of one layout; ``same layout``: every pair of eight pages of each layout or style of the
reader's pages).

    python benchmarks/pixel_shares.py --readers vismemo-docqa-tiny,vismemo-docqa-base

Writes results/lookup/pixel-shares.md.
"""

import argparse
import itertools
import sys
from collections import defaultdict

from vismemo_hf.bench.report import header, machine, write
from vismemo_hf.core.pixel_first import (
    MAX_BANDS,
    MIN_SAME,
    REGION_SAME,
    REGION_SAME_TOP,
    REGION_SAME_TWO,
    band_share,
    distinctive,
)
from vismemo_hf.eval import calibrate, docpage, synthdoc
from vismemo_hf.eval.docstream import reader_pages
from vismemo_hf.eval.loading import load_model
from vismemo_hf.families import ModelAdapter


def same_layout_pairs(pages: str, per_layout: int = 8):
    """Every pair of ``per_layout`` pages of each layout (``docpage``) or style (``synthdoc``)."""
    if pages == "docpage":
        groups = [[docpage.render(docpage.random_page(5000 + 37 * k + i, layout=layout)) for i in range(per_layout)]
                  for k, layout in enumerate(docpage.LAYOUTS)]
    else:
        groups = [[synthdoc.render(synthdoc.random_form(5000 + 37 * k + i, style=style)) for i in range(per_layout)]
                  for k, style in enumerate(synthdoc.STYLES)]
    return [(g[i], g[j], False, "same layout") for g in groups for i, j in itertools.combinations(range(per_layout), 2)]


def shares(name: str, seed: int, per_kind: int) -> dict:
    model, _ = load_model(name, None, seed=0)
    pages, _ = reader_pages(name, "auto")
    adapter = ModelAdapter.for_model(model)
    processor = adapter.image_processor()

    def hashes(image):
        inputs = processor(images=[image.convert("RGB")], return_tensors="pt")
        grid = tuple(int(v) for v in inputs["image_grid_thw"][0])
        found = adapter.patch_hashes(inputs["pixel_values"], grid)
        return found, adapter.hash_rows(found, grid) if found is not None else None

    out = defaultdict(list)
    for a, b, _, what in calibrate.pairs(seed, per_kind, pages) + same_layout_pairs(pages):
        (ha, _), (hb, rows) = hashes(a), hashes(b)
        if ha is None or hb is None or ha.shape != hb.shape:
            continue
        same, marked = ha == hb, distinctive(hb)
        out[what].append((float(same.float().mean()), float(same[marked].float().mean()) if marked.any() else 0.0,
                          *(band_share(hb, ha, rows) or (None, None, None, None))[:3]))
    return dict(sorted(out.items()))


def _span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if values else "-"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--readers", default="vismemo-docqa-tiny,vismemo-docqa-base")
    parser.add_argument("--seed", type=int, default=2, help="calibrate's held-out seed")
    parser.add_argument("--pairs-per-kind", type=int, default=10)
    parser.add_argument("--out", default="results/lookup/pixel-shares.md")
    args = parser.parse_args()
    command = "python benchmarks/pixel_shares.py " + " ".join(sys.argv[1:])
    lines = header("Pixel-first: shares of unchanged tokens per kind of pair", command, machine()) + [
        f"Held-out pairs of `vismemo calibrate` (seed {args.seed}). `all`: share of the tokens whose pixel hash is the "
        "first image's at the same place; `distinctive`: the same over the second image's distinctive tokens (a hash "
        "it shows once); `region`: the share of its distinctive tokens outside the band (or two) of token rows its "
        "changes lie in, `from the top` where one band starts at the first row (`none`: pairs whose changes lie in more "
        f"than {MAX_BANDS} bands, or none distinctive). The rule "
        f"takes the first image as the alias when both of the first reach {MIN_SAME}, or the region share reaches "
        f"{REGION_SAME} ({REGION_SAME_TOP} for one band from the top, {REGION_SAME_TWO} for two bands). `same layout`: "
        "every pair of eight other pages of each layout or style of the reader's pages.", ""]
    for name in args.readers.split(","):
        lines += [f"## {name}", "", "| pair | pairs | all min | all max | distinctive min | distinctive max | "
                  "region, one band from the top | region, one other band | region, two bands | none |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for what, rows in shares(name, args.seed, args.pairs_per_kind).items():
            lines.append(f"| {what} | {len(rows)} | {min(r[0] for r in rows):.2f} | {max(r[0] for r in rows):.2f} | "
                         f"{min(r[1] for r in rows):.2f} | {max(r[1] for r in rows):.2f} | "
                         f"{_span([r[2] for r in rows if r[4] == 1 and r[3]])} | "
                         f"{_span([r[2] for r in rows if r[4] == 1 and not r[3]])} | "
                         f"{_span([r[2] for r in rows if r[4] == 2])} | {sum(r[4] is None for r in rows)} |")
        lines.append("")
    write(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

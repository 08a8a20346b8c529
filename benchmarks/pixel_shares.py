"""What the pixel-first rule sees on ``vismemo calibrate``'s held-out pairs: per kind of pair, the share of the
second image's tokens whose pixel hashes equal the first one's at the same place, over all tokens and over its
distinctive ones (``core.pixel_first``), min and max. The rule takes an alias when both reach ``same_pixels``
(0.75): this is what a different rule would have to separate (near-duplicates from unrelated pages of one layout).

    python benchmarks/pixel_shares.py --readers vismemo-docqa-tiny,vismemo-docqa-base

Writes results/lookup/pixel-shares.md.
"""

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from vismemo_hf.bench.report import header, machine
from vismemo_hf.core.pixel_first import MIN_SAME, distinctive
from vismemo_hf.eval import calibrate
from vismemo_hf.eval.docstream import reader_pages
from vismemo_hf.eval.loading import load_model
from vismemo_hf.families import ModelAdapter


def shares(name: str, seed: int, per_kind: int) -> dict:
    model, _ = load_model(name, None, seed=0)
    pages, _ = reader_pages(name, "auto")
    adapter = ModelAdapter.for_model(model)
    processor = adapter.image_processor()

    def hashes(image):
        inputs = processor(images=[image.convert("RGB")], return_tensors="pt")
        return adapter.patch_hashes(inputs["pixel_values"], tuple(int(v) for v in inputs["image_grid_thw"][0]))

    out = defaultdict(list)
    for a, b, _, what in calibrate.pairs(seed, per_kind, pages):
        ha, hb = hashes(a), hashes(b)
        if ha is None or hb is None or ha.shape != hb.shape:
            continue
        same, marked = ha == hb, distinctive(hb)
        out[what].append((float(same.float().mean()), float(same[marked].float().mean()) if marked.any() else 0.0))
    return dict(sorted(out.items()))


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
        f"it shows once). The rule takes the first image as the alias when both reach {MIN_SAME}.", ""]
    for name in args.readers.split(","):
        lines += [f"## {name}", "", "| pair | pairs | all min | all max | distinctive min | distinctive max |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for what, rows in shares(name, args.seed, args.pairs_per_kind).items():
            lines.append(f"| {what} | {len(rows)} | {min(r[0] for r in rows):.2f} | {max(r[0] for r in rows):.2f} | "
                         f"{min(r[1] for r in rows):.2f} | {max(r[1] for r in rows):.2f} |")
        lines.append("")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

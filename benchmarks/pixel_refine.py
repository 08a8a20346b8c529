"""How much the pixel stage's refinement adds to its best whole-pixel alignment, against the bound its early decision
assumes (``core.thresholds.REFINE_GAIN``): per kind of change, over both readers' pages.

``aligned_similarity`` finds the best zoom and move of a candidate's thumbnail on a lattice of whole pixels and zoom
steps, then refines the three best on finer grids. A caller that only asks whether a threshold is reached stops after
the lattice when the lattice's score falls short by more than ``REFINE_GAIN`` times the request's own loss when moved
by half a pixel both ways (``_half_pixel_loss``), plus ``REFINE_SLACK``. This measures, for copies moved by 1-14 px,
zoomed by 1-5 %, turned, shifted, scrolled, cropped, rescaled and for the global changes of ``unseen_changes.py``
(and for another page of the same layout), the lattice's score, the refined one, and the gain over that loss.

    python benchmarks/pixel_refine.py --pages 15

Writes results/lookup/pixel-refine.md.
"""

import argparse
import random
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from unseen_changes import CHANGES, _zoom  # noqa: E402

from vismemo_hf.bench.report import header, machine, write  # noqa: E402
from vismemo_hf.core import thresholds as T  # noqa: E402
from vismemo_hf.core.features import thumb_per_token  # noqa: E402
from vismemo_hf.eval import docpage, synthdoc  # noqa: E402
from vismemo_hf.eval.loading import load_model  # noqa: E402
from vismemo_hf.families.base import ModelAdapter  # noqa: E402


def lattice_and_refined(a: torch.Tensor, b: torch.Tensor, per: int) -> tuple[float, float, float]:
    """(the lattice's score, the full search's, the request's half-pixel loss) of request thumbnail ``a`` against
    candidate ``b``."""
    refined = T.aligned_similarity(a, b, per)[0]
    lattice = T.aligned_similarity(a, b, per, hopeless_below=10.0)[0]  # unreachable: stops after the lattice
    return lattice, refined, T._request_side(a, per).half_pixel_loss


def measure(reader: str, pages: int, seed: int) -> dict:
    model, processor = load_model(reader)
    adapter = ModelAdapter.for_model(model)
    base = "base" in reader

    def thumb(image):
        x = processor.image_processor(images=[image.convert("RGB")], return_tensors="pt")
        grid = tuple(int(v) for v in x["image_grid_thw"][0])
        return adapter.thumbnail_of(x["pixel_values"], grid)(), thumb_per_token(adapter.thumbnail_hw(grid))

    rng = random.Random(seed)
    rows = defaultdict(list)
    for i in range(pages):
        if base:
            page = docpage.random_page(seed * 1000 + i, layout=docpage.LAYOUTS[i % len(docpage.LAYOUTS)])
            other = docpage.random_page(seed * 1000 + 500 + i, layout=page.layout)
            render = docpage.render
        else:
            style = synthdoc.STYLES[i % len(synthdoc.STYLES)]
            page, other = synthdoc.random_form(seed * 1000 + i, style=style), \
                synthdoc.random_form(seed * 1000 + 500 + i, style=style)
            render = synthdoc.render
        image = render(page).convert("RGB")
        mine, per = thumb(image)
        changed = {name: change(image, rng) for name, change in CHANGES.items()}
        changed.update({f"moved {dx} px": synthdoc.shift_image(image, dx, dx // 2) for dx in (1, 2, 3, 5, 7, 10, 14)})
        changed.update({f"zoomed x{z}": _zoom(image, z) for z in (0.95, 0.97, 1.01, 1.03, 1.05)})
        if base:
            changed.update({"shifted 3 px": render(docpage.shift(page, 3, 2)), "scrolled": render(docpage.scroll(page, 9)),
                            "cropped": render(docpage.crop(page, 4)), "turned 1 deg": render(docpage.rotate(page, 1.0)),
                            "rescaled 2 %": render(docpage.rescale(page, 1.02))})
        changed["another page of the layout"] = render(other)
        for name, other_image in changed.items():
            theirs, _ = thumb(other_image)
            if theirs.shape == mine.shape:
                rows[name].append(lattice_and_refined(theirs, mine, per))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--readers", default="vismemo-docqa-base,vismemo-docqa-tiny")
    parser.add_argument("--pages", type=int, default=15)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--out", default="results/lookup/pixel-refine.md")
    args = parser.parse_args()
    command = "python benchmarks/pixel_refine.py " + " ".join(sys.argv[1:])
    lines = header("What the pixel stage's refinement adds to its whole-pixel alignment", command, machine()) + [
        f"Each of {args.pages} pages per reader (seed {args.seed}) changed each way; `lattice`: the best of the "
        "whole-pixel, whole-zoom-step alignments; `refined`: the full search; `gain / loss`: their difference over the "
        "request's own loss when moved by half a pixel both ways. The early decision assumes at most "
        f"{T.REFINE_GAIN} x that loss + {T.REFINE_SLACK}.", ""]
    for reader in args.readers.split(","):
        rows = measure(reader, args.pages, args.seed)
        lines += [f"## {reader}", "", "| change | pairs | lattice min / max | refined min / max | largest gain | "
                  "largest gain / loss |", "| --- | --- | --- | --- | --- | --- |"]
        worst = 0.0
        for name, values in rows.items():
            ratio = max((r - la) / loss for la, r, loss in values)
            if name != "another page of the layout":
                worst = max(worst, ratio)
            lines.append(f"| {name} | {len(values)} | {min(v[0] for v in values):.3f} / {max(v[0] for v in values):.3f} "
                         f"| {min(v[1] for v in values):.3f} / {max(v[1] for v in values):.3f} | "
                         f"{max(r - la for la, r, _ in values):.3f} | {ratio:.2f} |")
        lines += ["", f"Largest gain over the half-pixel loss on a changed copy: {worst:.2f} (bound {T.REFINE_GAIN}).", ""]
    write(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

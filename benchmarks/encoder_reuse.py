"""How close a partial encode comes to a whole-image one: for one-value edits of synthetic forms, the cosine between
the changed tokens' encoder output in a partial encode and their output in a whole-image encode of the edited page.
Two partial encodes: the changed tokens lent the old page's tower K/V of every other patch (``families.tower_kv``,
what the default does), and the changed tokens with only a halo of h neighbours as context (``encoder_tokens``).
Next to them, how far the old page's output at those tokens is (what reusing the alias's output would give) and how
far the unchanged tokens move.

    python benchmarks/encoder_reuse.py --readers vismemo-docqa-tiny,vismemo-docqa-base --pages 10 --seed 60000

Writes results/quality/encoder-reuse.md (the figures behind ``attend-deviate``'s ``reuse_encoder`` default).
"""

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from vismemo_hf import enable
from vismemo_hf.bench.report import header, machine
from vismemo_hf.core.features import token_grid
from vismemo_hf.core.pixel_first import encoder_tokens, pixel_changes
from vismemo_hf.eval import synthdoc
from vismemo_hf.eval.loading import load_model
from vismemo_hf.runtime.hooks import _own

HALOS = (0, 1, 2, 4, 8)


def measure(name: str, pages: int, seed: int) -> dict:
    model, processor = load_model(name)
    enable(model)
    adapter = model._vismemo
    encoder = _own(adapter.base, "get_image_features")
    rows = {"old": [], "unchanged": [], "lent": [], **{h: [] for h in HALOS}}
    tokens = {"lent": [], **{h: [] for h in HALOS}}
    n = 0
    for i in range(pages):
        base = synthdoc.random_form(seed + i, style=synthdoc.STYLES[i % len(synthdoc.STYLES)])
        edited = synthdoc.edit_value(base, i % synthdoc.ROWS, random.Random(i))
        inputs = [processor(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[synthdoc.render(p)],
                            return_tensors="pt") for p in (base, edited)]
        pixels = [(x["pixel_values"], tuple(int(v) for v in x["image_grid_thw"][0])) for x in inputs]
        with torch.no_grad():
            [(old, _)], kvs = adapter.encode_capturing(encoder, pixels[0][0], torch.tensor([pixels[0][1]]))
            whole = [old, adapter.encode(encoder, pixels[1][0], torch.tensor([pixels[1][1]]))[0][0]]
            changed = pixel_changes(adapter.patch_hashes(*pixels[1]), adapter.patch_hashes(*pixels[0]))
            if changed is None or not bool(changed.any()):
                continue
            at = torch.nonzero(changed).flatten()
            n = changed.numel()
            rows["old"].append(float(F.cosine_similarity(whole[0][at], whole[1][at], dim=-1).mean()))
            rows["unchanged"].append(float(F.cosine_similarity(whole[0][~changed], whole[1][~changed], dim=-1).mean()))
            hw = token_grid(pixels[1][1], adapter.merge)[1:]
            wanted = encoder_tokens(changed, hw, halo=0, window=adapter.encoder_window)
            part = adapter.encode_tokens(encoder, [(pixels[1][0], pixels[1][1], wanted)], lent=kvs)[0][0]
            rows["lent"].append(float(F.cosine_similarity(part[torch.searchsorted(wanted, at)], whole[1][at],
                                                          dim=-1).mean()))
            tokens["lent"].append(wanted.numel() / n)
            for halo in HALOS:
                wanted = encoder_tokens(changed, hw, halo=halo, window=adapter.encoder_window)
                part = adapter.encode_tokens(encoder, [(pixels[1][0], pixels[1][1], wanted)])[0][0]
                got = part[torch.searchsorted(wanted, at)]
                rows[halo].append(float(F.cosine_similarity(got, whole[1][at], dim=-1).mean()))
                tokens[halo].append(wanted.numel() / n)
    return {"reader": name, "pages": len(rows["old"]), "tokens": n,
            "cos": {str(k): statistics.mean(v) for k, v in rows.items()},
            "encoded": {str(h): statistics.mean(v) for h, v in tokens.items()}}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--readers", default="vismemo-docqa-tiny,vismemo-docqa-base")
    parser.add_argument("--pages", type=int, default=10)
    parser.add_argument("--seed", type=int, default=60_000)
    parser.add_argument("--out", default="results/quality/encoder-reuse.md")
    args = parser.parse_args()
    results = [measure(r, args.pages, args.seed) for r in args.readers.split(",")]
    command = "python benchmarks/encoder_reuse.py " + " ".join(sys.argv[1:])
    lines = header("Encoder reuse: a partial encode against a whole-image one", command, machine()) + [
        "One-value edits of synthetic forms (seeds from `--seed`). `old`: mean cosine, over the changed tokens, "
        "between the old page's whole-image encoder output and the edited page's (what reusing the alias's output "
        "would give); `unchanged`: the same over the tokens whose pixels did not change; `lent`: the changed tokens "
        "encoded alone but lent the old page's tower K/V of every other patch at every full-attention block (the "
        "default, `families.tower_kv`); `halo h`: the changed tokens encoded with only the tokens within h of them "
        "(`encoder_tokens`); each against their whole-image output, with the share of the image's tokens that "
        "encode ran for.", "",
        "| reader | pages | visual tokens | old | unchanged | lent | " + " | ".join(f"halo {h}" for h in HALOS) + " |",
        "| --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in HALOS) + " |"]
    for r in results:
        lines.append(f"| {r['reader']} | {r['pages']} | {r['tokens']} | {r['cos']['old']:.3f} | "
                     f"{r['cos']['unchanged']:.4f} | {r['cos']['lent']:.4f} ({r['encoded']['lent']:.0%}) | " + " | ".join(
                         f"{r['cos'][str(h)]:.3f} ({r['encoded'][str(h)]:.0%})" for h in HALOS) + " |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

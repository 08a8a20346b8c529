"""Page changes that no stream, calibration pair or test of the project makes: per kind, how the default serves a
page after it saw the page unchanged (approximate hit, found by which stage, computed in full by a fallback, or a
miss) and whether its answer is plain transformers' on the same request.

Each page of a reader's own stream kind (a held-out seed) is asked about once unchanged (stored), then once changed
by one of ``CHANGES`` (global edits a scanner, viewer, messenger or annotator makes: contrast, gamma, blur of 0.6 to
1.5 px, sharpening, JPEG recompression, sensor noise, grey scale, a small zoom or turn, a watermark, a stamp, a
strike-through, a highlighter, a border, posterisation; ``--changes`` picks some of them), the
same question, a fresh store per pair. Agreement: the whole greedy answer (8 new tokens) equals the answer of a
never-enabled copy of the weights on the changed page.

    python benchmarks/unseen_changes.py --readers vismemo-docqa-tiny,vismemo-docqa-base --pages 20 --seed 7100

Writes results/quality/unseen-changes.md.
"""

import argparse
import copy
import io
import random
import sys
from collections import Counter

import numpy as np
import yaml
from PIL import Image, ImageDraw, ImageEnhance, ImageFilter, ImageOps
from transformers import DynamicCache

from vismemo_hf import VisMemoCache, VisMemoStore, enable
from vismemo_hf.bench.report import header, machine, write
from vismemo_hf.eval.docstream import reader_pages
from vismemo_hf.eval.loading import load_model
from vismemo_hf.eval.quality import answer


def _zoom(image: Image.Image, factor: float) -> Image.Image:
    """Zoomed about the centre, the size kept (white where a zoom out leaves nothing)."""
    w, h = image.size
    big = image.resize((round(w * factor), round(h * factor)), Image.BICUBIC)
    if factor >= 1:
        left, top = (big.width - w) // 2, (big.height - h) // 2
        return big.crop((left, top, left + w, top + h))
    out = Image.new("RGB", (w, h), (255, 255, 255))
    out.paste(big, ((w - big.width) // 2, (h - big.height) // 2))
    return out


def _watermark(image: Image.Image, rng: random.Random) -> Image.Image:
    """Three translucent red "DRAFT COPY" marks."""
    out = image.convert("RGBA")
    layer = Image.new("RGBA", out.size, (0, 0, 0, 0))
    draw, (w, h) = ImageDraw.Draw(layer), out.size
    for _ in range(3):
        draw.text((rng.randrange(w // 2), rng.randrange(h)), "DRAFT COPY", fill=(200, 0, 0, 70))
    return Image.alpha_composite(out, layer).convert("RGB")


def _stamp(image: Image.Image, rng: random.Random) -> Image.Image:
    """A red ring drawn somewhere (a stamp)."""
    out = image.convert("RGB").copy()
    w, h = out.size
    x, y = rng.randrange(w - w // 6), rng.randrange(h - h // 8)
    ImageDraw.Draw(out).ellipse((x, y, x + w // 6, y + h // 8), outline=(220, 0, 0), width=2)
    return out


def _strike(image: Image.Image, rng: random.Random) -> Image.Image:
    """A thin black line across part of a row."""
    out = image.convert("RGB").copy()
    w, h = out.size
    y = rng.randrange(h // 4, 3 * h // 4)
    ImageDraw.Draw(out).line((w // 8, y, w // 2, y), fill=(0, 0, 0), width=1)
    return out


def _highlight(image: Image.Image, rng: random.Random) -> Image.Image:
    """A yellow highlighter over part of a row (the dark strokes kept)."""
    out = image.convert("RGB").copy()
    w, h = out.size
    y = rng.randrange(h // 4, 3 * h // 4)
    box = (w // 10, y, w // 2, y + h // 14)
    region = out.crop(box)
    grey = region.convert("L")
    yellow = ImageOps.colorize(grey, (0, 0, 0), (255, 240, 0))
    out.paste(Image.composite(region, yellow, grey.point(lambda v: 255 if v < 128 else 0)), box[:2])
    return out


def _jpeg(image: Image.Image, quality: int) -> Image.Image:
    """Saved and read back as a JPEG (a re-sent screenshot, a messenger's recompression)."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, "JPEG", quality=quality)
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")


def _noise(image: Image.Image, rng: random.Random) -> Image.Image:
    """Sensor noise: every pixel moved by up to 4 grey levels."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    noise = np.random.default_rng(rng.randrange(2**31)).integers(-4, 5, pixels.shape)
    return Image.fromarray(np.clip(pixels + noise, 0, 255).astype(np.uint8))


def _border(image: Image.Image, rng: random.Random) -> Image.Image:
    """A 2-pixel grey frame in place of the outer pixels."""
    w, h = image.size
    return ImageOps.expand(image.convert("RGB").crop((2, 2, w - 2, h - 2)), 2, fill=(120, 120, 120))


CHANGES = {
    "contrast 0.85": lambda im, rng: ImageEnhance.Contrast(im).enhance(0.85),
    "gamma 1.3": lambda im, rng: im.point(lambda v: round(255 * (v / 255) ** 1.3)),
    "blur 0.6 px": lambda im, rng: im.filter(ImageFilter.GaussianBlur(0.6)),
    "blur 0.8 px": lambda im, rng: im.filter(ImageFilter.GaussianBlur(0.8)),
    "blur 1.0 px": lambda im, rng: im.filter(ImageFilter.GaussianBlur(1.0)),
    "blur 1.5 px": lambda im, rng: im.filter(ImageFilter.GaussianBlur(1.5)),
    "JPEG quality 50": lambda im, rng: _jpeg(im, 50),
    "noise 4 levels": _noise,
    "sharpen": lambda im, rng: im.filter(ImageFilter.SHARPEN),
    "grey scale": lambda im, rng: ImageOps.grayscale(im).convert("RGB"),
    "saturation 0.6": lambda im, rng: ImageEnhance.Color(im).enhance(0.6),
    "zoom in 2 %": lambda im, rng: _zoom(im, 1.02),
    "zoom out 2 %": lambda im, rng: _zoom(im, 0.98),
    "turn 0.5 deg": lambda im, rng: im.rotate(0.5, resample=Image.BICUBIC, fillcolor=(255, 255, 255)),
    "watermark": _watermark,
    "stamp": _stamp,
    "strike-through": _strike,
    "highlighter": _highlight,
    "border": _border,
    "posterize 5 bits": lambda im, rng: ImageOps.posterize(im.convert("RGB"), 5),
}


class _Changed:
    """A stream request showing another image."""

    def __init__(self, request, image: Image.Image) -> None:
        self._request, self._image = request, image

    def image(self) -> Image.Image:
        return self._image

    def __getattr__(self, name):
        return getattr(self._request, name)


def measure(name: str, pages: int, seed: int, kinds: list[str], options: dict | None = None) -> dict:
    model, processor = load_model(name)
    plain = copy.deepcopy(model)  # the same weights, never enabled
    enable(model)
    _, stream = reader_pages(name, "auto")
    requests = [r for r in stream(seed, n_bases=pages) if r.intended == "miss"][:pages]
    rng = random.Random(seed)
    rows = {kind: Counter() for kind in kinds}
    differ: list = []  # (change, question, the page's answer, the hit's, plain transformers')
    for request in requests:
        original = request.image().convert("RGB")
        for kind in kinds:
            change = CHANGES[kind]
            changed = _Changed(request, change(original, rng))
            store = VisMemoStore()
            answer(model, processor, _Changed(request, original), VisMemoCache(store=store), 1)
            cache = VisMemoCache(store=store, **(options or {}))
            said, tokens = answer(model, processor, changed, cache, 8)[:2]
            plain_said, reference = answer(plain, processor, changed, DynamicCache(), 8)[:2]
            event, c = cache.events[0], rows[kind]
            if tokens != reference and str(event.kind) == "approximate" and event.fallback is None:
                differ.append((kind, request.question, request.answers[0], said, plain_said))
            c["requests"] += 1
            c[str(event.kind)] += 1
            c["agree"] += tokens == reference
            if str(event.kind) == "approximate":
                c[f"by {event.found_by}"] += 1
                c["fallback"] += event.fallback is not None
                c["reused agree"] += event.fallback is None and tokens == reference
                c["reused"] += event.fallback is None
    return rows, differ


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--readers", default="vismemo-docqa-tiny,vismemo-docqa-base")
    parser.add_argument("--pages", type=int, default=12)
    parser.add_argument("--seed", type=int, default=7100)
    parser.add_argument("--changes", default="all", help="comma-separated names of CHANGES, or all")
    parser.add_argument("--policy-options", default="", help="the default policy's options for the changed pages, "
                                                             "comma-separated name=value (e.g. drift_min_deviation=0.01)")
    parser.add_argument("--out", default="results/quality/unseen-changes.md")
    args = parser.parse_args()
    kinds = list(CHANGES) if args.changes == "all" else args.changes.split(",")
    unknown = [k for k in kinds if k not in CHANGES]
    if unknown:
        parser.error(f"unknown changes {unknown}; known: {', '.join(CHANGES)}")
    options = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.policy_options.split(",") if o)}
    command = "python benchmarks/unseen_changes.py " + " ".join(sys.argv[1:])
    given = ", ".join(f"{k}={v}" for k, v in options.items())
    policy = f"; the default policy with {given}" if options else " and policy"
    lines = header(f"Page changes the project's streams and tests do not make (default thresholds{policy})", command,
                   machine()) + [
        f"Each of {args.pages} pages of the reader's stream kind (seed {args.seed}) stored unchanged, then asked "
        "again changed, one fresh store per pair. `reused`: approximate hits that reused K/V (no fallback); "
        "`agree`: the whole greedy answer (8 new tokens) equals plain transformers' on the changed page, over all "
        "requests and over the reused ones.", ""]
    for name in args.readers.split(","):
        lines += [f"## {name}", "", "| change | requests | approximate | exact | miss | by pixels | by thumbnail | "
                  "by encoder | fallback | reused | agree | reused agree |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        total = Counter()
        rows, differ = measure(name, args.pages, args.seed, kinds, options)
        for kind, c in rows.items():
            total.update(c)
            lines.append(f"| {kind} | {c['requests']} | {c['approximate']} | {c['exact']} | {c['miss']} | "
                         f"{c['by pixels']} | {c['by thumbnail']} | {c['by encoder']} | {c['fallback']} | "
                         f"{c['reused']} | {c['agree'] / c['requests']:.3f} | "
                         f"{c['reused agree']}/{c['reused']} |")
        lines += [f"| all | {total['requests']} | {total['approximate']} | {total['exact']} | {total['miss']} | "
                  f"{total['by pixels']} | {total['by thumbnail']} | {total['by encoder']} | {total['fallback']} | "
                  f"{total['reused']} | {total['agree'] / total['requests']:.3f} | "
                  f"{total['reused agree']}/{total['reused']} |", ""]
        if differ:
            lines += ["Reused hits whose answer differs from plain transformers' (the page's own answer next to both):", "",
                      "| change | question | the page's | the hit's | plain transformers' |",
                      "| --- | --- | --- | --- | --- |"]
            lines += [f"| {k} | {q} | {a} | {ours} | {theirs} |" for k, q, a, ours, theirs in differ] + [""]
    write(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``vismemo calibrate``: lookup thresholds for one model, from near-duplicate and unrelated image pairs.

Pairs are synthetic: document pages (``synthdoc``, five page styles, or with ``pages="docpage"`` the
``docpage`` layouts of ``vismemo-docqa-base`` and the near-duplicate kinds of its streams) and text pages, forms
of one template, screens, photos and textures (``thresholds.synthetic_image``). A near-duplicate is the same image
with a small change (an edited value or key, swapped rows, a 1-3 px shift, JPEG, brightness,
noise, a small pasted patch, a row inverted, tinted or inserted; on ``docpage`` pages one or several edited
cells, a scroll, a crop, a popup, a
switched widget, a rescan, a shift); an unrelated image is another one of the same kind and size.
Each pair is scored exactly as the lookup scores it: the smallest centred regional cosine
(coarse), the mean centred token cosine at the best shift by up to one visual token (fine, full width and from
sketches; ``core.thresholds.best_shift``) and the aligned similarity of the two thumbnails (pixel;
``core.thresholds.aligned_similarity``).

``tau_fine`` sits halfway between the highest unrelated score and the low (10th percentile)
near-duplicate scores above it, so that no calibration pair aliases an unrelated image. The pixel stage's
``tau_pixel`` is chosen the same way from the pixel scores of the pairs below ``tau_fine`` (every unrelated pair
counts), and ``tau_near`` lets through every near-duplicate that passes ``tau_pixel``; ``tau`` lets through every
near-duplicate that passes either. Recall and false-positive rate are reported on the calibration pairs and on
held-out pairs of other seeds, with and without the pixel stage.
"""

from __future__ import annotations

import random
from dataclasses import replace

import torch
from PIL import Image, ImageDraw, ImageOps

from vismemo_hf.core.features import (
    centred_sketches,
    region_descriptors,
    thumb_per_token,
    token_grid,
    token_sketch,
)
from vismemo_hf.core.images import IMAGE_KINDS, synthetic_image
from vismemo_hf.core.pixel_first import MIN_SAME, partly_changed, pixel_changes
from vismemo_hf.core.thresholds import (
    ENCODER_PIXEL_AGREE,
    LookupThresholds,
    aligned_similarity,
    best_shift,
    fine_score,
    regional_cosines,
)
from vismemo_hf.eval import docpage, docstream, synthdoc
from vismemo_hf.families import ModelAdapter
from vismemo_hf.progress import progress as progress_bar
from vismemo_hf.runtime.reference import encode_images, model_reference


def _band(image: Image.Image, rng: random.Random) -> tuple[int, int, int, int]:
    """A box about one table row high across most of the width, somewhere in the middle of the image."""
    w, h = image.size
    bh = max(8, h // 12)
    y = rng.randrange(h // 8, max(h // 8 + 1, h - h // 8 - bh))
    return w // 10, y, w - w // 10, y + bh


def _invert(image: Image.Image, rng: random.Random) -> Image.Image:
    """A row's colours inverted (a selected table header, a highlighted menu entry)."""
    out, box = image.convert("RGB").copy(), _band(image, rng)
    out.paste(ImageOps.invert(out.crop(box)), box[:2])
    return out


def _recolour(image: Image.Image, rng: random.Random) -> Image.Image:
    """A row tinted (a highlighter, a hover colour)."""
    out, box = image.convert("RGB").copy(), _band(image, rng)
    region = out.crop(box)
    tint = Image.new("RGB", region.size, tuple(rng.randrange(120, 256) for _ in range(3)))
    out.paste(Image.blend(region, tint, 0.45), box[:2])
    return out


def _insert_row(image: Image.Image, filler: Image.Image, rng: random.Random) -> Image.Image:
    """A row inserted: a band of another image pasted in, what was below it pushed down (the bottom cut off)."""
    out = image.convert("RGB").copy()
    w, h = out.size
    bh = max(8, h // 12)
    y = rng.randrange(h // 4, h // 2)
    out.paste(image.convert("RGB").crop((0, y, w, h - bh)), (0, y + bh))
    out.paste(filler.convert("RGB").resize((w, h)).crop((0, y, w, y + bh)), (0, y))
    return out


def _local(image: Image.Image, filler: Image.Image, rng: random.Random) -> dict[str, Image.Image]:
    """The large local changes the pixel-first stage is for: an inverted row, a tinted row, an inserted row."""
    return {"invert": _invert(image, rng), "recolour": _recolour(image, rng),
            "insert row": _insert_row(image, filler, rng)}


def _patch(image: Image.Image, rng: random.Random) -> Image.Image:
    """A small rectangle pasted somewhere (about 3 % of the image): an edit of a screen or photo."""
    out = image.copy()
    w, h = out.size
    pw, ph = w // 6, h // 6
    x, y = rng.randrange(w - pw), rng.randrange(h - ph)
    ImageDraw.Draw(out).rectangle((x, y, x + pw, y + ph), fill=tuple(rng.randrange(256) for _ in range(3)))
    return out


def docpage_pairs(seed: int, per_kind: int) -> list[tuple[Image.Image, Image.Image, bool, str]]:
    """``docpage`` pairs (layouts in turn): each kind of ``docstream``'s near-duplicates, and another page of the
    same layout as the unrelated one."""
    rng = random.Random(seed)
    out = []
    for i in range(per_kind):
        layout = docpage.LAYOUTS[i % len(docpage.LAYOUTS)]
        page = docpage.random_page(2**31 + seed * 1000 + i, layout=layout)
        cells = [(r, c) for r in range(page.n_rows) for c in range(len(page.columns))]
        ui = page if layout == "ui" else docpage.random_page(2**31 + seed * 1000 + 700 + i, layout="ui")
        near = {"edit cell": (page, docpage.edit_cells(page, rng.sample(cells, 1), rng)),
                "edit cells": (page, docpage.edit_cells(page, rng.sample(cells, min(3, len(cells))), rng))}
        for kind in docstream.PAGE_CHANGES:
            base = ui if kind == "widget" else page
            near[kind] = (base, docstream.changed_page(rng, base, kind))
        out += [(docpage.render(a), docpage.render(b), True, f"docpage {kind}") for kind, (a, b) in near.items()]
        other = docpage.random_page(2**31 + seed * 1000 + 500 + i, layout=layout)
        image = docpage.render(page)
        out += [(image, b, True, f"docpage {kind}") for kind, b in _local(image, docpage.render(other), rng).items()]
        out.append((docpage.render(page), docpage.render(other), False, "docpage unrelated"))
    return out


def pairs(seed: int, per_kind: int, pages: str = "synthdoc") -> list[tuple[Image.Image, Image.Image, bool, str]]:
    """(image, other image, near-duplicate?, what changed) pairs: ``per_kind`` of each near-duplicate kind and as
    many unrelated pairs, for documents (``synthdoc`` forms, or ``docpage`` pages as well) and for each synthetic
    image kind."""
    rng = random.Random(seed)
    out = docpage_pairs(seed, per_kind) if pages == "docpage" else []
    for i in range(per_kind):
        style = synthdoc.STYLES[i % len(synthdoc.STYLES)]
        page = synthdoc.random_form(seed * 1000 + i, style=style)
        near = {"edit value": synthdoc.edit_value(page, rng.randrange(synthdoc.ROWS), rng),
                "edit key": synthdoc.edit_key(page, rng.randrange(synthdoc.ROWS), rng),
                "swap rows": synthdoc.swap_rows(page, 0, synthdoc.ROWS - 1),
                "shift": synthdoc.shift(page, rng.randint(1, 3), rng.randint(0, 1)),
                "jpeg": synthdoc.reencode(page, 60), "brightness": synthdoc.brighten(page, 0.85),
                "noise": synthdoc.noisy(page, 6.0)}
        base = synthdoc.render(page)
        out += [(base, synthdoc.render(p), True, f"page {kind}") for kind, p in near.items()]
        other = synthdoc.random_form(seed * 1000 + 500 + i, style=style)
        out += [(base, b, True, f"page {kind}") for kind, b in _local(base, synthdoc.render(other), rng).items()]
        out.append((base, synthdoc.render(other), False, "page unrelated"))
        for kind in IMAGE_KINDS:
            image = synthetic_image(kind, seed * 1000 + i)
            near_images = {"patch": _patch(image, rng), "jpeg": synthdoc.reencode_image(image, 60),
                           "brightness": synthdoc.brighten_image(image, 0.9),
                           "shift": synthdoc.shift_image(image, rng.randint(1, 3))}
            out += [(image, b, True, f"{kind} {what}") for what, b in near_images.items()]
            out.append((image, synthetic_image(kind, seed * 1000 + 500 + i), False, f"{kind} unrelated"))
    return out


def thumbnails(adapter, images, bar=None) -> list[tuple]:
    """The lookup's thumbnail, token pixel hashes (``ModelAdapter.patch_hashes``) and their token rows of each image,
    from the model's own processor output (``bar``: a progress bar whose postfix counts them)."""
    processor = adapter.image_processor()
    out = []
    for i, image in enumerate(images):
        if bar is not None and i % 20 == 0:
            bar.set_postfix_str(f"thumbnails {i}/{len(images)}")
        (pixels, grid, extra), = adapter.processed_images(processor(images=[image.convert("RGB")],
                                                                      return_tensors="pt"))
        made, hashes = adapter.thumbnail_of(pixels, grid, extra), adapter.patch_hashes(pixels, grid, extra)
        out.append((made() if made is not None else None, hashes,
                    adapter.hash_rows(hashes, grid) if hashes is not None else None))
    return out


def score_pairs(adapter, get_image_features, pair_list, reference, desc: str = "pairs") -> list[dict]:
    """Per pair: coarse (smallest centred regional cosine), fine (``fine_score``), fine_sketch (the same from
    token sketches), pixel (``aligned_similarity`` of their thumbnails) and pixel_first (the second image shows
    the first one edited, ``core.pixel_first.pixel_changes``: the pixel-first stage finds it). A bar (``desc``)
    counts the pairs scored; its postfix names the step before (encoding the images in one batch, their thumbnails)."""
    descriptor_mean, token_mean = reference.descriptor_mean, reference.token_mean
    images = [im for a, b, _, _ in pair_list for im in (a, b)]
    bar = progress_bar(total=len(pair_list), desc=desc, unit="pair")
    bar.set_postfix_str(f"encoding {len(images)} images")
    encoded = encode_images(adapter, get_image_features, images)
    thumbs = thumbnails(adapter, images, bar)
    bar.set_postfix_str("")
    rows = []
    for i, (_, _, near, what) in enumerate(pair_list):
        bar.update(1)
        (ea, ga), (eb, gb) = encoded[2 * i], encoded[2 * i + 1]
        if ga != gb:
            continue
        hw = token_grid(ga, adapter.merge)[1:]
        da, db = region_descriptors(ea, ga, adapter.merge), region_descriptors(eb, gb, adapter.merge)
        rows.append({
            "near": near, "what": what,
            "coarse": float(regional_cosines(da, db, descriptor_mean).min()),
            "fine": fine_score(ea, eb, ga, adapter.merge, token_mean, adapter.max_shift)[0],
            "fine_sketch": best_shift(centred_sketches(token_sketch(ea), token_mean),
                                      centred_sketches(token_sketch(eb), token_mean), hw, adapter.max_shift)[0],
            "pixel": aligned_similarity(thumbs[2 * i][0], thumbs[2 * i + 1][0],
                                        thumb_per_token(adapter.thumbnail_hw(ga)))[0]
            if thumbs[2 * i][0] is not None and thumbs[2 * i + 1][0] is not None else -1.0,
            "pixel_first": thumbs[2 * i][1] is not None and thumbs[2 * i + 1][1] is not None
            and pixel_changes(thumbs[2 * i + 1][1], thumbs[2 * i][1], MIN_SAME, thumbs[2 * i + 1][2]) is not None,
            "partly": partly_changed(thumbs[2 * i + 1][1], thumbs[2 * i][1]),
            "coarse_raw": float(torch.nn.functional.cosine_similarity(da, db, dim=-1).min()),
            "fine_raw": float(torch.nn.functional.cosine_similarity(ea, eb, dim=-1).mean()),
        })
    bar.close()
    return rows


def _halfway(rows: list[dict], key: str, cap: float) -> float:
    """Halfway between the highest unrelated ``key`` score and the low (10th percentile) near-duplicate scores above
    it (at least 0.02 above it, at most ``cap``)."""
    unrelated = max(r[key] for r in rows if not r["near"])
    above = sorted(r[key] for r in rows if r["near"] and r[key] > unrelated)
    if above:
        low = above[int(0.1 * (len(above) - 1))]
        return min(cap, unrelated + max(0.02, 0.5 * (low - unrelated)))
    return min(cap + 0.01, unrelated + 0.02)


def choose(rows: list[dict]) -> LookupThresholds:
    """The thresholds (``adaptive`` off) from scored calibration pairs (see the module docstring)."""
    tau_fine = _halfway(rows, "fine", 0.98)
    below = [r for r in rows if r["fine"] < tau_fine]  # every unrelated pair (tau_fine is above them all)
    pixel = _halfway(below, "pixel", 0.98)
    kept = [r["fine"] for r in below if r["near"] and r["pixel"] >= pixel and not r.get("partly")]
    tau_pixel, tau_near = (round(pixel, 4), round(max(-1.0, min(kept) - 0.02), 4)) if kept else (None, None)
    thresholds = LookupThresholds(0.0, round(tau_fine, 4), adaptive=False, tau_pixel=tau_pixel, tau_near=tau_near)
    kept = [r["coarse"] for r in rows if r["near"] and _fine_passes(r, thresholds)]
    tau = min(tau_fine, min(kept) - 0.02) if kept else tau_fine
    return replace(thresholds, tau=round(max(-1.0, tau), 4))


def _fine_passes(r: dict, thresholds: LookupThresholds, key: str = "fine") -> bool:
    if key != "fine_raw" and r[key] >= thresholds.tau_fine and -1.0 < r["pixel"] < ENCODER_PIXEL_AGREE:
        return False  # the lookup turns down a match of the tokens alone whose thumbnails disagree
    return thresholds.matches(r[key], thresholds.tau_fine, lambda: r["pixel"], r.get("partly", False))


def rates(rows: list[dict], thresholds: LookupThresholds, key: str = "fine", coarse: str = "coarse") -> dict:
    """Recall (near-duplicates found), false-positive rate (unrelated aliased), per source and per-kind recall,
    under ``thresholds`` (its ``tau_fine`` as given)."""
    def passes(r):
        if thresholds.same_pixels is not None and r.get("pixel_first") and key != "fine_raw":
            return True  # the pixel-first stage, before the encoder-based ones
        return r[coarse] > thresholds.tau and _fine_passes(r, thresholds, key)

    def of(subset):
        near, far = [r for r in subset if r["near"]], [r for r in subset if not r["near"]]
        return {"recall": sum(map(passes, near)) / max(1, len(near)), "fpr": sum(map(passes, far)) / max(1, len(far)),
                "near_pairs": len(near), "unrelated_pairs": len(far)}

    near = [r for r in rows if r["near"]]
    kinds = sorted({r["what"] for r in near})
    sources = sorted({r["what"].split()[0] for r in rows})
    return {**of(rows), "by_source": {s: of([r for r in rows if r["what"].split()[0] == s]) for s in sources},
            "recall_by_kind": {k: sum(passes(r) for r in near if r["what"] == k) / sum(r["what"] == k for r in near)
                               for k in kinds}}


def calibrate(model, per_kind: int = 10, seed: int = 1, heldout_seed: int = 2, pages: str = "synthdoc") -> dict:
    """Measure and choose thresholds for ``model`` on ``pages``' pairs; the report holds what ``LookupThresholds``
    needs."""
    adapter = ModelAdapter.for_model(model)
    get_image_features = model.model.get_image_features
    with torch.no_grad():
        reference = model_reference(adapter, get_image_features)
        rows = score_pairs(adapter, get_image_features, pairs(seed, per_kind, pages), reference,
                           "calibrate: calibration pairs")
        heldout = score_pairs(adapter, get_image_features, pairs(heldout_seed, per_kind, pages), reference,
                              "calibrate: held-out pairs")
    chosen = choose(rows)
    tau_fine = chosen.tau_fine
    sketch_agree = [(r["fine"] >= tau_fine) == (r["fine_sketch"] >= tau_fine) for r in rows + heldout]
    defaults = LookupThresholds()
    return {
        "fingerprint": adapter.fingerprint, "tau": chosen.tau, "tau_fine": tau_fine, "tau_pixel": chosen.tau_pixel,
        "tau_near": chosen.tau_near,
        "calibration": rates(rows, chosen), "heldout": rates(heldout, chosen),
        "heldout_from_sketches": rates(heldout, chosen, key="fine_sketch"),
        "heldout_without_pixel_stage": rates(heldout, replace(chosen, tau_pixel=None, tau_near=None, same_pixels=None)),
        "sketch_agreement": sum(sketch_agree) / len(sketch_agree),
        "max_unrelated_fine": max(r["fine"] for r in rows if not r["near"]),
        "max_unrelated_pixel": max(r["pixel"] for r in rows if not r["near"]),
        "defaults": rates(heldout, defaults.for_model(reference)),
        "defaults_without_pixel_stage": rates(heldout, replace(defaults, derive_pixel=False).for_model(reference)),
        "default_pixel_stage": defaults.for_model(reference).tau_pixel,
        "uncentred_rule": rates(heldout, LookupThresholds(0.8, 0.8, adaptive=False), key="fine_raw",
                                coarse="coarse_raw"),
        "rows": rows, "heldout_rows": heldout,
    }

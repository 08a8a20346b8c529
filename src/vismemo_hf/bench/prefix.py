"""``vismemo report prefix``: exact image hits after another text before the image -> results/quality/prefix.*

An entry's K/V from layer 1 on carry the context of the text that preceded the image when it was
computed. This report stores each page after one text, asks about it after another text of 0-400
tokens, and compares the first generated token with a full prefill of the new request: agreement
of the greedy token and KL(full || hit) of its distribution, for exact reuse (`reuse`, docs/METHOD.md §2's
exact hit) and for the check-layer routing (`check`, the default policy's), on both packaged readers
and on tiny random models of the four families. On ``vismemo-docqa-base`` the image's K/V depend on the text
before it by training (an instruction naming a column selects what its cells hold), so there a swapped column
instruction changes the answer an exact reuse gives.
"""

from __future__ import annotations

import json
import random
import string
import time
from pathlib import Path
from typing import TypedDict

import torch
from transformers import DynamicCache

from vismemo_hf import VisMemoCache, VisMemoStore, enable
from vismemo_hf.bench.report import command as report_command
from vismemo_hf.bench.report import header, machine
from vismemo_hf.eval import docpage, synthdoc
from vismemo_hf.eval.docqa import messages
from vismemo_hf.families import FAMILIES
from vismemo_hf.progress import progress as progress_bar


class _Routing(TypedDict, total=False):
    """The cache options of a routing of exact hits after another context."""

    policy: str
    context: dict


ROUTINGS = {"reuse": _Routing(policy="attend-deviate", context={"routing": "reuse"}),
            "check": _Routing(policy="attend-deviate")}


def random_text(n_tokens: int, seed: int) -> str:
    """Words of random letters, ``n_tokens`` characters (one token each under the byte-level tokenizers)."""
    rng = random.Random(seed)
    words, size = [], 0
    while size < n_tokens:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:n_tokens]


@torch.no_grad()
def first_token(model, processor, page, question: str, prefix: str | tuple, cache) -> torch.Tensor:
    """Log-probabilities of the first generated token (one forward of the whole request); ``page`` is a
    ``synthdoc`` page, a ``docpage`` page or an image; ``prefix`` the text before it, or ``(earlier page, text)``:
    another image first."""
    earlier, before = prefix if isinstance(prefix, tuple) else (None, prefix)
    chat, images = messages(question, before), [_image(page)]
    if earlier is not None:
        chat[0]["content"].insert(0, {"type": "image"})
        images.insert(0, _image(earlier))
    text = processor.apply_chat_template(chat, add_generation_prompt=True)
    inputs = processor(text=[text], images=images, return_tensors="pt")
    out = model(**inputs, cache=cache, use_cache=True)
    return torch.log_softmax(out.logits[0, -1].float(), -1)


def _image(page):
    if isinstance(page, synthdoc.FormPage):
        return synthdoc.render(page)
    if isinstance(page, docpage.DocPage):
        return docpage.render(page)
    return page


def synthdoc_question(page, i: int) -> str:
    return synthdoc.question_for(page.rows[i % len(page.rows)][0])


def docpage_question(page, i: int) -> str:
    """A question whose answer no instruction chooses (a cell, or a key from its value)."""
    kind = "cell" if len(page.columns) > 1 and i % 2 == 0 else "key"
    return docpage.ask(page, kind, i % page.n_rows, (i // 2) % len(page.columns)).text


def measure(model, processor, pages, lengths, prefix_pairs, question=synthdoc_question, desc: str | None = None) -> dict:
    """Per routing and changed-prefix length: first-token agreement and mean KL against a full prefill;
    ``prefix_pairs(n, i)`` gives page i's old and new text, ``question(page, i)`` what is asked; a bar (``desc``)
    counts the pages measured."""
    out: dict[str, dict[int, dict[str, float]]] = {name: {} for name in ROUTINGS}
    bar = progress_bar(total=len(lengths) * len(pages), desc=desc or "prefix", unit="page")
    for n in lengths:
        rows: dict[str, list[tuple[float, float, int]]] = {name: [] for name in ROUTINGS}
        for i, page in enumerate(pages):
            bar.update(1)
            q = question(page, i)
            old, new = prefix_pairs(n, i)
            ref = first_token(model, processor, page, q, new, DynamicCache())
            for name, options in ROUTINGS.items():
                store = VisMemoStore()
                first_token(model, processor, page, q, old, VisMemoCache(store=store, **options))
                cache = VisMemoCache(store=store, **options)
                hit = first_token(model, processor, page, q, new, cache)
                event = cache.events[-1]  # the page's (an earlier image comes first)
                if str(event.kind) != "exact" or event.prefix_changed != (old != new):
                    raise RuntimeError(f"expected an exact hit after another prefix, got {event.kind}")
                rows[name].append((float(hit.argmax() == ref.argmax()),
                                   float(torch.sum(ref.exp() * (ref - hit))), event.recomputed))
        for name, r in rows.items():
            out[name][n] = {"first_token_agreement": sum(x[0] for x in r) / len(r),
                            "first_token_kl": sum(x[1] for x in r) / len(r),
                            "recomputed": sum(x[2] for x in r) / len(r), "pages": len(r)}
    bar.close()
    return out


def base_reader(args, lengths, random_pair) -> dict:
    """``vismemo-docqa-base`` on ``docpage`` pages: its training texts swapped (neutral ones, or none), a column
    instruction swapped for another column's (the answer changes with it), and random texts of ``lengths``."""
    from vismemo_hf.eval.loading import load_model

    model, processor = load_model(args.base_model)
    enable(model)
    layouts = docpage.LAYOUTS
    pages = [docpage.random_page(2**31 + args.seed + i, layout=layouts[i % len(layouts)]) for i in range(args.pages)]
    many = [docpage.random_page(2**31 + args.seed + 10_000 + i, layout=layouts[i % len(layouts)])
            for i in range(5 * args.pages)]
    options = ("",) + docpage.NEUTRAL

    def trained(n, i):
        return tuple(random.Random(args.seed * 7919 + i).sample(options, 2))

    columns = [docpage.random_page(2**31 + args.seed + 20_000 + i, layout=("table", "invoice")[i % 2])
               for i in range(5 * args.pages)]

    def column_question(page, i):
        return docpage.ask(page, "value", i % page.n_rows, 0).text

    def column_pair(n, i):  # stored after an instruction naming column 1; asked about column 0
        return docpage.use_column(columns[i].columns[1]), docpage.use_column(columns[i].columns[0])

    def earlier_image(n, i):  # stored alone, asked after another page
        return "", (many[-1 - i], "")

    name = "vismemo-docqa-base"
    return {f"{name} (training prefixes)": measure(model, processor, many, [0], trained, docpage_question,
                                                   f"{name} (training prefixes)"),
            f"{name} (column instruction)": measure(model, processor, columns, [0], column_pair, column_question,
                                                    f"{name} (column instruction)"),
            f"{name} (earlier image)": measure(model, processor, pages, [0], earlier_image, docpage_question,
                                               f"{name} (earlier image)"),
            name: measure(model, processor, pages, lengths, random_pair, docpage_question, name)}


def main(args) -> int:
    from vismemo_hf.eval.loading import load_model

    torch.manual_seed(0)
    lengths = [int(x) for x in args.lengths.split(",")]
    pages = [synthdoc.random_form(args.seed + i, style=synthdoc.STYLES[i % len(synthdoc.STYLES)])
             for i in range(args.pages)]
    t0 = time.time()
    results = {}
    # the reader: its training prefixes (synthdoc.PREFIXES, or none) swapped for another one of them
    model, processor = load_model("vismemo-docqa-tiny")
    enable(model)
    options = ("",) + synthdoc.PREFIXES

    def trained(n, i):
        rng = random.Random(args.seed * 7919 + i)
        old, new = rng.sample(options, 2)
        return old, new

    many = [synthdoc.random_form(args.seed + 10_000 + i, style=synthdoc.STYLES[i % len(synthdoc.STYLES)])
            for i in range(5 * args.pages)]  # the pass / fail row gets five times the pages
    results["vismemo-docqa-tiny (training prefixes)"] = measure(model, processor, many, [0], trained,
                                                                desc="vismemo-docqa-tiny (training prefixes)")

    def random_pair(n, i):
        return random_text(8, 2 * i), random_text(n, 2 * i + 1) if n else ""

    results["vismemo-docqa-tiny"] = measure(model, processor, pages, lengths, random_pair, desc="vismemo-docqa-tiny")
    results.update(base_reader(args, lengths, random_pair))
    for family in FAMILIES:
        model, processor = load_model("tiny", family)
        enable(model)
        results[f"tiny {family} (random weights)"] = measure(model, processor, pages, lengths, random_pair,
                                                             desc=f"tiny {family} (random weights)")
    command = report_command("report prefix", args, ["pages", "lengths", "seed", "base_model"])
    mach = machine(note="fp32")
    report = {"command": command, "machine": mach, "seconds": round(time.time() - t0), "results": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix.json").write_text(json.dumps(report, indent=2))
    lines = header("Exact image hits after another text before the image", command, mach) + [
             "Each page is stored after one text and asked about after another (an exact image hit whose "
             "stored K/V carry the old text's context from layer 1 on). `reuse`: every visual token reused "
             "(docs/METHOD.md §2's exact hit); `check`: the default policy's routing of such hits (every token computed "
             "at layer 0; from layer 1 on, the 15 % whose fresh K/V deviate most from the stored ones at layer 1 "
             "recomputed, and every token whose relative deviation there exceeds `context.tolerance` (0.005); the "
             "rest reused). Compared with a full prefill of the new request: agreement of the first greedy "
             "token and KL(full || hit) of the first token's distribution, averaged over the pages. "
             "`changed prefix` is the length in tokens of the new text (0: the page was stored after a short text "
             "and is asked with none). The first row keeps the reader within its training range: the old and "
             "new texts are two different ones of the texts it was trained with (or none). `column instruction swapped` "
             "(vismemo-docqa-base): the page, a table or invoice, was stored after `Use COL.` naming its second "
             "column and is asked about its first; the text changes the answer, and the stored cells hold the "
             "other column's selection. `another page before it`: the page was stored alone and is asked about after "
             "another page (two images in the request).", "",
             "| model | changed prefix (tokens) | reuse: agreement | reuse: KL | check: agreement | check: KL | "
             "check: recomputed tokens | pages |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for model_name, by_routing in results.items():
        for n in by_routing["reuse"]:
            r, c = by_routing["reuse"][n], by_routing["check"][n]
            name, _, case = model_name.partition(" (")
            label = {"training prefixes)": "training texts", "column instruction)": "column instruction swapped",
                     "earlier image)": "another page before it"}.get(case, str(n))
            lines.append(f"| {name if 'random' not in case else model_name} | {label} | "
                         f"{r['first_token_agreement']:.3f} | {r['first_token_kl']:.4f} | "
                         f"{c['first_token_agreement']:.3f} | {c['first_token_kl']:.4f} | {c['recomputed']:.1f} | "
                         f"{r['pages']} |")
    (out / "prefix.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0

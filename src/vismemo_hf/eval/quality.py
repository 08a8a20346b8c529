"""Quality of reuse on request streams: ANLS by hit kind and fidelity to a full prefill (docs/METHOD.md §6).

``evaluate(model, processor, requests, policy=...)`` runs a stream in order through one store
(so hits happen as in serving) and scores every answer; ``vismemo report quality`` compares
every policy on the same streams and writes ``results/quality/``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from vismemo_hf.eval import synthdoc
from vismemo_hf.runtime.cache import DEFAULT_POLICY, VisMemoCache
from vismemo_hf.store.store import VisMemoStore


def levenshtein(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def anls(prediction: str, answers: list[str], threshold: float = 0.5) -> float:
    """ANLS of one answer, computed exactly as ``lmms_eval.api.metrics.anls`` (DocVQA protocol)."""
    pred = " ".join(prediction.strip().lower().split())
    dists = []
    for answer in answers:
        gold = " ".join(answer.strip().lower().split())
        length = max(len(answer.upper()), len(prediction.upper()))
        dists.append(0.0 if length == 0 else levenshtein(gold, pred) / length)
    score = 1 - min(dists)
    return 0.0 if score < threshold else score


@dataclass
class Scored:
    request: synthdoc.BaseRequest[object]
    prediction: str
    kind: str
    anls: float
    first_token_logprobs: torch.Tensor | None = field(default=None, repr=False)
    tokens: list[int] = field(default_factory=list)
    #: approximate hits: how many of the asked value's cells the plan put in R, B and M
    answer_cells: dict | None = None
    visual_tokens: int = 0  # the request's visual tokens (every image)
    ttft_ms: float = 0.0  # time to the first token (vision encoder, prefill, first token)
    recomputed_share: float | None = None  # hits: the share of the image's tokens the plan recomputed


class TokenClock(StoppingCriteria):
    """The time of every token ``generate`` produces (stopping criteria run once per new token); on CUDA after
    the device has finished it."""

    def __init__(self, device="cpu") -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def answer_cell_routing(request: synthdoc.BaseRequest[object], plan) -> dict:
    """Where the plan put the visual tokens that hold the asked value."""
    cells = request.answer_tokens()
    sets = {"R": plan.recompute, "B": plan.reuse, "M": plan.mask}
    return {name: len(set(cells) & set(tokens.tolist())) for name, tokens in sets.items()}


@torch.no_grad()
def answer(model, processor, request: synthdoc.BaseRequest[object], cache, max_new_tokens: int = 8):
    from vismemo_hf.eval.docqa import messages

    text = processor.apply_chat_template(messages(request.question, request.prefix), add_generation_prompt=True)
    inputs = processor(text=[text], images=[request.image()], return_tensors="pt").to(model.device)
    clock = TokenClock(model.device)
    t0 = time.perf_counter()
    out = model.generate(**inputs, cache=cache, max_new_tokens=max_new_tokens, do_sample=False,
                         output_scores=True, return_dict_in_generate=True,
                         stopping_criteria=StoppingCriteriaList([clock]))
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    prediction = processor.tokenizer.decode(tokens, skip_special_tokens=True).strip()
    visual = int((inputs["input_ids"] == model.config.image_token_id).sum())
    ttft = (clock.times[0] - t0) * 1e3
    return prediction, tokens, torch.log_softmax(out.scores[0][0].float(), -1).cpu(), visual, ttft


def evaluate(model, processor, requests, policy: str = DEFAULT_POLICY, store: VisMemoStore | None = None,
             max_new_tokens: int = 8, progress=None, **options) -> list[Scored]:
    """Answer ``requests`` in order with one store; ``policy="plain"`` uses a ``DynamicCache`` (no VisMemo)."""
    store = store if store is not None else VisMemoStore()
    scored = []
    for request in requests:
        cache = DynamicCache() if policy == "plain" else VisMemoCache(store=store, policy=policy,
                                                                      **{"approximate": "always", **options})
        prediction, tokens, logprobs, visual, ttft = answer(model, processor, request, cache, max_new_tokens)
        kind = "miss" if policy == "plain" else str(cache.events[0].kind)
        event = None if policy == "plain" else cache.events[0]
        routing = answer_cell_routing(request, event.plan) if event is not None and kind == "approximate" else None
        share = event.recomputed / event.n_tokens if event is not None and kind in ("exact", "approximate") \
            and event.n_tokens else None
        scored.append(Scored(request, prediction, kind, anls(prediction, request.answers), logprobs, tokens, routing,
                             visual, ttft, share))
        if progress is not None:
            progress.update(1)
    return scored


def summarise(scored: list[Scored], reference: list[Scored] | None = None) -> dict:
    """ANLS overall, by hit kind and on edited-value questions; stale answers; fidelity to ``reference``."""

    def mean(xs):
        return sum(xs) / len(xs) if xs else float("nan")

    out = {"n": len(scored), "anls": mean([s.anls for s in scored]),
           "visual_tokens": mean([s.visual_tokens for s in scored])}
    for kind in ("exact", "approximate", "miss"):
        subset = [s.anls for s in scored if s.kind == kind]
        out[f"anls_{kind}"] = mean(subset)
        out[f"n_{kind}"] = len(subset)
    variants = sorted({s.request.variant for s in scored})
    out["anls_by_variant"] = {v: mean([s.anls for s in scored if s.request.variant == v]) for v in variants}
    shares = [s.recomputed_share for s in scored if s.kind == "approximate" and s.recomputed_share is not None]
    out["recomputed_share_approximate"] = mean(shares)
    routed = [s.answer_cells for s in scored if s.answer_cells is not None]
    total = sum(sum(r.values()) for r in routed)
    out["answer_cells"] = {k: sum(r[k] for r in routed) / total for k in ("R", "B", "M")} if total else None
    edited = [s for s in scored if s.request.about_edit]
    out["anls_edited_value"] = mean([s.anls for s in edited])
    out["stale_rate"] = mean([float(s.request.stale is not None and s.prediction == s.request.stale) for s in edited])
    if reference is not None:
        pairs = list(zip(scored, reference))
        out["first_token_agreement"] = mean([float(a.tokens[:1] == b.tokens[:1]) for a, b in pairs])
        out["sequence_match"] = mean([float(a.tokens == b.tokens) for a, b in pairs])
        out["first_token_kl"] = mean([_first_token_kl(a, b) for a, b in pairs])
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


def _first_token_kl(scored: Scored, reference: Scored) -> float:
    """KL(reference || scored) of the first token's distribution."""
    a, b = scored.first_token_logprobs, reference.first_token_logprobs
    assert a is not None and b is not None  # ``evaluate`` keeps every answer's first-token log-probabilities
    return float(torch.sum(b.exp() * (b - a)))


def heldout_pages(per_type: int = 40, seed: int = 900_000,
                  pages: str = "synthdoc") -> list[synthdoc.BaseRequest[object]]:
    """Pages no training step drew (fixed seeds), ``per_type`` of every page type (``synthdoc`` styles, or
    ``docpage`` layouts with questions of every kind and instructions), one question each; ``variant`` names the
    type (``base-TYPE``)."""
    import random

    rng = random.Random(seed)
    out: list[synthdoc.BaseRequest[object]] = []
    if pages == "docpage":
        from vismemo_hf.eval import docpage, docstream

        for layout in docpage.LAYOUTS:  # seeds from 2**31 on: training draws page seeds below 2**31
            for i in range(per_type):
                doc = docpage.random_page(2**31 + seed + len(out), layout=layout)
                out.append(docstream.request(f"held-{layout}-{i}", doc, docpage.random_question(rng, doc),
                                             "miss", f"base-{layout}"))
        return out
    for style in synthdoc.STYLES:
        for i in range(per_type):
            page = synthdoc.random_form(seed + len(out), style=style)
            key, value = page.rows[rng.randrange(synthdoc.ROWS)]
            out.append(synthdoc.Request(f"held-{style}-{i}", page, synthdoc.question_for(key), [value], "miss",
                                        f"base-{style}"))
    return out


def reading_by_type(model, processor, per_type: int = 40, max_new_tokens: int = 6, progress=None,
                    pages: str = "synthdoc") -> dict:
    """Full-prefill ANLS of the reader on held-out pages, per page type (``DynamicCache``: no VisMemo at all)."""
    requests = heldout_pages(per_type, pages=pages)
    scored = evaluate(model, processor, requests, policy="plain", max_new_tokens=max_new_tokens, progress=progress)

    def rates(subset):
        return {"anls": sum(s.anls for s in subset) / len(subset),
                "exact_match": sum(s.prediction == s.request.answers[0] for s in subset) / len(subset),
                "n": len(subset)}

    types = dict.fromkeys(s.request.variant for s in scored)
    out = {t.removeprefix("base-"): rates([s for s in scored if s.request.variant == t]) for t in types}
    out["all"] = rates(scored)
    return out

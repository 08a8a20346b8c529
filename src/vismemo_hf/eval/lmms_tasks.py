"""Functions the lmms-eval tasks in ``eval_tasks/`` point at (their ``utils.py`` re-exports these)."""

from __future__ import annotations

import math

from vismemo_hf.eval.lmms import HIT_KINDS

KINDS = ("exact", "approximate", "miss")


def doc_to_visual(doc):
    return [doc["image"].convert("RGB")]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return doc["question"]


def process_results(doc, results):
    """ANLS overall, per hit kind of this answer (None where it does not apply) and on edited values."""
    from lmms_eval.api.metrics import anls

    score = anls(list(doc["answers"]), results)["anls"]
    kind = HIT_KINDS.get(str(doc["id"]), "unknown")
    out = {"anls": score, "anls_edited_value": score if doc.get("about_edit") else None}
    for k in KINDS:
        out[f"anls_{k}"] = score if kind == k else None
        out[f"answers_{k}"] = int(kind == k)  # the realized hit kinds, counted
    return out


def mean_of(values):
    """Mean over the answers a metric applies to (``None`` entries are skipped)."""
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else math.nan


def count_of(values):
    """How many answers had the hit kind (an aggregation: lmms-eval has no sum)."""
    return int(sum(values))

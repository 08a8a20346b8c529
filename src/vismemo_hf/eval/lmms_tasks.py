"""Functions the lmms-eval tasks in ``eval_tasks/`` point at (their ``utils.py`` re-exports these)."""

from __future__ import annotations

import math

from vismemo_hf.eval.lmms import ANSWERS, Answer

KINDS = ("exact", "approximate", "miss")


def doc_to_visual(doc):
    return [doc["image"].convert("RGB")]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return doc["question"]


def _current_task() -> str | None:
    """The task lmms-eval is scoring (it names it before each task's ``process_results``), if it says."""
    try:
        from lmms_eval.models.model_utils import usage_metrics
    except ImportError:
        return None
    return getattr(usage_metrics, "_CURRENT_TASK_CONTEXT", None)


def answer_of(doc, task: str | None = None) -> Answer:
    """The realised answer of ``doc``'s request in ``task`` (default: the task being scored; without one, the only
    task that answered a request of that id); kind ``unknown`` when none was recorded."""
    doc_id = str(doc["id"])
    task = task or _current_task()
    if task is not None:
        return ANSWERS.get((task, doc_id), Answer("unknown"))
    found = [a for (_, i), a in ANSWERS.items() if i == doc_id]
    return found[0] if len(found) == 1 else Answer("unknown")


def process_results(doc, results):
    """ANLS overall, per hit kind of this answer (None where it does not apply) and on edited values; the realised
    hit kind and fallback of this request, as counts (``answers_KIND``, ``answers_fallback``)."""
    from lmms_eval.api.metrics import anls

    score = anls(list(doc["answers"]), results)["anls"]
    answer = answer_of(doc)
    out = {"anls": score, "anls_edited_value": score if doc.get("about_edit") else None}
    for k in KINDS:
        out[f"anls_{k}"] = score if answer.kind == k else None
        out[f"answers_{k}"] = int(answer.kind == k)  # the realized hit kinds, counted
    out["answers_fallback"] = int(answer.fallback is not None)  # hits computed in full (the context check, ...)
    return out


def mean_of(values):
    """Mean over the answers a metric applies to (``None`` entries are skipped)."""
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else math.nan


def count_of(values):
    """How many answers had the hit kind (an aggregation: lmms-eval has no sum)."""
    return int(sum(values))

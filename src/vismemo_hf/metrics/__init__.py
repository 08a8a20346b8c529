"""The report metrics as Hugging Face ``evaluate`` modules, loadable offline from the installed package:

    import vismemo_hf.metrics
    anls = vismemo_hf.metrics.load("anls")
    anls.compute(predictions=["4821"], references=[["4821", "4,821"]])  # {"anls": 1.0}

``anls``: the DocVQA protocol (``eval.quality.anls``, as lmms-eval computes it); ``exact_match``: normalised
string equality with any reference.
"""

from __future__ import annotations

from pathlib import Path

NAMES = ("anls", "exact_match")


def path(name: str) -> str:
    """The folder of metric ``name`` (for ``evaluate.load(path)``)."""
    if name not in NAMES:
        raise ValueError(f"unknown metric {name!r}; available: {', '.join(NAMES)}")
    return str(Path(__file__).resolve().parent / name)


def load(name: str, **kwargs):
    """``evaluate.load`` of a packaged metric (no hub access)."""
    import evaluate

    return evaluate.load(path(name), **kwargs)

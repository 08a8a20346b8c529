"""Exact match (case- and whitespace-normalised) against any of the accepted answers, as an ``evaluate`` metric."""

import datasets
import evaluate


def _norm(text: str) -> str:
    return " ".join(text.strip().lower().split())


class ExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Share of predictions equal to one of their references after lower-casing and folding "
                        "whitespace.",
            citation="",
            inputs_description="predictions: list of str; references: list of lists of str (the accepted answers)",
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Sequence(datasets.Value("string"))}),
        )

    def _compute(self, predictions, references):
        hits = [any(_norm(p) == _norm(r) for r in refs) for p, refs in zip(predictions, references)]
        return {"exact_match": sum(hits) / len(hits) if hits else float("nan")}

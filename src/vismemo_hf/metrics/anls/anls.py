"""ANLS (average normalised Levenshtein similarity, DocVQA protocol) as an ``evaluate`` metric."""

import datasets
import evaluate

from vismemo_hf.eval.quality import anls


class Anls(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="ANLS: 1 - normalised edit distance to the closest reference, 0 below 0.5 (DocVQA).",
            citation="Biten et al., Scene Text Visual Question Answering, ICCV 2019.",
            inputs_description="predictions: list of str; references: list of lists of str (the accepted answers)",
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Sequence(datasets.Value("string"))}),
        )

    def _compute(self, predictions, references, threshold: float = 0.5):
        scores = [anls(p, list(r), threshold) for p, r in zip(predictions, references)]
        return {"anls": sum(scores) / len(scores) if scores else float("nan")}

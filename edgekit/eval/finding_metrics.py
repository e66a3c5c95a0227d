"""Finding-level scores: the report is parsed back into structured findings and matched to the ground truth.

A finding matches on (type, location). Among matches we also score the count and the size in mm. A predicted
finding whose type is absent from the study's ground truth is a hallucination (a right type on the wrong side is
a localisation error, not a hallucination). A finding that the report states absent although it is present is a
contradiction, the most harmful error a report can make.

`summarise_findings` turns the scores of many studies into the figures `edgekit eval` reports, by the names it
reports them under (rates, not counts): the training run's probes report the same vocabulary.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..findings import COUNTED_TYPES
from .bootstrap import bootstrap_ci


@dataclass
class StudyScore:
    tp: int
    fp: int
    fn: int
    hallucinated: int  # predicted findings whose type the study does not have
    predicted: int
    contradictions: int  # present findings stated absent
    count_correct: int  # among matches
    size_abs_err_mm: list[float]
    counted_matches: int = 0  # matches of a type that can be more than one (CT nodules): where a count can be wrong
    counted_correct: int = 0


def _key(f) -> tuple:
    return (f.type, f.location)


def score_study(truth: list, truth_negatives: list[str], predicted: list, predicted_negatives: list[str]) -> StudyScore:
    del truth_negatives  # negatives are scored through contradictions; absent findings have no (type, location)
    remaining = Counter(_key(f) for f in truth)
    by_key: dict[tuple, list] = {}
    for f in truth:
        by_key.setdefault(_key(f), []).append(f)
    tp = 0
    count_ok = 0
    counted = counted_ok = 0
    size_err: list[float] = []
    for f in predicted:
        k = _key(f)
        if remaining[k] > 0:
            remaining[k] -= 1
            tp += 1
            ref = by_key[k][remaining[k]]
            count_ok += int(f.count == ref.count)
            if f.type in COUNTED_TYPES:
                counted += 1
                counted_ok += int(f.count == ref.count)
            if f.size_mm is not None and ref.size_mm is not None:
                size_err.append(abs(float(f.size_mm) - float(ref.size_mm)))
    truth_types = {f.type for f in truth}
    return StudyScore(
        tp=tp,
        fp=len(predicted) - tp,
        fn=sum(remaining.values()),
        hallucinated=sum(1 for f in predicted if f.type not in truth_types),
        predicted=len(predicted),
        contradictions=len(truth_types & set(predicted_negatives)),
        count_correct=count_ok,
        size_abs_err_mm=size_err,
        counted_matches=counted,
        counted_correct=counted_ok,
    )


def prf(tp: float, fp: float, fn: float) -> tuple[float, float, float]:
    """Micro precision, recall, F1. An empty prediction on an empty truth is perfect, not undefined."""
    p = tp / (tp + fp) if tp + fp else 1.0
    r = tp / (tp + fn) if tp + fn else 1.0
    f = 2 * p * r / (p + r) if p + r else 0.0
    return p, r, f


def summarise_findings(scores: Sequence[StudyScore], *, resamples: int = 1000, seed: int = 0) -> dict:
    """The finding-level figures over `scores` (one per report): micro F1 with its bootstrap interval, precision,
    recall, the hallucinated share of predicted findings, the shares of reports with a hallucination or a
    contradiction, count accuracy among matches (overall and among the types that can be more than one, where a
    miscount hides behind the many findings that are always one) and the size error."""
    counts = np.array([[s.tp, s.fp, s.fn] for s in scores], dtype=np.float64).reshape(-1, 3)
    p, r, f1 = prf(*counts.sum(0))
    predicted = sum(s.predicted for s in scores)
    tp = sum(s.tp for s in scores)
    counted = sum(s.counted_matches for s in scores)
    counted_right = sum(s.counted_correct for s in scores)
    sizes = [e for s in scores for e in s.size_abs_err_mm]
    return {
        "finding_f1": {
            "value": f1,
            "ci95": bootstrap_ci(counts, lambda c: prf(*c.sum(0))[2], resamples=resamples, seed=seed),
        },
        "finding_precision": p,
        "finding_recall": r,
        "hallucinated_finding_rate": sum(s.hallucinated for s in scores) / predicted if predicted else 0.0,
        "reports_with_hallucination": float(np.mean([s.hallucinated > 0 for s in scores])) if scores else 0.0,
        "contradiction_rate": float(np.mean([s.contradictions > 0 for s in scores])) if scores else 0.0,
        "count_accuracy": sum(s.count_correct for s in scores) / tp if tp else None,
        "count_accuracy_counted_types": {
            "value": counted_right / counted if counted else None,
            "correct": counted_right,
            "n": counted,
        },
        "size_mae_mm": float(np.mean(sizes)) if sizes else None,
    }

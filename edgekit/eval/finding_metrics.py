"""Finding-level scores: the report is parsed back into structured findings and matched to the ground truth.

A finding matches on (type, location). Among matches we also score the count and the size in mm. A predicted
finding whose type is absent from the study's ground truth is a hallucination (a right type on the wrong side is
a localisation error, not a hallucination). A finding that the report states absent although it is present is a
contradiction, the most harmful error a report can make.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..findings import COUNTED_TYPES


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
    by_key = {}
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

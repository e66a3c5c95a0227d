"""Text-overlap metrics that run offline: BLEU-4 (sacrebleu) and ROUGE-L.

Both are kept as per-report sufficient statistics so that bootstrap resampling re-aggregates them without
re-tokenising (1000 resamples of the test split take milliseconds, not minutes).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
from sacrebleu.metrics import BLEU

_WORD = re.compile(r"[a-z0-9]+")


def bleu_statistics(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> np.ndarray:
    """Per-report BLEU statistics (n_reports, 10): the counts sacrebleu sums before computing corpus BLEU.

    `references[i]` holds every reference phrasing of report i (multi-reference BLEU, as sacrebleu defines it).
    """
    width = max(len(r) for r in references)
    streams = [[refs[k] if k < len(refs) else None for refs in references] for k in range(width)]
    # a None reference is one this report does not have: sacrebleu skips them (metrics/base.py), but its
    # annotation says Sequence[Sequence[str]]
    stats = BLEU()._extract_corpus_statistics(list(hypotheses), streams)  # type: ignore[arg-type]
    return np.asarray(stats, dtype=np.float64)


def bleu_from_statistics(stats: np.ndarray) -> float:
    """Corpus BLEU-4 (0-100) from summed per-report statistics."""
    return float(BLEU()._compute_score_from_stats(list(stats.sum(axis=0))).score)


def _lcs(a: list[str], b: list[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(hypothesis: str, references: Sequence[str]) -> float:
    """ROUGE-L F-measure (beta = 1) on lower-cased word tokens, best over the references."""
    hyp = _WORD.findall(hypothesis.lower())
    best = 0.0
    for ref in references:
        r = _WORD.findall(ref.lower())
        if not hyp or not r:
            continue
        lcs = _lcs(hyp, r)
        if lcs:
            p, rec = lcs / len(hyp), lcs / len(r)
            best = max(best, 2 * p * rec / (p + rec))
    return best

"""The scoring code behind every quality figure: each case here is one a wrong implementation gets wrong."""

from dataclasses import dataclass

import numpy as np
import pytest

from edgekit.eval.bootstrap import bootstrap_ci
from edgekit.eval.finding_metrics import prf, score_study
from edgekit.eval.text_metrics import bleu_from_statistics, bleu_statistics, rouge_l


@dataclass
class F:
    type: str
    location: str | None
    size_mm: int | None = None
    count: int = 1


def test_bleu_identical_is_100_and_multi_reference_takes_the_best():
    refs = [["there is a nodule in the right lung .", "a right lung nodule is present ."]]
    assert bleu_from_statistics(bleu_statistics(["a right lung nodule is present ."], refs)) == pytest.approx(100)
    one_ref = bleu_from_statistics(bleu_statistics(["a right lung nodule is seen ."], [refs[0][:1]]))
    two_refs = bleu_from_statistics(bleu_statistics(["a right lung nodule is seen ."], refs))
    assert two_refs > one_ref


def test_bleu_statistics_sum_like_sacrebleu_corpus_score():
    from sacrebleu.metrics import BLEU

    hyps = ["no acute abnormality .", "two nodules in the left lung , the largest 14 mm ."]
    refs = [["no acute abnormality .", "normal study ."], ["two left lung nodules , largest 14 mm .", "x y z"]]
    expected = BLEU().corpus_score(hyps, [[r[0] for r in refs], [r[1] for r in refs]]).score
    assert bleu_from_statistics(bleu_statistics(hyps, refs)) == pytest.approx(expected)


def test_rouge_l_known_values():
    assert rouge_l("a b c d", ["a b c d"]) == pytest.approx(1.0)
    # LCS("a b x d", "a b c d") = 3 -> P = R = 3/4
    assert rouge_l("a b x d", ["a b c d"]) == pytest.approx(0.75)
    assert rouge_l("", ["a"]) == 0.0
    assert rouge_l("q r s", ["a b", "q r s t"]) == pytest.approx(2 * 1 * 0.75 / 1.75)


def test_prf_edge_cases():
    assert prf(0, 0, 0) == (1.0, 1.0, 1.0)  # normal study reported normal
    assert prf(0, 1, 0)[2] == 0.0
    p, r, f = prf(3, 1, 2)
    assert (p, r) == (0.75, 0.6) and f == pytest.approx(2 * 0.75 * 0.6 / 1.35)


def test_score_study_matches_on_type_and_location_and_separates_error_kinds():
    truth = [F("nodule", "right lung", 12, 2), F("pleural effusion", "left")]
    pred = [F("nodule", "right lung", 10, 2), F("pleural effusion", "right"), F("mass", "left lung", 40)]
    s = score_study(truth, ["mass"], pred, ["pleural effusion"])
    assert (s.tp, s.fp, s.fn) == (1, 2, 1)
    assert s.hallucinated == 1  # the mass; the wrong-sided effusion is a localisation error
    assert s.contradictions == 1  # "no pleural effusion" while one is present
    assert s.count_correct == 1 and s.size_abs_err_mm == [2.0]


def test_score_study_duplicate_predictions_do_not_double_count():
    s = score_study([F("nodule", "left lung")], [], [F("nodule", "left lung")] * 2, [])
    assert (s.tp, s.fp, s.fn) == (1, 1, 0)


def test_bootstrap_interval_contains_the_estimate_and_narrows_with_more_data():
    rng = np.random.default_rng(1)
    small = rng.normal(5, 1, size=(20, 1))
    large = rng.normal(5, 1, size=(2000, 1))
    lo_s, hi_s = bootstrap_ci(small, lambda x: float(x.mean()), resamples=500)
    lo_l, hi_l = bootstrap_ci(large, lambda x: float(x.mean()), resamples=500)
    assert lo_s < small.mean() < hi_s and lo_l < large.mean() < hi_l
    assert (hi_l - lo_l) < (hi_s - lo_s) / 4
    assert bootstrap_ci(small, lambda x: float(x.mean()), seed=3) == bootstrap_ci(
        small, lambda x: float(x.mean()), seed=3
    )


def test_counted_types_are_scored_apart_so_always_one_findings_cannot_hide_a_miscount():
    truth = [F("nodule", "left", 30, 1), F("pleural effusion", "left"), F("mass", "right", 50)]
    pred = [F("nodule", "left", 30, 3), F("pleural effusion", "left"), F("mass", "right", 50)]
    s = score_study(truth, [], pred, [])
    assert s.count_correct == 2  # two of three matches right overall: the effusion and mass cannot be miscounted
    assert (s.counted_matches, s.counted_correct) == (1, 0)  # the one finding whose count can be wrong, is wrong
    right = score_study(truth, [], [F("nodule", "left", 30, 1)], [])
    assert (right.counted_matches, right.counted_correct) == (1, 1)


def test_summarise_findings_reports_what_edgekit_eval_reports_under_the_same_names():
    """The training run's probes score through `summarise_findings`; `edgekit eval` must report the same figures
    under the same names, so the two vocabularies cannot drift apart again."""
    from dataclasses import asdict

    from edgekit.eval.finding_metrics import summarise_findings
    from edgekit.eval.runner import _summarise

    scores = [
        score_study([F("nodule", "right lung", 12, 2)], [], [F("nodule", "right lung", 10, 3)], []),
        score_study([F("pleural effusion", "left")], [], [F("mass", "left lung", 40)], ["pleural effusion"]),
        score_study([], ["mass"], [], ["mass"]),
        score_study([F("mass", "left lung", 30)], [], [F("mass", "left lung", 30)], []),
    ]
    records = [
        {
            "score": asdict(s),
            "text": "a",
            "references": ["a"],
            "rouge_l": 1.0,
            "timings": {"total_ms": 1.0},
            "cost": {},
        }
        for s in scores
    ]
    summary = summarise_findings(scores, resamples=200, seed=0)
    assert summary["hallucinated_finding_rate"] == pytest.approx(1 / 3)  # a rate over predicted findings
    assert summary["contradiction_rate"] == 0.25 and summary["reports_with_hallucination"] == 0.25
    assert summary["count_accuracy_counted_types"] == {"value": 0.0, "correct": 0, "n": 1}
    overall = _summarise(records, resamples=200, seed=0)
    assert summary == {k: overall[k] for k in summary}

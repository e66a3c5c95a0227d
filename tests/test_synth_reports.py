"""Reports of synthetic studies: exact render/parse round trip in every style, and a parser that survives what a
small model writes instead."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgekit.findings import KINDS, Finding, parse_report, sort_findings, sort_types
from edgekit.models.synth import render_report
from edgekit.models.synth.generator import draw_findings
from edgekit.models.synth.reports import STYLES


def _random_cases(n=400):
    rng = np.random.default_rng(7)
    for i in range(n):
        yield draw_findings(KINDS[i % len(KINDS)], rng)


@pytest.mark.parametrize("style", STYLES)
def test_round_trip_every_style(style):
    for findings, negatives in _random_cases():
        text = render_report(findings, negatives, style)
        parsed = parse_report(text)
        assert parsed.findings == findings, text
        assert parsed.negatives == negatives, text


def test_styles_differ_and_say_every_absent_type():
    findings = [Finding("nodule", "left", 30, 2)]
    negatives = ["mass", "pleural effusion"]
    texts = [render_report(findings, negatives, s) for s in STYLES]
    assert len(set(texts)) == len(STYLES)
    for t in texts:
        assert t.startswith("FINDINGS: ") and " IMPRESSION: " in t
        assert "30 mm" in t and "mass" in t.lower() and "pleural effusion" in t.lower()
    assert "Two nodules in the left lung, the largest 30 mm." in texts[0]


def test_normal_study_has_a_normal_impression():
    text = render_report([], ["nodule", "mass", "pleural effusion"], 0)
    assert text.endswith("IMPRESSION: No acute abnormality.")
    assert "No pleural effusion." in text


@pytest.mark.parametrize(
    "text, findings, negatives",
    [
        (
            "Findings: 2 nodules in the left lung, up to 3 cm. no mass or pleural effusion.",
            [Finding("nodule", "left", 30, 2)],
            ["mass", "pleural effusion"],
        ),
        (
            "There is a 1.5 cm lesion in the right hemisphere; ventricles are normal in size",
            [Finding("lesion", "right", 15)],
            ["hydrocephalus"],
        ),
        (
            "Right-sided pneumothorax. Heart size is normal. Pleural effusion is absent. No consolidation.",
            [Finding("pneumothorax", "right")],
            ["consolidation", "pleural effusion", "cardiomegaly"],
        ),
        ("Hypokinesis. No pericardial effusion.", [Finding("reduced wall motion")], ["pericardial effusion"]),
        ("Left effusion.", [Finding("pleural effusion", "left")], []),
        (
            "INDICATION: Follow-up of lung nodule. FINDINGS: No pulmonary nodules. IMPRESSION: Normal study.",
            [],
            ["nodule"],
        ),
        (
            "A 20 mm nodule in the right lung and a 50 mm mass in the left lung, no pleural effusion.",
            [Finding("nodule", "right", 20), Finding("mass", "left", 50)],
            ["pleural effusion"],
        ),
        ("Mass and pleural effusion are absent.", [], ["mass", "pleural effusion"]),
        ("No mass but a 20 mm nodule in the left lung.", [Finding("nodule", "left", 20)], ["mass"]),
        ("Left lung nodules.", [Finding("nodule", "left", None, 2)], []),
    ],
)
def test_near_misses(text, findings, negatives):
    parsed = parse_report(text)
    assert parsed.findings == sort_findings(findings)
    assert parsed.negatives == sort_types(negatives)


@pytest.mark.parametrize(
    "junk",
    [
        None,
        "",
        "   ",
        b"\xff\xfe FINDINGS",
        "....;;;,,,",
        "no no no",
        42,
        "FINDINGS: IMPRESSION:",
        "mm mm 3 cm cm",
        "nodule" * 5000,
        "1. 2. 3. left right left",
        "\x00\x01 mass \u202e right",
    ],
)
def test_parser_never_raises_on_garbage(junk):
    parsed = parse_report(junk)
    assert isinstance(parsed.findings, list) and isinstance(parsed.negatives, list)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            list("abcdeilmnoprstuvwxyz 0123456789.,;:-")
            + [" nodule", " mass", " no ", " left", " right", " mm", " effusion", " and", " or", " two", " absent"]
        ),
        max_size=120,
    ).map("".join)
)
def test_parser_total_on_model_like_noise(text):
    parsed = parse_report(text)
    assert all(isinstance(f, Finding) for f in parsed.findings)
    assert not {f.type for f in parsed.findings} & set(parsed.negatives)

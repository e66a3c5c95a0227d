"""Reports of the synthetic studies: render findings as text in several phrasings (the core's
`edgekit.findings.parse_report` reads them back).

The report is a deterministic function of (findings, negatives) up to the phrasing `style`: every finding type of
the study's kind is mentioned, present (with side, size and count) or stated absent, one sentence per type in a
fixed order. That makes the text learnable by a tiny model and lets evaluation score reports at finding level.

`edgekit.findings.parse_report` is the inverse for every style.
"""

from __future__ import annotations

from edgekit.findings import COUNTED_TYPES, NUMBER_WORDS, Finding, sort_findings, sort_types

STYLES = (0, 1, 2, 3)
NORMAL_IMPRESSIONS = ("No acute abnormality.", "Normal study.", "No acute findings.", "Unremarkable examination.")

_ORGAN = {"nodule": "lung", "mass": "lung", "consolidation": "lung", "lesion": "hemisphere"}
_PLURAL = {"nodule": "nodules", "mass": "masses", "lesion": "lesions"}
_ADJECTIVE_SIDE = {"pleural effusion", "pneumothorax"}  # "left pleural effusion", not "... in the left ..."
_NEG_NOUN = {"nodule": "pulmonary nodule", "lesion": "focal lesion"}


# --------------------------------------------------------------------------------------------------- rendering


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _count_word(n: int) -> str:
    return NUMBER_WORDS.get(n, str(n))


def _where(f: Finding) -> str:
    return f" in the {f.location} {_ORGAN[f.type]}" if f.location else ""


def _noun_sentence(f: Finding, style: int) -> str:
    """nodule, mass, lesion, consolidation: things in an organ, maybe sized and counted."""
    t, s, where = f.type, f.size_mm, _where(f)
    many = f.count > 1
    noun = _PLURAL.get(t, t) if many else t
    size_pre = f"{s} mm " if s else ""
    if t == "consolidation":
        return [
            f"Consolidation{where}.",
            f"There is consolidation{where}.",
            f"{_cap(f.location)} lung: consolidation." if f.location else "Consolidation is present.",
            f"{_cap(f.location)} lung consolidation." if f.location else "Consolidation.",
        ][style]
    if style == 0:
        if many:
            return f"{_cap(_count_word(f.count))} {noun}{where}" + (f", the largest {s} mm." if s else ".")
        return f"A {size_pre}{noun}{where}."
    if style == 1:
        if many:
            return f"There are {_count_word(f.count)} {noun}{where}" + (f", measuring up to {s} mm." if s else ".")
        return f"There is a {size_pre}{noun}{where}."
    if style == 2:
        head = f"{_cap(f.location)} {_ORGAN[t]}: " if f.location else ""
        if many:
            body = f"{_count_word(f.count)} {noun}" + (f", largest {s} mm" if s else "")
        else:
            body = ("one " if t in COUNTED_TYPES else "") + noun + (f", {s} mm" if s else "")
        return _cap(head + body) + "."
    # style 3
    if many:
        adj = "pulmonary " if t == "nodule" else ""
        return f"{_cap(_count_word(f.count))} {adj}{noun}{where}" + (f", the largest measuring {s} mm." if s else ".")
    lead = "Solitary nodule" if t == "nodule" else _cap(t)
    return f"{lead}{where}" + (f" measuring {s} mm." if s else ".")


def _side_sentence(f: Finding, style: int) -> str:
    """pleural effusion, pneumothorax: the side is an adjective."""
    t, side = f.type, f.location
    if side:
        return [
            f"{_cap(side)} {t}.",
            f"There is a {side} {t}.",
            f"{_cap(t)} on the {side}.",
            f"A {side}-sided {t} is present.",
        ][style]
    return [f"{_cap(t)}.", f"There is a {t}.", f"{_cap(t)} is present.", f"A {t} is present."][style]


_FIXED_POSITIVE = {
    "hydrocephalus": (
        "Hydrocephalus with enlarged ventricles.",
        "There is hydrocephalus.",
        "Ventricles: enlarged, consistent with hydrocephalus.",
        "The ventricles are enlarged (hydrocephalus).",
    ),
    "cardiomegaly": (
        "Cardiomegaly.",
        "The heart is enlarged.",
        "Heart: enlarged.",
        "Enlarged cardiac silhouette (cardiomegaly).",
    ),
    "reduced wall motion": (
        "Reduced wall motion.",
        "Wall motion is reduced.",
        "Wall motion: reduced.",
        "Globally reduced wall motion (hypokinesis).",
    ),
    "pericardial effusion": (
        "Pericardial effusion.",
        "There is a pericardial effusion.",
        "Pericardial effusion is present.",
        "A pericardial effusion surrounds the heart.",
    ),
}
# Negatives said in words of their own rather than "No X." (style 3 keeps them out of the grouped list).
_FIXED_NEGATIVE = {
    "reduced wall motion": (
        "Normal wall motion.",
        "Wall motion is normal.",
        "Wall motion: normal.",
        "Wall motion is normal.",
    ),
    "hydrocephalus": (None, "The ventricles are normal in size.", None, None),
    "cardiomegaly": (None, "Heart size is normal.", "Heart: normal size.", None),
}


def positive_sentence(f: Finding, style: int) -> str:
    if f.type in _FIXED_POSITIVE:
        return _FIXED_POSITIVE[f.type][style]
    if f.type in _ADJECTIVE_SIDE:
        return _side_sentence(f, style)
    return _noun_sentence(f, style)


def negative_sentence(t: str, style: int) -> str | None:
    """The sentence stating `t` absent, or None in style 3 where plain negatives are grouped into one list."""
    fixed = _FIXED_NEGATIVE.get(t, (None,) * 4)[style]
    if fixed:
        return fixed
    noun = _NEG_NOUN.get(t, t)
    return [f"No {noun}.", f"There is no {noun}.", f"{_cap(noun)} is absent.", None][style]


def _join_list(items: list[str], conj: str) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" {conj} " + items[-1]


def _impression_item(f: Finding) -> str:
    t = f.type
    if t in _ORGAN:
        noun = _PLURAL.get(t, t) if f.count > 1 else t
        if f.location:
            return f"{f.location} {_ORGAN[t]} {noun}"
        return f"intracranial {noun}" if t == "mass" else noun
    if t in _ADJECTIVE_SIDE and f.location:
        return f"{f.location} {t}"
    return t


def impression(findings: list[Finding], style: int) -> str:
    if not findings:
        return NORMAL_IMPRESSIONS[style]
    items = [_impression_item(f) for f in findings]
    if style == 0:
        return " ".join(_cap(i) + "." for i in items)
    if style == 1:
        return _cap(_join_list(items, "and")) + "."
    if style == 2:
        return " ".join(f"{k + 1}. {_cap(i)}." for k, i in enumerate(items))
    return "Positive for " + _join_list(items, "and") + "."


def render_report(findings, negatives, style: int = 0) -> str:
    """One report: "FINDINGS: <one sentence per type, fixed order> IMPRESSION: <summary>"."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, not {style!r}")
    findings = sort_findings(findings)
    present = {f.type for f in findings}
    negatives = [t for t in sort_types(negatives) if t not in present]
    by_type = {f.type: f for f in findings}
    sentences: list[str] = []
    grouped: list[str] = []
    for t in sort_types(list(present) + negatives):
        if t in by_type:
            sentences.append(positive_sentence(by_type[t], style))
            continue
        s = negative_sentence(t, style)
        if s is None:
            grouped.append(_NEG_NOUN.get(t, t))
        else:
            sentences.append(s)
    if grouped:
        sentences.append(f"No {_join_list(grouped, 'or')}.")
    return f"FINDINGS: {' '.join(sentences)} IMPRESSION: {impression(findings, style)}"

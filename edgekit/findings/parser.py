"""Structured findings from report text: `parse_report` reads findings and negatives out of any phrasing.

Why in the core: the reporter turns every generated report into findings and the metrics score them, on any
target and any model; the synthetic data writer (`edgekit.models.synth.reports`) renders the phrasings this
parser reads. Tolerant of what a small model generates (digits for counts, cm, synonyms, lists of negatives,
missing sections). It never raises: garbage parses to nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .vocabulary import COUNTED_TYPES, LATERAL_TYPES, SIZED_TYPES, Finding, sort_findings, sort_types

NUMBER_WORDS = {
    1: "one",
    2: "two",
    3: "three",
    4: "four",
    5: "five",
    6: "six",
    7: "seven",
    8: "eight",
    9: "nine",
    10: "ten",
}


@dataclass
class ParsedReport:
    findings: list[Finding] = field(default_factory=list)
    negatives: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------- parsing

# (type, polarity, pattern). Negative-polarity patterns state a type absent by meaning ("Heart size is normal.").
_MENTIONS: list[tuple[str, bool, str]] = [
    ("pericardial effusion", True, r"pericardial effusions?"),
    ("pleural effusion", True, r"pleural effusions?|hydrothora(?:x|ces)"),
    ("pleural effusion?", True, r"effusions?"),  # bare "effusion": pleural only when a side is given
    ("nodule", True, r"nodules?|nodular opacit(?:y|ies)"),
    ("mass", True, r"mass(?:es)?"),
    ("lesion", True, r"lesions?"),
    ("consolidation", True, r"consolidations?|airspace (?:disease|opacit(?:y|ies))|pneumonia"),
    ("pneumothorax", True, r"pneumothora(?:x|ces)"),
    (
        "hydrocephalus",
        False,
        r"(?:the )?ventricles (?:are |appear )?(?:normal|not (?:enlarged|dilated))"
        r"|normal(?:-sized| sized)? ventricles|ventricles: normal|ventricular size is normal",
    ),
    (
        "hydrocephalus",
        True,
        r"hydrocephalus|ventriculomegaly|(?:enlarged|dilated) ventricles"
        r"|ventricles (?:are |appear )?(?:enlarged|dilated)|ventricles: (?:enlarged|dilated)",
    ),
    (
        "cardiomegaly",
        False,
        r"heart size (?:is )?normal|normal heart size|heart: normal(?: size)?"
        r"|heart (?:is )?(?:normal in size|not enlarged)|normal cardiac (?:size|silhouette)"
        r"|cardiac silhouette (?:is )?(?:normal|not enlarged)",
    ),
    (
        "cardiomegaly",
        True,
        r"cardiomegaly|enlarged (?:heart|cardiac silhouette)"
        r"|(?:heart|cardiac silhouette) (?:is |appears )?enlarged|heart: enlarged",
    ),
    ("reduced wall motion", False, r"normal wall motion|wall motion (?:is )?normal|wall motion: normal"),
    (
        "reduced wall motion",
        True,
        r"(?:reduced|decreased|impaired|diminished|abnormal) wall motion"
        r"|wall motion (?:is )?(?:reduced|decreased|impaired|diminished|abnormal)"
        r"|wall motion: (?:reduced|decreased|impaired)|hypokine(?:sis|tic)"
        r"|wall motion abnormalit(?:y|ies)",
    ),
]
_MENTION_RES = [(t, pol, re.compile(r"\b(?:" + p + r")\b")) for t, pol, p in _MENTIONS]

_SECTION = re.compile(
    r"\b(findings|impression|conclusion|indication|clinical history|history|comparison|"
    r"technique|reason for exam)\s*:",
    re.I,
)
_SKIPPED_SECTIONS = {"indication", "clinical history", "history", "comparison", "technique", "reason for exam"}
_CLAUSE_SPLIT = re.compile(r"[;!?\n]|\.(?!\d)")
_PHRASE_SPLIT = re.compile(r"(,|\band\b|\bor\b|\bnor\b|\bbut\b|\bhowever\b|\bas well as\b)")
_PRE_NEG = re.compile(r"\b(?:no|without|negative for|absence of|free of|rules? out|ruled out)\b")
_POST_NEG = re.compile(
    r"\b(?:is|are|was|were)\s+(?:absent|not\s+(?:seen|identified|present|visuali[sz]ed|"
    r"demonstrated|evident))\b|\babsent\b|:\s*none\b|\bnot (?:seen|identified|present)\b"
    r"|\bresolved\b"
)
_SIZE = re.compile(r"(\d{1,4}(?:\.\d+)?)\s*(mm|millimet(?:er|re)s?|cm|centimet(?:er|re)s?)\b")
_SIDE = re.compile(r"\b(right|left)\b")
_COUNT_WORDS = {w: n for n, w in NUMBER_WORDS.items()} | {"single": 1, "solitary": 1}
_COUNT_BEFORE = re.compile(
    r"\b(one|two|three|four|five|six|seven|eight|nine|ten|single|solitary|\d{1,2})\s+"
    r"(?:(?!mm\b|cm\b)[a-z-]+\s+){0,2}$"
)
_POSITIVE_START = re.compile(r"^\s*(?:a|an|there|the|one|two|three|\d)\b")
_MAX_CHARS = 20000


@dataclass
class _Mention:
    type: str
    positive: bool
    start: int
    end: int
    plural: bool
    count: int | None = None
    side: str | None = None
    side_dist: int = 10**9
    sizes: list[int] = field(default_factory=list)


def _find_mentions(phrase: str) -> list[_Mention]:
    found: list[_Mention] = []
    taken: list[tuple[int, int]] = []
    for t, pol, rx in _MENTION_RES:  # earlier patterns win overlaps (specific before generic)
        for m in rx.finditer(phrase):
            if any(m.start() < e and s < m.end() for s, e in taken):
                continue
            word = m.group(0)
            plural = word.endswith(("s", "ies", "ces")) and not word.endswith(("mass", "thorax", "sis", "lus"))
            found.append(_Mention(t, pol, m.start(), m.end(), plural))
            taken.append((m.start(), m.end()))
    return sorted(found, key=lambda m: m.start)


def _sizes(phrase: str) -> list[tuple[int, int]]:
    out = []
    for m in _SIZE.finditer(phrase):
        try:
            v = float(m.group(1)) * (10.0 if m.group(2).startswith(("cm", "centi")) else 1.0)
        except ValueError:
            continue
        if 0 < v < 1000:
            out.append((m.start(), int(round(v))))
    return out


def _nearest(mentions: list[_Mention], pos: int, only: frozenset | None = None) -> tuple[_Mention | None, int]:
    best, dist = None, 10**9
    for m in mentions:
        if only is not None and m.type not in only and m.type != "pleural effusion?":
            continue
        d = m.start - pos if pos < m.start else max(0, pos - m.end)
        if d < dist:
            best, dist = m, d
    return best, dist


def _attach(mentions: list[_Mention], sides, sizes, *, own: bool) -> None:
    """Give each side/size word to the nearest mention that can carry it (a weaker claim when not `own` phrase)."""
    for pos, side in sides:
        m, d = _nearest(mentions, pos, LATERAL_TYPES)
        d = d if own else 10**8
        if m is not None and d < m.side_dist:
            m.side, m.side_dist = side, d
    for pos, size in sizes:
        m, _ = _nearest(mentions, pos, SIZED_TYPES)
        if m is not None:
            m.sizes.append(size)


def _parse_clause(clause: str) -> list[_Mention]:
    """Mentions of one sentence, NegEx-style: a leading "no" negates forward through a list ("No mass, nodule or
    effusion"), a trailing "is absent" negates backward; side and size words go to the nearest mention within
    their comma/and-delimited phrase, or to the previous phrase's ("Two nodules in the left lung, largest 30 mm")."""
    parts = _PHRASE_SPLIT.split(clause)
    phrases = [(parts[0], "")] + [(parts[i + 1], parts[i].strip()) for i in range(1, len(parts) - 1, 2)]
    out: list[_Mention] = []
    prev: list[_Mention] = []
    pending_sides: list = []
    pending_sizes: list = []
    negating = False
    bare_run: list[_Mention] = []  # attribute-less mentions a later "... are absent" also covers
    for text, joiner in phrases:
        if not text.strip():
            continue
        mentions = _find_mentions(text)
        sizes = _sizes(text)
        sides = [(m.start(), m.group(1)) for m in _SIDE.finditer(text)]
        has_attrs = bool(sizes or sides or _POSITIVE_START.match(text))
        if joiner in ("but", "however"):
            negating, bare_run = False, []
        if has_attrs:
            negating = False
        pre = _PRE_NEG.search(text)
        post = _POST_NEG.search(text)
        for m in mentions:
            c = _COUNT_BEFORE.search(text[: m.start])
            if c:
                w = c.group(1)
                m.count = int(w) if w.isdigit() else _COUNT_WORDS.get(w)
            if m.positive and (negating or (pre and pre.start() < m.start) or (post and post.start() >= m.end)):
                m.positive = False
        if post and any(post.start() >= m.end for m in mentions):
            for b in bare_run:
                b.positive = False
        if pre:
            negating = True
        if mentions:
            _attach(mentions, pending_sides + sides, pending_sizes + sizes, own=True)
            pending_sides, pending_sizes = [], []
            bare_run = [] if has_attrs else bare_run + mentions
            prev = mentions
            out.extend(mentions)
        elif prev:
            _attach(prev, sides, sizes, own=False)
        else:
            pending_sides += [(0, s) for _, s in sides]
            pending_sizes += [(0, s) for _, s in sizes]
    return out


def _strip_sections(text: str) -> str:
    """Drop the indication/history/comparison/technique sections: they name findings the study need not have."""
    keep: list[str] = []
    pos, skipping = 0, False
    for m in _SECTION.finditer(text):
        if not skipping:
            keep.append(text[pos : m.start()])
        skipping = m.group(1).lower() in _SKIPPED_SECTIONS
        pos = m.end()
        keep.append(". ")
    if not skipping:
        keep.append(text[pos:])
    return " ".join(keep)


def _merge(mentions: list[_Mention]) -> ParsedReport:
    positive: dict[str, list[_Mention]] = {}
    negated: set[str] = set()
    for m in mentions:
        t = m.type
        if t == "pleural effusion?":
            if m.side is None:
                continue  # a bare "effusion" could be pleural or pericardial: say nothing rather than guess
            t = m.type = "pleural effusion"
        if m.positive:
            positive.setdefault(t, []).append(m)
        else:
            negated.add(t)
    findings: list[Finding] = []
    for t, ms in positive.items():
        groups: dict[str | None, list[_Mention]] = {}
        for m in ms:
            side = m.side if t in LATERAL_TYPES else None
            groups.setdefault(side, []).append(m)
        if None in groups and len(groups) > 1:  # side-less repeats (an impression) belong to the sided finding
            first_sided = next(k for k in groups if k is not None)
            groups[first_sided] += groups.pop(None)
        for side, group in groups.items():
            size = next((max(m.sizes) for m in group if m.sizes), None) if t in SIZED_TYPES else None
            count = 1
            if t in COUNTED_TYPES:
                explicit = next((m.count for m in group if m.count), None)
                count = explicit if explicit else (2 if group[0].plural else 1)
            findings.append(Finding(t, side, size, count))
    negatives = [t for t in sort_types(negated) if t not in positive]
    return ParsedReport(sort_findings(findings), negatives)


def parse_report(text) -> ParsedReport:
    """Findings and negatives stated by a report in any phrasing `render_report` uses (and near-misses)."""
    try:
        if text is None:
            return ParsedReport()
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        text = str(text)[:_MAX_CHARS].lower()
        text = _strip_sections(text)
        mentions: list[_Mention] = []
        for clause in _CLAUSE_SPLIT.split(text):
            if clause.strip():
                mentions.extend(_parse_clause(clause))
        return _merge(mentions)
    except Exception:  # noqa: BLE001 - a parser of model output must never take the caller down
        return ParsedReport()

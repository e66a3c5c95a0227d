"""The finding schema and vocabulary: what a report can state, per study kind.

One table decides, per study kind, which finding types exist, whether they take a side, a size and a count, and
which sizes may be drawn. The report parser and the metrics (core), and the synthetic generator, pixel renderer and
report writer (`edgekit.models.synth`) all read it, so a finding the images can show is always a finding the
reports can say, and vice versa.

Sizes are few and far apart on purpose: at 64x64 after area downsampling the smallest finding is at least 4 px
across and neighbouring sizes differ by at least 2 px, so a 2.3M-parameter model can tell them apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Finding:
    """A positive finding. `size_mm` is the largest diameter (of the largest one when `count` > 1)."""

    type: str
    location: str | None = None
    size_mm: int | None = None
    count: int = 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Finding:
        return cls(type=d["type"], location=d.get("location"), size_mm=d.get("size_mm"), count=d.get("count", 1))


@dataclass(frozen=True)
class FindingSpec:
    """What one finding type may carry in one study kind."""

    type: str
    locations: tuple[str, ...] = ()  # () means the finding has no side
    sizes_mm: tuple[int, ...] = ()  # () means no size is reported
    max_count: int = 1


@dataclass(frozen=True)
class KindSpec:
    """A study kind: its modality, native geometry and its finding vocabulary (in report order)."""

    name: str
    modalities: tuple[str, ...]
    rows: int
    pixel_spacing_mm: float  # at the native size; at 64x64 multiply by rows / 64
    findings: tuple[FindingSpec, ...]
    indications: tuple[str, ...]

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(f.type for f in self.findings)

    def spec(self, type_: str) -> FindingSpec:
        for f in self.findings:
            if f.type == type_:
                return f
        raise KeyError(type_)


SIDES = ("right", "left")

CT_CHEST = KindSpec(
    name="ct_chest",
    modalities=("CT",),
    rows=128,
    pixel_spacing_mm=2.5,  # 5 mm per pixel at 64x64
    findings=(
        FindingSpec("nodule", SIDES, (20, 30), max_count=3),
        FindingSpec("mass", SIDES, (50, 70)),
        FindingSpec("pleural effusion", SIDES),
    ),
    indications=(
        "Cough and fever.",
        "Follow-up.",
        "Shortness of breath.",
        "Chest pain.",
        "Staging.",
        "Weight loss.",
        "Hemoptysis.",
    ),
)

MR_BRAIN = KindSpec(
    name="mr_brain",
    modalities=("MR",),
    rows=128,
    pixel_spacing_mm=1.8,  # 3.6 mm per pixel at 64x64
    findings=(
        FindingSpec("lesion", SIDES, (16, 26)),
        FindingSpec("mass", (), (35, 50)),
        FindingSpec("hydrocephalus"),
    ),
    indications=("Headache.", "Seizure.", "Follow-up.", "Dizziness.", "Confusion.", "Weakness."),
)

CR_CHEST = KindSpec(
    name="cr_chest",
    modalities=("CR", "DX"),
    rows=256,
    pixel_spacing_mm=1.4,
    findings=(
        FindingSpec("consolidation", SIDES),
        FindingSpec("pneumothorax", SIDES),
        FindingSpec("pleural effusion", SIDES),
        FindingSpec("cardiomegaly"),
    ),
    indications=("Cough and fever.", "Shortness of breath.", "Chest pain.", "Pre-operative.", "Follow-up.", "Trauma."),
)

US_CARDIAC = KindSpec(
    name="us_cardiac",
    modalities=("US",),
    rows=128,
    pixel_spacing_mm=0.8,
    findings=(
        FindingSpec("reduced wall motion"),
        FindingSpec("pericardial effusion"),
    ),
    indications=("Dyspnea.", "Chest pain.", "Palpitations.", "Follow-up.", "Murmur.", "Syncope."),
)

KINDS: tuple[KindSpec, ...] = (CT_CHEST, MR_BRAIN, CR_CHEST, US_CARDIAC)
KIND_BY_NAME = {k.name: k for k in KINDS}

# Every type once, in the order reports mention them; parse_report returns findings and negatives in this order.
TYPE_ORDER: tuple[str, ...] = (
    "nodule",
    "mass",
    "lesion",
    "consolidation",
    "pneumothorax",
    "pleural effusion",
    "hydrocephalus",
    "cardiomegaly",
    "reduced wall motion",
    "pericardial effusion",
)
# Types that take a side / a size / a count in at least one kind (the parser keeps only these attributes).
LATERAL_TYPES = frozenset(f.type for k in KINDS for f in k.findings if f.locations)
SIZED_TYPES = frozenset(f.type for k in KINDS for f in k.findings if f.sizes_mm)
COUNTED_TYPES = frozenset(f.type for k in KINDS for f in k.findings if f.max_count > 1)


def sort_findings(findings) -> list[Finding]:
    return sorted(
        findings,
        key=lambda f: (TYPE_ORDER.index(f.type) if f.type in TYPE_ORDER else len(TYPE_ORDER), f.type, f.location or ""),
    )


def sort_types(types) -> list[str]:
    return sorted(set(types), key=lambda t: (TYPE_ORDER.index(t) if t in TYPE_ORDER else len(TYPE_ORDER), t))

"""`generate_study(index, split)`: one synthetic study with its ground truth, a pure function of (split, index).

Everything random comes from `numpy.random.default_rng` streams seeded from a hash of (version, split, index), one
stream per concern (findings, indication, anatomy, noise, each finding type's placement, file metadata), so
splits are independent, any study can be made alone and in any order, and no global state is touched.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
from pydicom.uid import (
    DeflatedExplicitVRLittleEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGBaseline8Bit,
    RLELossless,
)

from edgekit.errors import ConfigError
from edgekit.findings import KINDS, TYPE_ORDER, Finding, KindSpec, sort_findings, sort_types

from .render import Rendered, render_cr_chest, render_ct_chest, render_mr_brain, render_us_cardiac
from .reports import STYLES, render_report

# Bump when any study's pixels, findings or text change: caches of generated splits are keyed on it.
GENERATOR_VERSION = 1
SPLITS = ("train", "val", "test", "sample")

# Studies cycle through these by index, so any 20+ consecutive studies of a kind cover every syntax.
LOSSLESS_SYNTAXES = (
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    DeflatedExplicitVRLittleEndian,
    RLELossless,
    JPEG2000Lossless,
)
US_SYNTAXES = (
    JPEGBaseline8Bit,
    ExplicitVRLittleEndian,
    JPEGBaseline8Bit,
    RLELossless,
    JPEGBaseline8Bit,
    JPEG2000Lossless,
)
POSITIVE_COUNT_P = (0.25, 0.35, 0.25, 0.15)  # 0..3 positive findings; about a quarter of studies are normal

_STREAM_FINDINGS, _STREAM_INDICATION, _STREAM_ANATOMY, _STREAM_NOISE, _STREAM_META = range(5)
_STREAM_PLACE = 100


@dataclass
class SynthStudy:
    """A generated study: stored pixels with their display parameters, ground truth and file metadata."""

    index: int
    split: str
    kind: str
    modality: str
    stored: np.ndarray  # (n, H, W)
    slope: float
    intercept: float
    center: float | None
    width: float | None
    photometric: str
    pixel_spacing: tuple[float, float]  # (row, column) in mm
    findings: list[Finding]
    negatives: list[str]
    indication: str
    references: list[str]  # the report in every style; references[0] is the canonical one
    study_uid: str
    series_uid: str
    transfer_syntax: str
    slice_thickness: float | None = None
    fps: float | None = None  # cine loops only
    patient: dict = field(default_factory=dict)  # synthetic PHI, written to DICOM only, never logged
    masks: dict[str, np.ndarray] = field(default_factory=dict)  # finding type -> bool (n, H, W) drawn pixels
    centres: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # counted type -> (row, col) of each

    def display(self) -> np.ndarray:
        """Display values in [0, 1], through the function inference applies to the DICOM files."""
        from edgekit.ingest.pixels import to_display

        return to_display(
            self.stored,
            slope=self.slope,
            intercept=self.intercept,
            center=self.center,
            width=self.width,
            photometric=self.photometric,
        )

    @property
    def id(self) -> str:
        return f"{self.split}-{self.index:05d}"

    @property
    def report(self) -> str:
        return self.references[0]

    @property
    def num_frames(self) -> int:
        return int(self.stored.shape[0])

    @property
    def is_cine(self) -> bool:
        return self.modality == "US" and self.num_frames > 1

    @property
    def frame_rate(self) -> float:
        """`fps`, which an ultrasound study has (its cine loop's, or its one frame's); an error for any other."""
        if self.fps is None:
            raise ValueError(f"{self.id}: a {self.modality} study has no frame rate")
        return self.fps


def synth_uid(split: str, index: int, what: str) -> str:
    """A deterministic UID in the 2.25 (UUID-derived) root: 128 bits of a hash of (split, index, what)."""
    digest = hashlib.sha256(f"edgekit.synth/{split}/{index}/{what}".encode()).digest()
    return "2.25." + str(int.from_bytes(digest[:16], "big"))


def study_seed(split: str, index: int) -> int:
    digest = hashlib.sha256(f"edgekit.synth/v{GENERATOR_VERSION}/{split}/{index}".encode()).digest()
    return int.from_bytes(digest[:16], "little")


def _stream(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


def kind_for_index(index: int) -> KindSpec:
    """Kinds rotate with the index, so any 4k consecutive studies are balanced across kinds."""
    return KINDS[index % len(KINDS)]


def draw_findings(kind: KindSpec, rng: np.random.Generator) -> tuple[list[Finding], list[str]]:
    n_pos = min(int(rng.choice(len(POSITIVE_COUNT_P), p=POSITIVE_COUNT_P)), len(kind.findings))
    chosen = sorted(rng.choice(len(kind.findings), size=n_pos, replace=False).tolist())
    findings = []
    for i in chosen:
        spec = kind.findings[i]
        location = str(rng.choice(spec.locations)) if spec.locations else None
        size = int(rng.choice(spec.sizes_mm)) if spec.sizes_mm else None
        count = int(rng.integers(1, spec.max_count + 1)) if spec.max_count > 1 else 1
        findings.append(Finding(spec.type, location, size, count))
    present = {f.type for f in findings}
    return sort_findings(findings), sort_types(t for t in kind.types if t not in present)


def _patient(index: int, seed: int, rng: np.random.Generator) -> dict:
    year = int(rng.integers(1940, 2006))
    study = np.datetime64("2020-01-01") + int(rng.integers(0, 5 * 365))
    return {
        "PatientName": f"SYNTH^CASE{index:04d}",
        "PatientID": f"SYN{seed % 10**8:08d}",
        "PatientBirthDate": f"{year}{int(rng.integers(1, 13)):02d}{int(rng.integers(1, 29)):02d}",
        "PatientSex": "MF"[int(rng.integers(0, 2))],
        "StudyDate": str(study).replace("-", ""),
        "StudyTime": f"{int(rng.integers(7, 19)):02d}{int(rng.integers(0, 60)):02d}00",
        "AccessionNumber": f"A{seed % 10**9:09d}",
    }


def generate_study(index: int, split: str) -> SynthStudy:
    """Study `index` of `split`: the same pixels, text and UIDs on every machine and every call."""
    return generate_study_with(index, split, None)


def generate_study_with(index: int, split: str, override: list[Finding] | None) -> SynthStudy:
    """Study `index` of `split` with other `findings` (None: its own): same anatomy, noise and placement of the
    findings they share. Counterfactual pairs prove a finding is what changes the pixels."""
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or index < 0:
        raise ConfigError(f"study index must be a non-negative integer, not {index!r}")
    index = int(index)
    seed = study_seed(split, index)
    kind = kind_for_index(index)
    findings, negatives = draw_findings(kind, _stream(seed, _STREAM_FINDINGS))
    if override is not None:
        findings = sort_findings(override)
        negatives = sort_types(t for t in kind.types if t not in {f.type for f in findings})
    indication = str(_stream(seed, _STREAM_INDICATION).choice(kind.indications))
    anat, noise, meta = (_stream(seed, s) for s in (_STREAM_ANATOMY, _STREAM_NOISE, _STREAM_META))

    def place(type_: str) -> np.random.Generator:
        return _stream(seed, _STREAM_PLACE + TYPE_ORDER.index(type_))

    modality = kind.modalities[0]
    slope, intercept, thickness, fps = 1.0, 0.0, None, None
    rendered: Rendered
    rank = index // len(KINDS)
    if kind.name == "ct_chest":
        n = int(meta.integers(10, 17))
        rendered = render_ct_chest(findings, n, anat, noise, place)
        intercept, thickness = -1024.0, 10.0
        syntax = LOSSLESS_SYNTAXES[rank % len(LOSSLESS_SYNTAXES)]
    elif kind.name == "mr_brain":
        n = int(meta.integers(10, 17))
        rendered = render_mr_brain(findings, n, anat, noise, place)
        thickness = 8.0
        syntax = LOSSLESS_SYNTAXES[rank % len(LOSSLESS_SYNTAXES)]
    elif kind.name == "cr_chest":
        modality = str(meta.choice(kind.modalities))
        rendered = render_cr_chest(findings, anat, noise, place, monochrome1=bool(meta.random() < 0.4))
        syntax = LOSSLESS_SYNTAXES[rank % len(LOSSLESS_SYNTAXES)]
    else:
        n = int(meta.integers(16, 33))
        fps = float(meta.choice([25.0, 30.0]))
        rendered = render_us_cardiac(findings, n, anat, noise, place, cycles=int(meta.integers(1, 3)))
        syntax = US_SYNTAXES[rank % len(US_SYNTAXES)]

    uid = lambda what: synth_uid(split, index, what)  # noqa: E731
    return SynthStudy(
        index=index,
        split=split,
        kind=kind.name,
        modality=modality,
        stored=rendered.stored,
        slope=slope,
        intercept=intercept,
        center=rendered.center,
        width=rendered.width,
        photometric=rendered.photometric,
        pixel_spacing=(kind.pixel_spacing_mm, kind.pixel_spacing_mm),
        findings=findings,
        negatives=negatives,
        indication=indication,
        references=[render_report(findings, negatives, s) for s in STYLES],
        study_uid=uid("study"),
        series_uid=uid("series"),
        transfer_syntax=str(syntax),
        slice_thickness=thickness,
        fps=fps,
        patient=_patient(index, seed, meta),
        masks=rendered.masks,
        centres=rendered.centres,
    )

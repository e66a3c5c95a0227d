"""DICOM Structured Report output: the report as a TID 2000-shaped Enhanced SR a PACS can store.

Title LN 18748-4 "Diagnostic Imaging Report"; sections LN 59776-5 Findings (DCM 121071 Finding items) and
LN 19005-8 Impressions (DCM 121073 Impression); the generating algorithm per TID 4019 (name, version, parameters)
with a device observer context (TID 1002); a DCM 121106 Comment, "Processing notes", lists the report's warnings
(skipped slices, clamped values, decoder fallbacks, capped options) when it has any. The SR joins the source study
(its Study Instance UID and patient module come from the evidence headers), lists every source instance as
evidence (Current Requested Procedure Evidence: study, series, SOP instance UIDs) and names the request it answers
(Referenced Request: the study's accession number and requested procedure, from the source's Request Attributes).

Evidence is kept as a few header attributes per source instance (no pixels), because the SR must copy the patient
and study identity; it lives only in the private state directory and is never logged.
"""

from __future__ import annotations

import io
import logging
import re
import zipfile
from pathlib import Path
from typing import Any

import pydicom
from pydicom.dataset import Dataset

from edgekit.errors import EdgekitError

# What an SR needs from its source to be filed in the same study (patient, study, series, instance identity).
EVIDENCE_KEYWORDS = (
    "PatientName",
    "PatientID",
    "PatientBirthDate",
    "PatientSex",
    "StudyInstanceUID",
    "StudyDate",
    "StudyTime",
    "StudyID",
    "AccessionNumber",
    "ReferringPhysicianName",
    "SeriesInstanceUID",
    "Modality",
    "SOPClassUID",
    "SOPInstanceUID",
    "SpecificCharacterSet",
    "StudyDescription",
    "RequestAttributesSequence",
)
MAX_EVIDENCE = 10000
MAX_NOTE_CHARS = 8192


class SrUnavailableError(EdgekitError):
    code = "sr_unavailable"
    http_status = 409


def collect_evidence(study_path: Path) -> list[dict[str, Any]]:
    """Header attributes of every DICOM instance in a file, folder or zip, as DICOM JSON; [] for a video."""
    from edgekit.ingest import phi_guard

    def read(src: Path | io.BytesIO) -> dict[str, Any] | None:
        try:
            ds = pydicom.dcmread(src, stop_before_pixels=True, specific_tags=list(EVIDENCE_KEYWORDS))
        except Exception:  # non-DICOM members were already reported (or skipped) by ingest
            return None
        if "SOPInstanceUID" not in ds or "StudyInstanceUID" not in ds:
            return None
        keep = Dataset()
        for kw in EVIDENCE_KEYWORDS:
            if kw in ds:
                setattr(keep, kw, ds[kw].value)
        return keep.to_json_dict()

    out: list[dict[str, Any]] = []
    with phi_guard():
        if study_path.is_dir():
            sources = (p for p in sorted(study_path.rglob("*")) if p.is_file())
            out = [d for p in sources if (d := read(p)) is not None]
        elif study_path.suffix.lower() == ".zip":
            with zipfile.ZipFile(study_path) as zf:
                for m in zf.infolist():
                    if not m.is_dir() and len(out) < MAX_EVIDENCE:
                        d = read(io.BytesIO(zf.read(m)))
                        if d is not None:
                            out.append(d)
        else:
            d = read(study_path)
            out = [d] if d is not None else []
    return out[:MAX_EVIDENCE]


# An item number: at the start, after a sentence's end, or at a line start; the digits are group 1.
_ITEM_NUMBER = re.compile(r"(?:^|[.;:!?]\s|\n)\s*(\d{1,2})[.)](?=\s|$)")
_BARE_NUMBER = re.compile(r"\d{1,2}[.)]")


def _sentences(text: str) -> list[str]:
    """The text items of a section: one per numbered item ("1. A. 2. B." gives "1. A." and "2. B.", never a bare
    "1."), else one per sentence. A number counts as an item's only where a sentence could start and in order from
    1, so "segment 1. No effusion." stays two sentences."""
    cuts, expect = [], 1
    for m in _ITEM_NUMBER.finditer(text):
        if int(m.group(1)) == expect:
            cuts.append(m.start(1))
            expect += 1
    head = _split_sentences(text[: cuts[0] if cuts else len(text)])
    items = [text[a:b].strip() for a, b in zip(cuts, [*cuts[1:], len(text)], strict=False)]  # [] without cuts
    return head + [i for i in items if i and not _BARE_NUMBER.fullmatch(i)]


def _split_sentences(text: str) -> list[str]:
    """Sentences; a bare number ("2." of a list that does not start at 1) joins the sentence after it."""
    out: list[str] = []
    number = ""
    for s in re.split(r"(?<=\.)\s+", text):
        s = s.strip()
        if _BARE_NUMBER.fullmatch(s):
            number = f"{number} {s}".strip()
        elif s:
            out.append(f"{number} {s}".strip())
            number = ""
    return out


def build_sr(
    report: dict[str, Any], evidence: list[dict[str, Any]], *, algorithm_version: str, series_number: int = 901
) -> Dataset:
    """An Enhanced SR of `report` (the daemon's JSON report) in the source study given by `evidence`."""
    import highdicom as hd
    from highdicom.sr import (
        AlgorithmIdentification,
        CodedConcept,
        ContainerContentItem,
        ContentSequence,
        DeviceObserverIdentifyingAttributes,
        ObserverContext,
        RelationshipTypeValues,
        TextContentItem,
    )
    from pydicom.sr.codedict import codes

    # highdicom logs each evidence instance's SOP Instance UID at INFO while copying the patient and study modules
    logging.getLogger("highdicom").setLevel(logging.WARNING)
    if not evidence:
        raise SrUnavailableError("a DICOM SR needs a DICOM source study; this report was made from a video")
    sources = [Dataset.from_json(d) for d in evidence]
    blanked = sorted({kw for ds in sources for kw in _conformant(ds)})
    study_uids = {str(ds.StudyInstanceUID) for ds in sources}
    if len(study_uids) != 1:
        raise SrUnavailableError(f"the source instances belong to {len(study_uids)} studies; an SR references one")

    contains = RelationshipTypeValues.CONTAINS
    root = ContainerContentItem(name=CodedConcept("18748-4", "LN", "Diagnostic Imaging Report"), template_id="2000")
    device = ObserverContext(
        observer_type=codes.DCM.Device,
        observer_identifying_attributes=DeviceObserverIdentifyingAttributes(
            uid=hd.UID(), name="edgekitd", model_name=str(report.get("model", "edgekit"))
        ),
    )
    algorithm = AlgorithmIdentification(
        name=str(report.get("model", "edgekit")),
        version=algorithm_version,
        parameters=[f"variant={report.get('variant', '')}", f"target={report.get('target', '')}"],
    )
    findings = ContainerContentItem(name=CodedConcept("59776-5", "LN", "Findings"), relationship_type=contains)
    # a ContentSequence, as highdicom's items would make of a list (their __setattr__ is typed for one only)
    findings.ContentSequence = ContentSequence(
        [
            TextContentItem(name=CodedConcept("121071", "DCM", "Finding"), value=s[:1024], relationship_type=contains)
            for s in (_sentences(report.get("findings_text", "")) or ["No findings reported."])
        ]
    )
    impressions = ContainerContentItem(name=CodedConcept("19005-8", "LN", "Impressions"), relationship_type=contains)
    impressions.ContentSequence = ContentSequence(
        [
            TextContentItem(
                name=CodedConcept("121073", "DCM", "Impression"), value=s[:1024], relationship_type=contains
            )
            for s in (_sentences(report.get("impression", "")) or ["No impression reported."])
        ]
    )
    blank_notes = [f"the source's {kw} is not a valid value; left empty" for kw in blanked]
    notes = [*(report.get("warnings") or []), *blank_notes]
    root.ContentSequence = ContentSequence([*device, *algorithm, findings, impressions, *_notes(notes)])
    return hd.sr.EnhancedSR(
        evidence=sources,
        requested_procedures=[_referenced_request(sources)],
        content=root,
        series_instance_uid=hd.UID(),
        series_number=series_number,
        sop_instance_uid=hd.UID(),
        instance_number=1,
        manufacturer="edgekit",
        is_complete=True,
        is_final=False,
        is_verified=False,  # machine-written drafts: a clinician verifies them
    )


# Type 2 attributes of the patient and study modules that the SR copies from its source (PS3.3 C.7.1.1, C.7.2.1).
# A source may leave them out or hold a value its VR forbids ('19811399' as a date); the SR then carries them
# empty, which the standard allows, instead of there being no SR at all.
SOURCE_TYPE2 = (
    "PatientName",
    "PatientID",
    "PatientBirthDate",
    "PatientSex",
    "StudyDate",
    "StudyTime",
    "ReferringPhysicianName",
    "StudyID",
    "AccessionNumber",
)


def _conformant(ds: Dataset) -> list[str]:
    """Fill `ds`'s absent SOURCE_TYPE2 attributes with empty values and empty the invalid ones; the keywords
    emptied for an invalid value (never the value: it is the patient's)."""
    from pydicom import config
    from pydicom.datadict import dictionary_VR
    from pydicom.valuerep import validate_value

    blanked = []
    for kw in SOURCE_TYPE2:
        if kw not in ds:
            ds.add_new(kw, dictionary_VR(kw), None)
            continue
        elem = ds[kw]
        try:
            validate_value(elem.VR, elem.value, config.RAISE)
        except (ValueError, TypeError):
            elem.value = None
            blanked.append(kw)
    return blanked


def _referenced_request(sources: list[Dataset]) -> Dataset:
    """The Referenced Request Sequence item (PS3.3 C.17.2): the study and the order it was made for, as the source
    states them (type 2 attributes stay empty when the source has none)."""
    first = sources[0]
    request = next(
        (item for ds in sources for item in (ds.get("RequestAttributesSequence") or []) if item is not None), None
    )
    item = Dataset()
    item.StudyInstanceUID = first.StudyInstanceUID
    item.ReferencedStudySequence = []
    item.AccessionNumber = first.get("AccessionNumber", "")
    item.PlacerOrderNumberImagingServiceRequest = ""
    item.FillerOrderNumberImagingServiceRequest = ""
    item.RequestedProcedureID = (request.get("RequestedProcedureID", "") if request is not None else "") or ""
    description = request.get("RequestedProcedureDescription", "") if request is not None else ""
    item.RequestedProcedureDescription = description or first.get("StudyDescription", "")
    item.RequestedProcedureCodeSequence = (
        list(request.get("RequestedProcedureCodeSequence") or []) if request is not None else []
    )
    return item


def _notes(warnings: list[str]) -> list[Any]:
    """What ingest skipped or changed and what was capped, as one DCM 121106 Comment TEXT item that a reader of
    the SR sees beside the report (none when there is nothing to say). Warnings are PHI-safe by construction."""
    from highdicom.sr import CodedConcept, RelationshipTypeValues, TextContentItem

    if not warnings:
        return []
    text = "Processing notes:\n" + "\n".join(f"- {w}" for w in warnings)
    if len(text) > MAX_NOTE_CHARS:
        text = text[: MAX_NOTE_CHARS - 1] + "\u2026"
    return [
        TextContentItem(
            name=CodedConcept("121106", "DCM", "Comment"), value=text, relationship_type=RelationshipTypeValues.CONTAINS
        )
    ]


def render_sr(report: dict[str, Any], evidence: list[dict[str, Any]], *, algorithm_version: str) -> bytes:
    """The SR of `report` as Part 10 bytes, or SrUnavailableError (409) with a reason that names no value.

    highdicom refuses source headers it cannot copy (an invalid date, a missing Type 2 attribute) with an error
    quoting the value, and pydicom warns with it: both are kept out of the answer and the log (`phi_guard`)."""
    from edgekit.ingest.phi import phi_guard

    with phi_guard():
        try:
            return sr_bytes(build_sr(report, evidence, algorithm_version=algorithm_version))
        except EdgekitError:
            raise
        except Exception as exc:
            raise SrUnavailableError(
                f"the SR cannot be built from the study's headers ({type(exc).__name__})"
            ) from None


def sr_bytes(ds: Dataset) -> bytes:
    buf = io.BytesIO()
    ds.save_as(buf, enforce_file_format=True)
    return buf.getvalue()

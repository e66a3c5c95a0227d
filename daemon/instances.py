"""One received DICOM instance (STOW-RS part or C-STORE dataset): accepted for a study, or refused with a reason.

STOW-RS and the Storage SCP accept the same things: the image storage SOP classes that ingest makes frames of, in
the transfer syntaxes a pixel decoder is installed for. The refusal codes are the DICOM storage failure reasons
(PS3.4 Annex B, used by STOW-RS in FailureReason (0008,1197) and by C-STORE as the response status), so each kind
of bad input has its own.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from pydicom.dataset import Dataset
from pydicom.uid import UID

# Failure reasons (PS3.4 Annex B.2.3 / PS3.18 table "Store Instances Response Attribute Description")
OUT_OF_RESOURCES = 0xA700
DATASET_MISMATCH = 0xA900  # truncated, no pixel data, missing identifiers, another study than the target
CANNOT_UNDERSTAND = 0xC000  # not DICOM at all
SOP_CLASS_NOT_SUPPORTED = 0x0122
TRANSFER_SYNTAX_NOT_SUPPORTED = 0xC122
PROCESSING_FAILURE = 0x0110

# Image storage SOP classes ingest turns into frames (single frames, stacks, cines). SR, RT, waveforms,
# presentation states, segmentations and encapsulated documents carry no image to report on.
IMAGE_STORAGE = {
    "1.2.840.10008.5.1.4.1.1.1": "CR Image Storage",
    "1.2.840.10008.5.1.4.1.1.1.1": "Digital X-Ray Image Storage - For Presentation",
    "1.2.840.10008.5.1.4.1.1.1.1.1": "Digital X-Ray Image Storage - For Processing",
    "1.2.840.10008.5.1.4.1.1.1.2": "Digital Mammography X-Ray Image Storage - For Presentation",
    "1.2.840.10008.5.1.4.1.1.2": "CT Image Storage",
    "1.2.840.10008.5.1.4.1.1.2.1": "Enhanced CT Image Storage",
    "1.2.840.10008.5.1.4.1.1.3.1": "Ultrasound Multi-frame Image Storage",
    "1.2.840.10008.5.1.4.1.1.4": "MR Image Storage",
    "1.2.840.10008.5.1.4.1.1.4.1": "Enhanced MR Image Storage",
    "1.2.840.10008.5.1.4.1.1.6.1": "Ultrasound Image Storage",
    "1.2.840.10008.5.1.4.1.1.7": "Secondary Capture Image Storage",
    "1.2.840.10008.5.1.4.1.1.7.2": "Multi-frame Grayscale Byte Secondary Capture Image Storage",
    "1.2.840.10008.5.1.4.1.1.7.3": "Multi-frame Grayscale Word Secondary Capture Image Storage",
    "1.2.840.10008.5.1.4.1.1.7.4": "Multi-frame True Color Secondary Capture Image Storage",
    "1.2.840.10008.5.1.4.1.1.12.1": "X-Ray Angiographic Image Storage",
    "1.2.840.10008.5.1.4.1.1.12.2": "X-Ray Radiofluoroscopic Image Storage",
    "1.2.840.10008.5.1.4.1.1.20": "Nuclear Medicine Image Storage",
    "1.2.840.10008.5.1.4.1.1.128": "Positron Emission Tomography Image Storage",
}


# PS3.5 9.1: components of digits separated by single dots, at most 64 chars. The standard also forbids a leading
# zero in a component ("1.2.840.0123"), which some vendors write anyway: accepted, as pydicom and PACSs accept it
# (the refusal is for what cannot be a UID at all: a 10 KB string, a path, letters).
_UID = re.compile(r"[0-9]+(?:\.[0-9]+)*", re.ASCII)
MAX_UID_CHARS = 64


def is_uid(value: str) -> bool:
    """Whether `value` is a valid DICOM UID. UIDs become file names (hashed), log fields (hashed) and are echoed
    back to the sender, so anything else (a 10 KB string, a path) is refused before it is used as one."""
    return len(value) <= MAX_UID_CHARS and _UID.fullmatch(value) is not None


@functools.cache
def decodable_transfer_syntaxes() -> tuple[UID, ...]:
    """The transfer syntaxes whose pixel data this install can decode (what the SCP offers), native ones first."""
    import pydicom.pixels as px
    from pydicom.uid import AllTransferSyntaxes, DeflatedExplicitVRLittleEndian

    native = [UID("1.2.840.10008.1.2.1"), UID("1.2.840.10008.1.2"), UID("1.2.840.10008.1.2.2")]
    out = list(native)
    for ts in AllTransferSyntaxes:
        ts = UID(ts)
        if ts in out or ts == DeflatedExplicitVRLittleEndian:
            continue
        try:
            if px.get_decoder(ts).is_available:
                out.append(ts)
        except (NotImplementedError, ValueError):
            continue
    return tuple(out)


@dataclass(frozen=True)
class InstanceUids:
    study: str
    series: str
    sop_instance: str
    sop_class: str


@dataclass(frozen=True)
class Refusal:
    """Why an instance was not stored: a failure reason code, and a PHI-free text for the client."""

    reason: int
    text: str
    sop_class: str = ""
    sop_instance: str = ""


def _uid(ds: Dataset, keyword: str) -> str:
    value = ds.get(keyword)
    return str(value).strip() if value else ""


def check_dataset(ds: Dataset, transfer_syntax: str | None, target_study: str | None = None) -> InstanceUids | Refusal:
    """Whether a parsed dataset is an image instance we can report on, from its identifiers and encoding only
    (pixel data is decoded when the study is ingested, not per instance)."""
    sop_class = _uid(ds, "SOPClassUID") or _uid(getattr(ds, "file_meta", Dataset()), "MediaStorageSOPClassUID")
    sop_instance = _uid(ds, "SOPInstanceUID") or _uid(getattr(ds, "file_meta", Dataset()), "MediaStorageSOPInstanceUID")
    study, series = _uid(ds, "StudyInstanceUID"), _uid(ds, "SeriesInstanceUID")
    # a refusal echoes the SOP UIDs back to the sender (FailedSOPSequence): only values that are UIDs
    echo_class, echo_instance = (u if is_uid(u) else "" for u in (sop_class, sop_instance))
    if not (sop_class and sop_instance and study and series):
        return Refusal(
            DATASET_MISMATCH, "missing SOP Class, SOP Instance, Study or Series Instance UID", echo_class, echo_instance
        )
    named = {"SOP Class": sop_class, "SOP Instance": sop_instance, "Study Instance": study, "Series Instance": series}
    invalid = [f"{name} UID" for name, uid in named.items() if not is_uid(uid)]
    if invalid:  # named, never quoted: the value is the sender's and may be anything
        return Refusal(
            DATASET_MISMATCH,
            f"not a valid UID (PS3.5 9.1: 1-64 digits and dots, no leading zeros): {', '.join(invalid)}",
            echo_class,
            echo_instance,
        )
    if sop_class not in IMAGE_STORAGE:
        return Refusal(
            SOP_CLASS_NOT_SUPPORTED, "not an image storage SOP class edgekit reports on", sop_class, sop_instance
        )
    if transfer_syntax is not None and UID(transfer_syntax) not in decodable_transfer_syntaxes():
        return Refusal(TRANSFER_SYNTAX_NOT_SUPPORTED, "no pixel decoder for its syntax", sop_class, sop_instance)
    if not any(tag in ds for tag in ("PixelData", "FloatPixelData", "DoubleFloatPixelData")):
        return Refusal(DATASET_MISMATCH, "an image SOP class without pixel data", sop_class, sop_instance)
    if target_study is not None and study != target_study:
        return Refusal(DATASET_MISMATCH, "another study than the URL names", sop_class, sop_instance)
    return InstanceUids(study, series, sop_instance, sop_class)


def parse_part(data: bytes, target_study: str | None = None) -> tuple[Dataset, InstanceUids] | Refusal:
    """A STOW-RS part (a DICOM file with its meta header) parsed and checked; never raises on bad bytes."""
    from edgekit.ingest.dicom import DicomDirectory, NotDicom, read_dataset
    from edgekit.ingest.phi import phi_guard

    try:
        with phi_guard():  # pydicom's notes quote element values: keep them out of the log
            ds = read_dataset(data, "part")
    except (NotDicom, DicomDirectory):
        return Refusal(CANNOT_UNDERSTAND, "not a DICOM instance")
    except Exception as err:  # SliceError (truncated, unreadable) or anything pydicom raised on broken bytes
        reason = getattr(err, "reason", None) or type(err).__name__
        return Refusal(DATASET_MISMATCH, f"truncated or malformed DICOM: {reason}")
    ts = ds.file_meta.get("TransferSyntaxUID") if getattr(ds, "file_meta", None) is not None else None
    checked = check_dataset(ds, str(ts) if ts else None, target_study)
    return checked if isinstance(checked, Refusal) else (ds, checked)

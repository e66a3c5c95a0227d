"""One DICOM object -> header facts and decoded stored values.

Split from series assembly so a folder can be checked (series, sizes, limits, order) from headers before any
pixel data is decoded, and so every failure names the one file that caused it.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pydicom
import pydicom.pixels as px
from pydicom.dataset import Dataset
from pydicom.errors import InvalidDicomError
from pydicom.uid import (
    UID,
    ExplicitVRBigEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    MediaStorageDirectoryStorage,
)

from edgekit.errors import StudyError, UnsupportedTransferSyntaxError
from edgekit.ingest.phi import scrub
from edgekit.ingest.study import IngestLimits

_PIXEL_TAGS = ("PixelData", "FloatPixelData", "DoubleFloatPixelData")


class NotDicom(Exception):
    """Raised by `read_dataset` for bytes that are not DICOM at all (the caller decides: skip or fail)."""


class DicomDirectory(Exception):
    """Raised by `read_dataset` for a DICOMDIR media directory, which series folders may carry and we ignore."""


def _short(err: BaseException) -> str:
    """An exception's text on one line (decoders list one reason per plugin), capped and scrubbed."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = "; ".join(lines) if lines else type(err).__name__
    return scrub(text if len(text) <= 300 else text[:297] + "...")


def read_dataset(source: Path | bytes, label: str) -> Dataset:
    """Parse a whole DICOM object; `label` names it in errors. Raises NotDicom / DicomDirectory / StudyError."""
    try:
        fp = io.BytesIO(source) if isinstance(source, bytes) else source
        ds = pydicom.dcmread(fp)
    except InvalidDicomError:
        raise NotDicom(label) from None
    except IsADirectoryError:
        raise NotDicom(label) from None
    except PermissionError:
        raise StudyError("permission denied", label) from None
    except (EOFError, OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, OverflowError) as err:
        raise StudyError(f"unreadable or truncated DICOM ({type(err).__name__}: {_short(err)})", label) from None
    sop_class = ds.file_meta.get("MediaStorageSOPClassUID") if hasattr(ds, "file_meta") else None
    if sop_class == MediaStorageDirectoryStorage or "DirectoryRecordSequence" in ds:
        raise DicomDirectory(label)
    return ds


def _first(value: Any) -> Any:
    if isinstance(value, (list, tuple, pydicom.multival.MultiValue)):
        return value[0] if len(value) else None
    return value


def _functional(ds: Dataset, seq: str, attr: str) -> Any:
    """An attribute from the top level, else the shared, else the first per-frame functional group."""
    if attr in ds:
        return ds[attr].value
    for groups in ("SharedFunctionalGroupsSequence", "PerFrameFunctionalGroupsSequence"):
        try:
            item = getattr(ds, groups)[0]
            inner = getattr(item, seq)[0]
            if attr in inner:
                return inner[attr].value
        except (AttributeError, IndexError, KeyError, TypeError):
            continue
    return None


def _float(value: Any) -> float | None:
    value = _first(value)
    if value is None or value == "":
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if np.isfinite(out) else None


def _transfer_syntax(ds: Dataset) -> UID:
    meta = getattr(ds, "file_meta", None)
    ts = meta.get("TransferSyntaxUID") if meta is not None else None
    if ts is None:  # a bare dataset: pydicom worked the encoding out while reading it
        implicit, little = getattr(ds, "original_encoding", (True, True))
        ts = ImplicitVRLittleEndian if implicit else (ExplicitVRLittleEndian if little else ExplicitVRBigEndian)
        ds.file_meta = ds.file_meta if meta is not None else pydicom.dataset.FileMetaDataset()
        ds.file_meta.TransferSyntaxUID = ts
    return UID(str(ts))


@dataclass
class DicomImage:
    """Header facts of one DICOM object with pixel data, enough to group, order and bound a series."""

    label: str
    ds: Dataset
    transfer_syntax: UID
    series_uid: str | None
    study_uid: str | None
    modality: str
    rows: int
    columns: int
    frames: int
    samples: int
    photometric: str
    instance_number: int | None
    orientation: np.ndarray | None  # (6,) row and column direction cosines
    position: np.ndarray | None  # (3,) ImagePositionPatient of the first frame


def inspect_image(ds: Dataset, label: str, limits: IngestLimits) -> DicomImage:
    """Check one object has decodable-looking pixel data within limits; no pixels are decoded here."""
    if not any(tag in ds for tag in _PIXEL_TAGS):
        raise StudyError("no pixel data (not an image object)", label)
    try:
        rows = int(ds.Rows)
        columns = int(ds.Columns)
    except (AttributeError, TypeError, ValueError):
        raise StudyError("pixel data without valid Rows/Columns", label) from None
    if rows < 1 or columns < 1:
        raise StudyError(f"invalid image size {rows}x{columns}", label)
    if rows * columns > limits.max_pixels:
        raise StudyError(f"frame of {rows}x{columns} pixels exceeds the limit of {limits.max_pixels} pixels", label)
    try:
        frames = int(_first(ds.get("NumberOfFrames", 1)) or 1)
    except (TypeError, ValueError):
        frames = 1
    if frames < 1:
        raise StudyError(f"invalid NumberOfFrames {frames}", label)
    if frames > limits.max_frames:
        raise StudyError(f"{frames} frames exceed the limit of {limits.max_frames}", label)
    ts = _transfer_syntax(ds)
    _check_decoder(ts, label)
    orientation = _functional(ds, "PlaneOrientationSequence", "ImageOrientationPatient")
    position = _functional(ds, "PlanePositionSequence", "ImagePositionPatient")
    try:
        instance = int(ds.InstanceNumber) if ds.get("InstanceNumber") not in (None, "") else None
    except (TypeError, ValueError):
        instance = None
    return DicomImage(
        label=label,
        ds=ds,
        transfer_syntax=ts,
        series_uid=str(ds.SeriesInstanceUID) if ds.get("SeriesInstanceUID") else None,
        study_uid=str(ds.StudyInstanceUID) if ds.get("StudyInstanceUID") else None,
        modality=str(ds.get("Modality") or "OT").strip().upper() or "OT",
        rows=rows,
        columns=columns,
        frames=frames,
        samples=int(ds.get("SamplesPerPixel", 1) or 1),
        photometric=str(ds.get("PhotometricInterpretation", "MONOCHROME2") or "MONOCHROME2").strip().upper(),
        instance_number=instance,
        orientation=_vector(orientation, 6),
        position=_vector(position, 3),
    )


def _vector(value: Any, n: int) -> np.ndarray | None:
    if value is None:
        return None
    try:
        vec = np.array([float(v) for v in value], dtype=np.float64)
    except (TypeError, ValueError):
        return None
    return vec if vec.shape == (n,) and np.all(np.isfinite(vec)) else None


def _check_decoder(ts: UID, label: str) -> None:
    if not ts.is_transfer_syntax:
        raise UnsupportedTransferSyntaxError(f"unknown transfer syntax {ts}", label)
    try:
        decoder = px.get_decoder(ts)
    except NotImplementedError:
        raise UnsupportedTransferSyntaxError(f"unsupported transfer syntax {ts.name} ({ts})", label) from None
    if not decoder.is_available:
        raise UnsupportedTransferSyntaxError(
            f"unsupported transfer syntax {ts.name} ({ts}): no decoder for it is installed", label
        )


@dataclass
class Decoded:
    """Stored values of one object (n, H, W) plus what turns them into display values."""

    stored: np.ndarray
    slope: float
    intercept: float
    center: float | None
    width: float | None
    photometric: str
    voi_lut: bool  # stored values already went through the object's VOI LUT and are scaled to [0, 1]
    notes: list[str]


def decode_image(img: DicomImage) -> Decoded:
    """Decode pixels and collect the modality LUT and VOI to apply; undecodable data is a StudyError."""
    ds, ts, label = img.ds, img.transfer_syntax, img.label
    if not ts.is_compressed and "PixelData" in ds:
        bits = int(ds.get("BitsAllocated", 8) or 8)
        expected = (img.rows * img.columns * img.frames * img.samples * bits + 7) // 8
        got = len(ds.PixelData or b"")
        if got < expected:
            raise StudyError(f"truncated DICOM: pixel data holds {got} of {expected} bytes", label)
    try:
        arr = ds.pixel_array
    except MemoryError:
        raise
    except Exception as err:  # decoders raise anything from ValueError to RuntimeError on bad data
        raise StudyError(f"cannot decode {ts.name} ({ts}) pixel data: {_short(err)}", label) from None
    arr = np.asarray(arr)
    if img.frames == 1:  # pydicom drops the frame axis of a single frame
        arr = arr[None]
    if arr.ndim != 3 + (img.samples > 1):
        raise StudyError(f"decoded pixel data has an unexpected shape {arr.shape}", label)
    notes: list[str] = []
    photometric = img.photometric
    if photometric == "PALETTE COLOR":
        try:
            arr = px.apply_color_lut(arr, ds)
        except Exception as err:
            raise StudyError(f"cannot apply the palette colour LUT: {_short(err)}", label) from None
        photometric = "RGB"
    elif img.samples == 3:
        photometric = "RGB"  # pydicom converts YBR to RGB while decoding
    if arr.shape[1:3] != (img.rows, img.columns):
        raise StudyError(
            f"decoded pixel data is {arr.shape[1]}x{arr.shape[2]}, header says {img.rows}x{img.columns}", label
        )

    slope = _float(_functional(ds, "PixelValueTransformationSequence", "RescaleSlope"))
    intercept = _float(_functional(ds, "PixelValueTransformationSequence", "RescaleIntercept"))
    slope = 1.0 if slope is None or slope == 0 else slope
    intercept = 0.0 if intercept is None else intercept
    if "ModalityLUTSequence" in ds and photometric != "RGB":
        arr = px.apply_modality_lut(arr, ds).astype(np.float32)
        slope, intercept = 1.0, 0.0

    center = _float(_functional(ds, "FrameVOILUTSequence", "WindowCenter"))
    width = _float(_functional(ds, "FrameVOILUTSequence", "WindowWidth"))
    if center is not None and width is not None and width < 1:
        notes.append(f"ignored a window width below 1 in {Path(label).name}")
        center = width = None
    if center is None or width is None:
        center = width = None
    voi_lut = False
    if center is None and "VOILUTSequence" in ds and photometric != "RGB":
        try:
            values = arr.astype(np.float32) * np.float32(slope) + np.float32(intercept)
            out = px.apply_voi(values, ds, index=0)
            bits = int(ds.VOILUTSequence[0].LUTDescriptor[2])
            arr = np.clip(out.astype(np.float32) / np.float32(2**bits - 1), 0, 1)
            slope, intercept, voi_lut = 1.0, 0.0, True
        except Exception as err:
            notes.append(f"ignored an unusable VOI LUT in {Path(label).name}: {_short(err)}")
    return Decoded(arr, slope, intercept, center, width, photometric, voi_lut, notes)


def header_meta(img: DicomImage) -> dict[str, Any]:
    """Non-identifying facts for `Study.meta`."""
    ds = img.ds
    spacing = _functional(ds, "PixelMeasuresSequence", "PixelSpacing") or ds.get("ImagerPixelSpacing")
    spacing_vec = _vector(spacing, 2) if spacing is not None else None
    thickness = _float(_functional(ds, "PixelMeasuresSequence", "SliceThickness"))
    fps = None
    frame_time = _float(_functional(ds, "CineSequence", "FrameTime") or ds.get("FrameTime"))
    if frame_time and frame_time > 0:
        fps = round(1000.0 / frame_time, 3)
    elif _float(ds.get("CineRate")):
        fps = _float(ds.get("CineRate"))
    elif _float(ds.get("RecommendedDisplayFrameRate")):
        fps = _float(ds.get("RecommendedDisplayFrameRate"))
    return {
        "rows": img.rows,
        "columns": img.columns,
        "transfer_syntax": str(img.transfer_syntax),
        "transfer_syntax_name": img.transfer_syntax.name,
        "photometric": img.photometric,
        "bits_stored": int(ds.get("BitsStored", 0) or 0) or None,
        "pixel_spacing": [float(v) for v in spacing_vec] if spacing_vec is not None else None,
        "slice_thickness": thickness,
        "fps": fps,
    }

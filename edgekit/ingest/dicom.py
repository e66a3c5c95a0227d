"""One DICOM object -> header facts and decoded stored values.

Split from series assembly so a folder can be checked (series, sizes, limits, order) from headers before any
pixel data is decoded, and so every failure names the one file that caused it.
"""

from __future__ import annotations

import io
import struct
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pydicom
import pydicom.pixels as px
from pydicom.dataset import Dataset
from pydicom.errors import InvalidDicomError
from pydicom.uid import (
    UID,
    DeflatedExplicitVRLittleEndian,
    ExplicitVRBigEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    MediaStorageDirectoryStorage,
)

from edgekit.errors import StudyError, StudyTooLargeError, UnsupportedTransferSyntaxError
from edgekit.ingest import budget
from edgekit.ingest.budget import inflate_limit, mib
from edgekit.ingest.phi import captured_warnings, held_log_messages, scrub
from edgekit.ingest.study import IngestLimits

_PIXEL_TAGS = ("PixelData", "FloatPixelData", "DoubleFloatPixelData")
_PIXEL_TAG_NUMBERS = (0x7FE00010, 0x7FE00008, 0x7FE00009)


class NotDicom(Exception):
    """Raised by `read_dataset` for bytes that are not DICOM at all (the caller decides: skip or fail)."""


class DicomDirectory(Exception):
    """Raised by `read_dataset` for a DICOMDIR media directory, which series folders may carry and we ignore."""


class SliceError(StudyError):
    """One object of a series is unusable (unreadable, truncated, not an image, undecodable).

    A folder or zip goes on without it and says so in `Study.warnings`; a single file fails with it. The slice is
    named by `instance` (InstanceNumber, when its header could be read), never by file name: file names of real
    exports carry patient names, while `path` (for the error a caller sees) keeps the file.
    """

    def __init__(self, reason: str, path: str | Path | None = None, *, instance: int | None = None):
        super().__init__(reason, path)
        self.instance = instance


def _label_parts(label: str) -> tuple[str, ...]:
    """The label, its file name and (for a zip entry `archive!member`) both halves: what scrub must redact."""
    parts = [label, PurePosixPath(label.replace("\\", "/")).name]
    if "!" in label:
        parts.extend(label.split("!", 1))
    return tuple(p for p in parts if p)


def short_reason(err: BaseException | str, label: str = "") -> str:
    """An exception's text on one line (decoders list one reason per plugin), capped, without paths or values."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = "; ".join(lines) if lines else type(err).__name__
    text = scrub(text, _label_parts(label) if label else ())
    return text if len(text) <= 300 else text[:297] + "..."


def _instance_of(ds: Dataset | None) -> int | None:
    try:
        value = ds.get("InstanceNumber") if ds is not None else None
        return int(value) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None


def read_dataset(source: Path | bytes, label: str, *, max_inflated: int | None = None) -> Dataset:
    """Parse a whole DICOM object; `label` names it in errors. Raises NotDicom / DicomDirectory / SliceError, and
    StudyTooLargeError for a Deflated object that inflates past `max_inflated` bytes (default: a quarter of the
    default ingest budget), counted before pydicom inflates it.

    pydicom meets a file cut short inside encapsulated pixel data with a warning and an empty dataset; the header
    is then read again on its own, so the error says "truncated" and which slice, not "no pixel data".
    """
    try:
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
    except IsADirectoryError:
        raise NotDicom(label) from None
    except PermissionError:
        raise StudyError("permission denied", label) from None
    except OSError as err:
        raise StudyError(f"cannot read the file ({type(err).__name__})", label) from None
    _check_inflated_size(data, inflate_limit(None) if max_inflated is None else max_inflated, label)
    with held_log_messages() as logged, captured_warnings() as caught:
        try:
            ds = pydicom.dcmread(io.BytesIO(data))
            ds.buffer = None  # pydicom keeps the file's bytes for deferred reads (none here): a second copy
            failure = None
        except InvalidDicomError:
            raise NotDicom(label) from None
        except (EOFError, OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, OverflowError) as err:
            ds, failure = None, err
    messages = list(
        dict.fromkeys([short_reason(w, label) for w in caught.raw] + [short_reason(m, label) for m in logged])
    )
    eof = any("End of file reached" in m for m in messages)
    if failure is not None or eof or (ds is not None and not any(tag in ds for tag in _PIXEL_TAGS)):
        header, truncation = _pixel_truncation(data)
        if truncation is not None:
            raise SliceError(f"truncated inside its pixel data: {truncation}", label, instance=_instance_of(header))
        if failure is not None:
            reason = f"unreadable or truncated DICOM ({type(failure).__name__}: {short_reason(failure, label)})"
            raise SliceError(reason, label, instance=_instance_of(header)) from None
        if eof:
            raise SliceError("truncated DICOM: the file ends inside an element", label, instance=_instance_of(header))
    assert ds is not None  # a failed read (`failure`) raised above
    for message in messages:  # pydicom's notes on an object we keep: passed on without paths or values
        warnings.warn(message, UserWarning, stacklevel=2)
    sop_class = ds.file_meta.get("MediaStorageSOPClassUID") if hasattr(ds, "file_meta") else None
    if sop_class == MediaStorageDirectoryStorage or "DirectoryRecordSequence" in ds:
        raise DicomDirectory(label)
    return ds


_DEFLATED = str(DeflatedExplicitVRLittleEndian).encode("ascii")


def _check_inflated_size(data: bytes, limit: int, label: str) -> None:
    """A Deflated Explicit VR Little Endian object inflated in 1 MiB steps and counted, nothing kept: pydicom would
    inflate the whole dataset before any check (a 1 MB part can hold a gibibyte). Past `limit` it is refused."""
    if data[128:132] != b"DICM" or _DEFLATED not in data:  # only a Part 10 file's meta can say Deflated
        return
    fp = io.BytesIO(data)
    try:
        pydicom.filereader.read_preamble(fp, False)
        meta = pydicom.filereader._read_file_meta_info(fp)
    except Exception:  # not a Part 10 file: pydicom's own read says what is wrong
        return
    if meta.get("TransferSyntaxUID") != DeflatedExplicitVRLittleEndian:
        return
    inflater = zlib.decompressobj(-zlib.MAX_WBITS)
    view, pos, total = memoryview(data), fp.tell(), 0
    chunk: bytes | memoryview
    try:
        while not inflater.eof:
            if inflater.unconsumed_tail:
                chunk = inflater.unconsumed_tail
            elif pos < len(data):
                chunk, pos = view[pos : pos + (1 << 16)], pos + (1 << 16)
            else:
                break
            total += len(inflater.decompress(chunk, 1 << 20))
            if total > limit:
                raise StudyTooLargeError(
                    f"its Deflated dataset inflates past {mib(limit)}, more than a quarter of the ingest memory "
                    "budget ([limits] ingest_memory_bytes)",
                    label,
                )
    except zlib.error:
        return  # corrupt: pydicom's read fails on it and says so


def _pixel_truncation(data: bytes) -> tuple[Dataset | None, str | None]:
    """Read the header alone; when the file holds a pixel data element cut short, say how (else None)."""
    fp = io.BytesIO(data)
    try:
        with captured_warnings():  # the first read already reported what pydicom had to say
            header = pydicom.dcmread(fp, stop_before_pixels=True)
    except Exception:
        return None, None
    start = fp.tell()
    ts = _transfer_syntax(header)
    if ts == pydicom.uid.DeflatedExplicitVRLittleEndian or start + 8 > len(data):
        return header, None
    little = ts != ExplicitVRBigEndian
    endian = "<" if little else ">"
    group, element = struct.unpack(endian + "HH", data[start : start + 4])
    if (group, element) not in ((0x7FE0, 0x0010), (0x7FE0, 0x0008), (0x7FE0, 0x0009)):
        return header, None
    if ts == ImplicitVRLittleEndian:
        (length,) = struct.unpack("<I", data[start + 4 : start + 8])
        value = start + 8
    elif data[start + 4 : start + 6] in (b"OB", b"OW", b"OF", b"OD", b"UN", b"OL", b"OV"):
        if start + 12 > len(data):
            return header, "the file ends in the pixel data element's header"
        (length,) = struct.unpack(endian + "I", data[start + 8 : start + 12])
        value = start + 12
    else:
        (length,) = struct.unpack(endian + "H", data[start + 6 : start + 8])
        value = start + 8
    present = len(data) - value
    if length != 0xFFFFFFFF:
        return header, (f"{present} of {length} bytes of pixel data present" if present < length else None)
    # Encapsulated: items (FFFE,E000) with lengths, then the sequence delimiter (FFFE,E0DD).
    pos = value
    while pos + 8 <= len(data):
        tag = struct.unpack(endian + "HH", data[pos : pos + 4])
        (item_length,) = struct.unpack(endian + "I", data[pos + 4 : pos + 8])
        if tag == (0xFFFE, 0xE0DD):
            return header, None
        if tag != (0xFFFE, 0xE000):
            return header, f"encapsulated pixel data breaks off after {pos - value} bytes (no item tag)"
        if pos + 8 + item_length > len(data):
            expected = pos + 8 + item_length - value
            return header, f"{present} of at least {expected} bytes of encapsulated pixel data present"
        pos += 8 + item_length
    return header, f"the file ends after {present} bytes of encapsulated pixel data, before its end marker"


def _first(value: Any) -> Any:
    if isinstance(value, (list, tuple, pydicom.multival.MultiValue)):
        return value[0] if len(value) else None
    return value


def functional_attr(ds: Dataset, seq: str, attr: str) -> Any:
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


def as_float(value: Any) -> float | None:
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
    bits_allocated: int = 8
    encoded_bytes: int = 0  # the pixel data element's length, held while the object decodes
    held_bytes: int = 0  # what `ds` holds in memory while the series waits (budget.header_bytes + pixel data)
    ordinal: int | None = None  # 1-based place among the DICOM files of a folder or zip (None: a single file)
    of: int | None = None  # how many DICOM files that folder or zip held
    # Reads the whole object again for decoding, when `ds` holds only its header (a folder's or zip's objects are
    # checked and costed from headers; their pixel data is read back one object at a time): None, `ds` is whole.
    reload: Callable[[], Dataset] | None = None

    @property
    def slice_name(self) -> str:
        """How warnings name this object: by InstanceNumber, else by place, never by file name."""
        return slice_name(self.instance_number, self.ordinal, self.of)


def slice_name(instance: int | None, ordinal: int | None = None, of: int | None = None) -> str:
    if instance is not None:
        return f"InstanceNumber {instance}"
    if ordinal is not None:
        return f"file {ordinal} of {of}" if of else f"file {ordinal}"
    return "the image"


def inspect_image(ds: Dataset, label: str, limits: IngestLimits) -> DicomImage:
    """Check one object has decodable-looking pixel data within limits; no pixels are decoded here.

    A broken object is a `SliceError` (a series can do without it); a limit exceeded is a plain `StudyError`.
    """
    instance = _instance_of(ds)
    if not any(tag in ds for tag in _PIXEL_TAGS):
        raise SliceError("no pixel data (not an image object)", label, instance=instance)
    try:
        rows = int(ds.Rows)
        columns = int(ds.Columns)
    except (AttributeError, TypeError, ValueError):
        raise SliceError("pixel data without valid Rows/Columns", label, instance=instance) from None
    if rows < 1 or columns < 1:
        raise SliceError(f"invalid image size {rows}x{columns}", label, instance=instance)
    if rows * columns > limits.max_pixels:
        raise StudyError(f"frame of {rows}x{columns} pixels exceeds the limit of {limits.max_pixels} pixels", label)
    try:
        frames = int(_first(ds.get("NumberOfFrames", 1)) or 1)
    except (TypeError, ValueError):
        # Guessing one frame would read the pixel data with a layout the header does not state.
        raise SliceError("malformed header: NumberOfFrames is not an integer", label, instance=instance) from None
    if frames < 1:
        raise SliceError(f"invalid NumberOfFrames {frames}", label, instance=instance)
    if frames > limits.max_frames:
        raise StudyError(f"{frames} frames exceed the limit of {limits.max_frames}", label)
    ts = _transfer_syntax(ds)
    _check_decoder(ts, label)
    orientation = functional_attr(ds, "PlaneOrientationSequence", "ImageOrientationPatient")
    position = functional_attr(ds, "PlanePositionSequence", "ImagePositionPatient")
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
        bits_allocated=_bits_allocated(ds),
        encoded_bytes=(encoded := max(len(ds[tag].value or b"") for tag in _PIXEL_TAGS if tag in ds)),
        held_bytes=budget.header_bytes(ds, _PIXEL_TAG_NUMBERS) + encoded,
    )


def _bits_allocated(ds: Dataset) -> int:
    try:
        return max(1, int(ds.get("BitsAllocated", 8) or 8))
    except (TypeError, ValueError):
        return 8


def drop_pixels(img: DicomImage, reload: Callable[[], Dataset]) -> None:
    """Keep only `img`'s public header in memory; `reload` reads the object again when it is its turn to decode."""
    for tag in _PIXEL_TAGS:
        if tag in img.ds:
            del img.ds[tag]
    img.ds.remove_private_tags()  # ingest reads none; the SR's evidence is read from the files
    img.held_bytes = budget.header_bytes(img.ds)
    img.reload = reload


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


def header_meta(img: DicomImage) -> dict[str, Any]:
    """Non-identifying facts for `Study.meta`."""
    ds = img.ds
    spacing = functional_attr(ds, "PixelMeasuresSequence", "PixelSpacing") or ds.get("ImagerPixelSpacing")
    spacing_vec = _vector(spacing, 2) if spacing is not None else None
    thickness = as_float(functional_attr(ds, "PixelMeasuresSequence", "SliceThickness"))
    fps = None
    frame_time = as_float(functional_attr(ds, "CineSequence", "FrameTime") or ds.get("FrameTime"))
    if frame_time and frame_time > 0:
        fps = round(1000.0 / frame_time, 3)
    elif as_float(ds.get("CineRate")):
        fps = as_float(ds.get("CineRate"))
    elif as_float(ds.get("RecommendedDisplayFrameRate")):
        fps = as_float(ds.get("RecommendedDisplayFrameRate"))
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

"""One DICOM object -> header facts and decoded stored values.

Split from series assembly so a folder can be checked (series, sizes, limits, order) from headers before any
pixel data is decoded, and so every failure names the one file that caused it.
"""

from __future__ import annotations

import io
import struct
import warnings
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
    ExplicitVRBigEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    JPEG2000TransferSyntaxes,
    JPEGExtended12Bit,
    MediaStorageDirectoryStorage,
)

from edgekit.errors import StudyError, UnsupportedTransferSyntaxError
from edgekit.ingest.phi import held_log_messages, scrub
from edgekit.ingest.study import IngestLimits

_PIXEL_TAGS = ("PixelData", "FloatPixelData", "DoubleFloatPixelData")


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


def _short(err: BaseException | str, label: str = "") -> str:
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


def read_dataset(source: Path | bytes, label: str) -> Dataset:
    """Parse a whole DICOM object; `label` names it in errors. Raises NotDicom / DicomDirectory / SliceError.

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
    with held_log_messages() as logged, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ds = pydicom.dcmread(io.BytesIO(data))
            failure = None
        except InvalidDicomError:
            raise NotDicom(label) from None
        except (EOFError, OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, OverflowError) as err:
            ds, failure = None, err
    messages = list(dict.fromkeys([_short(w.message, label) for w in caught] + [_short(m, label) for m in logged]))
    eof = any("End of file reached" in m for m in messages)
    if failure is not None or eof or (ds is not None and not any(tag in ds for tag in _PIXEL_TAGS)):
        header, truncation = _pixel_truncation(data)
        if truncation is not None:
            raise SliceError(f"truncated inside its pixel data: {truncation}", label, instance=_instance_of(header))
        if failure is not None:
            reason = f"unreadable or truncated DICOM ({type(failure).__name__}: {_short(failure, label)})"
            raise SliceError(reason, label, instance=_instance_of(header)) from None
        if eof:
            raise SliceError("truncated DICOM: the file ends inside an element", label, instance=_instance_of(header))
    for message in messages:  # pydicom's notes on an object we keep: passed on without paths or values
        warnings.warn(message, UserWarning, stacklevel=2)
    sop_class = ds.file_meta.get("MediaStorageSOPClassUID") if hasattr(ds, "file_meta") else None
    if sop_class == MediaStorageDirectoryStorage or "DirectoryRecordSequence" in ds:
        raise DicomDirectory(label)
    return ds


def _pixel_truncation(data: bytes) -> tuple[Dataset | None, str | None]:
    """Read the header alone; when the file holds a pixel data element cut short, say how (else None)."""
    fp = io.BytesIO(data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
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
    ordinal: int | None = None  # 1-based place among the DICOM files of a folder or zip (None: a single file)
    of: int | None = None  # how many DICOM files that folder or zip held

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
    orientation = _functional(ds, "PlaneOrientationSequence", "ImageOrientationPatient")
    position = _functional(ds, "PlanePositionSequence", "ImagePositionPatient")
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


def _expected_bytes(img: DicomImage, bits: int) -> int:
    """Native pixel data length; YBR_FULL_422 stores two samples per pixel, not three (PS3.3 C.7.6.3.1.2)."""
    samples = 2 if img.samples == 3 and img.photometric == "YBR_FULL_422" else img.samples
    return (img.rows * img.columns * img.frames * samples * bits + 7) // 8


def _j2k_size(ds: Dataset) -> tuple[int, int] | None:
    """(columns, rows) a JPEG 2000 codestream's SIZ marker declares for the first frame, when it has one."""
    try:
        frame = next(pydicom.encaps.generate_frames(ds.PixelData, number_of_frames=1))
    except Exception:
        return None
    if len(frame) < 24 or frame[:4] != b"\xff\x4f\xff\x51":  # SOC then SIZ (a JP2 wrapper is left alone)
        return None
    xsiz, ysiz, xosiz, yosiz = struct.unpack(">IIII", frame[8:24])
    return xsiz - xosiz, ysiz - yosiz


def _gdcm_12bit(img: DicomImage) -> np.ndarray | None:
    """12-bit JPEG Extended (1.2.840.10008.1.2.4.51) decoded by python-gdcm, frame by frame.

    pydicom's GDCM plugin declines 12-bit precision outright, and its only other decoder for it (pylibjpeg-libjpeg)
    is GPL, which we do not ship. GDCM itself decodes these (its IJG 12-bit codec). Greyscale only; None when
    GDCM is missing or the object is colour, so pydicom's refusal stands.
    """
    try:
        import gdcm
    except ImportError:
        return None
    ds = img.ds
    if img.samples != 1:
        return None
    signed = int(ds.get("PixelRepresentation", 0) or 0) == 1
    bits_stored = int(ds.get("BitsStored", 12) or 12)
    out = np.empty((img.frames, img.rows, img.columns), dtype=np.int16 if signed else np.uint16)
    for k, frame in enumerate(pydicom.encaps.generate_frames(ds.PixelData, number_of_frames=img.frames)):
        if k >= img.frames:
            break
        fragment = gdcm.Fragment()
        fragment.SetByteStringValue(frame)
        fragments = gdcm.SequenceOfFragments.New()
        fragments.AddFragment(fragment)
        element = gdcm.DataElement(gdcm.Tag(0x7FE0, 0x0010))
        element.SetValue(fragments.__ref__())
        image = gdcm.Image()
        image.SetNumberOfDimensions(2)
        image.SetDimensions((img.columns, img.rows, 1))
        image.SetDataElement(element)
        pi = gdcm.PhotometricInterpretation.GetPIType(img.photometric)
        image.SetPhotometricInterpretation(gdcm.PhotometricInterpretation(pi))
        image.SetTransferSyntax(gdcm.TransferSyntax(gdcm.TransferSyntax.JPEGExtendedProcess2_4))
        image.SetPixelFormat(gdcm.PixelFormat(1, 16, bits_stored, bits_stored - 1, int(signed)))
        raw = image.GetBuffer().encode("utf-8", "surrogateescape")  # GDCM hands back char* as str
        if len(raw) != img.rows * img.columns * 2:
            raise StudyError(f"GDCM decoded {len(raw)} bytes, the header implies {img.rows * img.columns * 2}")
        out[k] = np.frombuffer(raw, dtype="<i2" if signed else "<u2").reshape(img.rows, img.columns)
    return out[0] if img.frames == 1 else out  # pydicom's shape convention, which the caller expects


def decode_image(img: DicomImage) -> Decoded:
    """Decode pixels and collect the modality LUT and VOI to apply; undecodable data is a SliceError.

    `notes` are the decoder fallbacks taken and values changed, as reasons without the slice's name: the series
    assembler groups them per reason and names the slices.
    """
    ds, ts, label = img.ds, img.transfer_syntax, img.label
    notes: list[str] = []

    def fail(reason: str) -> SliceError:
        return SliceError(reason, label, instance=img.instance_number)

    bits = int(ds.get("BitsAllocated", 8) or 8)
    if not ts.is_compressed and "PixelData" in ds:
        expected = _expected_bytes(img, bits)
        got = len(ds.PixelData or b"")
        if got < expected:
            raise fail(f"truncated inside its pixel data: {got} of {expected} bytes of pixel data present")
    if ts in JPEG2000TransferSyntaxes and "PixelData" in ds:
        size = _j2k_size(ds)
        if size is not None and size != (img.columns, img.rows):
            raise fail(
                f"corrupt JPEG 2000 codestream: it declares a {size[0]}x{size[1]} image, the header "
                f"{img.columns}x{img.rows}"
            )
    arr = None
    twelve_bit = ts == JPEGExtended12Bit and int(ds.get("BitsStored", 8) or 8) > 8
    if twelve_bit:
        try:
            arr = _gdcm_12bit(img)
        except MemoryError:
            raise
        except Exception as err:
            raise fail(f"cannot decode 12-bit {ts.name} ({ts}) pixel data with GDCM: {_short(err, label)}") from None
        if arr is not None:
            notes.append("12-bit JPEG Extended decoded by GDCM directly (pydicom's GDCM plugin declines 12-bit)")
    if arr is None:
        try:
            arr = ds.pixel_array
        except MemoryError:
            raise
        except Exception as err:  # decoders raise anything from ValueError to RuntimeError on bad data
            reason = f"cannot decode {ts.name} ({ts}) pixel data: {_short(err, label)}"
            if twelve_bit:
                reason += " (12-bit colour JPEG needs pylibjpeg-libjpeg, which is GPL and not used here)"
            raise fail(reason) from None
    arr = np.asarray(arr)
    if img.frames == 1:  # pydicom drops the frame axis of a single frame
        arr = arr[None]
    if arr.ndim != 3 + (img.samples > 1):
        raise fail(f"decoded pixel data has an unexpected shape {arr.shape}")
    photometric = img.photometric
    if photometric == "PALETTE COLOR":
        try:
            arr = px.apply_color_lut(arr, ds)
        except Exception as err:
            raise fail(f"cannot apply the palette colour LUT: {_short(err, label)}") from None
        photometric = "RGB"
    elif img.samples == 3:
        photometric = "RGB"  # pydicom converts YBR to RGB while decoding
    if arr.shape[1:3] != (img.rows, img.columns):
        raise fail(f"decoded pixel data is {arr.shape[1]}x{arr.shape[2]}, header says {img.rows}x{img.columns}")

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
        notes.append("ignored a window width below 1")
        center = width = None
    if center is None or width is None:
        center = width = None
    voi_lut = False
    if center is None and "VOILUTSequence" in ds and photometric != "RGB":
        try:
            values = arr.astype(np.float32) * np.float32(slope) + np.float32(intercept)
            out = px.apply_voi(values, ds, index=0)
            lut_bits = int(ds.VOILUTSequence[0].LUTDescriptor[2])
            scaled = out.astype(np.float32) / np.float32(2**lut_bits - 1)
            outside = int(np.count_nonzero((scaled < 0) | (scaled > 1)))
            arr = np.clip(scaled, 0, 1)
            slope, intercept, voi_lut = 1.0, 0.0, True
            if outside:
                notes.append(f"clamped {outside} VOI LUT output value(s) beyond the LUT's {lut_bits}-bit range")
        except Exception as err:
            notes.append(f"ignored an unusable VOI LUT: {_short(err, label)}")
    if arr.dtype.kind == "f":
        bad = int(np.count_nonzero(~np.isfinite(arr)))
        if bad:  # to_display would map them to 0 without a word
            arr = np.nan_to_num(arr, nan=0.0, posinf=0.0, neginf=0.0)
            notes.append(f"replaced {bad} non-finite (NaN or infinite) pixel value(s) with 0")
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

"""Decoding one DICOM image's pixel data into stored values, with the modality LUT and VOI to apply.

Split from header reading (`dicom.py`) because decoding is where transfer syntaxes, decoder plug-ins (pydicom's,
GDCM for 12-bit JPEG) and truncation inside pixel data are handled; a series is checked from headers first and
decoded only when it is consistent.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import pydicom
import pydicom.pixels as px
from pydicom.dataset import Dataset
from pydicom.uid import JPEG2000TransferSyntaxes, JPEGExtended12Bit

from edgekit.errors import StudyError
from edgekit.ingest.dicom import DicomImage, SliceError, as_float, functional_attr, short_reason


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
            raise fail(
                f"cannot decode 12-bit {ts.name} ({ts}) pixel data with GDCM: {short_reason(err, label)}"
            ) from None
        if arr is not None:
            notes.append("12-bit JPEG Extended decoded by GDCM directly (pydicom's GDCM plugin declines 12-bit)")
    if arr is None:
        try:
            arr = ds.pixel_array
        except MemoryError:
            raise
        except Exception as err:  # decoders raise anything from ValueError to RuntimeError on bad data
            reason = f"cannot decode {ts.name} ({ts}) pixel data: {short_reason(err, label)}"
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
            raise fail(f"cannot apply the palette colour LUT: {short_reason(err, label)}") from None
        photometric = "RGB"
    elif img.samples == 3:
        photometric = "RGB"  # pydicom converts YBR to RGB while decoding
    if arr.shape[1:3] != (img.rows, img.columns):
        raise fail(f"decoded pixel data is {arr.shape[1]}x{arr.shape[2]}, header says {img.rows}x{img.columns}")

    slope = as_float(functional_attr(ds, "PixelValueTransformationSequence", "RescaleSlope"))
    intercept = as_float(functional_attr(ds, "PixelValueTransformationSequence", "RescaleIntercept"))
    slope = 1.0 if slope is None or slope == 0 else slope
    intercept = 0.0 if intercept is None else intercept
    if "ModalityLUTSequence" in ds and photometric != "RGB":
        arr = px.apply_modality_lut(arr, ds).astype(np.float32)
        slope, intercept = 1.0, 0.0

    center = as_float(functional_attr(ds, "FrameVOILUTSequence", "WindowCenter"))
    width = as_float(functional_attr(ds, "FrameVOILUTSequence", "WindowWidth"))
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
            notes.append(f"ignored an unusable VOI LUT: {short_reason(err, label)}")
    if arr.dtype.kind == "f":
        bad = int(np.count_nonzero(~np.isfinite(arr)))
        if bad:  # to_display would map them to 0 without a word
            arr = np.nan_to_num(arr, nan=0.0, posinf=0.0, neginf=0.0)
            notes.append(f"replaced {bad} non-finite (NaN or infinite) pixel value(s) with 0")
    return Decoded(arr, slope, intercept, center, width, photometric, voi_lut, notes)

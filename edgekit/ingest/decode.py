"""Decoding one DICOM image's pixel data into stored values, frame by frame, with the modality LUT and VOI to apply.

Split from header reading (`dicom.py`) because decoding is where transfer syntaxes, decoder plug-ins (pydicom's;
Pillow's OpenJPEG first for JPEG 2000; GDCM for 12-bit JPEG) and truncation inside pixel data are handled; a series
is checked from headers first and decoded only when it is consistent. Frames come one at a time (`Decoded.frames`),
so a multi-frame object never exists whole in memory: the series assembler writes each into the study's display
array (`budget.py`).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pydicom
import pydicom.pixels as px
from pydicom.dataset import Dataset
from pydicom.pixels.decoders.base import get_decoder
from pydicom.uid import UID, JPEG2000TransferSyntaxes, JPEGExtended12Bit

from edgekit.errors import StudyError
from edgekit.ingest.dicom import DicomImage, SliceError, as_float, functional_attr, short_reason
from edgekit.ingest.phi import held_log_messages


@dataclass
class Window:
    """How one object's stored values become display values, read from its headers alone (no pixel decoded)."""

    slope: float
    intercept: float
    center: float | None
    width: float | None
    photometric: str  # after decoding: colour objects are RGB
    voi_lut: bool  # its VOI LUT is applied while decoding; values then come scaled to [0, 1]
    modality_lut: bool
    notes: list[str] = field(default_factory=list)

    @property
    def per_object(self) -> bool:
        """The object carries its own rendering (a window or a VOI LUT)."""
        return self.center is not None or self.voi_lut


@dataclass
class Decoded:
    """An object's stored values, one (H, W[, 3]) frame at a time, and what turns them into display values.

    `notes` (decoder fallbacks taken, values changed) is complete once `frames` is exhausted."""

    frames: Iterator[np.ndarray]
    window: Window
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


def _gdcm_available(img: DicomImage) -> bool:
    if img.samples != 1:
        return False
    try:
        import gdcm  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _pillow_decodes(ts: UID) -> bool:
    try:
        return "pillow" in get_decoder(ts).available_plugins
    except (NotImplementedError, ValueError):
        return False


def _pillow_takes(img: DicomImage, ds: Dataset) -> bool:
    """Pillow's plugin declines more than 16 bits, and more than 8 in several samples; and Pillow warns about (past
    twice the size refuses) images above `Image.MAX_IMAGE_PIXELS`, which edgekit's budget has costed from the
    headers already. Those frames go straight to pydicom's order: every plugin that fails is logged, and pydicom's
    log lines become the study's warnings."""
    from PIL import Image

    bits = int(ds.get("BitsStored", 16) or 16)
    limit = Image.MAX_IMAGE_PIXELS
    return (
        _pillow_decodes(img.transfer_syntax)
        and bits <= (16 if img.samples == 1 else 8)
        and (limit is None or img.rows * img.columns <= limit)
    )


def _gdcm_12bit(img: DicomImage, ds: Dataset) -> Iterator[np.ndarray]:
    """12-bit JPEG Extended (1.2.840.10008.1.2.4.51) decoded by python-gdcm, frame by frame.

    pydicom's GDCM plugin declines 12-bit precision outright, and its only other decoder for it (pylibjpeg-libjpeg)
    is GPL, which we do not ship. GDCM itself decodes these (its IJG 12-bit codec). Greyscale only (the caller
    checks `_gdcm_available`), so pydicom's refusal stands for colour.
    """
    import gdcm

    signed = int(ds.get("PixelRepresentation", 0) or 0) == 1
    bits_stored = int(ds.get("BitsStored", 12) or 12)
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
        yield np.frombuffer(raw, dtype="<i2" if signed else "<u2").reshape(img.rows, img.columns)


def _stored_range(ds: Dataset) -> np.ndarray:
    """Every value (up to 65,536 evenly spaced ones) a stored pixel of `ds` can hold, as float32."""
    bits = min(max(int(ds.get("BitsStored", 16) or 16), 1), 32)
    signed = int(ds.get("PixelRepresentation", 0) or 0) == 1
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    return np.linspace(lo, hi, num=min(hi - lo + 1, 65536), dtype=np.float32)[None]


def display_window(img: DicomImage, ds: Dataset) -> Window:
    """The modality LUT and VOI of one object, from its headers: decided before any frame is decoded, so a series
    knows up front whether every object renders itself or the series shares one min-max."""
    notes: list[str] = []
    photometric = "RGB" if img.photometric == "PALETTE COLOR" or img.samples == 3 else img.photometric
    slope = as_float(functional_attr(ds, "PixelValueTransformationSequence", "RescaleSlope"))
    intercept = as_float(functional_attr(ds, "PixelValueTransformationSequence", "RescaleIntercept"))
    slope = 1.0 if slope is None or slope == 0 else slope
    intercept = 0.0 if intercept is None else intercept
    modality_lut = "ModalityLUTSequence" in ds and photometric != "RGB"
    if modality_lut:
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
        try:  # the LUT applied to every value the pixels can hold: a malformed one fails here, before decoding
            px.apply_voi(_stored_range(ds) * np.float32(slope) + np.float32(intercept), ds, index=0)
            int(ds.VOILUTSequence[0].LUTDescriptor[2])
            voi_lut = True
        except Exception as err:
            notes.append(f"ignored an unusable VOI LUT: {short_reason(err, img.label)}")
    return Window(slope, intercept, center, width, photometric, voi_lut, modality_lut, notes)


def decode_image(img: DicomImage, ds: Dataset) -> Decoded:
    """Check the pixel data against the header and set up frame-by-frame decoding of `ds` (the object `img`
    describes, with its pixel data); undecodable data is a SliceError, raised here or while iterating `frames`.

    `notes` are the decoder fallbacks taken and values changed, as reasons without the slice's name: the series
    assembler groups them per reason and names the slices.
    """
    window = display_window(img, ds)
    notes = list(window.notes)
    _check_pixel_data(img, ds)
    twelve_bit = img.transfer_syntax == JPEGExtended12Bit and int(ds.get("BitsStored", 8) or 8) > 8
    use_gdcm = twelve_bit and _gdcm_available(img)
    if use_gdcm:
        notes.append("12-bit JPEG Extended decoded by GDCM directly (pydicom's GDCM plugin declines 12-bit)")
    return Decoded(_FrameDecoder(img, ds, window, notes, twelve_bit, use_gdcm).frames(), window, notes)


def _fail(img: DicomImage, reason: str) -> SliceError:
    return SliceError(reason, img.label, instance=img.instance_number)


def _check_pixel_data(img: DicomImage, ds: Dataset) -> None:
    """What the header alone shows wrong with the pixel data: native data cut short, a JPEG 2000 codestream
    whose size is not the header's."""
    ts = img.transfer_syntax
    bits = int(ds.get("BitsAllocated", 8) or 8)
    if not ts.is_compressed and "PixelData" in ds:
        expected = _expected_bytes(img, bits)
        got = len(ds.PixelData or b"")
        if got < expected:
            raise _fail(img, f"truncated inside its pixel data: {got} of {expected} bytes of pixel data present")
    if ts in JPEG2000TransferSyntaxes and "PixelData" in ds:
        size = _j2k_size(ds)
        if size is not None and size != (img.columns, img.rows):
            raise _fail(
                img,
                f"corrupt JPEG 2000 codestream: it declares a {size[0]}x{size[1]} image, the header "
                f"{img.columns}x{img.rows}",
            )


class _FrameDecoder:
    """One object's frames, decoded one at a time, checked, and taken through its modality LUT and VOI LUT;
    what it changes on the way is counted and added to `notes` once the last frame is out."""

    def __init__(
        self, img: DicomImage, ds: Dataset, window: Window, notes: list[str], twelve_bit: bool, use_gdcm: bool
    ):
        self.img, self.ds, self.window, self.notes = img, ds, window, notes
        self.twelve_bit, self.use_gdcm = twelve_bit, use_gdcm
        self.pillow = img.transfer_syntax in JPEG2000TransferSyntaxes and _pillow_takes(img, ds)
        self.clamped = self.non_finite = 0

    def frames(self) -> Iterator[np.ndarray]:
        img, ds = self.img, self.ds
        # One frame at a time by index: pydicom's iter_pixels() hands out read-only buffers that its own
        # signedness fix-up (J2K_pixelrep_mismatch.dcm) then fails to write to.
        source = _gdcm_12bit(img, ds) if self.use_gdcm else (self._decode(k) for k in range(img.frames))
        count = 0
        while True:
            arr = self._next(source)
            if arr is None:
                break
            count += 1
            if count > img.frames:
                break
            yield self._finite(self._apply_luts(self._checked(np.asarray(arr))))
        if count < img.frames:
            raise _fail(img, f"decoded {count} of the {img.frames} frames the header announces")
        self._add_notes()

    def _decode(self, index: int) -> np.ndarray:
        """Frame `index`'s stored values. JPEG 2000 goes through Pillow's OpenJPEG first: it decodes at the thread
        count edgekit sets (`decode_threads.py`), where GDCM, pydicom's first choice, takes one thread per online CPU,
        and it spends less CPU a frame (`bench/j2k_decoders.py`); lossless, they agree pixel for pixel. Once Pillow
        fails on a frame, this object's frames go through pydicom's order of plugins, as anything else does, which
        names every plugin's reason when none decodes one."""
        if self.pillow:
            # pydicom logs a plugin's failure: Pillow's is no news when another plugin decodes the frame, and when
            # none does, pydicom's error names it. (pydicom's warnings also go by `warnings`, and reach the study.)
            with held_log_messages(quiet=True):
                try:
                    return px.pixel_array(self.ds, index=index, decoding_plugin="pillow")
                except MemoryError:
                    raise
                except Exception:
                    self.pillow = False
        return px.pixel_array(self.ds, index=index)

    def _next(self, source: Iterator) -> np.ndarray | None:
        try:
            return next(source, None)
        except MemoryError:
            raise
        except StudyError as err:
            raise _fail(self.img, err.reason) from None
        except Exception as err:  # decoders raise anything from ValueError to RuntimeError on bad data
            raise self._decoder_error(err) from None

    def _decoder_error(self, err: Exception) -> SliceError:
        ts, label = self.img.transfer_syntax, self.img.label
        if self.use_gdcm:
            return _fail(
                self.img, f"cannot decode 12-bit {ts.name} ({ts}) pixel data with GDCM: {short_reason(err, label)}"
            )
        reason = f"cannot decode {ts.name} ({ts}) pixel data: {short_reason(err, label)}"
        if self.twelve_bit:
            reason += " (12-bit colour JPEG needs pylibjpeg-libjpeg, which is GPL and not used here)"
        return _fail(self.img, reason)

    def _checked(self, arr: np.ndarray) -> np.ndarray:
        """The decoded frame's shape against the header's, after the palette colour LUT."""
        img = self.img
        if arr.ndim != 2 + (img.samples > 1):
            raise _fail(img, f"decoded pixel data has an unexpected shape {arr.shape}")
        if img.photometric == "PALETTE COLOR":
            try:
                arr = px.apply_color_lut(arr, self.ds)
            except Exception as err:
                raise _fail(img, f"cannot apply the palette colour LUT: {short_reason(err, img.label)}") from None
        if arr.shape[:2] != (img.rows, img.columns):
            raise _fail(
                img, f"decoded pixel data is {arr.shape[0]}x{arr.shape[1]}, header says {img.rows}x{img.columns}"
            )
        return arr

    def _apply_luts(self, arr: np.ndarray) -> np.ndarray:
        ds, window = self.ds, self.window
        try:  # checked against the whole stored range up front; a LUT that still fails loses only this slice
            if window.modality_lut:
                arr = px.apply_modality_lut(arr, ds).astype(np.float32)
            if window.voi_lut:
                values = arr.astype(np.float32) * np.float32(window.slope) + np.float32(window.intercept)
                lut_bits = int(ds.VOILUTSequence[0].LUTDescriptor[2])
                scaled = px.apply_voi(values, ds, index=0).astype(np.float32) / np.float32(2**lut_bits - 1)
                self.clamped += int(np.count_nonzero((scaled < 0) | (scaled > 1)))
                arr = np.clip(scaled, 0, 1, out=scaled)
        except Exception as err:
            raise _fail(
                self.img, f"cannot apply its modality or VOI LUT: {short_reason(err, self.img.label)}"
            ) from None
        return arr

    def _finite(self, arr: np.ndarray) -> np.ndarray:
        if arr.dtype.kind == "f":
            bad = int(np.count_nonzero(~np.isfinite(arr)))
            if bad:  # to_display would map them to 0 without a word
                arr = np.nan_to_num(arr, nan=0.0, posinf=0.0, neginf=0.0)
                self.non_finite += bad
        return arr

    def _add_notes(self) -> None:
        if self.clamped:
            lut_bits = int(self.ds.VOILUTSequence[0].LUTDescriptor[2])
            self.notes.append(f"clamped {self.clamped} VOI LUT output value(s) beyond the LUT's {lut_bits}-bit range")
        if self.non_finite:
            self.notes.append(f"replaced {self.non_finite} non-finite (NaN or infinite) pixel value(s) with 0")

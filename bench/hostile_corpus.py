"""The hostile inputs of bench/hostile_inputs.py: small files that decode, inflate or unpack into a lot.

Apart from the bench's harness so that what an input *is* (codec, frame count, bytes on the wire vs bytes decoded)
reads in one place. Every builder writes into a folder the bench owns and returns the path plus the figures the bench
prints. Codec bombs encode one frame of zeros and encapsulate it N times: the bench never holds the decoded volume.
Datasets come from the ingest tests' factory (tests/ingest_factory.py), so they are the same kind the tests read.
"""

from __future__ import annotations

import io
import sys
import uuid
import warnings
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydicom.dataset import Dataset
from pydicom.encaps import encapsulate, generate_frames
from pydicom.filebase import DicomBytesIO
from pydicom.filewriter import write_dataset, write_file_meta_info
from pydicom.uid import (
    DeflatedExplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGBaseline8Bit,
    JPEGLSLossless,
    RLELossless,
    generate_uid,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ingest_factory import make_dataset  # noqa: E402  (the tests' DICOM factory)

SIDE = 4096  # the daemon's default limits.max_pixels is 4096 x 4096 per frame
MiB = 1 << 20


class NoEncoder(Exception):
    """No encoder for a codec is installed here; the text says which package would provide one."""


@dataclass
class Made:
    """A built input: where it is, its size on the wire, what it becomes once decoded, how it was made."""

    path: Path
    wire_bytes: int
    decoded_bytes: int
    how: str
    extra: dict = field(default_factory=dict)

    def describe(self) -> str:
        return f"{self.wire_bytes / 1024:.0f} KiB -> {self.decoded_bytes / MiB:.0f} MiB decoded; {self.how}"


# --- codec bombs ------------------------------------------------------------------------------------------------
CODECS = {
    # name: (transfer syntax, pydicom encoding plugin or None for Pillow, the package it needs)
    "jpegls": (JPEGLSLossless, "pyjpegls", "pyjpegls"),
    "rle": (RLELossless, "pydicom", "pydicom"),
    "j2k": (JPEG2000Lossless, "pylibjpeg", "pylibjpeg-openjpeg"),
    "jpeg": (JPEGBaseline8Bit, None, "Pillow"),
}


def _one_frame(codec: str, ds: Dataset, pixels: np.ndarray) -> tuple[bytes, str]:
    """One compressed frame of `pixels` in `codec` and the words for the encoder that made it."""
    ts, plugin, package = CODECS[codec]
    if plugin is None:  # JPEG baseline: pydicom has no encoder for it; Pillow's libjpeg does 8-bit baseline
        try:
            from PIL import Image
        except ImportError:
            raise NoEncoder("no JPEG baseline encoder: pip install Pillow") from None
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=95)
        return buf.getvalue(), "Pillow (libjpeg) baseline"
    from pydicom.pixels import get_encoder

    encoder = get_encoder(ts)
    if plugin not in encoder.available_plugins:
        raise NoEncoder(f"no {ts.name} encoder: pip install {package}")
    ds.compress(ts, pixels, encoding_plugin=plugin)
    return next(generate_frames(ds.PixelData, number_of_frames=1)), f"pydicom Dataset.compress, plugin {plugin}"


def codec_bomb(path: Path, codec: str, frames: int, *, rgb: bool = False) -> Made:
    """`frames` frames of SIDE x SIDE zeros in `codec` (16-bit grey; 8-bit for JPEG baseline and RGB)."""
    ts = CODECS[codec][0]
    bits8 = rgb or codec == "jpeg"
    pixels = np.zeros((SIDE, SIDE, 3) if rgb else (SIDE, SIDE), np.uint8 if bits8 else np.uint16)
    ds = make_dataset(pixels, photometric="RGB" if rgb else None)
    frame, how = _one_frame(codec, ds, pixels)
    ds.PixelData = encapsulate([frame] * frames)
    ds["PixelData"].VR = "OB"
    ds.NumberOfFrames = frames
    ds.file_meta.TransferSyntaxUID = ts
    ds.save_as(path, enforce_file_format=True)
    decoded = frames * pixels.nbytes
    shape = f"{frames} x {SIDE}x{SIDE}{' RGB' if rgb else ''}"
    return Made(path, path.stat().st_size, decoded, f"{ts.name}, {shape}; {how}")


# --- a deflated dataset -----------------------------------------------------------------------------------------
def deflate_bomb(path: Path, inflated: int = 1 << 30, chunk: int = 16 * MiB) -> Made:
    """A Deflated Explicit VR Little Endian Part 10 file whose dataset inflates to ~`inflated` bytes: headers and
    a PixelData of zeros (16-bit frames of SIDE x SIDE), deflated here with zlib in chunks (pydicom would need the
    whole dataset in memory to write it)."""
    frame = SIDE * SIDE * 2
    frames = max(1, inflated // frame)
    ds = make_dataset(np.zeros((1, 1), np.uint16))
    del ds.PixelData
    ds.Rows = ds.Columns = SIDE
    ds.NumberOfFrames = frames
    ds.BitsAllocated = ds.BitsStored = 16
    ds.HighBit = 15
    meta = ds.file_meta
    meta.TransferSyntaxUID = DeflatedExplicitVRLittleEndian
    head = DicomBytesIO()
    head.write(b"\0" * 128 + b"DICM")
    write_file_meta_info(head, meta)
    body = DicomBytesIO()
    body.is_little_endian, body.is_implicit_VR = True, False
    write_dataset(body, ds)
    pixel_len = frames * frame
    # (7FE0,0010) OW, 2 reserved bytes, 4-byte length: the last element, so the dataset stays in tag order
    body.write(b"\xe0\x7f\x10\x00OW\x00\x00" + pixel_len.to_bytes(4, "little"))
    z = zlib.compressobj(9, zlib.DEFLATED, -15)
    zeros = bytes(chunk)
    with open(path, "wb") as f:
        f.write(head.getvalue())
        f.write(z.compress(body.getvalue()))
        left = pixel_len
        while left:
            n = min(left, chunk)
            f.write(z.compress(zeros if n == chunk else bytes(n)))
            left -= n
        f.write(z.flush())
    return Made(
        path,
        path.stat().st_size,
        len(body.getvalue()) + pixel_len,
        f"Deflated Explicit VR LE, {frames} x {SIDE}x{SIDE} 16-bit zeros, zlib level 9",
    )


# --- archives and series ----------------------------------------------------------------------------------------
def series_datasets(n: int, side: int, pattern) -> list[bytes]:
    """n slices of one series as Part 10 bytes; slice k's pixels are `pattern(k)` ((side, side) uint16)."""
    study, series = generate_uid(), generate_uid()
    out = []
    for k in range(n):
        ds = make_dataset(pattern(k), study_uid=study, series_uid=series, position=(0.0, 0.0, 2.5 * k), instance=k + 1)
        out.append(to_bytes(ds))
    return out


def series_zip(path: Path, n: int, side: int, *, zeros: bool) -> Made:
    """A zip of one series of `n` slices of side x side 16-bit: zeros (a zip bomb) or a smooth CT-like ramp (a
    large but legal study)."""
    ramp = (np.add.outer(np.arange(side), np.arange(side)) % 1024).astype(np.uint16)

    def pattern(k: int) -> np.ndarray:
        return np.zeros((side, side), np.uint16) if zeros else ramp + np.uint16(k)

    raw = 0
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        for k, data in enumerate(series_datasets(n, side, pattern)):
            zf.writestr(f"series/IM{k + 1:05d}.dcm", data)
            raw += len(data)
    return Made(path, path.stat().st_size, raw, f"zip of {n} x {side}x{side} 16-bit {'zeros' if zeros else 'ramps'}")


def to_bytes(ds: Dataset) -> bytes:
    buf = io.BytesIO()
    ds.save_as(buf, enforce_file_format=True)
    return buf.getvalue()


def tiny_instance(study: str | None = None, series: str | None = None, k: int = 0, side: int = 8) -> bytes:
    """A small valid CT instance (the 'normal' request next to the hostile ones)."""
    px = (np.arange(side * side, dtype=np.uint16).reshape(side, side) * 7 + k) % 4096
    return to_bytes(make_dataset(px, study_uid=study, series_uid=series, position=(0.0, 0.0, 2.5 * k), instance=k + 1))


def noise_instance(nbytes: int, study: str | None = None, series: str | None = None, k: int = 0) -> bytes:
    """An instance of about `nbytes` of random 16-bit pixels (fills a disk: no file system compresses it)."""
    cols = 1024
    rows = max(1, nbytes // (2 * cols))
    px = np.random.default_rng(k).integers(0, 4096, (rows, cols), dtype=np.uint16)
    return to_bytes(make_dataset(px, study_uid=study, series_uid=series, position=(0.0, 0.0, 2.5 * k), instance=k + 1))


def stow_body(parts: list[bytes]) -> tuple[bytes, str]:
    """A STOW-RS request body (multipart/related of application/dicom parts) and its Content-Type."""
    boundary = uuid.uuid4().hex
    out = bytearray()
    for data in parts:
        out += f"--{boundary}\r\nContent-Type: application/dicom\r\n\r\n".encode() + data + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return bytes(out), f'multipart/related; type="application/dicom"; boundary={boundary}'


# --- patient data that must never reach the log -----------------------------------------------------------------
UID_ROOT = "1.2.826.0.1.3680043.8.498."  # pydicom's root; the suffixes below are distinctive


@dataclass(frozen=True)
class Phi:
    name: str = "HOSTILE^PATIENT^ZQX"
    patient_id: str = "ZQX-0042-ID"
    birth_date: str = "19811399"  # not a date (month 13, day 99): validators quote it
    study_date: str = "20230917"
    long_name: str = "ZQXOVERLONGFAMILY" + "Q" * 70 + "^GIVENZQX"  # a PN component > 64 characters
    study: str = UID_ROOT + "9917770042001"
    series: str = UID_ROOT + "9917770042002"
    study_b: str = UID_ROOT + "9917770042101"  # the C-STORE study
    series_b: str = UID_ROOT + "9917770042102"
    study_c: str = UID_ROOT + "9917770042201"  # uploads (/v1/reports, /v1/jobs)
    series_c: str = UID_ROOT + "9917770042202"

    def sop(self, k: int) -> str:
        return UID_ROOT + f"99177700429{k:03d}"

    def needles(self) -> dict[str, str]:
        """What to grep the log for: each name (and its distinctive part), ID, date and raw UID."""
        out = {
            "PatientName": self.name,
            "name part HOSTILE": "HOSTILE",
            "PatientID": self.patient_id,
            "PatientBirthDate": self.birth_date,
            "StudyDate": self.study_date,
            "over-long PN": "ZQXOVERLONGFAMILY",
        }
        for label in ("study", "series", "study_b", "series_b", "study_c", "series_c"):
            out[f"{label} UID"] = getattr(self, label)
        for k in range(8):
            out[f"SOP UID {k}"] = self.sop(k)
        return out


def phi_instance(phi: Phi, k: int, *, study: str, series: str, long_name: bool = False, side: int = 16) -> Dataset:
    """An instance carrying `phi`: an invalid birth date, missing Type 2 attributes (no AccessionNumber, no
    ReferringPhysicianName), raw UIDs of our choosing, optionally an over-long PatientName."""
    px = (np.arange(side * side, dtype=np.uint16).reshape(side, side) * 11 + 13 * k) % 4096
    ds = make_dataset(px, study_uid=study, series_uid=series, position=(0.0, 0.0, 2.5 * k), instance=k + 1)
    ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = phi.sop(k)
    with warnings.catch_warnings():  # pydicom warns about the invalid DA and the long PN: that is the point
        warnings.simplefilter("ignore")
        ds.PatientName = phi.long_name if long_name else phi.name
        ds.PatientID = phi.patient_id
        ds.PatientBirthDate = phi.birth_date
        ds.StudyDate = phi.study_date
    for keyword in ("AccessionNumber", "ReferringPhysicianName"):
        if keyword in ds:
            delattr(ds, keyword)
    return ds


def phi_bytes(ds: Dataset) -> bytes:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return to_bytes(ds)

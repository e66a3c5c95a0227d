"""Builders for the DICOM and video files the ingest tests read (no test cases here).

Everything is written by pydicom, Pillow or PyAV inside the test, so the tests need no fixtures on disk.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pydicom
from PIL import Image
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.encaps import encapsulate
from pydicom.uid import (
    CTImageStorage,
    ExplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGBaseline8Bit,
    RLELossless,
    generate_uid,
)

PHI_NAME = "Secretname^Johnathan"
PHI_ID = "PATID12345"
PHI_DATE = "19650412"


def make_dataset(
    pixels: np.ndarray,
    *,
    modality: str = "CT",
    study_uid: str | None = None,
    series_uid: str | None = None,
    position: tuple[float, float, float] | None = None,
    orientation: tuple[float, ...] | None = (1, 0, 0, 0, 1, 0),
    instance: int | None = 1,
    window: tuple[float, float] | None = None,
    slope: float | None = None,
    intercept: float | None = None,
    photometric: str | None = None,
) -> Dataset:
    """A minimal but valid image object around `pixels` ((H, W), (n, H, W) or (H, W, 3))."""
    pixels = np.asarray(pixels)
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.file_meta.MediaStorageSOPClassUID = CTImageStorage
    ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    ds.SOPClassUID = CTImageStorage
    ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID
    ds.StudyInstanceUID = study_uid or generate_uid()
    ds.SeriesInstanceUID = series_uid or generate_uid()
    ds.Modality = modality
    ds.PatientName = PHI_NAME
    ds.PatientID = PHI_ID
    if instance is not None:
        ds.InstanceNumber = instance
    if orientation is not None:
        ds.ImageOrientationPatient = list(orientation)
    if position is not None:
        ds.ImagePositionPatient = list(position)
    if window is not None:
        ds.WindowCenter, ds.WindowWidth = window
    if slope is not None:
        ds.RescaleSlope = slope
    if intercept is not None:
        ds.RescaleIntercept = intercept
    colour = pixels.ndim == 3 and pixels.shape[-1] == 3 and photometric == "RGB"
    if colour:
        ds.SamplesPerPixel = 3
        ds.PlanarConfiguration = 0
        frames_shape = pixels.shape[:2]
    else:
        ds.SamplesPerPixel = 1
        frames_shape = pixels.shape[-2:]
        if pixels.ndim == 3:
            ds.NumberOfFrames = pixels.shape[0]
    ds.Rows, ds.Columns = frames_shape
    ds.PhotometricInterpretation = photometric or "MONOCHROME2"
    bits = 8 if pixels.dtype.itemsize == 1 else 16
    ds.BitsAllocated = bits
    ds.BitsStored = bits
    ds.HighBit = bits - 1
    ds.PixelRepresentation = 1 if pixels.dtype.kind == "i" else 0
    ds.PixelData = pixels.tobytes()
    return ds


def save(ds: Dataset, path: Path, transfer_syntax: str | None = None) -> Path:
    if transfer_syntax is not None:
        ds.file_meta.TransferSyntaxUID = transfer_syntax
    ds.save_as(path, enforce_file_format=True)
    return path


def save_pillow_compressed(ds: Dataset, pixels: np.ndarray, path: Path, kind: str) -> Path:
    """Encapsulate a frame compressed by Pillow: JPEG 2000 lossless (8/16 bit) or JPEG baseline (8 bit)."""
    buf = io.BytesIO()
    if kind == "j2k":
        mode = "I;16" if pixels.dtype.itemsize == 2 else "L"
        img = Image.frombytes(mode, pixels.shape[::-1], pixels.astype(pixels.dtype.newbyteorder("<")).tobytes())
        img.save(buf, "JPEG2000", irreversible=False, no_jp2=True)
        ts = JPEG2000Lossless
    elif kind == "jpeg":
        Image.fromarray(pixels.astype(np.uint8)).save(buf, "JPEG", quality=95)
        ts = JPEGBaseline8Bit
    else:
        raise ValueError(kind)
    ds.PixelData = encapsulate([buf.getvalue()])
    ds["PixelData"].VR = "OB"
    ds.file_meta.TransferSyntaxUID = ts
    if kind == "jpeg":
        ds.PhotometricInterpretation = "MONOCHROME2"
    ds.save_as(path, enforce_file_format=True)
    return path


def ramp(rows: int = 16, cols: int = 16, *, dtype=np.uint16, scale: int = 7, offset: int = 0) -> np.ndarray:
    return (np.arange(rows * cols, dtype=np.int64).reshape(rows, cols) * scale + offset).astype(dtype)


def write_series(folder: Path, n: int = 5, *, shuffle_names: bool = True, **kwargs) -> tuple[str, list[int]]:
    """n single-frame slices; slice k has constant value 100*k and z = -10 + 2.5k. Returns (series uid, values)."""
    folder.mkdir(parents=True, exist_ok=True)
    study, series = generate_uid(), generate_uid()
    rng = np.random.default_rng(3)
    names = [f"IM{v:04d}" for v in rng.permutation(1000)[:n]] if shuffle_names else [f"IM{k:04d}" for k in range(n)]
    for k in range(n):
        px = np.full((8, 8), 100 * k, dtype=np.uint16)
        ds = make_dataset(
            px, study_uid=study, series_uid=series, position=(0.0, 0.0, -10 + 2.5 * k), instance=n - k, **kwargs
        )  # InstanceNumber deliberately disagrees with position
        save(ds, folder / names[k])
    return series, [100 * k for k in range(n)]


def write_mp4(path: Path, frames: int = 20, size: int = 32) -> Path:
    """A tiny MPEG-4 clip whose frame k has a mean grey level rising with k."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width = size
        stream.height = size
        stream.pix_fmt = "yuv420p"
        for k in range(frames):
            grey = np.full((size, size, 3), int(20 + 200 * k / max(frames - 1, 1)), dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(grey, format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def read_back(path: Path) -> Dataset:
    return pydicom.dcmread(path)


def write_rle_series(folder: Path, n: int = 5, *, name=lambda k: f"IM{k + 1:04d}.dcm") -> list[Path]:
    """n RLE-compressed 32x32 slices (encapsulated pixel data, as the shipped samples), InstanceNumber k + 1."""
    folder.mkdir(parents=True, exist_ok=True)
    study, series = generate_uid(), generate_uid()
    paths = []
    for k in range(n):
        pixels = ramp(32, 32, offset=100 * k)
        ds = make_dataset(
            pixels, study_uid=study, series_uid=series, position=(0.0, 0.0, 2.5 * k), instance=k + 1, window=(400, 900)
        )
        ds.compress(RLELossless, pixels, encoding_plugin="pydicom")
        paths.append(save(ds, folder / name(k)))
    return paths


def cut(path: Path, keep: float = 0.5) -> Path:
    """Truncate a file to a fraction of its length."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def rle_zero_frames(rows: int, cols: int, frames: int) -> bytes:
    """Encapsulated RLE Lossless pixel data of `frames` all-zero 8-bit frames, written as PackBits runs by hand: a
    4096x4096 frame takes 256 KiB instead of pydicom's minutes of pure-Python encoding (a decompression bomb)."""
    count = rows * cols
    runs = b"\x81\x00" * (count // 128) + (bytes([257 - count % 128, 0]) if count % 128 > 1 else b"")
    runs += b"\x00\x00" if count % 128 == 1 else b""
    header = np.zeros(16, dtype="<u4")
    header[0], header[1] = 1, 64
    frame = header.tobytes() + runs
    return encapsulate([frame + b"\x00" * (len(frame) % 2)] * frames)


def rle_bomb(path: Path, rows: int = 4096, cols: int = 4096, frames: int = 12) -> Path:
    """A few MB of RLE Lossless DICOM that decodes to rows x cols x frames bytes of zeros."""
    ds = make_dataset(np.zeros((2, 2), dtype=np.uint8))
    ds.Rows, ds.Columns, ds.NumberOfFrames = rows, cols, frames
    ds.PixelData = rle_zero_frames(rows, cols, frames)
    ds["PixelData"].VR = "OB"
    return save(ds, path, RLELossless)


def deflated_zeros(path: Path, rows: int, cols: int, frames: int) -> Path:
    """A Deflated Explicit VR Little Endian object of 16-bit zero frames: ~1000:1, so a small file inflates big."""
    from pydicom.uid import DeflatedExplicitVRLittleEndian

    ds = make_dataset(np.zeros((2, 2), dtype=np.uint16))
    ds.Rows, ds.Columns, ds.NumberOfFrames = rows, cols, frames
    ds.PixelData = bytes(rows * cols * frames * 2)
    return save(ds, path, DeflatedExplicitVRLittleEndian)

"""DICOM objects of one series -> an ordered `Study`.

Ordering and display mapping live here, apart from file access, so a folder, a zip and a single file all give
the same frames for the same objects.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgekit.errors import StudyError
from edgekit.ingest.dicom import DicomImage, decode_image, header_meta
from edgekit.ingest.phi import hash_uid
from edgekit.ingest.pixels import luminance, to_display
from edgekit.ingest.study import IngestLimits, Study


def check_one_series(images: list[DicomImage], label: str) -> None:
    """A folder or zip must hold exactly one series: the model reports on one stack of images."""
    series = {img.series_uid for img in images}
    if len(series) > 1:
        raise StudyError(f"holds {len(series)} different series (SeriesInstanceUID); pass one series at a time", label)


def order_images(images: list[DicomImage]) -> list[DicomImage]:
    """Sort by position along the slice normal when every object has one, else by InstanceNumber.

    Ties and missing numbers fall back to the file label so the order never depends on directory listing.
    """
    if len(images) < 2:
        return list(images)
    orientation = next((img.orientation for img in images if img.orientation is not None), None)
    if orientation is not None and all(img.position is not None for img in images):
        normal = np.cross(orientation[:3], orientation[3:])
        if np.linalg.norm(normal) > 1e-6:
            key = {id(img): float(np.dot(normal, img.position)) for img in images}
            return sorted(
                images, key=lambda i: (key[id(i)], i.instance_number if i.instance_number is not None else 0, i.label)
            )
    return sorted(
        images,
        key=lambda i: (i.instance_number is None, i.instance_number if i.instance_number is not None else 0, i.label),
    )


def _check_sizes(images: list[DicomImage], limits: IngestLimits, label: str) -> None:
    first = images[0]
    for img in images[1:]:
        if (img.rows, img.columns) != (first.rows, first.columns):
            raise StudyError(
                f"inconsistent frame sizes: {img.rows}x{img.columns} here but {first.rows}x{first.columns} in "
                f"{Path(first.label).name}",
                img.label,
            )
    total_frames = sum(img.frames for img in images)
    if total_frames > limits.max_frames:
        raise StudyError(f"{total_frames} frames exceed the limit of {limits.max_frames}", label)
    total_pixels = total_frames * first.rows * first.columns
    if total_pixels > limits.max_total_pixels:
        raise StudyError(f"{total_pixels} pixels in all exceed the limit of {limits.max_total_pixels}", label)


def assemble(images: list[DicomImage], label: str, limits: IngestLimits, warnings: list[str]) -> Study:
    """Order, decode and window the objects of one series into display frames."""
    if not images:
        raise StudyError("no DICOM image found", label)
    check_one_series(images, label)
    images = order_images(images)
    _check_sizes(images, limits, label)

    first = images[0]
    meta = header_meta(first)  # before decoding: decoding releases each object's dataset
    uid = first.study_uid or first.series_uid or str(first.ds.get("SOPInstanceUID", "") or "")
    decoded = []
    for img in images:
        d = decode_image(img)
        warnings.extend(d.notes)
        decoded.append(d)
        img.ds = None  # the raw bytes are no longer needed; free them as we go

    n = sum(d.stored.shape[0] for d in decoded)
    frames = np.empty((n, first.rows, first.columns), dtype=np.float32)
    # Each object's own window is the faithful rendering; without one everywhere, one min-max over the whole
    # series keeps slices comparable (a per-slice min-max would flicker in brightness).
    per_object = all(d.center is not None or d.voi_lut for d in decoded)
    start = 0
    for d in decoded:
        stop = start + d.stored.shape[0]
        if d.voi_lut:
            frames[start:stop] = 1.0 - d.stored if d.photometric == "MONOCHROME1" else d.stored
        elif per_object:
            frames[start:stop] = to_display(
                d.stored,
                slope=d.slope,
                intercept=d.intercept,
                center=d.center,
                width=d.width,
                photometric=d.photometric,
            )
        else:
            values = luminance(d.stored) if d.photometric == "RGB" else d.stored.astype(np.float32)
            frames[start:stop] = values * np.float32(d.slope) + np.float32(d.intercept)
        start = stop
    if not per_object:
        frames = to_display(frames)
        start = 0
        for d in decoded:
            stop = start + d.stored.shape[0]
            if d.photometric == "MONOCHROME1":
                frames[start:stop] = 1.0 - frames[start:stop]
            start = stop

    meta["number_of_frames"] = int(n)
    meta["number_of_files"] = len(images)
    meta["series_uid_hash"] = hash_uid(first.series_uid) if first.series_uid else None
    meta["slice_spacing"] = _slice_spacing(images)
    return Study(
        frames=frames,
        modality=first.modality,
        uid_hash=hash_uid(uid),
        source="dicom",
        meta=meta,
        warnings=warnings,
    )


def _slice_spacing(images: list[DicomImage]) -> float | None:
    if len(images) < 2 or images[0].orientation is None or any(i.position is None for i in images):
        return None
    normal = np.cross(images[0].orientation[:3], images[0].orientation[3:])
    positions = np.array([float(np.dot(normal, i.position)) for i in images])
    diffs = np.diff(positions)
    return round(float(np.median(np.abs(diffs))), 4) if diffs.size else None

"""DICOM objects of one series -> an ordered `Study`.

Ordering and display mapping live here, apart from file access, so a folder, a zip and a single file all give
the same frames for the same objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgekit.errors import StudyError, UnsupportedTransferSyntaxError
from edgekit.ingest.decode import decode_image
from edgekit.ingest.dicom import DicomImage, SliceError, header_meta, slice_name
from edgekit.ingest.phi import hash_uid
from edgekit.ingest.pixels import luminance, to_display
from edgekit.ingest.study import IngestLimits, Study

# Per-object failures a series goes on without; limits and series-level problems still fail the whole study.
SKIPPABLE = (SliceError, UnsupportedTransferSyntaxError)


@dataclass
class Skipped:
    """One object of a folder or zip left out, and why; named at the end, once the file count is known."""

    error: StudyError
    instance: int | None
    ordinal: int | None

    def warning(self, of: int) -> str:
        name = slice_name(self.instance, self.ordinal, of)
        return f"skipped {'the slice with ' if self.instance is not None else ''}{name}: {self.error.reason}"


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


def assemble(
    images: list[DicomImage],
    label: str,
    limits: IngestLimits,
    warnings: list[str],
    skipped: list[Skipped] | None = None,
) -> Study:
    """Order, decode and window the objects of one series into display frames.

    With `skipped` (a folder or zip), an object that fails to decode joins the skipped ones and the series goes
    on; every skipped object gets one warning, first in `warnings`. Without it (one file) the failure is the error.
    When no object is left, the first failure is the error, so its code and reason reach the caller.
    """
    if not images and not skipped:
        raise StudyError("no DICOM image found", label)
    if images:
        check_one_series(images, label)
        images = order_images(images)
        _check_sizes(images, limits, label)
    of = images[0].of if images and images[0].of else None

    decoded, kept = [], []
    notes: dict[str, list[str]] = {}
    meta = None
    for img in images:
        try:
            d = decode_image(img)
        except SKIPPABLE as err:
            if skipped is None:
                raise
            skipped.append(Skipped(err, img.instance_number, img.ordinal))
            img.ds = None
            continue
        if meta is None:
            meta = header_meta(img)  # before the dataset is released below
            uid = img.study_uid or img.series_uid or str(img.ds.get("SOPInstanceUID", "") or "")
        for note in d.notes:
            notes.setdefault(note, []).append(img.slice_name)
        decoded.append(d)
        kept.append(img)
        img.ds = None  # the raw bytes are no longer needed; free them as we go
    if skipped:
        skipped.sort(key=lambda s: (s.ordinal is None, s.ordinal or 0))
        warnings[:0] = [s.warning(of or len(skipped) + len(kept)) for s in skipped]
    if not decoded:
        raise skipped[0].error
    warnings.extend(_note_warnings(notes, len(kept)))
    images = kept
    first = images[0]

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


def _note_warnings(notes: dict[str, list[str]], kept: int) -> list[str]:
    """One warning per kind of fallback or changed value, naming the slices (a few, then a count)."""
    out = []
    for note, names in notes.items():
        if kept == 1:
            out.append(note)
        elif len(names) <= 3:
            out.append(f"{note} ({', '.join(names)})")
        else:
            out.append(f"{note} ({len(names)} of {kept} slices: {', '.join(names[:3])}, ...)")
    return out


def _slice_spacing(images: list[DicomImage]) -> float | None:
    if len(images) < 2 or images[0].orientation is None or any(i.position is None for i in images):
        return None
    normal = np.cross(images[0].orientation[:3], images[0].orientation[3:])
    positions = np.array([float(np.dot(normal, i.position)) for i in images])
    diffs = np.diff(positions)
    return round(float(np.median(np.abs(diffs))), 4) if diffs.size else None

"""DICOM objects of one series -> an ordered `Study`.

Ordering and display mapping live here, apart from file access, so a folder, a zip and a single file all give
the same frames for the same objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgekit.errors import StudyError, UnsupportedTransferSyntaxError
from edgekit.ingest import budget
from edgekit.ingest.decode import Window, decode_image, display_window
from edgekit.ingest.dicom import DicomImage, SliceError, header_meta, slice_name
from edgekit.ingest.phi import hash_uid
from edgekit.ingest.pixels import luminance, min_max_in_place, to_display
from edgekit.ingest.study import IngestLimits, Study, allocate_frames

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


def study_cost(images: list[DicomImage]) -> int:
    """Bytes decoding the series costs at most: its display frames, what the objects hold in memory while they
    wait (headers, and the pixel data of those kept whole), and the costliest object's frame working set and
    encoded bytes (read back one at a time)."""
    first = images[0]
    frames = budget.display_bytes(sum(img.frames for img in images), first.rows, first.columns)
    held = sum(img.held_bytes for img in images)
    working = max(
        budget.frame_working_bytes(img.rows, img.columns, img.samples, img.bits_allocated)
        + (img.encoded_bytes if img.reload is not None else 0)
        for img in images
    )
    return frames + held + working


def assemble(
    images: list[DicomImage],
    label: str,
    limits: IngestLimits,
    warnings: list[str],
    skipped: list[Skipped] | None = None,
    admit: budget.Admit | None = None,
) -> Study:
    """Order, decode and window the objects of one series into display frames, frame by frame.

    The series is costed from its headers first (`budget.py`) and refused over the budget; `admit` then hears the
    cost (the daemon's pool). With `skipped` (a folder or zip), an object that fails to decode joins the skipped
    ones and the series goes on; every skipped object gets one warning, first in `warnings`. Without it (one
    file) the failure is the error. When no object is left, the first failure is the error, so its code and
    reason reach the caller.
    """
    if not images and not skipped:
        raise StudyError("no DICOM image found", label)
    if not images:
        raise skipped[0].error
    check_one_series(images, label)
    images = order_images(images)
    _check_sizes(images, limits, label)
    cost = study_cost(images)
    budget.check(cost, limits, label)
    if admit is not None:
        admit(cost)
    of = images[0].of or None
    first = images[0]
    out = allocate_frames((sum(img.frames for img in images), first.rows, first.columns))
    windows = [display_window(img, img.ds) for img in images]
    # Each object's own window is the faithful rendering; without one everywhere, one min-max over the whole
    # series keeps slices comparable (a per-slice min-max would flicker in brightness).
    per_object = all(w.per_object for w in windows)

    kept: list[DicomImage] = []
    spans: list[tuple[int, int, Window]] = []  # (start, stop, window) of each kept object in `out`
    notes: dict[str, list[str]] = {}
    meta = uid = None
    start = 0
    for img in images:
        try:
            ds = img.reload() if img.reload is not None else img.ds
            decoded = decode_image(img, ds)
            stop = start
            for frame in decoded.frames:
                _write_display(out[stop], frame, decoded.window, per_object)
                stop += 1
        except SKIPPABLE as err:
            if skipped is None:
                raise
            skipped.append(Skipped(err, img.instance_number, img.ordinal))
            img.ds = None
            continue  # its frames, if any, are overwritten by the next object's
        if meta is None:
            meta = header_meta(img)
            uid = img.study_uid or img.series_uid or str(img.ds.get("SOPInstanceUID", "") or "")
        for note in decoded.notes:
            notes.setdefault(note, []).append(img.slice_name)
        spans.append((start, stop, decoded.window))
        kept.append(img)
        start = stop
        img.ds = None  # the raw bytes are no longer needed; free them as we go
        del ds, decoded
    if skipped:
        skipped.sort(key=lambda s: (s.ordinal is None, s.ordinal or 0))
        warnings[:0] = [s.warning(of or len(skipped) + len(kept)) for s in skipped]
    if not kept:
        raise skipped[0].error
    warnings.extend(_note_warnings(notes, len(kept)))
    frames = out[:start]
    if not per_object and all(w.per_object for _, _, w in spans):
        # the objects without a window were all skipped: the kept ones render themselves, as the series would have
        # had it been sent without the broken ones (their frames hold modality values: window them now)
        for a, b, w in spans:
            if not w.voi_lut:
                frames[a:b] = to_display(frames[a:b], center=w.center, width=w.width, photometric=w.photometric)
    elif not per_object:
        min_max_in_place(frames)
        for a, b, w in spans:
            if w.photometric == "MONOCHROME1":
                np.subtract(np.float32(1.0), frames[a:b], out=frames[a:b])

    meta["number_of_frames"] = int(start)
    meta["number_of_files"] = len(kept)
    meta["series_uid_hash"] = hash_uid(first.series_uid) if first.series_uid else None
    meta["slice_spacing"] = _slice_spacing(kept)
    return Study(
        frames=frames,
        modality=kept[0].modality,
        uid_hash=hash_uid(uid),
        source="dicom",
        meta=meta,
        warnings=warnings,
    )


def _write_display(dest: np.ndarray, frame: np.ndarray, window: Window, per_object: bool) -> None:
    """One decoded frame into its place in the study: display values when the series renders per object, else
    modality values (luminance for colour), which `min_max_in_place` maps once the whole series is in."""
    if window.voi_lut:
        dest[...] = 1.0 - frame if window.photometric == "MONOCHROME1" else frame
    elif per_object:
        dest[...] = to_display(
            frame,
            slope=window.slope,
            intercept=window.intercept,
            center=window.center,
            width=window.width,
            photometric=window.photometric,
        )
    else:
        dest[...] = luminance(frame) if window.photometric == "RGB" else frame
        if window.slope != 1.0:
            dest *= np.float32(window.slope)
        if window.intercept != 0.0:
            dest += np.float32(window.intercept)
        if not np.isfinite(dest).all():
            np.nan_to_num(dest, copy=False, nan=0.0, posinf=0.0, neginf=0.0)


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

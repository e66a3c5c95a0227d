"""DICOM objects of one series -> an ordered `Study`.

Ordering and display mapping live here, apart from file access, so a folder, a zip and a single file all give
the same frames for the same objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydicom.dataset import Dataset

from edgekit.errors import StudyError, UnsupportedTransferSyntaxError
from edgekit.ingest import budget
from edgekit.ingest.decode import Decoded, Window, decode_image, display_window
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
    positions = [img.position for img in images if img.position is not None]
    if orientation is not None and len(positions) == len(images):
        normal = np.cross(orientation[:3], orientation[3:])
        if np.linalg.norm(normal) > 1e-6:
            key = {id(img): float(np.dot(normal, pos)) for img, pos in zip(images, positions)}
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
    images = _admit_series(images, label, limits, skipped, admit)
    first = images[0]
    out = allocate_frames((sum(img.frames for img in images), first.rows, first.columns))
    # Each object's own window is the faithful rendering; without one everywhere, one min-max over the whole
    # series keeps slices comparable (a per-slice min-max would flicker in brightness).
    per_object = all([display_window(img, img.ds).per_object for img in images])
    kept = _decode_series(images, out, per_object, skipped)
    if skipped:
        skipped.sort(key=lambda s: (s.ordinal is None, s.ordinal or 0))
        warnings[:0] = [s.warning(first.of or len(skipped) + len(kept.images)) for s in skipped]
    if not kept.images:  # every object failed: they are in `skipped` (without it the first failure was raised)
        raise skipped[0].error if skipped else StudyError("no DICOM image found", label)
    warnings.extend(_note_warnings(kept.notes, len(kept.images)))
    frames = out[: kept.stop]
    _render_series(frames, kept.spans, per_object)
    meta = kept.meta
    meta["number_of_frames"] = int(kept.stop)
    meta["number_of_files"] = len(kept.images)
    meta["series_uid_hash"] = hash_uid(first.series_uid) if first.series_uid else None
    meta["slice_spacing"] = _slice_spacing(kept.images)
    return Study(
        frames=frames,
        modality=kept.images[0].modality,
        uid_hash=hash_uid(kept.uid),
        source="dicom",
        meta=meta,
        warnings=warnings,
    )


def _admit_series(
    images: list[DicomImage],
    label: str,
    limits: IngestLimits,
    skipped: list[Skipped] | None,
    admit: budget.Admit | None,
) -> list[DicomImage]:
    """The series checked from its headers (one series, one frame size, the limits, the budget) and ordered;
    `admit` hears its cost."""
    if not images:
        raise skipped[0].error if skipped else StudyError("no DICOM image found", label)
    check_one_series(images, label)
    images = order_images(images)
    _check_sizes(images, limits, label)
    cost = study_cost(images)
    budget.check(cost, limits, label)
    if admit is not None:
        admit(cost)
    return images


@dataclass
class _Kept:
    """The objects that decoded, in order: their frames' spans in the study's array, the notes by reason (with the
    slices that gave each), and the header metadata and study UID of the first."""

    images: list[DicomImage] = field(default_factory=list)
    spans: list[tuple[int, int, Window]] = field(default_factory=list)  # (start, stop, window) in the array
    notes: dict[str, list[str]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    uid: str | None = None
    stop: int = 0  # frames written so far

    def add(self, img: DicomImage, decoded: Decoded, stop: int) -> None:
        if not self.images:
            self.meta = header_meta(img)
            self.uid = img.study_uid or img.series_uid or str(img.ds.get("SOPInstanceUID", "") or "")
        for note in decoded.notes:
            self.notes.setdefault(note, []).append(img.slice_name)
        self.spans.append((self.stop, stop, decoded.window))
        self.images.append(img)
        self.stop = stop


def _decode_series(images: list[DicomImage], out: np.ndarray, per_object: bool, skipped: list[Skipped] | None) -> _Kept:
    """Each object decoded into `out` after the last kept one, its raw bytes freed as it goes; with `skipped`, an
    object that fails joins them (its frames, if any, are overwritten by the next object's)."""
    kept = _Kept()
    for img in images:
        try:
            decoded, stop = _decode_into(img, out, kept.stop, per_object)
        except SKIPPABLE as err:
            if skipped is None:
                raise
            skipped.append(Skipped(err, img.instance_number, img.ordinal))
            _free(img)
            continue
        kept.add(img, decoded, stop)
        _free(img)  # the raw bytes are no longer needed; free them as we go
        del decoded
    return kept


def _free(img: DicomImage) -> None:
    """Drops the object's dataset (its pixel data) once it has been decoded or skipped, so a series never holds
    every object's bytes at once; an empty Dataset stands in, as `DicomImage.ds` is always one."""
    img.ds = Dataset()


def _decode_into(img: DicomImage, out: np.ndarray, start: int, per_object: bool) -> tuple[Decoded, int]:
    ds = img.reload() if img.reload is not None else img.ds
    decoded = decode_image(img, ds)
    stop = start
    for frame in decoded.frames:
        _write_display(out[stop], frame, decoded.window, per_object)
        stop += 1
    return decoded, stop


def _render_series(frames: np.ndarray, spans: list[tuple[int, int, Window]], per_object: bool) -> None:
    """Modality values into display values in place, where `_write_display` left them as modality values."""
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
    orientation = images[0].orientation
    places = [i.position for i in images if i.position is not None]
    if len(images) < 2 or orientation is None or len(places) < len(images):
        return None
    normal = np.cross(orientation[:3], orientation[3:])
    positions = np.array([float(np.dot(normal, p)) for p in places])
    diffs = np.diff(positions)
    return round(float(np.median(np.abs(diffs))), 4) if diffs.size else None

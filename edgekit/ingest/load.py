"""`load_study(path)`: pick the reader for a DICOM file, a series folder, a zip of a series or a video."""

from __future__ import annotations

import os
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from edgekit.errors import StudyError
from edgekit.ingest import budget
from edgekit.ingest.dicom import DicomDirectory, DicomImage, NotDicom, drop_pixels, inspect_image, read_dataset
from edgekit.ingest.phi import phi_guard, scrub
from edgekit.ingest.series import SKIPPABLE, Skipped, assemble
from edgekit.ingest.study import IngestLimits, Study
from edgekit.ingest.video import VIDEO_SUFFIXES, load_video

if TYPE_CHECKING:
    from pydicom.dataset import Dataset

# Files that series exports carry beside the images; skipped without a word.
_SILENT = {"DICOMDIR", "Thumbs.db"}
# Names that say "an image of the series": one that is not readable as DICOM is a lost slice, named by its place
# (its name may be the patient's), not a stray file named by its name.
_DICOM_SUFFIXES = {".dcm", ".dicom", ".dic", ".ima"}


def load_study(
    path: str | os.PathLike, *, limits: IngestLimits | None = None, admit: budget.Admit | None = None
) -> Study:
    """Read one study; any problem with the input is a `StudyError` naming the file and the reason.

    Its memory is costed from headers and refused over `limits.memory_bytes` before any pixel is decoded
    (`budget.py`); `admit`, when given, hears that cost first and may refuse it too (the daemon's pool)."""
    t0 = time.perf_counter()
    limits = limits or IngestLimits()
    path = Path(path)
    if not path.exists():
        raise StudyError("no such file or directory", path)
    with phi_guard() as captured:
        if path.is_dir():
            study = _load_entries(_folder_entries(path, limits), path, limits, admit)
        elif path.suffix.lower() == ".zip":
            study = _load_zip(path, limits, admit)
        elif path.suffix.lower() in VIDEO_SUFFIXES:
            study = load_video(path, limits, admit)
        else:
            study = _load_file(path, limits, admit)
    study.warnings.extend(captured.unique())
    study.ingest_ms = (time.perf_counter() - t0) * 1e3
    return study


def _load_file(path: Path, limits: IngestLimits, admit: budget.Admit | None) -> Study:
    try:
        ds = read_dataset(path, str(path), max_inflated=budget.inflate_limit(limits))
    except NotDicom:
        raise StudyError("not a DICOM file (no DICM preamble)", path) from None
    except DicomDirectory:
        raise StudyError("is a DICOMDIR media index, not an image; pass the series folder", path) from None
    return assemble([inspect_image(ds, str(path), limits)], str(path), limits, [], admit=admit)


Entry = tuple[str, Callable[[], "Path | bytes"]]
# A folder's or zip's objects are kept whole in memory up to this share of the budget; past it, headers only.
HELD_SHARE = 8


def _folder_entries(folder: Path, limits: IngestLimits) -> Iterator[Entry]:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if len(files) > limits.max_files:
        raise StudyError(f"{len(files)} files exceed the limit of {limits.max_files}", folder)
    total = sum(p.stat().st_size for p in files)
    if total > limits.max_bytes:
        raise StudyError(f"{total} bytes exceed the limit of {limits.max_bytes}", folder)
    for p in files:
        check_entry_size(p.stat().st_size, limits, p)
        yield str(p), _opener(p)


def _opener(path: Path) -> Callable[[], Path]:
    """A folder entry's opener: the file's path, which `read_dataset` reads."""
    return lambda: path


def _reader(opener: Callable[[], Path | bytes], name: str, max_inflated: int | None) -> Callable[[], Dataset]:
    """An entry read again, whole (an object whose pixel data was dropped, when its turn to decode comes)."""
    return lambda: read_dataset(opener(), name, max_inflated=max_inflated)


def check_entry_size(size: int, limits: IngestLimits, label: str | Path) -> None:
    """One file of a folder or zip is read whole to parse it: one larger than the budget is refused unread."""
    budget.check(size, limits, label, "reading this file")


def _load_entries(entries: Iterator[Entry], label: Path, limits: IngestLimits, admit: budget.Admit | None) -> Study:
    """A folder's or zip's files -> one series. A broken slice is left out with a warning naming it by
    InstanceNumber (else by its place among the DICOM files); stray files are named by their own name.

    Each object is parsed, checked and costed; once the objects held pass 1/HELD_SHARE of the budget, only headers
    are kept (private elements dropped; the pixel data is read again when the object decodes). The display frames
    and what is held are added up as the files come, and the study is refused as soon as they pass the budget, not
    after every file was read."""
    max_inflated = budget.inflate_limit(limits)
    frames_bytes = held = 0
    images: list[DicomImage] = []
    warnings: list[str] = []
    skipped: list[Skipped] = []
    seen = candidates = 0
    for name, opener in entries:
        seen += 1
        base = PurePosixPath(name.replace(os.sep, "/")).name
        if base in _SILENT:
            continue
        if base.startswith("."):
            warnings.append(f"skipped hidden file {scrub(base)}")
            continue
        try:
            ds = read_dataset(opener(), name, max_inflated=max_inflated)
        except DicomDirectory:
            continue
        except NotDicom:
            if PurePosixPath(base).suffix.lower() in _DICOM_SUFFIXES:
                candidates += 1
                err = StudyError("not readable as DICOM (no DICM preamble, not a dataset)", name)
                skipped.append(Skipped(err, None, candidates))
            else:
                warnings.append(f"skipped {scrub(base)}: not a DICOM file")
            continue
        except SKIPPABLE as err:
            candidates += 1
            skipped.append(Skipped(err, getattr(err, "instance", None), candidates))
            continue
        candidates += 1
        try:
            img = inspect_image(ds, name, limits)
        except SKIPPABLE as err:
            skipped.append(Skipped(err, getattr(err, "instance", None), candidates))
            continue
        img.ordinal = candidates
        if held + img.held_bytes > limits.memory_bytes // HELD_SHARE:  # read it again when its turn comes
            drop_pixels(img, _reader(opener, name, max_inflated))
        held += img.held_bytes
        images.append(img)
        frames_bytes += budget.display_bytes(img.frames, img.rows, img.columns)
        budget.check(frames_bytes + held, limits, label, f"decoding the {len(images)} images read so far")
    if seen == 0:
        raise StudyError("is empty", label)
    if not images and not skipped:
        raise StudyError(f"no DICOM image found among {seen} file(s)", label)
    for img in images:
        img.of = candidates
    if not images:
        raise skipped[0].error
    return assemble(images, str(label), limits, warnings, skipped, admit)


def _load_zip(path: Path, limits: IngestLimits, admit: budget.Admit | None) -> Study:
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise StudyError("not a valid zip archive", path) from None
    with archive:
        members = [m for m in archive.infolist() if not m.is_dir()]
        for m in archive.infolist():
            parts = PurePosixPath(m.filename.replace("\\", "/")).parts
            if m.filename.startswith(("/", "\\")) or ".." in parts or (parts and ":" in parts[0]):
                raise StudyError(f"zip entry {m.filename!r} escapes the archive (path traversal)", path)
        members = [m for m in members if not m.filename.startswith("__MACOSX/")]
        if len(members) > limits.max_files:
            raise StudyError(f"{len(members)} files exceed the limit of {limits.max_files}", path)
        total = sum(m.file_size for m in members)
        if total > limits.max_bytes:
            raise StudyError(f"{total} uncompressed bytes exceed the limit of {limits.max_bytes}", path)
        for m in members:  # the sizes zipfile enforces while inflating, read from the central directory
            check_entry_size(m.file_size, limits, f"{path}!{m.filename}")

        def read(m: zipfile.ZipInfo) -> bytes:
            try:
                data = archive.read(m)
            except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as err:
                raise StudyError(f"corrupt zip entry {m.filename!r}: {type(err).__name__}", path) from None
            except NotImplementedError:
                raise StudyError(f"zip entry {m.filename!r} uses an unsupported compression method", path) from None
            return data

        entries = ((f"{path}!{m.filename}", (lambda m=m: read(m))) for m in sorted(members, key=lambda m: m.filename))
        return _load_entries(entries, path, limits, admit)

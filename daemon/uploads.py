"""Uploaded studies onto disk: a private directory, safe names, a byte limit, and a fingerprint for idempotency.

Client file names never reach the disk (they can carry patient names); files are stored as numbered names and the
mapping back is kept only to name the culprit in an error sent to the same client.
"""

from __future__ import annotations

import errno
import hashlib
import os
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from edgekit.errors import EdgekitError, StudyError
from edgekit.ingest.video import VIDEO_SUFFIXES

if TYPE_CHECKING:
    from starlette.datastructures import UploadFile

CHUNK = 1 << 20
ZIP_MAGIC = b"PK\x03\x04"


class UploadTooLargeError(EdgekitError):
    code = "upload_too_large"
    http_status = 413


class InsufficientStorageError(EdgekitError):
    code = "insufficient_storage"
    http_status = 507


def storage_error(err: OSError | sqlite3.Error) -> BaseException:
    """A full disk (ENOSPC, EDQUOT, SQLite's "database or disk is full") as the client's 507; anything else as it
    was (a fault of the daemon's, not of the request)."""
    full = getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "disk is full" in str(err)
    if full:
        return InsufficientStorageError("the daemon's disk is full; retry once space has been freed")
    return err


@dataclass
class SavedStudy:
    path: Path  # what load_study reads: one file, a folder of DICOM files, a zip or a video
    kind: str  # "dicom" | "zip" | "video"
    names: dict[str, str] = field(default_factory=dict)  # stored basename -> the client's basename
    digest: str = ""  # sha256 over every file's bytes, in upload order

    def client_name(self, stored: str | None) -> str | None:
        return self.names.get(Path(stored).name) if stored else None

    def name_for_client(self, err: EdgekitError) -> None:
        """Make `err` name the client's file instead of the stored one it read (for that client's eyes only)."""
        stored = err.to_json().get("file")
        client = self.client_name(stored.split("!")[0]) if stored else None
        if client:
            err.path = client


def _client_basename(name: str | None) -> str:
    return PurePosixPath((name or "").replace("\\", "/")).name[:128] or "upload"


def _kind(name: str, content_type: str | None, head: bytes) -> str:
    suffix = Path(name).suffix.lower()
    if suffix == ".zip" or head.startswith(ZIP_MAGIC):
        return "zip"
    if suffix in VIDEO_SUFFIXES or (content_type or "").startswith("video/"):
        return "video"
    return "dicom"


async def save_uploads(files: Sequence[UploadFile], dest: Path, max_bytes: int, *, durable: bool = False) -> SavedStudy:
    """Write starlette `UploadFile`s under `dest` (created 0700) and decide what kind of study they form.
    `durable`: fsync files and folder (a durable job's input must outlive a power cut; a sync request's need not)."""
    if not files:
        raise StudyError("no file uploaded: send one or more DICOM files, a zip of a series, or a video")
    dest.mkdir(parents=True, exist_ok=True, mode=0o700)
    total = 0
    digest = hashlib.sha256()
    stored: list[tuple[Path, str, str]] = []  # (path, kind, client name)
    for i, upload in enumerate(files):
        client = _client_basename(upload.filename)
        head = await upload.read(CHUNK)
        kind = _kind(client, upload.content_type, head)
        suffix = {"zip": ".zip", "dicom": ".dcm"}.get(kind) or (Path(client).suffix.lower() or ".mp4")
        path = dest / f"{i:05d}{suffix}"
        with open(path, "wb", opener=lambda p, f: os.open(p, f, 0o600)) as out:
            chunk = head
            while chunk:
                total += len(chunk)
                if total > max_bytes:
                    raise UploadTooLargeError(f"the upload exceeds the limit of {max_bytes} bytes", client)
                digest.update(chunk)
                out.write(chunk)
                chunk = await upload.read(CHUNK)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        stored.append((path, kind, client))
    names = {p.name: c for p, _, c in stored}
    kinds = {k for _, k, _ in stored}
    if len(stored) > 1 and kinds != {"dicom"}:
        raise StudyError("send either DICOM files, or one zip, or one video; not a mix or several archives")
    only_path, only_kind, _ = stored[0]
    if len(stored) == 1:
        study = SavedStudy(only_path, only_kind, names)
    else:
        series = dest / "series"
        series.mkdir(mode=0o700)
        for p, _, _ in stored:
            p.rename(series / p.name)
        study = SavedStudy(series, "dicom", names)
    if durable:
        fsync_dir(dest)
    study.digest = digest.hexdigest()
    return study


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a file just renamed or created in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

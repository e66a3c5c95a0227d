"""STOW-RS in: a `multipart/related; type="application/dicom"` body into the inbox, and the store response.

The body is spooled to disk as it arrives and split there (`stow_spool`; not by a form parser: STOW-RS parts are
not form fields), then each part is read back, checked on its own (`instances.parse_part`) and stored or refused
with its own failure reason, so one bad part never costs the others. Memory holds one part at a time (with
pydicom's copy of its pixel data while it is parsed), never the body.
The answer is the standard store response (PS3.18 10.5.3): a DICOM JSON dataset with ReferencedSOPSequence and
FailedSOPSequence (FailureReason per instance); 200 when every instance was stored, 202 when some were, 409 when
none was, 400 for a body that is not multipart at all, 415 for another media type.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections import Counter
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgekit.errors import EdgekitError
from edgekit.ingest.phi import hash_uid

from . import telemetry
from .instances import CANNOT_UNDERSTAND, DATASET_MISMATCH, OUT_OF_RESOURCES, Refusal, is_uid, parse_part
from .metrics import Metrics
from .stow_spool import MultipartError, PartFinder, SpooledBody, spool
from .studies import StudyInbox, key

log = logging.getLogger("edgekitd")

DICOM_JSON = "application/dicom+json"
BodyChunks = AsyncGenerator[bytes, None]  # a request body as it arrives (starlette's `Request.stream()`)
_TOKEN_PARAM = re.compile(r';\s*([A-Za-z0-9_.-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)')


class UnsupportedMediaTypeError(EdgekitError):
    code = "unsupported_media_type"
    http_status = 415


@dataclass
class Part:
    headers: dict[str, str]
    content: bytes
    problem: str | None = None  # a framing problem found while splitting (the part is refused with it)


def media_type(header: str) -> tuple[str, dict[str, str]]:
    """`type/subtype` (lower case) and its parameters (names lower case, quotes removed)."""
    head, _, rest = header.partition(";")
    params = {}
    for m in _TOKEN_PARAM.finditer(";" + rest):
        value = m.group(2).strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = re.sub(r"\\(.)", r"\1", value[1:-1])
        params[m.group(1).lower()] = value
    return head.strip().lower(), params


def boundary_of(content_type: str | None) -> bytes:
    """The boundary of a STOW-RS request, or the error that refuses it."""
    mtype, params = media_type(content_type or "")
    if mtype != "multipart/related":
        raise UnsupportedMediaTypeError(
            f'STOW-RS takes multipart/related; type="application/dicom", not {mtype or "no content type"}'
        )
    part_type = params.get("type", "application/dicom").lower()
    if part_type != "application/dicom":
        raise UnsupportedMediaTypeError(
            f"only application/dicom parts are stored (type={part_type}); send Part 10 files, not metadata"
        )
    boundary = params.get("boundary", "")
    if not 1 <= len(boundary) <= 70:
        raise MultipartError("the Content-Type has no valid multipart boundary (1-70 characters)")
    try:
        return boundary.encode("ascii")
    except UnicodeEncodeError:
        raise MultipartError("the multipart boundary must be ASCII") from None


def split_parts(body: bytes, boundary: bytes) -> list[Part]:
    """The parts of a body already in memory (the route spools instead: `StowService.store`)."""
    finder = PartFinder(boundary)
    finder.feed(body)
    return [_part(body[s.start : s.end], s.problem) for s in finder.finish()]


def _part(raw: bytes, problem: str | None) -> Part:
    if raw.startswith(b"\r\n"):
        head, content = b"", raw[2:]
    else:
        cut = raw.find(b"\r\n\r\n")
        if cut < 0:
            return Part({}, b"", problem or "a part without a blank line between its headers and its content")
        head, content = raw[:cut], raw[cut + 4 :]
    headers = {}
    for line in head.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if sep:
            headers[name.decode("latin-1").strip().lower()] = value.decode("latin-1").strip()
    return Part(headers, content, problem)


def _item(sop_class: str, sop_instance: str, reason: int | None = None) -> dict[str, Any]:
    def ui(value: str) -> dict[str, Any]:
        return {"vr": "UI", "Value": [value]} if value else {"vr": "UI"}

    item = {"00081150": ui(sop_class), "00081155": ui(sop_instance)}
    if reason is not None:
        item["00081197"] = {"vr": "US", "Value": [reason]}
    return item


@dataclass
class StoreResult:
    status: int
    body: dict[str, Any]
    stored: int
    failed: int


class StowService:
    """What the STOW-RS route calls: parts in, instances into the inbox, the store response out."""

    def __init__(self, inbox: StudyInbox, metrics: Metrics):
        self.inbox, self.metrics = inbox, metrics
        # One request's parts in memory at a time: a part can be max_upload_bytes, and that is what the start-up
        # memory check counts (memory.check_memory). Parts are stored under the inbox's lock anyway.
        self._parts = threading.Lock()

    async def store(
        self,
        chunks: BodyChunks,
        content_type: str | None,
        target_study: str | None,
        complete: bool,
        spool_dir: Path,
    ) -> StoreResult:
        """Read the body (async) into a spool file under `spool_dir`, then store its parts (blocking: in a thread).
        Nothing is stored unless the whole body arrived and is multipart; the spool file is gone on every return."""
        if target_study is not None and not is_uid(target_study):
            raise EdgekitError("the StudyInstanceUID in the URL is not a UID", code="invalid_uid")
        body = await spool(chunks, boundary_of(content_type), spool_dir)
        try:
            return await asyncio.to_thread(self._store_parts_alone, body, target_study, complete)
        finally:
            body.close()

    def _store_parts_alone(self, body: SpooledBody, target_study: str | None, complete: bool) -> StoreResult:
        with self._parts:
            return self._store_parts(body, target_study, complete)

    def _store_parts(self, body: SpooledBody, target_study: str | None, complete: bool) -> StoreResult:
        stored: list[dict[str, Any]] = []
        failed: list[dict[str, Any]] = []
        studies: set[str] = set()
        outcomes: Counter[str] = Counter()
        for span in body.spans:  # one part in memory at a time: each is garbage once `_one` returns
            result = self._one(_part(body.read(span), span.problem), target_study)
            if isinstance(result, Refusal):
                failed.append(_item(result.sop_class, result.sop_instance, result.reason))
                outcomes[f"{result.reason:#06x}"] += 1
            else:
                uids = result
                stored.append(_item(uids.sop_class, uids.sop_instance))
                studies.add(uids.study)
                outcomes["stored"] += 1
        for outcome, n in outcomes.items():
            self.metrics.dicom_instances.labels("stow", outcome).inc(n)
        telemetry.set_attribute("edgekit.stow.stored", len(stored))
        telemetry.set_attribute("edgekit.stow.refused", len(failed))
        telemetry.set_attribute("edgekit.studies", sorted(hash_uid(u) for u in studies))  # hashed as the log's
        if complete:
            for uid in studies:
                self.inbox.finish(uid)
        answer: dict[str, Any] = {}
        if target_study is not None:
            answer["0020000D"] = {"vr": "UI", "Value": [target_study]}
        if stored:
            answer["00081199"] = {"vr": "SQ", "Value": stored}
        if failed:
            answer["00081198"] = {"vr": "SQ", "Value": failed}
        status = 200 if not failed else (202 if stored else 409)
        log.info(
            "stow-rs: %d stored, %d refused (%s), studies %s",
            len(stored),
            len(failed),
            ", ".join(f"{k}x{v}" for k, v in sorted(outcomes.items()) if k != "stored") or "-",
            ",".join(sorted(hash_uid(u) for u in studies)) or "-",
        )
        return StoreResult(status, answer, len(stored), len(failed))

    def _one(self, part: Part, target_study: str | None):
        if part.problem is not None:
            return Refusal(DATASET_MISMATCH, part.problem)
        ctype, _ = media_type(part.headers.get("content-type", "application/dicom"))
        if ctype != "application/dicom":
            return Refusal(CANNOT_UNDERSTAND, "a part that is not application/dicom")
        parsed = parse_part(part.content, target_study)
        if isinstance(parsed, Refusal):
            return parsed
        _ds, uids = parsed
        try:
            self.inbox.add(part.content, uids)
        except OSError as err:  # disk full, permissions: the sender may retry later
            log.error("stow-rs: cannot store an instance (%s)", err.strerror or type(err).__name__)
            return Refusal(OUT_OF_RESOURCES, "cannot store the instance now", uids.sop_class, uids.sop_instance)
        telemetry.remember(self.inbox.root / key(uids.study))  # the study's job joins this request's trace
        return uids

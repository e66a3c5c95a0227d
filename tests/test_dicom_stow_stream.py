"""STOW-RS streamed: the body is spooled to disk as it arrives and split incrementally, so memory holds one part,
never the body. The splitter agrees with the whole-body one it replaced however the body is cut; the service
(`StowService` on a real `StudyInbox` in tmp_path) stores what it stored before, within a memory bound the old one
broke by far, and leaves no spool file behind, a client that disconnects mid-body included (in-process and against
the real daemon over its Unix socket)."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import socket
import time
import tracemalloc
import uuid
from importlib.resources import files
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pydicom = pytest.importorskip("pydicom")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from starlette.requests import ClientDisconnect  # noqa: E402

from edgekit.daemon.dicomweb import Part, StowService, _part  # noqa: E402
from edgekit.daemon.metrics import Metrics  # noqa: E402
from edgekit.daemon.stow_spool import (  # noqa: E402
    ENDS_INSIDE,
    MAX_PARTS,
    ClientGoneError,
    MultipartError,
    PartFinder,
)
from edgekit.daemon.studies import StudyInbox  # noqa: E402
from edgekit.daemon.uploads import InsufficientStorageError  # noqa: E402

SAMPLES = Path(str(files("edgekit.models") / "samples"))
CR = SAMPLES / "cr_chest" / "image.dcm"
CT = sorted((SAMPLES / "ct_chest").glob("*.dcm"))
CTYPE = 'multipart/related; type="application/dicom"; boundary={}'


def related(parts: list[bytes], boundary: str = "b0undary") -> tuple[bytes, str]:
    body = bytearray()
    for data in parts:
        body += f"--{boundary}\r\nContent-Type: application/dicom\r\n\r\n".encode() + data + b"\r\n"
    body += f"--{boundary}--\r\n".encode()
    return bytes(body), CTYPE.format(boundary)


# --- the splitter ------------------------------------------------------------------------------------------------
def reference_split(body: bytes, boundary: bytes) -> list[Part]:
    """The whole-body splitter the streaming one replaced (edgekitd before), kept as the oracle."""
    delim = b"--" + boundary
    start = body.find(delim)
    if start < 0:
        raise MultipartError("the body holds no part (the boundary never appears)")
    pos = start + len(delim)
    parts: list[Part] = []
    while True:
        if body.startswith(b"--", pos):
            break
        eol = body.find(b"\r\n", pos)
        if eol < 0:
            break
        pos = eol + 2
        nxt = body.find(b"\r\n" + delim, pos)
        end = nxt if nxt >= 0 else len(body)
        parts.append(_part(body[pos:end], None if nxt >= 0 else ENDS_INSIDE))
        if nxt < 0 or len(parts) > MAX_PARTS:
            break
        pos = nxt + 2 + len(delim)
    if not parts:
        raise MultipartError("the body holds no part")
    if len(parts) > MAX_PARTS:
        raise MultipartError(f"more than {MAX_PARTS} parts in one request")
    return parts


def streamed_split(body: bytes, boundary: bytes, cuts: list[int]) -> list[Part]:
    finder = PartFinder(boundary)
    edges = [0, *sorted(c % (len(body) + 1) for c in cuts), len(body)]
    for a, b in zip(edges, edges[1:], strict=False):
        finder.feed(body[a:b])
    return [_part(body[s.start : s.end], s.problem) for s in finder.finish()]


def outcome(split, *args):
    try:
        return [(p.headers, p.content, p.problem) for p in split(*args)]
    except MultipartError as err:
        return ("refused", str(err))


_piece = st.one_of(
    st.binary(max_size=30),
    st.sampled_from([b"--", b"\r\n", b"\r", b"-", b"\r\n\r\n", b"Content-Type: application/dicom"]),
)
_wire = st.sampled_from([b"b", b"b0undary", b"ab-ab"])


@st.composite
def bodies(draw) -> tuple[bytes, bytes]:
    boundary = draw(_wire)
    delim = b"--" + boundary
    body = b"".join(draw(st.lists(st.one_of(_piece, st.just(delim), st.just(b"\r\n" + delim)), max_size=25)))
    return body, boundary


@settings(max_examples=600, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(bodies(), st.lists(st.integers(0, 10_000), max_size=12))
def test_the_streaming_splitter_agrees_with_the_whole_body_one_however_the_body_is_cut(case, cuts):
    body, boundary = case
    want = outcome(reference_split, body, boundary)
    assert outcome(streamed_split, body, boundary, cuts) == want
    assert outcome(streamed_split, body, boundary, list(range(len(body)))) == want  # one byte at a time


def test_the_splitter_keeps_the_part_limit_and_a_cut_part():
    one = b"--b\r\n\r\nx\r\n"
    assert len(streamed_split(one * MAX_PARTS + b"--b--", b"b", [7, 99])) == MAX_PARTS
    with pytest.raises(MultipartError, match=f"more than {MAX_PARTS} parts"):
        streamed_split(one * (MAX_PARTS + 1) + b"--b--", b"b", [])
    parts = streamed_split(b"--b\r\nContent-Type: application/dicom\r\n\r\nONE\r\n--b\r\n\r\nTW", b"b", [20, 31])
    assert [(p.content, p.problem) for p in parts] == [(b"ONE", None), (b"TW", ENDS_INSIDE)]


# --- the service -------------------------------------------------------------------------------------------------
@pytest.fixture
def stow(tmp_path):
    inbox = StudyInbox(tmp_path / "state" / "inbox", lambda: 60.0, lambda folder: None)  # never started
    return StowService(inbox, Metrics()), tmp_path / "state" / "stow-spool"


async def chunked(body: bytes, size: int, fail_after: int | None = None):
    """What `Request.stream()` yields: the body in chunks, then b""; or ClientDisconnect part way."""
    for i in range(0, len(body), size):
        if fail_after is not None and i >= fail_after:
            raise ClientDisconnect()
        yield body[i : i + size]
    yield b""


def store(service: StowService, spool: Path, body: bytes, ctype: str, size: int = 65536, **kw):
    return asyncio.run(service.store(chunked(body, size, kw.pop("fail_after", None)), ctype, None, False, spool))


def spool_leftovers(spool: Path) -> list[str]:
    """Names in the spool folder, and this process's open files there (an anonymous file shows as `(deleted)`)."""
    names = [p.name for p in spool.iterdir()] if spool.exists() else []
    fds = Path("/proc/self/fd")
    held = [os.readlink(fd) for fd in fds.iterdir() if str(spool) in _readlink(fd)] if fds.is_dir() else []
    return names + held


def _readlink(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


@pytest.mark.parametrize("size", [7, 65536, 1 << 22])
def test_a_streamed_body_is_stored_part_by_part_and_the_spool_file_is_gone(stow, size):
    service, spool = stow
    body, ctype = related([CR.read_bytes(), CT[0].read_bytes(), b"not dicom", CT[1].read_bytes()[:3000]])
    result = store(service, spool, body, ctype, size)
    assert result.status == 202 and (result.stored, result.failed) == (2, 2)
    reasons = sorted(item["00081197"]["Value"][0] for item in result.body["00081198"]["Value"])
    assert reasons == [0xA900, 0xC000]  # truncated, not DICOM
    assert len(list(service.inbox.root.rglob("*.dcm"))) == 2
    assert spool.is_dir() and (spool.stat().st_mode & 0o777) == 0o700
    assert spool_leftovers(spool) == []


def test_framing_errors_are_refused_before_anything_is_stored_and_leave_no_spool(stow):
    service, spool = stow
    one = b"--b\r\nContent-Type: application/dicom\r\n\r\n" + CT[0].read_bytes() + b"\r\n"
    with pytest.raises(MultipartError, match="more than"):
        store(service, spool, one + b"--b\r\n\r\nx\r\n" * MAX_PARTS + b"--b--", CTYPE.format("b"))
    with pytest.raises(MultipartError, match="boundary never appears"):
        store(service, spool, b"no delimiter at all", CTYPE.format("b"))
    assert not list(service.inbox.root.rglob("*.dcm"))  # the first, valid part was not stored either
    assert spool_leftovers(spool) == []


def test_a_client_gone_mid_body_stores_nothing_logs_one_quiet_line_and_leaves_no_spool(stow, caplog):
    service, spool = stow
    body, ctype = related([CT[0].read_bytes(), CT[1].read_bytes()])
    with caplog.at_level(logging.INFO, logger="edgekitd"), pytest.raises(ClientGoneError):
        store(service, spool, body, ctype, 1000, fail_after=5000)
    lines = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert [r.getMessage() for r in lines] == ["stow-rs: client disconnected after 5000 bytes"]
    assert lines[0].levelno == logging.INFO and lines[0].exc_info is None
    assert not list(service.inbox.root.rglob("*.dcm"))
    assert spool_leftovers(spool) == []


def test_a_full_disk_while_spooling_is_a_507_and_frees_what_was_spooled(stow, tmp_path):
    """A real full disk: a 2 MB tmpfs under the spool (mounting one needs root; skipped where that is missing)."""
    import subprocess

    service, _ = stow
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(tiny)]).returncode:
        pytest.skip("mounting a 2 MB tmpfs (to fill a disk for real) needs root and mount(8)")
    try:
        free = os.statvfs(tiny).f_bfree
        body, ctype = related([b"x" * (4 << 20)])
        with pytest.raises(InsufficientStorageError) as err:
            store(service, tiny / "stow-spool", body, ctype)
        assert (err.value.code, err.value.http_status) == ("insufficient_storage", 507)
        assert spool_leftovers(tiny / "stow-spool") == [] and os.statvfs(tiny).f_bfree == free
    finally:
        subprocess.run(["umount", str(tiny)], check=True)


def big_instances(n: int, nbytes: int) -> list[bytes]:
    """`n` CT instances of one series, each with `nbytes` of uncompressed pixel data."""
    from pydicom.dataset import FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    ds = pydicom.dcmread(CT[0], stop_before_pixels=True)
    side = int((nbytes // 2) ** 0.5)
    ds.file_meta = FileMetaDataset(ds.file_meta)
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.Rows = ds.Columns = side
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.add_new(0x7FE00010, "OW", os.urandom(side * side * 2))  # PixelData
    out = []
    for _ in range(n):
        ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
        buf = io.BytesIO()
        ds.save_as(buf, enforce_file_format=True)
        out.append(buf.getvalue())
    return out


def test_memory_holds_one_part_not_the_body(stow):
    """20 parts of 2 MB: the Python heap's peak stays near two parts (a part and pydicom's copy of its pixel
    data); reading the body whole, as before, held it at least twice (80 MB)."""
    service, spool = stow
    parts = big_instances(20, 2 << 20)
    body, ctype = related(parts)
    part = max(len(p) for p in parts)
    tracemalloc.start()
    try:
        result = store(service, spool, body, ctype)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.status == 200 and result.stored == 20
    assert peak < 3 * part + (4 << 20), f"peak {peak / 2**20:.1f} MiB for {part / 2**20:.1f} MiB parts"
    assert spool_leftovers(spool) == []


# --- the daemon --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    pytest.importorskip("uvicorn")
    from edgekit.daemon.testing import tiny_daemon

    config = "[limits]\nmax_upload_bytes = 67108864\n[dicom]\nquiet_period_s = 60\n"
    with tiny_daemon(tmp_path_factory.mktemp("edgekitd-stow-stream"), config) as d:
        yield d


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def test_the_daemon_answers_a_client_gone_mid_body_with_one_quiet_line_and_no_spool(daemon):
    body, ctype = related(big_instances(4, 1 << 20))
    sent = len(body) // 2
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(daemon.socket))
        head = (
            f"POST /dicomweb/studies HTTP/1.1\r\nHost: edgekitd\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        s.sendall(head.encode() + body[:sent])
        time.sleep(0.3)  # the daemon has read (and spooled) what was sent
    deadline = time.monotonic() + 20
    while "stow-rs: client disconnected" not in daemon.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = daemon.log.read_text()
    lines = [line for line in log.splitlines() if "disconnected" in line]
    assert len(lines) == 1 and "stow-rs: client disconnected after" in lines[0], lines
    assert int(lines[0].rsplit("after ", 1)[1].split()[0]) <= sent
    assert "Traceback" not in log
    spool = daemon.state_dir / "stow-spool"
    fds = Path(f"/proc/{daemon.proc.pid}/fd")
    assert not [_readlink(fd) for fd in fds.iterdir() if str(spool) in _readlink(fd)]
    assert not list(spool.iterdir()) and not list((daemon.state_dir / "inbox").rglob("*.dcm"))
    assert daemon.client.get("/v2/health/ready").status == 200


def test_the_daemon_stores_a_48_mb_body_without_holding_it(daemon):
    """The daemon's resident set while it stores a 48 MB body of 24 parts, sampled from /proc: it grows by far
    less than the body (before, it grew by at least twice the body: the body, then a copy of every part)."""
    parts = big_instances(24, 2 << 20)
    body, ctype = related(parts)
    pid = daemon.proc.pid
    base = _status(pid, "VmRSS")
    peak = base
    reply = None

    def send():
        nonlocal reply
        reply = daemon.client.request("POST", "/dicomweb/studies", body=body, headers={"Content-Type": ctype})

    import threading

    t = threading.Thread(target=send)
    t.start()
    while t.is_alive():
        peak = max(peak, _status(pid, "VmRSS"))
        time.sleep(0.005)
    t.join()
    assert reply is not None and reply.status == 200, reply and reply.body[:300]
    assert len(reply.json()["00081199"]["Value"]) == 24
    grew = peak - base
    assert grew < len(body) // 3, f"RSS grew {grew / 2**20:.1f} MiB for a {len(body) / 2**20:.1f} MiB body"
    assert not list((daemon.state_dir / "stow-spool").iterdir())


def test_uuid_boundary_and_chunks_of_any_size_store_the_same(stow):
    service, spool = stow
    body, ctype = related([CT[2].read_bytes(), CT[3].read_bytes()], uuid.uuid4().hex)
    for size in (1, 3, 4096):
        assert store(service, spool, body, ctype, size).status == 200
    assert len(list(service.inbox.root.rglob("*.dcm"))) == 2  # the same two instances, replaced

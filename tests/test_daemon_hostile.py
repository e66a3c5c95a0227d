"""edgekitd under hostile input (issue 28), against a real daemon over its Unix socket: bombs refused from their
headers, slow bodies cut off while health answers, aborted uploads as one quiet line, an SR that cannot be built as
409, a full state directory as 507, crash loops quarantined, a config that cannot fit refused at start, and the
log filters. The figures at default settings come from bench/hostile_inputs.py."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the daemon needs the serve extra")

from edgekit.daemon.client import multipart, study_files  # noqa: E402
from edgekit.daemon.testing import DaemonProcess, tiny_daemon, write_tiny_model  # noqa: E402

from ingest_factory import make_dataset, ramp, rle_bomb, save  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "models" / "samples"
MiB = 2**20
LIMITS = "[limits]\nmax_upload_bytes = 8388608\ningest_memory_bytes = 67108864\nbody_timeout_s = 1.0\nmax_uploads = 2\n"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with tiny_daemon(tmp_path_factory.mktemp("hostile"), LIMITS) as d:
        yield d


def _slow_upload(path: Path) -> socket.socket:
    """A POST whose headers promise 1 MB and whose body never comes."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(path))
    s.sendall(
        b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        b"Content-Length: 1000000\r\n\r\n--b"
    )
    return s


def _status(s: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next((h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0))
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(head.split(b" ")[1]), json.loads(body or b"{}")


def test_slow_bodies_are_cut_off_and_health_answers_meanwhile(daemon):
    held = [_slow_upload(daemon.socket) for _ in range(2)]
    time.sleep(0.2)  # both are being read: the next ones are refused unread
    extra = [_slow_upload(daemon.socket) for _ in range(4)]
    t0 = time.monotonic()
    for s in extra:
        status, body = _status(s)
        assert (status, body["error"]["code"]) == (503, "uploads_busy")
    assert time.monotonic() - t0 < 1.0
    assert daemon.client.get("/v2/health/ready", timeout=2).status == 200
    # a small JSON body is not an upload: it is not held to max_uploads
    assert daemon.client.put_json("/v1/variants/active", {"name": "default"}).status == 200
    for s in held:
        status, body = _status(s)
        assert (status, body["error"]["code"]) == (408, "request_timeout")
        assert "limits.min_body_rate" in body["error"]["message"]
    assert time.monotonic() - t0 < 5
    for s in held + extra:
        s.close()
    reply = daemon.client.report(SAMPLES / "cr_chest" / "image.dcm", "Cough.")
    assert reply.status == 200, reply.body[:300]
    metrics = daemon.client.get("/metrics").body.decode()
    assert "edgekitd_slow_bodies_total 2.0" in metrics and "edgekitd_rejected_uploads_total 4.0" in metrics


def test_a_decompression_bomb_is_413_before_decoding(daemon, tmp_path):
    bomb = rle_bomb(tmp_path / "bomb.dcm", frames=12)
    t0 = time.monotonic()
    reply = daemon.client.post_study("/v1/reports", study_files(bomb))
    assert (reply.status, reply.error_code) == (413, "study_too_large"), reply.body[:300]
    assert "over the ingest memory budget of 64 MiB" in reply.json()["error"]["message"]
    assert time.monotonic() - t0 < 5
    assert daemon.client.get("/v2/health/ready").status == 200


def test_an_aborted_upload_is_one_quiet_line(daemon):
    before = daemon.log.stat().st_size
    files = study_files(SAMPLES / "cr_chest" / "image.dcm")
    body, ctype = multipart({"prompt": "x"}, files)
    for _ in range(3):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(daemon.socket))
        head = f"POST /v1/reports HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n"
        s.sendall(head.encode() + body[: len(body) // 2])
        s.close()
        time.sleep(0.3)  # one at a time: limits.max_uploads is 2 here
    assert daemon.client.get("/v2/health/ready").status == 200
    log = daemon.log.read_bytes()[before:].decode()
    assert "Traceback" not in log and "internal_error" not in log and "-> 500" not in log
    assert log.count("client disconnected during POST /v1/reports") == 3


def test_an_sr_from_headers_with_invalid_or_absent_type2_values_is_built_and_leaks_nothing(daemon, tmp_path):
    """A birth date its VR forbids and no PatientSex (Type 2): the SR carries both empty and says which, where it
    used to answer 500; nothing of the patient's reaches the log. (An SR that cannot be built at all, from a
    video, is 409 sr_unavailable: tests/test_daemon_api.py.)"""
    import pydicom
    from pydicom import config

    ds = make_dataset(ramp(32, 32))
    with config.disable_value_validation():
        ds.PatientBirthDate = "19811399"
    assert "PatientSex" not in ds
    path = save(ds, tmp_path / "bad-date.dcm")
    reply = daemon.client.post_study("/v1/reports?format=sr", study_files(path))
    assert reply.status == 200, reply.body[:300]
    job = daemon.client.post_study("/v1/jobs", study_files(path)).json()
    assert daemon.client.wait_job(job["id"])["state"] == "succeeded"
    sr = daemon.client.get(f"/v1/jobs/{job['id']}/sr")
    assert sr.status == 200
    for body in (reply.body, sr.body):
        out = pydicom.dcmread(io.BytesIO(body))
        assert out.StudyInstanceUID == ds.StudyInstanceUID and out.PatientName == ds.PatientName
        assert out.PatientBirthDate == "" and out.PatientSex == ""
        assert b"the source's PatientBirthDate is not a valid value; left empty" in body
    log = daemon.log.read_text()
    for secret in ("19811399", str(ds.PatientName), ds.PatientID, ds.StudyInstanceUID):
        assert secret not in log


def test_a_full_state_dir_is_507_and_not_ready(daemon):
    config = daemon.state_dir.parent / "edgekitd.toml"  # tiny_daemon's
    try:
        config.write_text(LIMITS + f"min_free_bytes = {2**60}\n")
        daemon.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while daemon.client.get("/v2/health/ready").status == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        ready = daemon.client.get("/v2/health/ready")
        assert (ready.status, ready.json()["status"]) == (503, "state_dir_full")
        for _ in range(20):  # more than max_queue (16): a refused upload must give its queue slot back
            sync = daemon.client.post_study("/v1/reports", study_files(SAMPLES / "cr_chest" / "image.dcm"))
            assert (sync.status, sync.error_code) == (507, "insufficient_storage")
        jobs_before = set((daemon.state_dir / "jobs").iterdir())
        reply = daemon.client.post_study("/v1/jobs", study_files(SAMPLES / "cr_chest" / "image.dcm"))
        assert (reply.status, reply.error_code) == (507, "insufficient_storage")
        assert set((daemon.state_dir / "jobs").iterdir()) == jobs_before, "a refused upload left its files"
        part = (SAMPLES / "cr_chest" / "image.dcm").read_bytes()
        body = b"--b\r\nContent-Type: application/dicom\r\n\r\n" + part + b"\r\n--b--\r\n"
        ctype = 'multipart/related; type="application/dicom"; boundary=b'
        stow = daemon.client.request("POST", "/dicomweb/studies", body, {"Content-Type": ctype})
        assert (stow.status, stow.error_code) == (507, "insufficient_storage")
        assert not list((daemon.state_dir / "inbox").glob("[!.]*")), "a refused STOW-RS stored an instance"
    finally:
        config.write_text(LIMITS)
        daemon.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while daemon.client.get("/v2/health/ready").status != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
    ready = daemon.client.get("/v2/health/ready")
    assert ready.status == 200 and ready.json()["queue_depth"] == 0  # no slot was kept by a refused upload
    assert daemon.client.report(SAMPLES / "cr_chest" / "image.dcm", "Cough.").status == 200


def test_state_files_are_private_under_the_tests_umask(daemon):
    assert os.umask(os.umask(0)) & 0o077 != 0o077, "the test process's umask would make any file private"
    assert (daemon.state_dir / "jobs.sqlite3").stat().st_mode & 0o777 == 0o600
    wal = daemon.state_dir / "jobs.sqlite3-wal"
    assert not wal.exists() or wal.stat().st_mode & 0o777 == 0o600


def test_crash_loops_end_as_quarantined_jobs(tmp_path):
    """A received study whose hand-over killed the daemon three times, and a job started three times: the next
    start fails both as quarantined, keeps their files and counts them."""
    from edgekit.daemon.jobs import Job, JobStore

    state = tmp_path / "state"
    series = state / "inbox" / ".taken" / "abc.12345678" / "series1"
    series.mkdir(parents=True)
    save(make_dataset(ramp(16, 16)), series / "inst.dcm")
    (series.parent / ".attempts").write_text("3")
    store = JobStore(state)
    job_input = store.job_dir("a" * 32) / "input"
    job_input.mkdir(parents=True)
    save(make_dataset(ramp(16, 16)), job_input / "x.dcm")
    store.insert(
        Job("a" * 32, None, "f", "queued", None, "", {}, str(job_input / "x.dcm"), time.time())  # noqa: S108
    )
    for _ in range(3):
        store.mark_running("a" * 32)
    store.close()
    model = write_tiny_model(tmp_path / "model")
    with DaemonProcess(state, model).start() as d:
        deadline = time.monotonic() + 20
        while len(d.client.get("/v1/jobs?state=failed").json()["jobs"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        failed = d.client.get("/v1/jobs?state=failed").json()["jobs"]
        assert sorted(j["error"]["code"] for j in failed) == ["quarantined", "quarantined"], failed
        metrics = d.client.get("/metrics").body.decode()
        assert 'edgekitd_quarantined_total{kind="job"} 1.0' in metrics
        assert 'edgekitd_quarantined_total{kind="received_study"} 1.0' in metrics
    kept = list((state / "quarantine").glob("*/series1/inst.dcm"))
    assert len(kept) == 1 and (job_input / "x.dcm").exists()
    assert not (state / "inbox" / ".taken" / "abc.12345678").exists()


def test_a_config_that_cannot_fit_the_memory_limit_does_not_start(tmp_path):
    """The cgroup is read from a fixture tree with the real layout (config's signals_root)."""
    root = tmp_path / "root"
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text("0::/system.slice/edgekitd.service\n")
    unit = root / "sys/fs/cgroup/system.slice/edgekitd.service"
    unit.mkdir(parents=True)
    (unit / "memory.max").write_text(f"{4 * 2**30}\n")
    (root / "sys/fs/cgroup/system.slice/memory.max").write_text("max\n")
    config = tmp_path / "edgekitd.toml"
    config.write_text(
        f"[scheduler]\ningest_processes = 2\n[limits]\ningest_memory_bytes = {3 * 2**30}\n"
        f'[policy]\nprofile = "p.json"\nsignals_root = "{root}"\n'
    )
    from edgekit.daemon.memory import cgroup_memory_max

    assert cgroup_memory_max(root) == 4 * 2**30
    out = subprocess.run(
        [sys.executable, "-m", "edgekit.daemon", "--config", str(config), "--state-dir", str(tmp_path / "s"),
         "--socket", str(tmp_path / "d.sock")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    checked = subprocess.run(
        [sys.executable, "-m", "edgekit.daemon", "--config", str(config), "--check-config"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # 3072 + 512 (max_upload_bytes) + 768 (runtime) + 2 x 96 (ingest processes)
    assert checked.returncode == 2 and "needs about 4544 MiB" in checked.stderr  # --check-config says so too
    assert (
        "needs about 4544 MiB" in out.stderr
        and "192 MiB for 2 ingest process(es)" in out.stderr
        and "memory limit (cgroup memory.max, systemd's MemoryMax=) is 4096 MiB" in out.stderr
    )


def test_the_memory_pool_refuses_what_it_cannot_hold_and_takes_it_back():
    from edgekit.daemon.memory import IngestBusyError, MemoryPool

    seen = []
    pool = MemoryPool(100, seen.append)
    a = pool.reserve(60)
    with pytest.raises(IngestBusyError) as info:
        pool.reserve(50)
    assert info.value.http_status == 503 and "retry" in info.value.reason
    forced = pool.reserve(50, force=True)  # a job a worker already runs
    assert pool.held == 110
    a.release()
    a.release()  # idempotent: every path that ends a work item may call it
    forced.release()
    assert pool.held == 0 and seen[-1] == 0


def test_the_log_filters_scrub_exceptions_and_hold_back_floods():
    from edgekit.daemon.logs import RateLimit
    from edgekit.ingest.phi import ScrubExceptions

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(ScrubExceptions())
    handler.addFilter(RateLimit(interval_s=60))
    logger = logging.getLogger("test-hostile")
    logger.addHandler(handler)
    try:
        name, born = "Doe^John", "19811399"  # a traceback's source lines show these names, not the values
        try:
            raise ValueError(f"Invalid value for VR PN: {name!r} born {born}")
        except ValueError:
            logger.exception("building the SR failed")
        logging.getLogger("highdicom.sr.templates").addHandler(handler)
        logging.getLogger("highdicom.sr.templates").warning("copying %s", "'Doe^John'")
        flood = logging.getLogger("asyncio")
        flood.addHandler(handler)
        for _ in range(100):
            flood.error("socket.accept() out of system resource")
    finally:
        for name in ("test-hostile", "highdicom.sr.templates", "asyncio"):
            logging.getLogger(name).removeHandler(handler)
    text = out.getvalue()
    assert "Doe^John" not in text and "19811399" not in text
    assert "Traceback" in text and "ValueError: Invalid value for VR PN" in text  # the frames stay readable
    assert text.count("socket.accept() out of system resource") == 1


def test_an_instance_that_cannot_be_written_leaves_no_part_file(tmp_path):
    """A real full disk: the inbox on a 1 MiB tmpfs (root only; CI runs as root)."""
    from edgekit.daemon.instances import InstanceUids
    from edgekit.daemon.studies import StudyInbox

    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)]).returncode:
        pytest.skip("mounting a tmpfs needs root and mount(8): no way to fill a disk here")
    try:
        inbox = StudyInbox(mount / "inbox", lambda: 10.0, lambda _folder: None)
        with pytest.raises(OSError) as info:
            inbox.add(bytes(2 * MiB), InstanceUids("1.2.3", "1.2.3.4", "1.2.3.4.5", "1.2.840.10008.5.1.4.1.1.2"))
        assert info.value.errno == 28  # ENOSPC
        assert not list((mount / "inbox").rglob("*.part")) and not list((mount / "inbox").rglob("*.dcm"))
        floor = StudyInbox(mount / "inbox", lambda: 10.0, lambda _folder: None, min_free=lambda: 2 * MiB)
        with pytest.raises(OSError) as info:  # a small instance, refused before the last space is gone
            floor.add(bytes(1024), InstanceUids("1.2.3", "1.2.3.4", "1.2.3.4.6", "1.2.840.10008.5.1.4.1.1.2"))
        assert info.value.errno == 28 and not list((mount / "inbox").rglob("*.dcm"))
        # a study handed over on the full disk: counting the attempt fails, and the inbox's thread lives on
        taken = mount / "inbox" / ".taken" / "abc.1"
        (taken / "series").mkdir(parents=True)
        (mount / "fill").write_bytes(bytes(max(0, os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize)))
        floor.start()
        time.sleep(1.5)
        assert floor._thread.is_alive() and taken.exists()
        floor.stop()
    finally:
        subprocess.run(["umount", str(mount)])


def test_a_hand_over_is_counted_on_disk_before_the_study_is_ingested(tmp_path):
    """What a crash loop is counted by: the count is durable before the service is handed the study."""
    from edgekit.daemon.instances import InstanceUids
    from edgekit.daemon.studies import ATTEMPTS, StudyInbox

    seen = []
    handed = __import__("threading").Event()

    def complete(folder: Path) -> None:  # the service's place: read what a crash here would leave on disk
        seen.append((folder / ATTEMPTS).read_text())
        handed.set()

    inbox = StudyInbox(tmp_path / "inbox", lambda: 0.0, complete)
    save(make_dataset(ramp(8, 8)), tmp_path / "x.dcm")
    inbox.add((tmp_path / "x.dcm").read_bytes(), InstanceUids("1.2.3", "1.2.3.4", "1.2.3.4.5", "1.2.840.1"))
    inbox.start()
    try:
        assert handed.wait(10)
    finally:
        inbox.stop()
    assert seen == ["1"]


def test_state_dir_database_is_created_private(tmp_path):
    from edgekit.daemon.jobs import JobStore

    old = os.umask(0o022)
    try:
        JobStore(tmp_path).close()
    finally:
        os.umask(old)
    assert (tmp_path / "jobs.sqlite3").stat().st_mode & 0o777 == 0o600
    assert sqlite3.connect(tmp_path / "jobs.sqlite3").execute("SELECT COUNT(*) FROM jobs").fetchone() == (0,)


def test_a_stalled_or_crashed_decoder_fails_its_study_only(tmp_path):
    """The study's ingest process stalls (SIGSTOP: a decoder in an endless loop) and then dies (SIGKILL: a decoder's
    segfault, the OOM killer): each is that report's 422, the daemon keeps serving and replaces the process."""
    from edgekit.daemon.testing import process_tree

    sample = SAMPLES / "cr_chest" / "image.dcm"
    config = "[scheduler]\ningest_processes = 1\n[limits]\ningest_timeout_s = 2.0\n"  # one process to stall
    with tiny_daemon(tmp_path, config) as d:
        (worker,) = [p for p in process_tree(d.proc.pid) if p != d.proc.pid]  # started with the daemon
        assert d.client.post_study("/v1/reports", study_files(sample)).status == 200
        os.kill(worker, signal.SIGSTOP)
        reply = d.client.post_study("/v1/reports", study_files(sample))
        assert reply.status == 422 and reply.json()["error"]["code"] == "ingest_timeout", reply.body[:300]
        assert "longer than 2 s" in reply.json()["error"]["message"]
        assert d.client.post_study("/v1/reports", study_files(sample)).status == 200
        (worker,) = [p for p in process_tree(d.proc.pid) if p != d.proc.pid]

        def kill_when_decoding() -> None:
            os.kill(worker, signal.SIGSTOP)  # held at its next study, then killed mid-study
            time.sleep(0.5)
            os.kill(worker, signal.SIGKILL)

        killer = threading.Thread(target=kill_when_decoding)
        killer.start()
        reply = d.client.post_study("/v1/reports", study_files(sample))
        killer.join()
        assert reply.status == 422 and reply.json()["error"]["code"] == "ingest_crashed", reply.body[:300]
        assert "killed by SIGKILL" in reply.json()["error"]["message"]
        assert d.client.post_study("/v1/reports", study_files(sample)).status == 200
        assert d.proc.poll() is None

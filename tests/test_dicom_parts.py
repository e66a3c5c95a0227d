"""The DICOM networking parts on their own, fast: config checks, multipart splitting, the inbox's quiet period and
its recovery after a restart, and delivery retries with backoff against a real HTTP server that fails first."""

from __future__ import annotations

import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from edgekit.daemon.config import load_config
from edgekit.errors import ConfigError

pytest.importorskip("prometheus_client")


def _config(tmp_path: Path, text: str):
    path = tmp_path / "edgekitd.toml"
    path.write_text(text)
    return load_config(path)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("[dimse]\nenabled = true\n", "dimse.allowed"),
        ("[dimse]\nport = 0\n", "dimse.port"),
        ("[dimse]\nbogus = 1\n", "unknown key dimse.bogus"),
        ("[dicom]\nquiet_period_s = -1\n", "quiet_period_s"),
        ('[[destinations]]\nname = "p"\nkind = "ftp"\n', "kind must be one of"),
        ('[[destinations]]\nname = "p"\nkind = "stow"\n', 'needs url = "http(s)://..."'),
        ('[[destinations]]\nname = "p"\nkind = "cstore"\nhost = "h"\n', "needs ae_title, host and port"),
        ('[[destinations]]\nname = "p"\nkind = "webhook"\nurl = "http://x"\n' * 2, "unique"),
        ("[delivery]\nmax_attempts = 0\n", "max_attempts"),
        ('[dimse]\nae_title = "WAY_TOO_LONG_FOR_AN_AE"\n', "ae_title"),
    ],
)
def test_bad_dicom_config_is_refused_naming_the_key(tmp_path, text, needle):
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, text)
    assert needle in str(err.value)


def test_dicom_config_reads_every_section(tmp_path):
    cfg = _config(
        tmp_path,
        '[dicom]\nquiet_period_s = 3\nprompt = "Chest pain."\n[dimse]\nenabled = true\nport = 104\n'
        '[[dimse.allowed]]\nae_title = "CT1"\nhost = "10.0.0.5"\n[[destinations]]\nname = "pacs"\nkind = "cstore"\n'
        'ae_title = "PACS"\nhost = "10.0.0.9"\nport = 104\n[delivery]\nmax_attempts = 3\n',
    )
    d = cfg.dicom
    assert (d.quiet_period_s, d.prompt, d.scp, d.scp_port, d.max_attempts) == (3.0, "Chest pain.", True, 104, 3)
    assert d.scp_host == "127.0.0.1"  # loopback unless told otherwise
    assert d.allowed[0].admits("CT1", "10.0.0.5") and not d.allowed[0].admits("CT1", "10.0.0.6")
    assert d.destination("pacs").describe() == "pacs (C-STORE PACS@10.0.0.9:104)"


def test_multipart_splitting_keeps_parts_and_marks_a_cut_one():
    from edgekit.daemon.dicomweb import MultipartError, boundary_of, split_parts

    b = boundary_of('multipart/related; type="application/dicom"; boundary="a b"')
    assert b == b"a b"
    parts = split_parts(b"preamble\r\n--a b\r\nContent-Type: application/dicom\r\n\r\nONE\r\n--a b\r\n\r\nTWO", b)
    assert [(p.content, p.problem is None) for p in parts] == [(b"ONE", True), (b"TWO", False)]
    assert parts[0].headers == {"content-type": "application/dicom"}
    with pytest.raises(MultipartError):
        split_parts(b"no boundary here", b)


def _uids(study: str, n: int):
    from edgekit.daemon.instances import InstanceUids

    return InstanceUids(study, study + ".1", f"{study}.1.{n}", "1.2.840.10008.5.1.4.1.1.2")


def test_inbox_waits_for_the_quiet_period_and_a_restart_keeps_what_it_held(tmp_path):
    from edgekit.daemon.studies import StudyInbox

    handed: list[tuple[float, int]] = []
    t0 = time.monotonic()

    def complete(folder: Path) -> None:
        handed.append((time.monotonic() - t0, len(list(folder.rglob("*.dcm")))))

    quiet = 1.5
    inbox = StudyInbox(tmp_path / "inbox", lambda: quiet, complete)
    inbox.start()
    for i in range(3):
        last = time.monotonic() - t0
        inbox.add(b"x" * 10, _uids("1.2.3", i))
        time.sleep(0.05)  # well within the quiet period: the study stays open
    deadline = time.monotonic() + 20
    while not handed and time.monotonic() < deadline:
        time.sleep(0.02)
    inbox.stop()
    assert len(handed) == 1 and handed[0][1] == 3  # one study, all three instances
    assert handed[0][0] - last >= quiet  # handed over only after a quiet period since the last instance

    # a restart: what a stopped inbox held is handed over by the next one
    inbox2 = StudyInbox(tmp_path / "inbox2", lambda: 60.0, complete)
    inbox2.add(b"y", _uids("9.8.7", 1))  # never started: the study sits on disk
    inbox3 = StudyInbox(tmp_path / "inbox2", lambda: 0.05, complete)
    assert inbox3.start() == 1
    deadline = time.monotonic() + 10
    while len(handed) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    inbox3.stop()
    assert handed[1][1] == 1
    assert not list((tmp_path / "inbox2").rglob("*.dcm"))  # handed over and removed


def test_a_failing_webhook_is_retried_with_backoff_then_delivered_and_a_dead_one_stops(tmp_path):
    from edgekit.daemon.delivery import DeliveryWorker
    from edgekit.daemon.dicom_config import Destination, DicomSettings
    from edgekit.daemon.jobs import DeliveryStore, Job, JobStore
    from edgekit.daemon.metrics import Metrics

    answers = [503, 500, 204]
    got: list[float] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            got.append(time.monotonic())
            self.send_response(answers.pop(0) if answers else 204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    settings = DicomSettings(
        destinations=(
            Destination("hook", "webhook", url=f"http://127.0.0.1:{server.server_address[1]}/"),
            Destination("gone", "webhook", url="http://127.0.0.1:9/", timeout_s=1),
        ),
        max_attempts=3,
        backoff_s=0.1,
        poll_s=0.05,
    )
    store = JobStore(tmp_path)
    deliveries = DeliveryStore(store)
    job = Job("a" * 32, None, "f", "queued", None, "", {}, "", time.time())
    store.insert(job, ("hook", "gone"))
    store.job_dir(job.id).mkdir(parents=True)
    store.finish(job.id, result={"text": "No acute findings."})
    metrics = Metrics()
    worker = DeliveryWorker(store, deliveries, lambda: settings, metrics)
    worker.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        states = {d.destination: d for d in deliveries.for_job(job.id)}
        if all(d.state != "pending" for d in states.values()):
            break
        time.sleep(0.05)
    worker.stop()
    server.shutdown()
    assert (states["hook"].state, states["hook"].attempts) == ("delivered", 3)
    assert got[1] - got[0] >= 0.09 and got[2] - got[1] >= 0.19  # 0.1 s, then twice that
    assert (states["gone"].state, states["gone"].attempts) == ("dead", 3)
    assert [j.id for j in store.list(delivery="dead")] == [job.id]
    assert 'edgekitd_deliveries_state{state="dead"} 1.0' in metrics.render().decode()


@pytest.mark.skipif(os.environ.get("EDGEKIT_REQUIRE_PACS") != "1", reason="EDGEKIT_REQUIRE_PACS=1 not set")
def test_ci_has_the_real_pacs_and_dicom_tools():
    """CI sets EDGEKIT_REQUIRE_PACS=1 where it can install them: a failed apt step would otherwise only show as the
    Orthanc and DCMTK tests skipping."""
    from edgekit.daemon.testing_pacs import missing

    assert missing("Orthanc", "dicomweb-plugin", "storescu", "echoscu") is None

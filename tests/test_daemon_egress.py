"""edgekitd's outbound deliveries against real HTTP servers on loopback: a redirect is a failed attempt that sends
nothing (and no credential) to the redirect's target, URLs reach `last_error` and the log without userinfo or query,
every failure counts toward `max_attempts`, and a study whose SR cannot be built dead-letters its SR deliveries
while its webhook still goes, with no patient value in the log."""

from __future__ import annotations

import io
import json
import logging
import shutil
import socket
import ssl
import subprocess
import threading
import time
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pydicom
import pytest
from pydicom.dataset import FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, generate_uid

from edgekit.daemon.delivery import DeliveryWorker
from edgekit.daemon.dicom_config import Destination, DicomSettings
from edgekit.daemon.jobs import DeliveryStore, Job, JobStore
from edgekit.daemon.metrics import Metrics
from edgekit.daemon.sr import collect_evidence

TOKEN = "tok-" + "7" * 24
STUDY_UID = "1.2.826.0.1.3680043.8.498.4242424242"
PATIENT = {"PatientName": "DOE^JANE", "PatientID": "MRN-55501", "PatientBirthDate": "19810203", "PatientSex": "F"}


class Recorder:
    """A real HTTP server on 127.0.0.1 that records every request (method, path, headers, body) and answers
    `status`, with a Location header when `location` is set; HTTPS when given a (cert, key) pair."""

    def __init__(self, status: int = 204, location: str | None = None, tls: tuple[Path, Path] | None = None):
        self.got: list[tuple[str, str, dict[str, str], bytes]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                recorder.got.append((self.command, self.path, dict(self.headers), body))
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = do_PUT = _answer  # noqa: N815

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def servers():
    made: list[Recorder] = []

    def make(*args, **kwargs) -> Recorder:
        made.append(Recorder(*args, **kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _study(tmp_path: Path, **override) -> Path:
    """A real DICOM file (header only: the SR needs no pixels) with the patient values a log must never show;
    an override of None deletes the attribute."""
    ds = pydicom.Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the invalid date is the point of some tests
        for key, value in {**PATIENT, **override}.items():
            if value is not None:
                setattr(ds, key, value)
    ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.SOPInstanceUID = STUDY_UID, generate_uid(), generate_uid()
    ds.SOPClassUID = "1.2.840.10008.5.1.4.1.1.1"  # CR
    ds.file_meta.MediaStorageSOPClassUID, ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPClassUID, ds.SOPInstanceUID
    ds.Modality, ds.StudyDate, ds.StudyTime, ds.StudyID, ds.AccessionNumber = "CR", "20240105", "101010", "1", "A77"
    ds.ReferringPhysicianName = ""
    path = tmp_path / "study.dcm"
    ds.save_as(path, enforce_file_format=True)
    return path


def _job(store: JobStore, destinations: tuple[str, ...], evidence_from: Path | None = None) -> Job:
    job = Job(JobStore.new_id(), None, "f", "queued", None, "", {}, "", time.time())
    store.insert(job, destinations)
    store.job_dir(job.id).mkdir(parents=True)
    if evidence_from is not None:
        store.save_evidence(job.id, collect_evidence(evidence_from))
    store.finish(job.id, result={"text": "No acute findings.", "findings_text": "Clear lungs.", "impression": "Ok."})
    return job


def _drain(worker: DeliveryWorker, deliveries: DeliveryStore, limit: int = 20) -> int:
    """Attempt every pending delivery until none is left, ignoring the backoff's wait; the number of attempts."""
    n = 0
    while n < limit and (due := deliveries.due(now=time.time() + 1e6)):
        for d, job_state in due:
            worker.attempt(d, job_state)
            n += 1
    return n


def _logged(caplog) -> str:
    return "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)


@pytest.mark.parametrize("status", [302, 307])
@pytest.mark.parametrize("kind", ["webhook", "stow"])
@pytest.mark.parametrize("userinfo", ["user:secret@", ""])
def test_a_redirect_is_a_failed_attempt_that_sends_nothing_to_its_target(
    tmp_path, servers, caplog, status, kind, userinfo
):
    caplog.set_level(logging.DEBUG)
    target = servers(204)
    first = servers(status, location=f"http://127.0.0.1:{target.port}/elsewhere")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    url = f"http://{userinfo}127.0.0.1:{first.port}/hook?token=abc"
    settings = DicomSettings(destinations=(Destination("out", kind, url=url, token_file=token_file, timeout_s=5),))
    store = JobStore(tmp_path / "state")
    deliveries = DeliveryStore(store)
    job = _job(store, ("out",), _study(tmp_path))
    worker = DeliveryWorker(store, deliveries, lambda: settings, Metrics())

    (d, job_state), *_ = deliveries.due()
    assert worker.attempt(d, job_state) == "pending"

    assert target.got == []  # nothing followed the Location: no GET, no POST, no token
    [(method, path, headers, body)] = first.got
    assert method == "POST" and body  # the configured host got the POST and the credential
    assert path == ("/hook/studies?token=abc" if kind == "stow" else "/hook?token=abc")
    assert headers["Authorization"] == f"Bearer {TOKEN}"  # the token file's bearer wins over user:secret@
    [after] = deliveries.for_job(job.id)
    assert (after.state, after.attempts) == ("pending", 1)
    assert after.last_error == (
        f"HTTP {status} from out ({kind} http://127.0.0.1:{first.port}/hook): redirects are not followed"
    )
    logged = _logged(caplog)
    assert f"HTTP {status} from out" in logged
    for secret in ("secret", "user:", "token=abc", "?", TOKEN):
        assert secret not in after.last_error
        assert secret not in logged


def test_an_unreachable_url_is_named_without_userinfo_or_query(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://user:secret@127.0.0.1:{port}/hook?token=abc"
    settings = DicomSettings(destinations=(Destination("out", "webhook", url=url, timeout_s=2),), max_attempts=2)
    store = JobStore(tmp_path)
    deliveries = DeliveryStore(store)
    job = _job(store, ("out",))
    assert _drain(DeliveryWorker(store, deliveries, lambda: settings, Metrics()), deliveries) == 2
    [after] = deliveries.for_job(job.id)
    assert (after.state, after.attempts) == ("dead", 2)
    where = f"out (webhook http://127.0.0.1:{port}/hook)"
    assert after.last_error == f"cannot reach {where}: ConnectError (Connection refused)"
    for secret in ("secret", "token=abc"):
        assert secret not in _logged(caplog)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_is_verified_against_the_system_store(tmp_path, servers, monkeypatch):
    """A self-signed certificate fails the attempt before any request is sent; the same certificate installed as a
    CA (SSL_CERT_FILE: how OpenSSL's default store is pointed elsewhere) is trusted."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    hook = servers(204, tls=(cert, key))
    settings = DicomSettings(destinations=(Destination("out", "webhook", url=f"https://127.0.0.1:{hook.port}/h"),))
    store = JobStore(tmp_path / "state")
    deliveries = DeliveryStore(store)
    job = _job(store, ("out",))
    worker = DeliveryWorker(store, deliveries, lambda: settings, Metrics())
    (d, job_state), *_ = deliveries.due()
    assert worker.attempt(d, job_state) == "pending"
    [after] = deliveries.for_job(job.id)
    where = f"out (webhook https://127.0.0.1:{hook.port}/h)"
    assert after.last_error == f"cannot reach {where}: ConnectError (CERTIFICATE_VERIFY_FAILED)"
    assert hook.got == []
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    (d, job_state), *_ = deliveries.due(now=time.time() + 1e6)
    assert worker.attempt(d, job_state) == "delivered"
    assert [m for m, *_ in hook.got] == ["POST"]


def test_a_study_without_an_sr_dead_letters_its_sr_deliveries_and_still_sends_its_webhook(tmp_path, servers, caplog):
    """Evidence from two studies: an SR references one, so there is none to send (sr.SrUnavailableError)."""
    caplog.set_level(logging.DEBUG)
    pacs, hook = servers(200), servers(204)
    settings = DicomSettings(
        destinations=(
            Destination("pacs", "stow", url=f"http://127.0.0.1:{pacs.port}/dicom-web", timeout_s=5),
            Destination("hook", "webhook", url=f"http://127.0.0.1:{hook.port}/hook", timeout_s=5),
        ),
        max_attempts=3,
        backoff_s=0.01,
        max_backoff_s=0.02,
    )
    store = JobStore(tmp_path / "state")
    deliveries = DeliveryStore(store)
    two = tmp_path / "two-studies"
    two.mkdir()
    _study(tmp_path).rename(two / "a.dcm")
    other = pydicom.dcmread(_study(tmp_path))
    other.StudyInstanceUID = "1.2.826.0.1.3680043.2.1125.99"
    other.save_as(two / "b.dcm")
    job = _job(store, ("pacs", "hook"), two)
    metrics = Metrics()
    worker = DeliveryWorker(store, deliveries, lambda: settings, metrics)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _drain(worker, deliveries) == 4  # 3 for the SR, 1 for the webhook: then nothing is due

    states = {d.destination: d for d in deliveries.for_job(job.id)}
    assert (states["pacs"].state, states["pacs"].attempts) == ("dead", 3)
    assert states["pacs"].last_error == "the source instances belong to 2 studies; an SR references one"
    assert pacs.got == []
    assert (states["hook"].state, states["hook"].attempts) == ("delivered", 1)
    [(method, _, _, body)] = hook.got
    payload = json.loads(body)
    assert method == "POST" and payload["job"]["id"] == job.id and payload["event"] == "report.finished"
    assert "study_instance_uid" not in payload and "sr_sop_instance_uid" not in payload
    assert 'edgekitd_deliveries_total{destination="pacs",outcome="dead"} 1.0' in metrics.render().decode()

    seen = _logged(caplog) + "\n".join(str(w.message) for w in caught) + states["pacs"].last_error
    assert "dead letter" in seen
    for value in (PATIENT["PatientBirthDate"], "DOE", "JANE", PATIENT["PatientID"], STUDY_UID, "4242424242"):
        assert value not in seen


def test_a_failure_outside_delivery_errors_counts_and_dead_letters(tmp_path, caplog):
    """A kept SR that is not DICOM makes pydicom raise in the C-STORE sender: not a DeliveryError, still one
    failed attempt of `max_attempts`, logged with where it happened but not its message."""
    pytest.importorskip("pynetdicom", reason="C-STORE needs pynetdicom (the serve extra)")
    caplog.set_level(logging.DEBUG)
    settings = DicomSettings(
        destinations=(Destination("pacs", "cstore", ae_title="PACS", host="127.0.0.1", port=9, timeout_s=2),),
        max_attempts=2,
    )
    store = JobStore(tmp_path)
    deliveries = DeliveryStore(store)
    job = _job(store, ("pacs",))
    store.save_sr(job.id, b"DOE^JANE 19810203 not a DICOM file")
    assert _drain(DeliveryWorker(store, deliveries, lambda: settings, Metrics()), deliveries) == 2
    [after] = deliveries.for_job(job.id)
    assert (after.state, after.attempts) == ("dead", 2)
    assert after.last_error == "internal error (InvalidDicomError)"
    logged = _logged(caplog)
    assert "crashed" in logged and "in cstore" in logged  # the stack of a bug is kept
    assert "DOE" not in logged and "19810203" not in logged


def test_describe_keeps_scheme_host_port_and_path_only():
    def describe(url: str) -> str:
        return Destination("d", "stow", url=url).describe()

    assert describe("https://u:p@pacs.example:8443/dicom-web?key=1#x") == "d (stow https://pacs.example:8443/dicom-web)"
    assert describe("https://[::1]/wado") == "d (stow https://[::1]/wado)"
    assert describe("http://tok@pacs.example:notaport/x") == "d (stow http://pacs.example/x)"


@pytest.mark.parametrize(
    "override", [{"PatientBirthDate": "19811399"}, {"PatientSex": None}], ids=["invalid-birth-date", "no-type2-sex"]
)
def test_a_source_with_an_invalid_or_absent_type2_value_still_gets_its_sr(tmp_path, servers, caplog, override):
    """The SR carries the attribute empty (Type 2 allows it) and is delivered; the value never reaches the log."""
    caplog.set_level(logging.DEBUG)
    pacs = servers(200)
    settings = DicomSettings(
        destinations=(Destination("pacs", "stow", url=f"http://127.0.0.1:{pacs.port}/dicom-web", timeout_s=5),),
        max_attempts=3,
    )
    store = JobStore(tmp_path / "state")
    deliveries = DeliveryStore(store)
    job = _job(store, ("pacs",), _study(tmp_path, **override))
    caplog.clear()  # writing the test's file logged pydicom's note on the bad date (the daemon's own log is below)
    worker = DeliveryWorker(store, deliveries, lambda: settings, Metrics())
    assert _drain(worker, deliveries) == 1
    [state] = deliveries.for_job(job.id)
    assert (state.state, state.attempts) == ("delivered", 1)
    [(method, _, _, body)] = pacs.got
    assert method == "POST" and b"DOE^JANE" in body  # the SR joins the patient's study
    sr = pydicom.dcmread(io.BytesIO(body[body.index(b"\r\n\r\n") + 4 : body.rindex(b"\r\n--")]))
    key = next(iter(override))
    assert sr.get(key) == ""
    assert "19811399" not in _logged(caplog)

"""The round trip against a real PACS: Orthanc (Debian's `orthanc` + `orthanc-dicomweb`, started here from a config
this test writes) and DCMTK (`dcmtk`). Studies go into edgekitd by DCMTK's storescu (C-STORE), by dicomweb-client
(STOW-RS over TCP with the token) and by Orthanc itself (a PACS routing a study to edgekitd); the SR comes back
into Orthanc by STOW-RS and C-STORE, and a webhook hears of it. Orthanc's REST API shows the SR arrived, in the
source study, and pydicom reads it back. A kill -9 between receive and delivery loses nothing; a destination that
is down ends as a dead letter while the job's report stays readable.
"""

from __future__ import annotations

import io
import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.resources import files
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("pynetdicom")
pydicom = pytest.importorskip("pydicom")

from edgekit.daemon.testing import DaemonProcess, write_tiny_model  # noqa: E402
from edgekit.daemon.testing_pacs import Orthanc, free_port, missing, tool  # noqa: E402

pytestmark = pytest.mark.skipif(
    missing("Orthanc", "dicomweb-plugin", "storescu") is not None,
    reason=str(missing("Orthanc", "dicomweb-plugin", "storescu")),
)

SAMPLES = Path(str(files("edgekit.models") / "samples"))
CT = sorted((SAMPLES / "ct_chest").glob("*.dcm"))
CR = SAMPLES / "cr_chest" / "image.dcm"
US = SAMPLES / "us_cardiac" / "cine.dcm"
TOKEN = "orthanc-test-token-0123456789"
ENHANCED_SR = "1.2.840.10008.5.1.4.1.1.88.22"


class Hook:
    """A webhook receiver: every JSON body POSTed to it."""

    def __init__(self):
        self.bodies: list[dict] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                hook.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"


def write_config(path: Path, *, scp_port: int, pacs: Orthanc, extra: str = "", quiet_s: float = 1.0, tcp: int = 0):
    token = path.parent / "token"
    token.write_text(TOKEN)
    listen = f'[listen]\ntcp = true\ntcp_port = {tcp}\ntcp_token_file = "{token}"\n' if tcp else ""
    path.write_text(
        f"""{listen}
[dicom]
quiet_period_s = {quiet_s}

[dimse]
enabled = true
ae_title = "EDGEKIT"
port = {scp_port}
[[dimse.allowed]]
ae_title = "MODALITY"
host = "127.0.0.1"
[[dimse.allowed]]
ae_title = "{pacs.aet}"
host = "127.0.0.1"

[[destinations]]
name = "pacs-stow"
kind = "stow"
url = "{pacs.dicomweb}"
{extra}"""
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "m")


@pytest.fixture(scope="module")
def pacs_and_daemon(tmp_path_factory, model):
    root = tmp_path_factory.mktemp("roundtrip")
    scp_port, tcp = free_port(), free_port()
    pacs = Orthanc(root / "orthanc", modalities={"edgekit": ("EDGEKIT", "127.0.0.1", scp_port)}).start()
    hook = Hook()
    config = root / "edgekitd.toml"
    write_config(
        config,
        scp_port=scp_port,
        pacs=pacs,
        tcp=tcp,
        extra=f"""
[[destinations]]
name = "pacs-dimse"
kind = "cstore"
ae_title = "{pacs.aet}"
host = "127.0.0.1"
port = {pacs.dicom_port}

[[destinations]]
name = "hook"
kind = "webhook"
url = "{hook.url}"
""",
    )
    d = DaemonProcess(root / "state", model, config=config).start()
    d.scp_port, d.tcp_port, d.hook = scp_port, tcp, hook
    try:
        yield pacs, d
    finally:
        _stop(d)
        pacs.stop()
        hook.server.shutdown()


def _stop(d: DaemonProcess) -> None:
    """SIGTERM, and SIGKILL when the drain outlasts a busy machine's patience (the test is over by then)."""
    try:
        d.stop(timeout=60)
    except subprocess.TimeoutExpired:
        d.kill()


def storescu(port: int, paths: list[Path], *syntax: str) -> None:
    cmd = [tool("storescu"), *syntax, "-aet", "MODALITY", "-aec", "EDGEKIT", "127.0.0.1", str(port)]
    sent = subprocess.run(cmd + [str(p) for p in paths], capture_output=True, text=True, timeout=120)
    assert sent.returncode == 0, sent.stderr[-2000:]


def job_of(d: DaemonProcess, study_uid: str, sr_uid: str | None = None, timeout: float = 60) -> dict:
    """The job whose SR is `sr_uid` (read through the API), once all its deliveries have settled."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for job in d.client.get("/v1/jobs").json()["jobs"]:
            if job["state"] != "succeeded" or any(x["state"] == "pending" for x in job.get("deliveries", [])):
                continue
            sr = pydicom.dcmread(io.BytesIO(d.client.get(f"/v1/jobs/{job['id']}/sr").body))
            if sr.StudyInstanceUID == study_uid and (sr_uid is None or sr.SOPInstanceUID == sr_uid):
                return job
        time.sleep(0.2)
    raise TimeoutError(d.client.get("/v1/jobs").json())


def check_sr_in_pacs(pacs: Orthanc, sources: list[Path], timeout: float = 90) -> pydicom.Dataset:
    """The SR Orthanc holds for the sources' study: one instance, read back with pydicom, referencing them."""
    src = [pydicom.dcmread(p, stop_before_pixels=True) for p in sources]
    study = str(src[0].StudyInstanceUID)
    found = pacs.wait_sr(study, timeout)
    assert len(found) == 1, found  # STOW-RS and C-STORE delivered the same SOP instance: stored once
    sr = pydicom.dcmread(io.BytesIO(pacs.instance_file(found[0])))
    assert sr.SOPClassUID == ENHANCED_SR
    assert sr.ConceptNameCodeSequence[0].CodeValue == "18748-4"
    assert (sr.StudyInstanceUID, sr.PatientID, str(sr.PatientName)) == (
        study,
        src[0].PatientID,
        str(src[0].PatientName),
    )
    assert sr.get("AccessionNumber", "") == src[0].get("AccessionNumber", "")
    assert sr.ReferencedRequestSequence[0].StudyInstanceUID == study
    evidence = sr.CurrentRequestedProcedureEvidenceSequence[0]
    assert evidence.StudyInstanceUID == study
    referenced = {
        (s.SeriesInstanceUID, i.ReferencedSOPInstanceUID)
        for s in evidence.ReferencedSeriesSequence
        for i in s.ReferencedSOPSequence
    }
    assert referenced == {(str(d.SeriesInstanceUID), str(d.SOPInstanceUID)) for d in src}
    assert sr.SeriesInstanceUID not in {str(d.SeriesInstanceUID) for d in src}  # a series of its own
    return sr


def test_cstore_from_dcmtk_to_sr_in_orthanc(pacs_and_daemon):
    pacs, d = pacs_and_daemon
    t0 = time.monotonic()
    storescu(d.scp_port, CT, "-xr")  # the CT sample is RLE Lossless
    sr = check_sr_in_pacs(pacs, CT)
    print(f"C-STORE of {len(CT)} instances -> SR in Orthanc in {time.monotonic() - t0:.1f} s")
    job = job_of(d, str(sr.StudyInstanceUID), str(sr.SOPInstanceUID))
    assert {x["destination"]: x["state"] for x in job["deliveries"]} == {
        "hook": "delivered",
        "pacs-dimse": "delivered",
        "pacs-stow": "delivered",
    }
    hooked = [b for b in d.hook.bodies if b["job"]["id"] == job["id"]]
    assert hooked and hooked[0]["sr_sop_instance_uid"] == sr.SOPInstanceUID
    assert hooked[0]["study_instance_uid"] == sr.StudyInstanceUID and hooked[0]["job"]["report"]["text"]


def test_stow_rs_from_dicomweb_client_over_tcp_to_sr_in_orthanc(pacs_and_daemon):
    dicomweb_client = pytest.importorskip("dicomweb_client")
    pacs, d = pacs_and_daemon
    client = dicomweb_client.DICOMwebClient(
        url=f"http://127.0.0.1:{d.tcp_port}/dicomweb", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    answer = client.store_instances(datasets=[pydicom.dcmread(CR)])
    assert [i.ReferencedSOPInstanceUID for i in answer.ReferencedSOPSequence] == [pydicom.dcmread(CR).SOPInstanceUID]
    check_sr_in_pacs(pacs, [CR])


def test_orthanc_routes_a_study_to_edgekitd_and_gets_the_report_back(pacs_and_daemon):
    """The worked example of docs/dicom-networking.md: the PACS forwards a modality's study by C-STORE."""
    pacs, d = pacs_and_daemon
    uploaded = json.loads(pacs.request("POST", "/instances", US.read_bytes(), "application/dicom"))
    job = pacs.post("/modalities/edgekit/store", {"Resources": [uploaded["ParentStudy"]], "Synchronous": True})
    assert job is not None
    check_sr_in_pacs(pacs, [US])


def restudied(src: Path, dest: Path) -> Path:
    """A copy of a sample as a study of its own (new Study/Series/SOP Instance UIDs, pixel data untouched)."""
    ds = pydicom.dcmread(src)
    ds.StudyInstanceUID, ds.SeriesInstanceUID = pydicom.uid.generate_uid(), pydicom.uid.generate_uid()
    ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = pydicom.uid.generate_uid()
    ds.save_as(dest, enforce_file_format=True)
    return dest


def test_kill_between_receive_and_delivery_loses_nothing_and_a_down_destination_is_a_dead_letter(
    tmp_path, model, pacs_and_daemon
):
    pacs, _ = pacs_and_daemon
    scp_port = free_port()
    config = tmp_path / "edgekitd.toml"
    write_config(
        config,
        scp_port=scp_port,
        pacs=pacs,
        quiet_s=3.0,
        extra=f"""
[[destinations]]
name = "down"
kind = "stow"
url = "http://127.0.0.1:{free_port()}/dicom-web"
timeout_s = 2

[delivery]
max_attempts = 2
backoff_s = 0.2
""",
    )
    study = restudied(CR, tmp_path / "cr.dcm")
    state = tmp_path / "state"
    d = DaemonProcess(state, model, config=config).start()
    storescu(scp_port, [study], "-xv")  # JPEG 2000 lossless, as the sample is
    d.kill()  # within the quiet period: the study is on disk, no job yet
    assert list((state / "inbox").rglob("*.dcm")), "the instance was not on disk when the sender heard success"
    assert not pacs.sr_instances(str(pydicom.dcmread(study).StudyInstanceUID))
    d2 = DaemonProcess(state, model, config=config).start()
    try:
        sr = check_sr_in_pacs(pacs, [study])
        job = job_of(d2, str(sr.StudyInstanceUID), str(sr.SOPInstanceUID))
        states = {x["destination"]: (x["state"], x["attempts"]) for x in job["deliveries"]}
        assert states == {"pacs-stow": ("delivered", 1), "down": ("dead", 2)}
        dead = d2.client.get("/v1/jobs?delivery=dead").json()["jobs"]
        assert [j["id"] for j in dead] == [job["id"]]
        assert "cannot reach" in dead[0]["deliveries"][0]["last_error"]
        assert 'edgekitd_deliveries_state{state="dead"} 1.0' in d2.client.get("/metrics").body.decode()
        # the report stays readable, as the very SR the PACS holds
        assert d2.client.get(f"/v1/jobs/{job['id']}").json()["report"]["text"]
        again = d2.client.request("POST", f"/v1/jobs/{job['id']}/deliveries/retry").json()
        assert {x["destination"]: x["state"] for x in again["deliveries"]}["down"] == "pending"
        assert d2.client.get("/v2/health/ready").status == 200
    finally:
        _stop(d2)

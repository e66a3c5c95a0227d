"""edgekitd's HTTP API, served for real over its Unix socket by a daemon subprocess on a tiny random model."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from edgekit.daemon.client import study_files  # noqa: E402
from edgekit.daemon.testing import DaemonProcess, write_tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "models" / "samples"
LIMIT = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("edgekitd")
    model = write_tiny_model(root / "model")
    config = root / "edgekitd.toml"
    config.write_text(f"[limits]\nmax_upload_bytes = {LIMIT}\n")
    with DaemonProcess(root / "state", model, config=config).start() as d:
        yield d


def _ok_report(reply):
    assert reply.status == 200, reply.body[:500]
    body = reply.json()
    for key in ("text", "findings_text", "impression", "findings", "variant", "timings", "study"):
        assert key in body
    assert body["variant"] == "default" and body["study"].startswith("uid:")
    assert body["timings"]["new_tokens"] >= 1 and body["timings"]["total_ms"] > 0
    return body


def test_report_from_one_dicom_file(daemon):
    body = _ok_report(daemon.client.report(SAMPLES / "cr_chest" / "image.dcm", "Cough."))
    assert body["modality"] == "DX"


def test_report_from_several_dicom_files_of_a_series(daemon):
    assert _ok_report(daemon.client.report(SAMPLES / "ct_chest", "Follow-up."))["modality"] == "CT"


def test_report_from_a_zip_of_a_series(daemon):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for p in sorted((SAMPLES / "ct_chest").glob("*.dcm")):
            zf.write(p, f"series/{p.name}")
    reply = daemon.client.post_study("/v1/reports", [("series.zip", buf.getvalue(), "application/zip")])
    assert _ok_report(reply)["modality"] == "CT"


def test_report_from_an_mp4(daemon):
    assert _ok_report(daemon.client.report(SAMPLES / "us_cardiac" / "cine.mp4"))["modality"] == "XC"


def test_same_input_same_report_and_text_format(daemon):
    a = daemon.client.report(SAMPLES / "cr_chest" / "image.dcm", "Cough.").json()["text"]
    files = study_files(SAMPLES / "cr_chest" / "image.dcm")
    text = daemon.client.post_study("/v1/reports?format=text", files, {"prompt": "Cough."})
    assert text.status == 200 and text.body.decode().strip() == a.strip()


def test_sr_from_the_synchronous_route_reads_back(daemon):
    import pydicom

    reply = daemon.client.post_study("/v1/reports?format=sr", study_files(SAMPLES / "cr_chest" / "image.dcm"))
    assert reply.status == 200 and reply.headers["content-type"] == "application/dicom"
    ds = pydicom.dcmread(io.BytesIO(reply.body))
    source = pydicom.dcmread(SAMPLES / "cr_chest" / "image.dcm", stop_before_pixels=True)
    assert ds.Modality == "SR" and ds.StudyInstanceUID == source.StudyInstanceUID


def _dicom_bytes(**change) -> bytes:
    import pydicom

    ds = pydicom.dcmread(SAMPLES / "cr_chest" / "image.dcm")
    for k, v in change.items():
        setattr(ds.file_meta, k, v)
    buf = io.BytesIO()
    ds.save_as(buf)
    return buf.getvalue()


def _empty_zip() -> bytes:
    buf = io.BytesIO()
    zipfile.ZipFile(buf, "w").close()
    return buf.getvalue()


CT1 = (SAMPLES / "ct_chest" / "IM0001.dcm").read_bytes()
BAD_UPLOADS = {
    "truncated_dicom": ([("a.dcm", CT1[:3000], "application/dicom")], {}, 400, "invalid_study"),
    "not_dicom": ([("notes.dcm", b"hello, not dicom", "application/dicom")], {}, 400, "invalid_study"),
    "unsupported_ts": (
        [("m.dcm", _dicom_bytes(TransferSyntaxUID="1.2.840.10008.1.2.4.100"), "application/dicom")],
        {},
        415,
        "unsupported_transfer_syntax",
    ),
    "oversized": ([("big.dcm", b"\0" * (LIMIT + (2 << 20)), "application/dicom")], {}, 413, "upload_too_large"),
    "empty_zip": ([("s.zip", _empty_zip(), "application/zip")], {}, 400, "invalid_study"),
    "corrupt_zip": ([("s.zip", b"PK\x03\x04" + b"junk" * 50, "application/zip")], {}, 400, "invalid_study"),
    "corrupt_video": ([("v.mp4", b"\0\0\0\x18ftypmp42" + b"junk" * 100, "video/mp4")], {}, 400, "invalid_study"),
    "mixed_upload": ([("a.dcm", CT1, "application/dicom"), ("v.mp4", b"x", "video/mp4")], {}, 400, "invalid_study"),
    "unknown_variant": ([("a.dcm", CT1, "application/dicom")], {"variant": "nope"}, 404, "unknown_variant"),
    "bad_temperature": ([("a.dcm", CT1, "application/dicom")], {"temperature": "hot"}, 422, "validation_error"),
    "nan_temperature": ([("a.dcm", CT1, "application/dicom")], {"temperature": "nan"}, 422, "validation_error"),
    "too_many_tokens": ([("a.dcm", CT1, "application/dicom")], {"max_new_tokens": "100000"}, 400, "validation_error"),
    "no_files": ([], {"prompt": "x"}, 422, "validation_error"),
}


@pytest.mark.parametrize("case", sorted(BAD_UPLOADS))
@pytest.mark.parametrize("route", ["/v1/reports", "/v1/jobs"])
def test_bad_input_is_a_4xx_json_error_and_the_daemon_stays_healthy(daemon, case, route):
    files, fields, status, code = BAD_UPLOADS[case]
    reply = daemon.client.post_study(route, files, fields)
    assert (reply.status, reply.error_code) == (status, code), reply.body[:300]
    assert reply.json()["error"]["message"]
    assert daemon.client.get("/v2/health/ready").status == 200


@pytest.mark.parametrize("route", ["/v1/reports", "/v1/jobs"])
def test_an_ingest_error_names_the_clients_file_not_the_stored_one(daemon, route):
    files = [("chest-scan.dcm", CT1[:3000], "application/dicom")]  # stored as 00000.dcm
    reply = daemon.client.post_study(route, files)
    assert (reply.status, reply.error_code) == (400, "invalid_study")
    assert reply.json()["error"]["file"] == "chest-scan.dcm"


@pytest.mark.parametrize(
    "method, url, body, headers, status, code",
    [
        ("PUT", "/v1/variants/active", b"{not json", {"Content-Type": "application/json"}, 422, "validation_error"),
        (
            "PUT",
            "/v1/variants/active",
            b'{"name": "nope"}',
            {"Content-Type": "application/json"},
            404,
            "unknown_variant",
        ),
        ("PUT", "/v1/variants/active", b"[1, 2]", {"Content-Type": "application/json"}, 422, "validation_error"),
        ("GET", "/v1/jobs/../../etc/passwd", None, {}, 404, "not_found"),
        ("GET", "/v1/jobs/0123456789abcdef0123456789abcdef", None, {}, 404, "job_not_found"),
        ("GET", "/v1/jobs/zzz/sr", None, {}, 404, "job_not_found"),
        ("POST", "/v1/reports", b"garbage", {"Content-Type": "multipart/form-data; boundary=x"}, 400, "bad_request"),
        ("POST", "/v1/reports", b"{}", {"Content-Type": "application/json"}, 422, "validation_error"),
        ("DELETE", "/v1/variants", None, {}, 405, "method_not_allowed"),
    ],
)
def test_bad_requests_are_json_errors(daemon, method, url, body, headers, status, code):
    reply = daemon.client.request(method, url, body=body, headers=headers)
    assert (reply.status, reply.error_code) == (status, code), reply.body[:300]


def test_bad_idempotency_key_is_refused(daemon):
    reply = daemon.client.post_study(
        "/v1/jobs", study_files(SAMPLES / "cr_chest" / "image.dcm"), headers={"Idempotency-Key": "no spaces/allowed"}
    )
    assert (reply.status, reply.error_code) == (400, "invalid_idempotency_key")


def test_job_with_idempotency_key_runs_once_and_gives_report_stream_and_sr(daemon):
    import pydicom

    files = study_files(SAMPLES / "ct_chest")
    first = daemon.client.post_study("/v1/jobs", files, {"prompt": "Follow-up."}, headers={"Idempotency-Key": "k-1"})
    assert first.status == 202 and first.headers["location"] == f"/v1/jobs/{first.json()['id']}"
    again = daemon.client.post_study("/v1/jobs", files, {"prompt": "Follow-up."}, headers={"Idempotency-Key": "k-1"})
    assert again.status == 200 and again.json()["id"] == first.json()["id"]
    other = daemon.client.post_study("/v1/jobs", files, {"prompt": "Other."}, headers={"Idempotency-Key": "k-1"})
    assert (other.status, other.error_code) == (409, "idempotency_key_reused")
    job_id = first.json()["id"]
    stream = daemon.client.get(f"/v1/jobs/{job_id}/stream")
    events = [json.loads(x) for x in stream.body.decode().splitlines()]
    assert stream.headers["content-type"].startswith("application/x-ndjson")
    assert events[-1]["state"] == "succeeded" and events[-1]["report"]["text"] is not None
    job = daemon.client.wait_job(job_id)
    assert job["attempts"] == 1 and job["report"]["modality"] == "CT" and "prompt" not in job
    sr = daemon.client.get(f"/v1/jobs/{job_id}/sr")
    assert sr.status == 200
    ds = pydicom.dcmread(io.BytesIO(sr.body))
    assert ds.StudyInstanceUID == pydicom.dcmread(SAMPLES / "ct_chest" / "IM0001.dcm").StudyInstanceUID
    sse = daemon.client.get(f"/v1/jobs/{job_id}/stream?format=sse")
    assert sse.body.decode().startswith("data: {")


def test_sr_of_a_video_job_is_409(daemon):
    reply = daemon.client.post_study("/v1/jobs", study_files(SAMPLES / "us_cardiac" / "cine.mp4"))
    job = daemon.client.wait_job(reply.json()["id"])
    assert job["state"] == "succeeded"
    sr = daemon.client.get(f"/v1/jobs/{job['id']}/sr")
    assert (sr.status, sr.error_code) == (409, "sr_unavailable")


def test_variants_health_metrics_and_openapi(daemon):
    variants = daemon.client.get("/v1/variants").json()
    assert variants["active"] == "default" and variants["variants"][0]["loaded"]
    assert daemon.client.put_json("/v1/variants/active", {"name": "default"}).status == 200
    assert daemon.client.get("/v2/health/live").json() == {"live": True}
    metrics = daemon.client.get("/metrics").body.decode()
    for name in (
        "edgekitd_requests_total",
        "edgekitd_queue_depth",
        "edgekitd_request_latency_seconds_bucket",
        "edgekitd_generated_tokens_total",
        'edgekitd_reports_total{outcome="ok",variant="default"}',
    ):
        assert name in metrics
    paths = daemon.client.get("/openapi.json").json()["paths"]
    assert {
        "/v1/reports",
        "/v1/jobs",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/stream",
        "/v1/variants",
        "/v1/variants/active",
        "/v2/health/live",
        "/v2/health/ready",
        "/metrics",
    } <= set(paths)


def test_no_patient_data_in_the_log(daemon):
    import pydicom

    daemon.client.report(SAMPLES / "cr_chest" / "image.dcm", "Cough.")
    log = daemon.log.read_text()
    for f in (SAMPLES / "cr_chest" / "image.dcm", SAMPLES / "ct_chest" / "IM0001.dcm"):
        ds = pydicom.dcmread(f, stop_before_pixels=True)
        for value in (str(ds.PatientName), ds.PatientID, ds.PatientBirthDate, ds.StudyInstanceUID, ds.AccessionNumber):
            assert value not in log
    assert "Cough." not in log and "Follow-up." not in log


def _series_with_a_broken_file() -> list[tuple[str, bytes, str]]:
    return [*study_files(SAMPLES / "ct_chest"), ("IM9999.dcm", b"not a dicom file", "application/dicom")]


def _sr_note(body: bytes) -> str:
    import pydicom

    ds = pydicom.dcmread(io.BytesIO(body))
    notes = [c.TextValue for c in ds.ContentSequence if c.ConceptNameCodeSequence[0].CodeValue == "121106"]
    assert len(notes) == 1
    return notes[0]


def test_ingest_warnings_travel_with_the_report_in_json_job_stream_and_sr(daemon):
    files, fields = _series_with_a_broken_file(), {"max_new_tokens": "120"}  # 120 > what the tiny context leaves
    body = _ok_report(daemon.client.post_study("/v1/reports", files, fields))
    skipped = [w for w in body["warnings"] if w.startswith("skipped")]
    assert len(skipped) == 1 and any(w.startswith("max_new_tokens lowered") for w in body["warnings"])
    assert body["timings"]["new_tokens"] < 120
    sr = daemon.client.post_study("/v1/reports?format=sr", files, fields)
    assert sr.status == 200 and _sr_note(sr.body).startswith("Processing notes") and skipped[0] in _sr_note(sr.body)
    streamed = daemon.client.post_study("/v1/reports?stream=ndjson", files, fields)
    final = json.loads(streamed.body.decode().splitlines()[-1])
    assert final["event"] == "report" and final["report"]["warnings"] == body["warnings"]
    job = daemon.client.wait_job(daemon.client.post_study("/v1/jobs", files, fields).json()["id"])
    assert job["state"] == "succeeded" and job["report"]["warnings"] == body["warnings"]
    assert skipped[0] in _sr_note(daemon.client.get(f"/v1/jobs/{job['id']}/sr").body)
    clean = _ok_report(daemon.client.report(SAMPLES / "ct_chest", "Follow-up."))
    assert clean["warnings"] == []


LONG_PROMPT = "Follow-up of a right upper lobe nodule, history of smoking. " * 30  # < the form's 2000 chars


@pytest.mark.parametrize("url", ["/v1/reports", "/v1/reports?stream=ndjson", "/v1/reports?format=sr", "/v1/jobs"])
def test_a_prompt_the_context_cannot_hold_is_422_prompt_too_long(daemon, url):
    assert len(LONG_PROMPT) <= 2000
    reply = daemon.client.post_study(url, study_files(SAMPLES / "cr_chest" / "image.dcm"), {"prompt": LONG_PROMPT})
    assert (reply.status, reply.error_code) == (422, "prompt_too_long"), reply.body[:300]
    assert "tokens" in reply.json()["error"]["message"] and LONG_PROMPT not in reply.body.decode()
    assert daemon.client.get("/v2/health/ready").status == 200


def test_a_prompt_too_long_is_refused_before_the_upload_is_read(daemon):
    files = [("a.dcm", b"not dicom at all", "application/dicom")]  # ingest would say invalid_study
    for url in ("/v1/reports", "/v1/jobs"):
        reply = daemon.client.post_study(url, files, {"prompt": LONG_PROMPT})
        assert (reply.status, reply.error_code) == (422, "prompt_too_long"), url


def test_ingest_time_is_measured_not_a_stub(daemon):
    sync = _ok_report(daemon.client.report(SAMPLES / "ct_chest", "Follow-up."))
    job = daemon.client.post_study("/v1/jobs", study_files(SAMPLES / "ct_chest"), {"prompt": "Follow-up."})
    done = daemon.client.wait_job(job.json()["id"])
    for timings in (sync["timings"], done["report"]["timings"]):
        assert timings["ingest_ms"] > 0.5  # 14 slices read and decoded; a stub around the call measured ~0.001
        assert 0 <= timings["ingest_wait_ms"] < timings["ingest_ms"]  # one study at a time: a worker was free
    metrics = daemon.client.get("/metrics").body.decode()
    count = next(line for line in metrics.splitlines() if line.startswith("edgekitd_ingest_wait_seconds_count"))
    assert float(count.split()[-1]) >= 2

"""STOW-RS in: edgekitd's `POST /dicomweb/studies` served for real (daemon subprocess, tiny random model) over its
Unix socket and its TCP listener; bad parts refused one by one, a fuzz of malformed multipart bodies, no PHI in logs.
"""

from __future__ import annotations

import time
import uuid
from importlib.resources import files
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pydicom = pytest.importorskip("pydicom")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from edgekit.daemon.testing import DaemonProcess, write_tiny_model  # noqa: E402
from edgekit.daemon.testing_pacs import free_port  # noqa: E402

SAMPLES = Path(str(files("edgekit.models") / "samples"))
CR = SAMPLES / "cr_chest" / "image.dcm"
CT = sorted((SAMPLES / "ct_chest").glob("*.dcm"))
TOKEN = "stow-token-0123456789abcdef"
NOT_DICOM, TRUNCATED, SOP_CLASS = 0xC000, 0xA900, 0x0122


def related(parts: list[tuple[bytes, str]], boundary: str | None = None) -> tuple[bytes, str]:
    boundary = boundary or uuid.uuid4().hex
    body = bytearray()
    for data, ctype in parts:
        body += f"--{boundary}\r\nContent-Type: {ctype}\r\n\r\n".encode() + data + b"\r\n"
    body += f"--{boundary}--\r\n".encode()
    return bytes(body), f'multipart/related; type="application/dicom"; boundary={boundary}'


def stow(d: DaemonProcess, body: bytes, ctype: str, path: str = "/dicomweb/studies"):
    return d.client.request("POST", path, body=body, headers={"Content-Type": ctype})


def reasons(answer: dict) -> list[int]:
    return sorted(item["00081197"]["Value"][0] for item in answer.get("00081198", {}).get("Value", []))


def stored_uids(answer: dict) -> list[str]:
    return [item["00081155"]["Value"][0] for item in answer.get("00081199", {}).get("Value", [])]


def unsupported_class_instance() -> bytes:
    """The CR sample relabelled as a Basic Text SR: valid DICOM of a class edgekit does not report on."""
    import io

    ds = pydicom.dcmread(CR)
    ds.SOPClassUID = ds.file_meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.88.11"
    ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = pydicom.uid.generate_uid()
    buf = io.BytesIO()
    ds.save_as(buf, enforce_file_format=True)
    return buf.getvalue()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("edgekitd-stow")
    token = root / "token"
    token.write_text(TOKEN)
    config = root / "edgekitd.toml"
    port = free_port()
    config.write_text(
        f'[listen]\ntcp = true\ntcp_port = {port}\ntcp_token_file = "{token}"\n'
        "[limits]\nmax_upload_bytes = 8388608\n[dicom]\nquiet_period_s = 0.5\n"
    )
    with DaemonProcess(root / "state", write_tiny_model(root / "model"), config=config).start() as d:
        d.tcp_port = port
        yield d


def _wait_jobs(d: DaemonProcess, n: int, timeout: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = d.client.get("/v1/jobs").json()["jobs"]
        if len(jobs) >= n and all(j["state"] in ("succeeded", "failed") for j in jobs):
            return jobs
        time.sleep(0.1)
    raise TimeoutError(jobs)


def test_each_bad_part_gets_its_own_reason_and_the_good_one_is_stored_and_reported(daemon):
    good = CR.read_bytes()
    ct = CT[1].read_bytes()
    body, ctype = related(
        [
            (good, "application/dicom"),
            (b"\x89PNG\r\n\x1a\n" + b"\0" * 200, "application/dicom"),  # not DICOM at all
            (ct[: int(len(ct) * 0.6)], "application/dicom"),  # cut inside its pixel data
            (unsupported_class_instance(), "application/dicom"),
            (b"hello", "text/plain"),  # a part of another type
        ]
    )
    reply = stow(daemon, body, ctype + "", "/dicomweb/studies?complete=true")
    assert reply.status == 202, reply.body[:300]  # some stored, some failed
    assert reply.headers["content-type"].startswith("application/dicom+json")
    answer = reply.json()
    assert stored_uids(answer) == [str(pydicom.dcmread(CR).SOPInstanceUID)]
    assert reasons(answer) == sorted([NOT_DICOM, TRUNCATED, SOP_CLASS, NOT_DICOM])
    # every failed item names what it could: the unsupported class its UIDs, garbage nothing
    failed = answer["00081198"]["Value"]
    sr = [f for f in failed if f["00081197"]["Value"][0] == SOP_CLASS][0]
    assert sr["00081150"]["Value"] == ["1.2.840.10008.5.1.4.1.1.88.11"]
    # complete=true: the study is reported at once, as a durable job
    jobs = _wait_jobs(daemon, 1, timeout=30)
    assert jobs[0]["state"] == "succeeded", jobs[0]
    assert jobs[0]["report"]["modality"] == "DX"
    sr_reply = daemon.client.get(f"/v1/jobs/{jobs[0]['id']}/sr")
    assert sr_reply.status == 200 and sr_reply.headers["content-type"] == "application/dicom"
    assert daemon.client.get("/v2/health/ready").status == 200


def test_a_study_url_refuses_instances_of_another_study(daemon):
    body, ctype = related([(CR.read_bytes(), "application/dicom")])
    reply = stow(daemon, body, ctype, "/dicomweb/studies/1.2.3.4.5")
    assert reply.status == 409 and reasons(reply.json()) == [TRUNCATED]  # 0xA900: not the study the URL names
    assert reply.json()["0020000D"]["Value"] == ["1.2.3.4.5"]
    assert stow(daemon, body, ctype, "/dicomweb/studies/not-a-uid").error_code == "invalid_uid"


@pytest.mark.parametrize(
    "ctype,status,code",
    [
        ("application/dicom", 415, "unsupported_media_type"),
        ('multipart/related; type="application/dicom+json"; boundary=x', 415, "unsupported_media_type"),
        ('multipart/related; type="application/dicom"', 400, "invalid_multipart"),
        ("", 415, "unsupported_media_type"),
    ],
)
def test_requests_that_are_not_stow_rs_are_refused_with_a_code(daemon, ctype, status, code):
    reply = stow(daemon, b"--x\r\n\r\nabc\r\n--x--\r\n", ctype)
    assert (reply.status, reply.error_code) == (status, code)


def test_tcp_keeps_its_token(daemon):
    import http.client

    body, ctype = related([(CT[0].read_bytes(), "application/dicom")])
    for headers, expect in (({}, 401), ({"Authorization": f"Bearer {TOKEN}"}, 200)):
        conn = http.client.HTTPConnection("127.0.0.1", daemon.tcp_port, timeout=30)
        conn.request("POST", "/dicomweb/studies", body=body, headers={"Content-Type": ctype, **headers})
        assert conn.getresponse().status == expect
        conn.close()


# --- fuzz --------------------------------------------------------------------------------------------------------
DICOM_BYTES = [CR.read_bytes(), CT[2].read_bytes()]
_content = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda i, f: DICOM_BYTES[i][: int(len(DICOM_BYTES[i]) * f)], st.integers(0, 1), st.floats(0, 1)),
    st.builds(
        lambda i, at, junk: DICOM_BYTES[i][:at] + junk + DICOM_BYTES[i][at + len(junk) :],
        st.integers(0, 1),
        st.integers(0, 1500),
        st.binary(min_size=1, max_size=40),
    ),  # fmt: skip
)
_header = st.one_of(
    st.just(b"Content-Type: application/dicom"),
    st.just(b""),
    st.binary(max_size=60),
    st.builds(lambda t: b"Content-Type: " + t, st.binary(max_size=40)),
)
_sep = st.sampled_from([b"\r\n", b"\n", b"", b"\r\n\r\n"])
_boundary = st.one_of(st.text(min_size=0, max_size=80), st.just("b0undary"))


@st.composite
def multipart_bodies(draw) -> tuple[bytes, str]:
    boundary = draw(_boundary)
    wire = boundary.encode("utf-8", "replace")
    body = bytearray(draw(st.binary(max_size=20)))  # a preamble
    for _ in range(draw(st.integers(0, 4))):
        body += b"--" + wire + draw(_sep) + draw(_header) + draw(_sep) + draw(_sep) + draw(_content) + draw(_sep)
    if draw(st.booleans()):
        body += b"--" + wire + b"--" + draw(_sep)
    ctype = draw(
        st.sampled_from(
            [
                f'multipart/related; type="application/dicom"; boundary="{boundary}"',
                f"multipart/related; boundary={boundary}",
                f'Multipart/Related; TYPE="application/dicom"; boundary={boundary}; start="<x>"',
                "multipart/related",
                "multipart/form-data; boundary=x",
                "",
            ]
        )
    )
    return bytes(body), ctype


def test_fuzz_malformed_multipart_never_answers_5xx(daemon):
    seen: dict[int, int] = {}

    @settings(max_examples=150, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(multipart_bodies())
    def fuzz(case):
        body, ctype = case
        # a header value of visible ASCII: other bytes are refused by uvicorn's HTTP parser before the app sees them
        header = "".join(c if " " <= c <= "~" else "?" for c in ctype)
        reply = stow(daemon, body, header)
        seen[reply.status] = seen.get(reply.status, 0) + 1
        assert reply.status in (200, 202, 400, 409, 415), (reply.status, reply.body[:300])
        if reply.status >= 400 and reply.status != 409:
            assert reply.error_code, reply.body[:200]  # the one error shape

    t0 = time.monotonic()
    fuzz()
    print(f"stow-rs fuzz: {sum(seen.values())} bodies in {time.monotonic() - t0:.1f} s, statuses {seen}")
    assert len(seen) >= 3  # the fuzz reached past the media-type check
    assert daemon.client.get("/v2/health/ready").status == 200


def test_logs_never_carry_patient_values(daemon):
    """Runs last in this module: everything above went through the daemon's log."""
    log = daemon.log.read_text(errors="replace")
    assert "stow-rs:" in log  # the log was written
    for path in (CR, *CT[:3]):
        ds = pydicom.dcmread(path, stop_before_pixels=True)
        for kw in ("PatientName", "PatientID", "AccessionNumber", "StudyInstanceUID", "SOPInstanceUID"):
            value = str(ds.get(kw, "") or "")
            if len(value) >= 4:
                assert value not in log, f"{kw} of {path.name} in the daemon's log"

"""DIMSE in: edgekitd's Storage SCP (daemon subprocess, tiny random model) against a real DICOM peer on the wire:
pynetdicom as the SCU for what DCMTK cannot send (a wrong host, a syntax nobody decodes, a broken dataset), and
DCMTK's echoscu/storescu where installed. Allowed peers, negotiation, failure statuses, health, no PHI in logs.
"""

from __future__ import annotations

import re
import subprocess
import time
from importlib.resources import files
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pynetdicom = pytest.importorskip("pynetdicom")
pydicom = pytest.importorskip("pydicom")

from edgekit.daemon.testing import DaemonProcess, write_tiny_model  # noqa: E402
from edgekit.daemon.testing_pacs import free_port, missing, tool  # noqa: E402

SAMPLES = Path(str(files("edgekit.models") / "samples"))
CT = sorted((SAMPLES / "ct_chest").glob("*.dcm"))
CR = SAMPLES / "cr_chest" / "image.dcm"
CT_STORAGE = "1.2.840.10008.5.1.4.1.1.2"
MPEG2 = "1.2.840.10008.1.2.4.100"  # no pixel decoder for it: must be negotiated away
BASIC_TEXT_SR = "1.2.840.10008.5.1.4.1.1.88.11"


@pytest.fixture(scope="module")
def scp(tmp_path_factory):
    root = tmp_path_factory.mktemp("edgekitd-dimse")
    port = free_port()
    config = root / "edgekitd.toml"
    config.write_text(
        f'[dicom]\nquiet_period_s = 0.5\n[dimse]\nenabled = true\nae_title = "EDGEKIT"\nport = {port}\n'
        '[[dimse.allowed]]\nae_title = "MODALITY"\nhost = "127.0.0.1"\n'
    )
    with DaemonProcess(root / "state", write_tiny_model(root / "model"), config=config).start() as d:
        d.scp_port = port
        yield d


def associate(d: DaemonProcess, contexts: list[tuple[str, list[str]]], *, aet: str = "MODALITY", host="127.0.0.1"):
    ae = pynetdicom.AE(ae_title=aet)
    ae.acse_timeout = ae.dimse_timeout = ae.network_timeout = 20
    for uid, syntaxes in contexts:
        ae.add_requested_context(uid, syntaxes)
    return ae.associate("127.0.0.1", d.scp_port, ae_title="EDGEKIT", bind_address=(host, 0))


def test_echo_from_an_allowed_ae(scp):
    assoc = associate(scp, [("1.2.840.10008.1.1", ["1.2.840.10008.1.2"])])
    assert assoc.is_established
    assert assoc.send_c_echo().Status == 0x0000
    assoc.release()


@pytest.mark.parametrize("aet,host", [("STRANGER", "127.0.0.1"), ("MODALITY", "127.0.0.2")])
def test_an_ae_not_allowed_is_rejected(scp, aet, host):
    """An unknown title, and a known title from another host (127.0.0.2 is loopback too on Linux)."""
    assoc = associate(scp, [("1.2.840.10008.1.1", ["1.2.840.10008.1.2"])], aet=aet, host=host)
    assert assoc.is_rejected and not assoc.is_established
    rj = assoc.acceptor.primitive
    assert (rj.result, rj.result_source, rj.diagnostic) == (0x01, 0x01, 0x03)  # permanent, calling AE not recognised
    # asserted here, not in a later test: under xdist a module's tests may run in another worker's daemon
    want, deadline = 'edgekitd_dicom_associations_total{outcome="rejected"}', time.monotonic() + 10
    while want not in scp.client.get("/metrics").body.decode() and time.monotonic() < deadline:
        time.sleep(0.05)  # the SCP counts the rejection on its own thread, maybe just after sending it
    assert want in scp.client.get("/metrics").body.decode()


def test_unsupported_transfer_syntax_and_sop_class_are_negotiated_away(scp):
    assoc = associate(
        scp,
        [
            (CT_STORAGE, [MPEG2]),  # a syntax no decoder reads
            (BASIC_TEXT_SR, ["1.2.840.10008.1.2.1"]),  # not an image
            (CT_STORAGE, ["1.2.840.10008.1.2.5"]),  # RLE, as the sample is
            (CT_STORAGE, [MPEG2, "1.2.840.10008.1.2.1"]),  # the syntax the SCP can read is the one taken
        ],
    )
    try:
        assert assoc.is_established
        by_id = {cx.context_id: cx for cx in assoc.accepted_contexts}
        accepted = sorted((cid, cx.abstract_syntax, cx.transfer_syntax[0]) for cid, cx in by_id.items())
        assert accepted == [(5, CT_STORAGE, "1.2.840.10008.1.2.5"), (7, CT_STORAGE, "1.2.840.10008.1.2.1")]
        rejected = {cx.context_id for cx in assoc.rejected_contexts}
        assert rejected == {1, 3}  # MPEG2 only, and the SR class
    finally:
        assoc.release()


def test_malformed_datasets_get_failure_statuses_and_good_ones_are_reported(scp, tmp_path, monkeypatch):
    ds = pydicom.dcmread(CT[0])
    no_study = pydicom.dcmread(CT[1])
    del no_study.StudyInstanceUID
    # a file whose meta header is fine but whose dataset is garbage: pynetdicom sends a file's bytes undecoded
    broken = tmp_path / "broken.dcm"
    good = CT[2].read_bytes()
    meta_end = 132 + 12 + int.from_bytes(good[140:144], "little")  # preamble, DICM, group length element
    broken.write_bytes(good[:meta_end] + b"\x08\x00\x16\x00UI\xff\x7f" + b"\x01" * 64)
    truncated = tmp_path / "truncated.dcm"
    truncated.write_bytes(good[: int(len(good) * 0.6)])  # cut inside its pixel data
    assoc = associate(scp, [(CT_STORAGE, ["1.2.840.10008.1.2.5"])])
    try:
        assert assoc.is_established
        assert assoc.send_c_store(ds).Status == 0x0000
        assert assoc.send_c_store(no_study).Status == 0xA900
        monkeypatch.setattr(pynetdicom._config, "STORE_SEND_CHUNKED_DATASET", True)  # the file's bytes as they are
        assert assoc.send_c_store(truncated).Status == 0xA900
        assert assoc.send_c_store(broken).Status in (0xA900, 0xC000)  # a failure, never success
    finally:
        assoc.release()
    # the daemon stayed healthy, and the good instance became a study report after the quiet period
    assert scp.client.get("/v2/health/ready").status == 200
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        jobs = scp.client.get("/v1/jobs").json()["jobs"]
        if jobs and jobs[0]["state"] in ("succeeded", "failed"):
            break
        time.sleep(0.1)
    assert jobs[0]["state"] == "succeeded", jobs
    assert jobs[0]["report"]["modality"] == "CT"
    metrics = scp.client.get("/metrics").body.decode()
    refused = re.search(r'edgekitd_dicom_instances_total\{outcome="0xa900",via="dimse"\} (\d+)', metrics)
    assert refused is not None and int(refused.group(1)) >= 2, metrics[-2000:]
    assert 'edgekitd_dicom_instances_total{outcome="stored",via="dimse"}' in metrics


@pytest.mark.skipif(missing("storescu", "echoscu") is not None, reason=str(missing("storescu", "echoscu")))
def test_dcmtk_storescu_sends_a_series_and_echoscu_is_refused_with_an_unknown_title(scp):
    echo = subprocess.run(
        [tool("echoscu"), "-aet", "NOBODY", "-aec", "EDGEKIT", "127.0.0.1", str(scp.scp_port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert echo.returncode != 0 and "Rejected" in echo.stderr + echo.stdout
    sent = subprocess.run(
        [tool("storescu"), "-xr", "-aet", "MODALITY", "-aec", "EDGEKIT", "127.0.0.1", str(scp.scp_port)]
        + [str(p) for p in CT[3:8]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sent.returncode == 0, sent.stderr[-1000:]


def test_logs_never_carry_patient_values(scp):
    log = scp.log.read_text(errors="replace")
    assert "DICOM SCP EDGEKIT listening" in log
    for path in CT[:3]:
        ds = pydicom.dcmread(path, stop_before_pixels=True)
        for kw in ("PatientName", "PatientID", "AccessionNumber", "StudyInstanceUID", "SOPInstanceUID"):
            value = str(ds.get(kw, "") or "")
            if len(value) >= 4:
                assert value not in log, f"{kw} in the daemon's log"

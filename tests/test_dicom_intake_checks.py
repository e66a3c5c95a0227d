"""What edgekitd refuses at its DICOM and upload intakes: identifiers that are not UIDs (STOW-RS parts, C-STORE
datasets, the STOW-RS URL), associations addressed to another AE title (the daemon's `StorageScp` on 127.0.0.1,
pynetdicom as the SCU), and uploads past `limits.max_files` (the real daemon: its form now reaches the limit
instead of stopping at Starlette's 1000 files)."""

from __future__ import annotations

import asyncio
import io
import logging
import warnings
from importlib.resources import files
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pydicom = pytest.importorskip("pydicom")

from edgekit.daemon.dicomweb import StowService  # noqa: E402
from edgekit.daemon.instances import DATASET_MISMATCH, Refusal, is_uid, parse_part  # noqa: E402
from edgekit.daemon.metrics import Metrics  # noqa: E402
from edgekit.daemon.studies import StudyInbox  # noqa: E402
from edgekit.errors import EdgekitError  # noqa: E402

SAMPLES = Path(str(files("edgekit.models") / "samples"))
CT = sorted((SAMPLES / "ct_chest").glob("*.dcm"))
CT_STORAGE = "1.2.840.10008.5.1.4.1.1.2"
RLE = "1.2.840.10008.1.2.5"  # the CT samples' transfer syntax
HUGE = "1." + "2" * 10_000
NOT_UIDS = ["1..2", "1.2.", ".1.2", "1.2.3a", "1.2.3 ", HUGE, "1" * 65, "1.2/../3"]


@pytest.mark.parametrize(
    "value,ok",
    [("1.2.840.10008.5.1.4.1.1.2", True), ("0", True), ("0.0.1", True), ("1" * 64, True), ("", False)]
    + [("1.2.840.0123.4", True)]  # a leading zero: against PS3.5 9.1, written by some vendors, accepted
    + [(v, False) for v in NOT_UIDS],
)
def test_is_uid_takes_what_can_be_a_uid(value, ok):
    assert is_uid(value) is ok


def instance(**uids: str) -> bytes:
    ds = pydicom.dcmread(CT[0])
    buf = io.BytesIO()
    with warnings.catch_warnings():  # pydicom warns about the invalid values it is told to set and write
        warnings.simplefilter("ignore")
        for keyword, value in uids.items():
            setattr(ds, keyword, value)
            if keyword in ("SOPInstanceUID", "SOPClassUID"):
                setattr(ds.file_meta, "MediaStorage" + keyword, value)
        ds.save_as(buf, enforce_file_format=True)
    return buf.getvalue()


NAMES = {
    "StudyInstanceUID": "Study Instance UID",
    "SeriesInstanceUID": "Series Instance UID",
    "SOPInstanceUID": "SOP Instance UID",
    "SOPClassUID": "SOP Class UID",
}


@pytest.mark.parametrize("keyword", sorted(NAMES))
@pytest.mark.parametrize("bad", ["1.2.3a", "1..2", HUGE])
def test_a_part_with_an_identifier_that_is_not_a_uid_is_refused_naming_it_not_quoting_it(keyword, bad):
    refusal = parse_part(instance(**{keyword: bad}))
    assert isinstance(refusal, Refusal) and refusal.reason == DATASET_MISMATCH
    assert NAMES[keyword] in refusal.text and bad not in refusal.text
    assert refusal.sop_instance == ("" if keyword == "SOPInstanceUID" else str(pydicom.dcmread(CT[0]).SOPInstanceUID))
    assert refusal.sop_class == ("" if keyword == "SOPClassUID" else CT_STORAGE)


@pytest.fixture
def stow(tmp_path):
    inbox = StudyInbox(tmp_path / "state" / "inbox", lambda: 60.0, lambda folder: None)  # never started
    return StowService(inbox, Metrics()), tmp_path / "state" / "stow-spool"


async def _once(body: bytes):
    yield body
    yield b""


def _store(stow, body: bytes, target: str | None = None):
    service, spool = stow
    ctype = 'multipart/related; type="application/dicom"; boundary=b'
    return asyncio.run(service.store(_once(body), ctype, target, False, spool))


def test_stow_refuses_a_10_kb_uid_without_echoing_it_and_stores_the_good_part(stow):
    bad = instance(SOPInstanceUID=HUGE)
    good = CT[1].read_bytes()
    body = b"--b\r\n\r\n" + bad + b"\r\n--b\r\n\r\n" + good + b"\r\n--b--\r\n"
    result = _store(stow, body)
    assert result.status == 202 and (result.stored, result.failed) == (1, 1)
    [failed] = result.body["00081198"]["Value"]
    assert failed["00081197"]["Value"] == [DATASET_MISMATCH]
    assert failed["00081155"] == {"vr": "UI"}  # the would-be UID is not sent back
    assert HUGE not in repr(result.body)
    assert len(list(stow[0].inbox.root.rglob("*.dcm"))) == 1


@pytest.mark.parametrize("target", ["1.2.3a", "1" * 65, "1.2.3\n", "1..2"])
def test_the_study_uid_in_the_url_is_checked_by_the_same_rule(stow, target):
    with pytest.raises(EdgekitError) as err:
        _store(stow, b"--b\r\n\r\n" + CT[0].read_bytes() + b"\r\n--b--\r\n", target)
    assert err.value.code == "invalid_uid"
    study = str(pydicom.dcmread(CT[0]).StudyInstanceUID)
    assert _store(stow, b"--b\r\n\r\n" + CT[0].read_bytes() + b"\r\n--b--\r\n", study).status == 200


# --- the Storage SCP ---------------------------------------------------------------------------------------------
@pytest.fixture
def scp(tmp_path, caplog):
    pynetdicom = pytest.importorskip("pynetdicom")
    from edgekit.daemon.config import load_config
    from edgekit.daemon.dimse import StorageScp
    from edgekit.daemon.testing_pacs import free_port

    config = tmp_path / "edgekitd.toml"
    config.write_text(
        f'[dimse]\nenabled = true\nae_title = "EDGEKIT"\nport = {free_port()}\n'
        '[[dimse.allowed]]\nae_title = "MODALITY"\nhost = "127.0.0.1"\n'
    )
    metrics = Metrics()
    inbox = StudyInbox(tmp_path / "inbox", lambda: 60.0, lambda folder: None)
    server = StorageScp(load_config(config).dicom, inbox, metrics)
    caplog.set_level(logging.INFO, logger="edgekitd")
    server.start()
    yield server, pynetdicom
    server.stop()


def associate(scp, called: str, contexts=((CT_STORAGE, [RLE]),)):
    server, pynetdicom = scp
    ae = pynetdicom.AE(ae_title="MODALITY")
    ae.acse_timeout = ae.dimse_timeout = ae.network_timeout = 20
    for uid, syntaxes in contexts:
        ae.add_requested_context(uid, syntaxes)
    return ae.associate("127.0.0.1", server.port, ae_title=called)


def sample(scp, name: str, **labels: str) -> float:
    return scp[0].metrics.registry.get_sample_value(name, labels) or 0.0


def rejected_count(scp) -> float:
    return sample(scp, "edgekitd_dicom_associations_total", outcome="rejected")


def test_an_association_addressed_to_another_ae_title_is_rejected_logged_and_counted(scp, caplog):
    assoc = associate(scp, "NOT_EDGEKIT")
    assert assoc.is_rejected and not assoc.is_established
    rj = assoc.acceptor.primitive
    assert (rj.result, rj.result_source, rj.diagnostic) == (0x01, 0x01, 0x07)  # called AE title not recognised
    assert rejected_count(scp) == 1
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert lines == [
        "DICOM association refused: calling AE 'MODALITY' from 127.0.0.1: called AE 'NOT_EDGEKIT' is not this SCP's"
    ]
    # the right title still gets in
    assoc = associate(scp, "EDGEKIT")
    assert assoc.is_established
    assoc.release()
    assert rejected_count(scp) == 1


def test_c_store_refuses_datasets_whose_identifiers_are_not_uids(scp, tmp_path):
    good, lettered, huge, leading_zero = (pydicom.dcmread(f) for f in CT[:4])
    assoc = associate(scp, "EDGEKIT")
    try:
        assert assoc.is_established
        with warnings.catch_warnings():  # pydicom warns about the invalid values it is told to set, and sends them
            warnings.simplefilter("ignore")
            lettered.StudyInstanceUID = "1.2.3a.4"
            huge.SeriesInstanceUID = HUGE
            leading_zero.SOPInstanceUID = "1.2.840.0123.4"  # against PS3.5 9.1, written by some vendors: taken
            assert assoc.send_c_store(lettered).Status == DATASET_MISMATCH
            assert assoc.send_c_store(huge).Status == DATASET_MISMATCH
        assert assoc.send_c_store(good).Status == 0x0000
        assert assoc.send_c_store(leading_zero).Status == 0x0000
    finally:
        assoc.release()
    stored = list(scp[0].inbox.root.rglob("*.dcm"))
    assert len(stored) == 2
    assert sample(scp, "edgekitd_dicom_instances_total", via="dimse", outcome=f"{DATASET_MISMATCH:#06x}") == 2


# --- max_files ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    pytest.importorskip("uvicorn")
    from edgekit.daemon.testing import tiny_daemon

    with tiny_daemon(tmp_path_factory.mktemp("edgekitd-intake"), "[limits]\nmax_files = 4000\n") as d:
        yield d


def tiny_files(n: int) -> list[tuple[str, bytes, str]]:
    return [(f"f{i:05d}.dcm", b"tiny-%d" % i, "application/dicom") for i in range(n)]


@pytest.mark.parametrize("route", ["/v1/reports", "/v1/jobs"])
def test_an_upload_of_1001_files_reaches_ingest(daemon, route):
    """Starlette's form parser stopped at 1000 files with an opaque 400; the files now reach ingest, which says
    what is wrong with them (they are not DICOM)."""
    reply = daemon.client.post_study(route, tiny_files(1001), {"prompt": "x"})
    assert (reply.status, reply.error_code) == (400, "invalid_study"), reply.body[:300]


def test_an_upload_past_max_files_is_refused_naming_the_limit(daemon):
    reply = daemon.client.post_study("/v1/reports", tiny_files(4001))
    assert (reply.status, reply.error_code) == (413, "too_many_files"), reply.body[:300]
    assert "4000" in reply.json()["error"]["message"] and "max_files" in reply.json()["error"]["message"]
    assert daemon.client.get("/v2/health/ready").status == 200


@pytest.mark.parametrize(
    "fields,needle",
    [({"temperature": "hot"}, "temperature"), ({"top_p": "0"}, "top_p"), ({"quality": "min"}, "quality")],
)
def test_form_fields_are_still_checked(daemon, fields, needle):
    reply = daemon.client.post_study("/v1/reports", tiny_files(1), fields)
    assert (reply.status, reply.error_code) == (422, "validation_error"), reply.body[:300]
    assert needle in reply.json()["error"]["message"]


def test_the_documented_upload_body_is_the_checked_one():
    """`UPLOAD_OPENAPI` (the routes' requestBody) names every field `FormFields` checks, with its bounds."""
    from edgekit.daemon.forms import MAX_PROMPT_CHARS, UPLOAD_OPENAPI, FormFields

    schema = UPLOAD_OPENAPI["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert set(schema["properties"]) == {"files", *FormFields.model_fields}
    # files are optional in the schema (a text model's variant takes a prompt alone) and the description says when
    assert "required" not in schema and "text model" in schema["properties"]["files"]["description"]
    assert schema["properties"]["prompt"]["maxLength"] == MAX_PROMPT_CHARS
    assert schema["properties"]["files"]["items"]["contentMediaType"] == "application/octet-stream"

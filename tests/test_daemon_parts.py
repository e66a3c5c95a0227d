"""edgekitd's parts without a server: config, sd_notify datagrams, the durable job store, DICOM SR, the unit file."""

from __future__ import annotations

import io
import os
import re
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from edgekit.daemon.config import DaemonConfig, load_config, read_token  # noqa: E402
from edgekit.daemon.jobs import FAILED, QUEUED, SUCCEEDED, Job, JobStore  # noqa: E402
from edgekit.daemon.notify import Notifier  # noqa: E402
from edgekit.errors import ConfigError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "models" / "samples"


# --- config ---------------------------------------------------------------------------------------------------------
def test_the_example_config_shows_every_key():
    """Every key of the config's key table (`_KEYS`) is in packaging/edgekitd.toml, set or commented out, under its
    section."""
    from edgekit.daemon.config import _KEYS

    text = (REPO / "packaging" / "edgekitd.toml").read_text()
    sections: dict[str, str] = {}
    current = ""
    for line in text.splitlines():
        if line.startswith("[") and line.rstrip().endswith("]"):
            current = line.strip("[] \n")
        sections[current] = sections.get(current, "") + line + "\n"
    missing = [
        f"[{section}] {key}"
        for section, key in _KEYS
        if not re.search(rf"^#? ?{re.escape(key)} =", sections.get(section, ""), re.MULTILINE)
    ]
    assert missing == []


def test_the_example_config_parses_and_matches_the_defaults(tmp_path):
    cfg = load_config(REPO / "packaging" / "edgekitd.toml")
    defaults = DaemonConfig()
    for name in (
        "socket",
        "socket_mode",
        "tcp_enabled",
        "tcp_host",
        "workers",
        "max_queue",
        "max_upload_bytes",
        "state_dir",
        "job_retention_s",
        "drain_timeout_s",
        "keep_alive_s",
    ):
        assert getattr(cfg, name) == getattr(defaults, name), name


def test_config_file_values_relative_paths_and_overrides(tmp_path):
    path = tmp_path / "edgekitd.toml"
    path.write_text(
        '[daemon]\nstate_dir = "state"\n[scheduler]\nmax_queue = 3\n[listen]\nsocket_mode = "0600"\n'
        '[[variants]]\nname = "int4"\nbundle = "b/int4"\n[models]\nactive = "int4"\n'
    )
    cfg = load_config(path, {"workers": 2, "max_queue": None})
    assert cfg.state_dir == tmp_path / "state" and cfg.max_queue == 3 and cfg.workers == 2
    assert cfg.socket_mode == 0o600 and cfg.variants[0].bundle == tmp_path / "b" / "int4"
    assert cfg.active_variant == "int4" and cfg.source == path


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[scheduler]\nworkerz = 1\n", "unknown key scheduler.workerz"),
        ('[scheduler]\nworkers = "two"\n', "scheduler.workers has the wrong type"),
        ("[scheduler]\nworkers = 0\n", "workers must be a positive integer"),
        ("[scheduler]\ningest_processes = -1\n", "ingest_processes must be a whole number >= 0"),
        ("[limits]\ningest_timeout_s = 0\n", "ingest_timeout_s must be > 0"),
        ("[listen]\ntcp = true\n", "tcp_token_file"),
        ("[models]\nkeep_alive_s = true\n", "models.keep_alive_s has the wrong type"),
        ("[models]\nkeep_alive_s = nan\n", "keep_alive_s must be a number of seconds"),
        ("[listen\n", "not valid TOML"),
        ('[[variants]]\nname = "a"\n', "variants[0] needs"),
        ('[models]\nactive = "zz"\n[[variants]]\nname = "a"\nbundle = "x"\n', "unknown variant"),
        ("[limits]\nmax_new_tokens = 100000\n", "max_new_tokens_limit must be <= 4096"),
    ],
)
def test_bad_config_names_the_file_and_the_reason(tmp_path, text, needle):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert needle in str(err.value) and str(path) in str(err.value)


def test_tcp_token_must_be_long_enough(tmp_path):
    token = tmp_path / "token"
    token.write_text("short\n")
    cfg = load_config(None, {"tcp_enabled": True, "tcp_token_file": token, "state_dir": tmp_path})
    with pytest.raises(ConfigError, match="at least 16"):
        read_token(cfg)
    token.write_text("x" * 32 + "\n")
    assert read_token(cfg) == "x" * 32


# --- sd_notify --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("abstract", [True, False])
def test_notify_sends_datagrams_to_path_and_abstract_sockets(tmp_path, abstract):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"@edgekit-test-{uuid.uuid4().hex}" if abstract else str(tmp_path / "notify")
    listener.bind(b"\0" + name[1:].encode() if abstract else name)
    listener.settimeout(5)
    n = Notifier({"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "200000"})
    try:
        n.ready("serving")
        assert listener.recv(4096).decode().splitlines()[:2] == ["READY=1", "STATUS=serving"]
        n.start_watchdog()
        t0 = time.monotonic()
        pings = [listener.recv(4096).decode() for _ in range(3)]
        assert pings == ["WATCHDOG=1"] * 3
        assert 0.1 < time.monotonic() - t0 < 2.0  # about one per 100 ms (half of WATCHDOG_USEC)
    finally:
        n.close()
        listener.close()


def test_notify_is_a_no_op_outside_systemd_and_honours_watchdog_pid():
    assert not Notifier({}).send("READY=1")
    assert Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}).watchdog_usec is None
    assert (
        Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": str(os.getpid())}).watchdog_usec
        == 1000
    )


# --- the job store ----------------------------------------------------------------------------------------------------
def _job(store, key=None, fp="f"):
    return Job(
        id=store.new_id(),
        idempotency_key=key,
        fingerprint=fp,
        state=QUEUED,
        variant=None,
        prompt="p",
        options={"temperature": 0.0},
        input="/x",
        created=time.time(),
    )


def test_job_store_survives_reopen_and_requeues_running_jobs(tmp_path):
    store = JobStore(tmp_path)
    a, b, c = (store.insert(_job(store)) for _ in range(3))
    store.mark_running(a.id)
    store.mark_running(b.id)
    store.finish(b.id, result={"text": "ok"})
    store.close()  # as if killed: a is still "running"
    store = JobStore(tmp_path)
    again = store.recover()
    assert [j.id for j in again] == [a.id, c.id]
    assert store.get(a.id).state == QUEUED and store.get(a.id).attempts == 1
    assert store.get(b.id).state == SUCCEEDED and store.get(b.id).result == {"text": "ok"}
    assert (tmp_path / "jobs.sqlite3").exists()
    with store._lock:
        assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_idempotency_key_returns_the_first_job(tmp_path):
    store = JobStore(tmp_path)
    first = store.insert(_job(store, key="k1", fp="a"))
    second = store.insert(_job(store, key="k1", fp="b"))
    assert second.id == first.id and second.fingerprint == "a"


def test_purge_deletes_finished_jobs_past_retention_with_their_files(tmp_path):
    store = JobStore(tmp_path)
    old, live = store.insert(_job(store)), store.insert(_job(store))
    store.job_dir(old.id).mkdir()
    store.finish(old.id, error={"code": "invalid_study"})
    assert store.get(old.id).state == FAILED
    assert store.purge(retention_s=3600) == 0
    assert store.purge(retention_s=3600, now=time.time() + 7200) == 1
    assert store.get(old.id) is None and not store.job_dir(old.id).exists() and store.get(live.id) is not None


# --- DICOM SR ---------------------------------------------------------------------------------------------------------
def test_sr_reads_back_with_tid_2000_shape_and_references_the_source_study():
    import pydicom

    from edgekit.daemon.sr import build_sr, collect_evidence, sr_bytes

    evidence = collect_evidence(SAMPLES / "ct_chest")
    report = {
        "findings_text": "A 12 mm nodule in the right upper lobe. No effusion.",
        "impression": "Nodule.",
        "model": "radreport-tiny",
        "variant": "default",
        "target": "cpu",
    }
    ds = pydicom.dcmread(io.BytesIO(sr_bytes(build_sr(report, evidence, algorithm_version="0.1.0"))))
    source = pydicom.dcmread(SAMPLES / "ct_chest" / "IM0001.dcm", stop_before_pixels=True)
    assert ds.SOPClassUID == "1.2.840.10008.5.1.4.1.1.88.22"  # Enhanced SR
    assert ds.StudyInstanceUID == source.StudyInstanceUID and ds.PatientID == source.PatientID
    assert ds.ConceptNameCodeSequence[0].CodeValue == "18748-4"
    assert ds.ContentTemplateSequence[0].TemplateIdentifier == "2000"
    items = {c.ConceptNameCodeSequence[0].CodeValue: c for c in ds.ContentSequence}
    assert items["59776-5"].ContentSequence[0].ConceptNameCodeSequence[0].CodeValue == "121071"
    assert [c.TextValue for c in items["59776-5"].ContentSequence] == [
        "A 12 mm nodule in the right upper lobe.",
        "No effusion.",
    ]
    assert items["19005-8"].ContentSequence[0].TextValue == "Nodule."
    assert items["111001"].TextValue == "radreport-tiny" and items["111003"].TextValue == "0.1.0"  # TID 4019
    refs = ds.CurrentRequestedProcedureEvidenceSequence[0].ReferencedSeriesSequence[0].ReferencedSOPSequence
    assert len(refs) == 14


def _sr_items(report: dict) -> dict:
    import pydicom

    from edgekit.daemon.sr import build_sr, collect_evidence, sr_bytes

    base = {"findings_text": "No effusion.", "impression": "", "model": "m", "variant": "v", "target": "cpu"}
    sr = build_sr({**base, **report}, collect_evidence(SAMPLES / "ct_chest"), algorithm_version="0")
    ds = pydicom.dcmread(io.BytesIO(sr_bytes(sr)))
    return {c.ConceptNameCodeSequence[0].CodeValue: c for c in ds.ContentSequence}


@pytest.mark.parametrize(
    "impression, items",
    [
        ("1. A. 2. B.", ["1. A.", "2. B."]),
        ("1. Nodule. Follow up in 3 months. 2. No effusion.", ["1. Nodule. Follow up in 3 months.", "2. No effusion."]),
        ("1) Nodule.\n2) Stable.", ["1) Nodule.", "2) Stable."]),
        ("2. A. 3. B.", ["2. A.", "3. B."]),  # a list not starting at 1: still no bare numbers
        ("Nodule in segment 1. No effusion.", ["Nodule in segment 1.", "No effusion."]),
        ("Nodule 12.5 mm. Stable.", ["Nodule 12.5 mm.", "Stable."]),
    ],
)
def test_sr_keeps_each_numbered_impression_item_with_its_number(impression, items):
    got = [c.TextValue for c in _sr_items({"impression": impression})["19005-8"].ContentSequence]
    assert got == items
    assert not any(re.fullmatch(r"\d+[.)]", t) for t in got)


def test_sr_lists_the_reports_warnings_as_a_processing_note():
    warnings = ["skipped 00003.dcm: not a DICOM file", "max_new_tokens lowered from 200 to 90"]
    items = _sr_items({"warnings": warnings})
    note = items["121106"]  # DCM Comment, a TEXT item beside the sections
    assert note.ValueType == "TEXT" and note.TextValue.startswith("Processing notes")
    assert all(w in note.TextValue for w in warnings)
    assert "121106" not in _sr_items({"warnings": []}) and "121106" not in _sr_items({})


def test_runner_fails_a_job_whose_prompt_is_too_long_with_its_code_not_500(tmp_path):
    import contextlib

    from edgekit.daemon.metrics import Metrics
    from edgekit.daemon.options import RequestOptions
    from edgekit.daemon.runner import ReportRunner
    from edgekit.daemon.variants import Loaded
    from edgekit.daemon.work import Work
    from edgekit.reporter import PromptTooLongError

    class Reporter:
        generation_config = {"max_new_tokens": 8}
        tokenizer = None
        is_text = False  # a VLM's: the work's study is reported

        def report(self, *_a, **_k):
            raise PromptTooLongError("prompt is 300 tokens; this model's context of 128 positions holds ...")

    class Registry:
        specs = {"default": None}

        @contextlib.contextmanager
        def hold(self, name):
            yield Loaded(name, Reporter(), 0.0, 0.0)

    store = JobStore(tmp_path)
    job = store.insert(_job(store))
    work = Work(study_path=tmp_path, prompt="x", options=RequestOptions(), variant="default", job_id=job.id)
    work.study = object()
    ReportRunner(Registry(), store, Metrics(), ingestor=None)(work)
    failed = store.get(job.id)
    assert failed.state == FAILED
    assert (failed.error["code"], failed.error["status"]) == ("prompt_too_long", 422)
    assert isinstance(work.future.exception(), PromptTooLongError)


def test_check_files_refuses_a_missing_bundle(tmp_path):
    from edgekit.daemon.config import check_files

    (tmp_path / "b" / "ok").mkdir(parents=True)
    (tmp_path / "b" / "ok" / "manifest.json").write_text("{}")
    (tmp_path / "b" / "empty").mkdir()
    (tmp_path / "b" / "x.ekb").write_bytes(b"PK")
    path = tmp_path / "edgekitd.toml"

    def cfg(*bundles):
        path.write_text("".join(f'[[variants]]\nname = "v{i}"\nbundle = "{b}"\n' for i, b in enumerate(bundles)))
        return load_config(path)

    check_files(cfg("b/ok", "b/x.ekb"))
    with pytest.raises(ConfigError, match="no such bundle") as err:
        check_files(cfg("b/ok", "b/missing"))
    assert str(tmp_path / "b" / "missing") in str(err.value)
    with pytest.raises(ConfigError, match="not a bundle"):
        check_files(cfg("b/empty"))
    with pytest.raises(ConfigError, match="weights are missing"):
        check_files(load_config(None, {"default_model_dir": tmp_path / "nowhere", "state_dir": tmp_path}))


def test_sr_of_a_video_study_is_refused():
    from edgekit.daemon.sr import SrUnavailableError, build_sr, collect_evidence

    assert collect_evidence(SAMPLES / "us_cardiac" / "cine.mp4") == []
    with pytest.raises(SrUnavailableError):
        build_sr({"findings_text": "x"}, [], algorithm_version="0")


# --- the unit files ---------------------------------------------------------------------------------------------------
def test_service_unit_exposure_is_at_most_2():
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    unit = REPO / "packaging" / "systemd" / "edgekitd.service"
    out = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(unit)], capture_output=True, text=True, timeout=60
    )
    line = next(x for x in out.stdout.splitlines() if "Overall exposure level" in x)
    score = float(line.split("level for")[1].split(":")[1].split()[0])
    assert score <= 2.0, out.stdout


def test_unit_files_verify():
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    units = REPO / "packaging" / "systemd"
    out = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(units / "edgekitd.socket"), str(units / "edgekitd.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    bad = [x for x in out.stderr.splitlines() if "edgekitd" in x and "Command" not in x and "executable" not in x]
    assert not bad, out.stderr


# --- keep-alive -----------------------------------------------------------------------------------------------------
def test_keep_alive_unloads_only_idle_non_active_variants_not_in_use(tmp_path):
    from edgekit.daemon.config import Variant
    from edgekit.daemon.variants import Loaded, VariantRegistry

    cfg = DaemonConfig(
        state_dir=tmp_path,
        keep_alive_s=10.0,
        active_variant="a",
        variants=tuple(Variant(n, tmp_path / n) for n in "abc"),
    )
    changes = []
    reg = VariantRegistry(cfg, on_change=changes.append)
    for name in "abc":  # stand-ins for loaded reporters: unloading never touches them
        reg.loaded[name] = Loaded(name, reporter=object(), load_ms=0.0, warm_ms=0.0, last_used=100.0)
    held = reg.get("b", hold=True)  # b is serving a report
    held.last_used = 100.0
    assert reg.unload_idle(now=105.0) == []  # nobody idle for 10 s yet
    assert reg.unload_idle(now=111.0) == ["c"]  # a is active, b is in use
    assert changes[-1] == {"a", "b"}
    reg.release(held)  # released now (monotonic clock), so b is fresh again
    assert reg.unload_idle() == []
    assert reg.unload_idle(now=held.last_used + 10.0) == ["b"]
    assert set(reg.loaded) == {"a"}
    reg.keep_alive_s = -1  # negative: never
    reg.loaded["b"] = Loaded("b", reporter=object(), load_ms=0.0, warm_ms=0.0, last_used=0.0)
    assert reg.unload_idle(now=1e9) == []

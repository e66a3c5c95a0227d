"""OpenTelemetry traces end to end: a real edgekitd (subprocess, tiny random model) exporting by OTLP/HTTP to a real
receiver on loopback that decodes the protobuf with `opentelemetry-proto`. One study sent by STOW-RS with a
`traceparent` is followed under ONE trace id: the STOW-RS request, the received study, `generate_content` and its
stages, the SR, and its deliveries by STOW-RS and webhook, whose requests carry that trace's `traceparent`. No
attribute holds a raw UID, the patient's name or the prompt.
"""

from __future__ import annotations

import gzip
import json
import secrets
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.resources import files
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("opentelemetry.sdk.trace")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")
trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
pydicom = pytest.importorskip("pydicom")

from edgekit.daemon.testing import DaemonProcess, write_tiny_model  # noqa: E402

CR = Path(str(files("edgekit.models") / "samples")) / "cr_chest" / "image.dcm"
PROMPT = "Cough and fever, ask Dr Quimby-Sentinel"  # the configured prompt: must never be exported
STAGES = {"ingest", "queue_wait", "preprocess", "encode_images", "prefill", "decode"}


class Receiver:
    """An HTTP server on loopback: OTLP/HTTP traces at /v1/traces (decoded), and any other POST recorded with its
    `traceparent` (the STOW-RS destination and the webhook)."""

    def __init__(self):
        self.spans: list = []  # (resource attributes, span)
        self.posts: list[tuple[str, str | None]] = []  # (path, traceparent)
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    assert self.headers["Content-Type"] == "application/x-protobuf"
                    req = trace_service.ExportTraceServiceRequest.FromString(body)
                    with outer.lock:
                        for rs in req.resource_spans:
                            for ss in rs.scope_spans:
                                outer.spans += [(rs.resource, s) for s in ss.spans]
                    answer = trace_service.ExportTraceServiceResponse().SerializeToString()
                    self._answer(200, "application/x-protobuf", answer)
                    return
                with outer.lock:
                    outer.posts.append((self.path, self.headers.get("traceparent")))
                self._answer(200, "application/dicom+json", b"{}")

            def _answer(self, status: int, ctype: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def in_trace(self, trace_id: bytes) -> list:
        with self.lock:
            return [s for _, s in self.spans if s.trace_id == trace_id]


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    root = tmp_path_factory.mktemp("edgekitd-traces")
    receiver = Receiver()
    base = f"http://127.0.0.1:{receiver.port}"
    config = root / "edgekitd.toml"
    config.write_text(
        f'[dicom]\nquiet_period_s = 0.5\nprompt = "{PROMPT}"\n'
        "[delivery]\nbackoff_s = 0.2\npoll_s = 0.1\n"
        f'[[destinations]]\nname = "pacs"\nkind = "stow"\nurl = "{base}/dicomweb"\n'
        f'[[destinations]]\nname = "hook"\nkind = "webhook"\nurl = "{base}/hook"\n'
        f'[telemetry]\nenabled = true\nendpoint = "{base}"\nservice_name = "edgekitd-test"\n'
    )
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # the standard variable: export every 100 ms, not every 5 s
    with DaemonProcess(root / "state", write_tiny_model(root / "model"), config=config, env=env).start() as d:
        yield d, receiver
    receiver.server.shutdown()


def _stow(d: DaemonProcess, data: bytes, headers: dict[str, str]):
    boundary = uuid.uuid4().hex
    body = (
        f"--{boundary}\r\nContent-Type: application/dicom\r\n\r\n".encode() + data + f"\r\n--{boundary}--\r\n".encode()
    )
    ctype = f'multipart/related; type="application/dicom"; boundary={boundary}'
    return d.client.request(
        "POST", "/dicomweb/studies?complete=true", body=body, headers={"Content-Type": ctype, **headers}
    )


def _wait(what, timeout: float, label: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.1)
    raise TimeoutError(label)


def _attrs(kvs) -> dict:
    out = {}
    for kv in kvs:
        v = kv.value
        which = v.WhichOneof("value")
        if which == "array_value":
            out[kv.key] = [getattr(x, x.WhichOneof("value")) for x in v.array_value.values]
        else:
            out[kv.key] = getattr(v, which) if which else None
    return out


def _every_value(spans, resources) -> list[str]:
    values = []
    for s in spans:
        groups = [s.attributes, *(e.attributes for e in s.events), *(link.attributes for link in s.links)]
        for kvs in groups:
            for value in _attrs(kvs).values():
                values += [str(x) for x in value] if isinstance(value, list) else [str(value)]
        values += [s.name, *(e.name for e in s.events), s.status.message]
    for r in resources:
        values += [str(v) for v in _attrs(r.attributes).values()]
    return values


def test_a_stow_rs_study_is_one_trace_from_receipt_to_its_sr_deliveries(traced):
    d, receiver = traced
    trace_id, caller = secrets.token_bytes(16), secrets.token_bytes(8)
    traceparent = f"00-{trace_id.hex()}-{caller.hex()}-01"
    reply = _stow(d, CR.read_bytes(), {"traceparent": traceparent})
    assert reply.status == 200, reply.body[:300]

    def delivered():
        jobs = d.client.get("/v1/jobs").json()["jobs"]
        done = [j for j in jobs if {x["state"] for x in j.get("deliveries", [])} == {"delivered"}]
        return done[0] if done else None

    job = _wait(delivered, 90, "the study reported and delivered to both destinations")
    assert job["state"] == "succeeded"
    report = job["report"]
    variant = report["variant"]
    wanted = {"POST /dicomweb/studies", "receive study", f"generate_content {variant}", "render_sr"}
    wanted |= {"STOW-RS pacs", "webhook hook", *STAGES}
    spans = _wait(
        lambda: (got := receiver.in_trace(trace_id)) and wanted <= {s.name for s in got} and got,
        30,
        f"spans {sorted(wanted)} exported under the caller's trace id",
    )
    by_name = {s.name: s for s in spans}
    ids = {s.span_id: s for s in spans}

    # parentage: caller -> STOW-RS request -> received study -> generate_content -> its stages; deliveries -> SR
    server = by_name["POST /dicomweb/studies"]
    assert server.parent_span_id == caller and server.kind == server.SPAN_KIND_SERVER
    server_attrs = _attrs(server.attributes)
    assert server_attrs["http.route"] == "/dicomweb/studies" and server_attrs["http.response.status_code"] == 200
    assert server_attrs["edgekit.stow.stored"] == 1 and server_attrs["edgekit.studies"] == [report["study"]]
    receive = by_name["receive study"]
    assert receive.parent_span_id == server.span_id
    gen = by_name[f"generate_content {variant}"]
    assert gen.parent_span_id == receive.span_id
    for stage in STAGES:
        child = by_name[stage]
        assert child.parent_span_id == gen.span_id, stage
        assert gen.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano, stage
        assert child.end_time_unix_nano <= gen.end_time_unix_nano, stage
    prefill, decode = by_name["prefill"], by_name["decode"]
    assert prefill.end_time_unix_nano == decode.start_time_unix_nano
    assert by_name["encode_images"].end_time_unix_nano == prefill.start_time_unix_nano
    wait = by_name["ingest_wait"]  # the received study waited (if at all) for an ingest process, just before
    assert wait.parent_span_id == gen.span_id and wait.end_time_unix_nano == by_name["ingest"].start_time_unix_nano
    assert by_name["queue_wait"].end_time_unix_nano <= by_name["preprocess"].start_time_unix_nano
    stow_span, hook_span = by_name["STOW-RS pacs"], by_name["webhook hook"]
    for delivery in (stow_span, hook_span):
        assert delivery.parent_span_id == receive.span_id and delivery.kind == delivery.SPAN_KIND_CLIENT
        assert delivery.start_time_unix_nano >= gen.end_time_unix_nano  # delivered after the report
        a = _attrs(delivery.attributes)
        assert a["http.response.status_code"] == 200 and a["server.address"] == "127.0.0.1"
        assert a["edgekit.job.id"] == job["id"] and a["edgekit.delivery.attempt"] == 1
    assert ids[by_name["render_sr"].parent_span_id] in (stow_span, hook_span)  # the SR is built for the first one

    # GenAI semantic conventions, and edgekit's own
    g = _attrs(gen.attributes)
    assert g["gen_ai.operation.name"] == "generate_content" and g["gen_ai.provider.name"] == "edgekit"
    assert g["gen_ai.request.model"] == variant and g["gen_ai.response.model"] == report["model"]
    assert g["gen_ai.usage.output_tokens"] == report["timings"]["new_tokens"]
    assert g["gen_ai.usage.input_tokens"] > 0 and g["gen_ai.request.max_tokens"] >= g["gen_ai.usage.output_tokens"]
    assert g["gen_ai.response.finish_reasons"] == [
        {"stop_token": "stop", "max_new_tokens": "length"}[report["stop_reason"]]
    ]
    assert 0 < g["gen_ai.response.time_to_first_chunk"] <= (gen.end_time_unix_nano - gen.start_time_unix_nano) / 1e9
    assert g["edgekit.target"] == report["target"] == "cpu" and g["edgekit.variant"] == variant
    assert g["edgekit.study"] == report["study"] and g["edgekit.study"].startswith("uid:")  # hashed, as the logs
    assert g["edgekit.job.id"] == job["id"] and g["edgekit.modality"] == "DX"
    assert ("edgekit.energy_j" in g) == (report["energy_j"] is not None)
    assert "gen_ai.input.messages" not in g and "gen_ai.output.messages" not in g  # capture_content is off

    # the outbound STOW-RS and webhook requests carried this trace, each its own attempt's span as the parent
    with receiver.lock:
        posts = dict(receiver.posts)
    assert posts["/dicomweb/studies"] == f"00-{trace_id.hex()}-{stow_span.span_id.hex()}-01"
    assert posts["/hook"] == f"00-{trace_id.hex()}-{hook_span.span_id.hex()}-01"

    # no patient data, no raw UID, no prompt, no report text in any attribute, event or name
    ds = pydicom.dcmread(CR)
    sr = pydicom.dcmread(__import__("io").BytesIO(d.client.get(f"/v1/jobs/{job['id']}/sr").body))
    secrets_ = {str(ds.PatientName), str(ds.PatientID), ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.SOPInstanceUID}
    secrets_ |= {sr.SOPInstanceUID, sr.SeriesInstanceUID, PROMPT, "Quimby"}
    if report["text"].strip():
        secrets_.add(report["text"].strip())
    secrets_ = {s for s in secrets_ if s}
    with receiver.lock:
        values = _every_value([s for _, s in receiver.spans], [r for r, _ in receiver.spans])
    leaks = [(s, v) for s in secrets_ for v in values if s in v]
    assert not leaks, leaks
    with receiver.lock:
        resource = _attrs(receiver.spans[0][0].attributes)
    assert resource["service.name"] == "edgekitd-test"


def test_a_malformed_traceparent_is_ignored_and_a_variant_switch_is_an_event(traced):
    d, receiver = traced
    bad = "00-not-a-trace-01"
    assert d.client.request("GET", "/v2/health/ready", headers={"traceparent": bad}).status == 200
    active = d.client.get("/v1/variants").json()["active"]
    trace_id = secrets.token_bytes(16)
    switch = d.client.request(
        "PUT",
        "/v1/variants/active",
        body=json.dumps({"name": active}).encode(),
        headers={"Content-Type": "application/json", "traceparent": f"00-{trace_id.hex()}-{'ab' * 8}-01"},
    )
    assert switch.status == 200, switch.body[:300]
    put = _wait(
        lambda: [s for s in receiver.in_trace(trace_id) if s.name == "PUT /v1/variants/active"],
        30,
        "the switch's server span",
    )[0]
    events = {e.name: _attrs(e.attributes) for e in put.events}
    assert events["edgekit.variant.switched"]["edgekit.variant"] == active
    assert events["edgekit.variant.switched"]["edgekit.reason"] == "activate"
    ready = _wait(
        lambda: [s for _, s in receiver.spans if s.name == "GET /v2/health/ready"], 30, "the probe's server span"
    )
    assert all(s.parent_span_id == b"" for s in ready)  # a new trace: the bad header named no parent


def test_an_uploaded_job_reports_under_its_request_span(traced):
    from edgekit.daemon.client import study_files

    d, receiver = traced
    trace_id = secrets.token_bytes(16)
    headers = {"traceparent": f"00-{trace_id.hex()}-{'cd' * 8}-01"}
    reply = d.client.post_study("/v1/jobs", study_files(CR), {"prompt": PROMPT}, headers=headers)
    assert reply.status == 202, reply.body[:300]
    job = d.client.wait_job(reply.json()["id"])
    assert job["state"] == "succeeded"
    variant = job["report"]["variant"]
    spans = _wait(
        lambda: (
            (got := receiver.in_trace(trace_id))
            and len({s.name for s in got} & {"POST /v1/jobs", "decode"}) == 2
            and got
        ),
        30,
        "the job's spans",
    )
    by_name = {s.name: s for s in spans}
    post, gen = by_name["POST /v1/jobs"], by_name[f"generate_content {variant}"]
    assert post.parent_span_id == bytes.fromhex("cd" * 8) and gen.parent_span_id == post.span_id
    assert _attrs(gen.attributes)["edgekit.job.id"] == job["id"]
    assert {s.name for s in spans if s.parent_span_id == gen.span_id} >= STAGES
    leaks = [v for v in _every_value(spans, []) if "Quimby" in v]
    assert not leaks, leaks

    # an uploaded job has no delivery: its SR is built when asked for, a render_sr under that request's span
    get_trace = secrets.token_bytes(16)
    headers = {"traceparent": f"00-{get_trace.hex()}-{'ab' * 8}-01"}
    sr = d.client.get(f"/v1/jobs/{job['id']}/sr", headers=headers)
    assert sr.status == 200 and pydicom.dcmread(__import__("io").BytesIO(sr.body)).Modality == "SR"
    got = _wait(
        lambda: (spans := receiver.in_trace(get_trace)) and "render_sr" in {s.name for s in spans} and spans,
        30,
        "the on-demand SR's render_sr span",
    )
    (render,) = [s for s in got if s.name == "render_sr"]
    (server,) = [s for s in got if s.kind == s.SPAN_KIND_SERVER]
    assert server.parent_span_id == bytes.fromhex("ab" * 8) and render.parent_span_id == server.span_id
    a = _attrs(render.attributes)
    assert a["edgekit.job.id"] == job["id"] and a["edgekit.variant"] == variant


def test_a_direct_sr_report_renders_its_sr_under_the_request_span(traced):
    """`POST /v1/reports?format=sr`: no job, no delivery; the SR is built in the request, a `render_sr` child of
    its server span, after the report's `generate_content`."""
    from edgekit.daemon.client import study_files

    d, receiver = traced
    trace_id = secrets.token_bytes(16)
    headers = {"traceparent": f"00-{trace_id.hex()}-{'ef' * 8}-01"}
    reply = d.client.post_study("/v1/reports?format=sr", study_files(CR), {"prompt": PROMPT}, headers=headers)
    assert reply.status == 200, reply.body[:300]
    assert pydicom.dcmread(__import__("io").BytesIO(reply.body)).Modality == "SR"
    spans = _wait(
        lambda: (
            (got := receiver.in_trace(trace_id))
            and {"POST /v1/reports", "render_sr", "decode"} <= {s.name for s in got}
            and got
        ),
        30,
        "the direct report's spans",
    )
    by_name = {s.name: s for s in spans}
    post, sr = by_name["POST /v1/reports"], by_name["render_sr"]
    (gen,) = [s for s in spans if s.name.startswith("generate_content ")]
    assert post.parent_span_id == bytes.fromhex("ef" * 8) and sr.parent_span_id == post.span_id
    assert gen.parent_span_id == post.span_id and sr.start_time_unix_nano >= gen.end_time_unix_nano
    assert post.start_time_unix_nano <= sr.start_time_unix_nano <= sr.end_time_unix_nano <= post.end_time_unix_nano
    a = _attrs(sr.attributes)
    assert a["edgekit.variant"] == gen.name.removeprefix("generate_content ") and "edgekit.job.id" not in a
    leaks = [v for v in _every_value(spans, []) if "Quimby" in v]
    assert not leaks, leaks


# --- the parts, without a daemon ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,needle",
    [
        ("enabled = 1", "telemetry.enabled has the wrong type"),
        ('endpoint = "collector:4318"', "http:// or https:// URL"),
        ("sample_ratio = 1.5", "within 0..1"),
        ("capture = true", "unknown key telemetry.capture"),
    ],
)
def test_bad_telemetry_config_is_refused_naming_the_key(tmp_path, text, needle):
    from edgekit.daemon.config import load_config
    from edgekit.errors import ConfigError

    path = tmp_path / "edgekitd.toml"
    path.write_text(f"[telemetry]\n{text}\n")
    with pytest.raises(ConfigError, match=needle):
        load_config(path)


def test_telemetry_enabled_without_the_extra_is_one_config_error_line(tmp_path, monkeypatch, capsys):
    from edgekit.daemon import main, telemetry

    monkeypatch.setattr(telemetry, "missing_module", lambda: "opentelemetry.sdk.trace")
    path = tmp_path / "edgekitd.toml"
    path.write_text("[telemetry]\nenabled = true\n")
    assert main.main(["--config", str(path), "--check-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "telemetry.enabled = true needs the otel extra" in err[0]
    assert "pip install 'edgekit[otel]'" in err[0]
    path.write_text("[telemetry]\nenabled = false\n")  # off needs nothing
    assert main.main(["--config", str(path), "--check-config"]) == 0


def test_off_by_default_and_the_otel_variables_turn_it_on_or_off():
    from edgekit.daemon.config import DaemonConfig
    from edgekit.daemon.jobs import Job
    from edgekit.daemon.telemetry import TelemetrySettings, carrier, enabled

    assert DaemonConfig().telemetry == TelemetrySettings() and not TelemetrySettings().wanted({})
    assert not enabled() and carrier() is None  # nothing set up in this process: every hook is a no-op
    assert Job("a" * 32, None, "f", "queued", None, "", {}, "", 0.0).trace is None
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert TelemetrySettings().wanted(env) and not TelemetrySettings(enabled=False).wanted(env)
    assert not TelemetrySettings(enabled=True).wanted({"OTEL_SDK_DISABLED": "true"})
    assert TelemetrySettings(endpoint="http://c:4318").traces_url() == "http://c:4318/v1/traces"
    assert TelemetrySettings(endpoint="http://c:4318/otlp/v1/traces").traces_url() == "http://c:4318/otlp/v1/traces"


def test_a_jobs_database_from_before_gains_the_trace_column_and_keeps_its_jobs(tmp_path):
    import sqlite3

    from edgekit.daemon.jobs import _SCHEMA, Job, JobStore

    old = _SCHEMA.replace(",\n    trace TEXT", "")
    assert old != _SCHEMA
    db = sqlite3.connect(tmp_path / "jobs.sqlite3")
    db.executescript(old)
    db.execute(
        "INSERT INTO jobs (id, fingerprint, state, prompt, options, input, created) VALUES (?, 'f', 'queued', '', "
        "'{}', '', 1.0)",
        ("b" * 32,),
    )
    db.commit()
    db.close()
    store = JobStore(tmp_path)
    assert store.get("b" * 32).trace is None
    carrier = json.dumps({"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"})
    store.insert(Job("c" * 32, None, "f", "queued", None, "", {}, "", 2.0, trace=carrier))
    assert [j.trace for j in store.recover()] == [None, carrier]
    store.close()
    assert JobStore(tmp_path).get("c" * 32).trace == carrier  # opened again: no second ALTER

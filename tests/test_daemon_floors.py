"""edgekitd's floors one at a time, without a model: the work queue, the options merge, the one upload form, and the
app's middleware and error shape while the model is still loading (the ASGI app called in-process)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from edgekit.daemon.metrics import Metrics  # noqa: E402
from edgekit.daemon.options import RequestOptions, generation_options  # noqa: E402
from edgekit.daemon.queue import QueueFullError, ShuttingDownError, WorkQueue  # noqa: E402
from edgekit.daemon.work import Work  # noqa: E402
from edgekit.errors import EdgekitError  # noqa: E402

TOKEN = "floors-token-0123456789"


# --- the queue ------------------------------------------------------------------------------------------------------
def _work(prompt: str = "") -> Work:
    return Work(study_path=Path("/nonexistent"), prompt=prompt, options=RequestOptions(), variant="v")


class Gate:
    """A `run` for the queue that holds each work item until let go, and answers it with its prompt."""

    def __init__(self):
        self.started = threading.Semaphore(0)
        self.go = threading.Event()

    def __call__(self, work: Work) -> None:
        self.started.release()
        self.go.wait(10)
        work.future.set_result({"text": work.prompt})


def test_queue_bounds_waiting_work_and_runs_it_in_order():
    metrics, gate = Metrics(), Gate()
    q = WorkQueue(gate, metrics, workers=1, max_queue=2)
    q.start()
    first = _work("1")
    q.submit(first)
    assert gate.started.acquire(timeout=5)  # running: no longer counted as waiting
    assert (q.depth, q.running) == (0, 1)
    q.reserve()
    q.submit(_work("2"), reserved=True)
    q.reserve()
    with pytest.raises(QueueFullError) as err:
        q.reserve()
    assert (err.value.code, err.value.http_status) == ("queue_full", 503)
    with pytest.raises(QueueFullError):
        q.submit(_work("x"))
    q.release()  # an upload that failed gives its slot back
    forced = _work("3")
    q.submit(forced, force=True)  # recovered jobs are queued past the bound
    q.submit(_work("4"), force=True)
    assert q.depth == 3
    gate.go.set()
    assert forced.future.result(timeout=10) == {"text": "3"} and first.future.result() == {"text": "1"}
    assert b"edgekitd_rejected_total 2.0" in metrics.render()
    assert q.drain(5)


def test_queue_stop_refuses_new_and_queued_work_but_lets_running_work_finish():
    gate = Gate()
    q = WorkQueue(gate, Metrics(), workers=1, max_queue=4)
    q.start()
    running, waiting = _work("running"), _work("waiting")
    q.submit(running)
    assert gate.started.acquire(timeout=5)
    q.submit(waiting)
    q.stop_accepting()
    with pytest.raises(ShuttingDownError):
        q.reserve()
    threading.Timer(0.2, gate.go.set).start()
    t0 = time.monotonic()
    assert q.drain(5)
    assert time.monotonic() - t0 >= 0.1  # it waited for the running report
    assert running.future.result(timeout=1) == {"text": "running"}
    with pytest.raises(ShuttingDownError):
        waiting.future.result(timeout=1)


def test_queue_answers_the_caller_when_run_itself_crashes():
    def broken(work: Work) -> None:
        raise RuntimeError("a bug in run")

    q = WorkQueue(broken, Metrics(), workers=1)
    q.start()
    work = _work()
    q.submit(work)
    with pytest.raises(RuntimeError, match="a bug in run"):
        work.future.result(timeout=5)
    assert q.drain(5) and q.running == 0


# --- options --------------------------------------------------------------------------------------------------------
def test_options_take_the_variant_default_unless_the_request_sets_them():
    plain = generation_options(RequestOptions(), {"max_new_tokens": 40, "eos_token_id": 2})
    assert (plain.max_new_tokens, plain.temperature, plain.top_p, plain.seed) == (40, 0.0, 1.0, None)
    assert generation_options(RequestOptions(), {}).max_new_tokens == 128
    asked = generation_options(
        RequestOptions(max_new_tokens=7, temperature=0.5, top_p=0.9, seed=3), {"max_new_tokens": 40}
    )
    assert (asked.max_new_tokens, asked.temperature, asked.top_p, asked.seed) == (7, 0.5, 0.9, 3)


def test_options_keep_their_stored_shape_and_the_configured_bound():
    # the stored shape feeds idempotency fingerprints: a job replayed after an upgrade must hash the same
    assert RequestOptions().as_dict() == {"temperature": 0.0, "top_p": 1.0, "seed": None}
    asked = RequestOptions(max_new_tokens=9, seed=1)
    assert asked.as_dict() == {"temperature": 0.0, "top_p": 1.0, "seed": 1, "max_new_tokens": 9}
    assert RequestOptions.from_dict(asked.as_dict()) == asked
    asked.check(9)
    with pytest.raises(EdgekitError) as err:
        asked.check(8)
    assert err.value.code == "validation_error" and "<= 8" in err.value.reason


# --- the app while loading ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loading_app(tmp_path_factory):
    """The real app over a real Daemon that has not started: no model, so every route that needs one says 503."""
    from edgekit.daemon.api import create_app
    from edgekit.daemon.config import load_config
    from edgekit.daemon.service import Daemon

    root = tmp_path_factory.mktemp("edgekitd-floors")
    empty = root / "edgekitd.toml"
    empty.write_text("")
    daemon = Daemon(load_config(empty, {"state_dir": root / "state", "max_upload_bytes": 1 << 20}))
    return create_app(daemon, token=TOKEN)


def _call(
    app, method: str, path: str, *, body: bytes = b"", headers: dict[str, str] | None = None, auth: bool = True
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request through the ASGI app, as seen from TCP (so the bearer token applies)."""
    hdrs = {**({"authorization": f"Bearer {TOKEN}"} if auth else {}), **(headers or {})}
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in hdrs.items()],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8471),
    }
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    out_headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return start["status"], out_headers, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def _code(body: bytes) -> str:
    return json.loads(body)["error"]["code"]


def test_while_loading_ready_says_so_and_model_routes_are_503_not_ready(loading_app):
    status, headers, body = _call(loading_app, "GET", "/v2/health/ready")
    assert status == 503 and json.loads(body) == {"ready": False, "status": "loading"} and headers["retry-after"]
    assert _call(loading_app, "GET", "/v2/health/live")[0] == 200
    for method, path in (("GET", "/v1/variants"), ("PUT", "/v1/variants/active")):
        status, headers, body = _call(
            loading_app, method, path, body=b'{"name": "a"}', headers={"content-type": "application/json"}
        )
        assert (status, _code(body), headers["retry-after"]) == (503, "not_ready", "5"), path
    from edgekit.daemon.client import multipart

    form, ctype = multipart({"prompt": "x"}, [("a.dcm", b"DICM", "application/dicom")])
    for path in ("/v1/reports", "/v1/jobs"):
        status, _, body = _call(loading_app, "POST", path, body=form, headers={"content-type": ctype})
        assert (status, _code(body)) == (503, "not_ready"), path


def test_tcp_needs_the_token_and_bodies_past_the_limit_are_413(loading_app):
    status, headers, body = _call(loading_app, "GET", "/v2/health/live", auth=False)
    assert (status, _code(body), headers["www-authenticate"]) == (401, "unauthorized", "Bearer")
    status, _, body = _call(loading_app, "POST", "/v1/reports", headers={"content-length": str(3 << 20)})
    assert (status, _code(body)) == (413, "upload_too_large")


def test_access_metrics_name_the_route_template_never_the_concrete_path(loading_app):
    job = "0123456789abcdef0123456789abcdef"
    status, _, body = _call(loading_app, "GET", f"/v1/jobs/{job}")
    assert (status, _code(body)) == (404, "job_not_found")
    assert _call(loading_app, "GET", "/no/such/route")[0] == 404
    metrics = _call(loading_app, "GET", "/metrics")[2].decode()
    assert 'edgekitd_requests_total{route="/v1/jobs/{job_id}",status="404"}' in metrics
    assert 'route="unmatched",status="404"' in metrics and job not in metrics


def test_both_upload_routes_document_one_form(loading_app):
    schema = loading_app.openapi()
    bodies = {}
    for path in ("/v1/reports", "/v1/jobs"):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
        if "$ref" in body:  # a component, or inline (forms.UPLOAD_OPENAPI): the same form either way
            body = schema["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
        bodies[path] = (body["properties"], body.get("required"))
    assert bodies["/v1/reports"] == bodies["/v1/jobs"]
    properties, required = bodies["/v1/jobs"]
    assert required is None  # files: required unless the variant is a text model's (checked once it is chosen)
    assert "text model" in properties["files"]["description"]
    assert {"files", "prompt", "variant", "max_new_tokens", "temperature", "top_p", "seed"} <= set(properties)


def test_docs_load_every_asset_from_the_daemon_itself(loading_app):
    import re

    status, headers, body = _call(loading_app, "GET", "/docs")
    html = body.decode()
    assert status == 200 and headers["content-type"].startswith("text/html") and "SwaggerUIBundle" in html
    assert not re.search(r"(?i)(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", html), "an asset from outside the daemon"
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert len(assets) >= 3 and all(a.startswith("/") for a in assets)
    for asset in assets:
        assert _call(loading_app, "GET", asset)[0] == 200, asset
    assert "validatorUrl" in html  # the validator badge would call swagger.io
    assert _call(loading_app, "GET", "/openapi.json")[0] == 200


def test_the_forms_bounds_are_the_shared_generation_bounds(loading_app):
    from edgekit.generate import MAX_NEW_TOKENS, MAX_TEMPERATURE

    schema = loading_app.openapi()
    properties = schema["paths"]["/v1/reports"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"][
        "properties"
    ]  # inline: forms.UPLOAD_OPENAPI
    assert properties["temperature"]["maximum"] == MAX_TEMPERATURE
    assert str(MAX_NEW_TOKENS) in properties["max_new_tokens"]["description"]

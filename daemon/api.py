"""The HTTP API (FastAPI, versioned, OpenAPI at /openapi.json): routes only validate, save, submit and answer.

Every error is `{"error": {"code", "message"}}`; input problems are 4xx with the `EdgekitError` code, a full queue
is 503 with Retry-After. Logs carry the route, the status and the hashed study id, never names or prompts.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, File, Form, Header, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgekit import __version__ as edgekit_version
from edgekit.errors import EdgekitError

from .jobs import TERMINAL, Job
from .scheduler import Work
from .service import Daemon
from .streams import TokenStream
from .sr import build_sr, collect_evidence, sr_bytes
from .uploads import SavedStudy, UploadTooLargeError, save_uploads

log = logging.getLogger("edgekitd")

IDEMPOTENCY_KEY = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
JOB_ID = re.compile(r"^[0-9a-f]{32}$")
DICOM_MEDIA_TYPE = "application/dicom"
Format = Literal["json", "text", "sr"]
StreamFormat = Literal["ndjson", "sse"]
STREAM_MEDIA = {"sse": "text/event-stream", "ndjson": "application/x-ndjson"}


class NotReadyError(EdgekitError):
    code = "not_ready"
    http_status = 503


class JobNotFoundError(EdgekitError):
    code = "job_not_found"
    http_status = 404


class JobNotFinishedError(EdgekitError):
    code = "job_not_finished"
    http_status = 409


class IdempotencyError(EdgekitError):
    code = "invalid_idempotency_key"


class IdempotencyConflictError(EdgekitError):
    code = "idempotency_key_reused"
    http_status = 409


class UnauthorizedError(EdgekitError):
    code = "unauthorized"
    http_status = 401


class ActiveVariant(BaseModel):
    name: str = Field(min_length=1, max_length=128)


def error_response(err: EdgekitError, names: SavedStudy | None = None, retry_after: int | None = None) -> JSONResponse:
    body = err.to_json()
    if "file" in body and names is not None:
        client = names.client_name(body["file"].split("!")[0])
        if client:
            body["file"] = client
    headers = {"Retry-After": str(retry_after)} if err.http_status == 503 and retry_after else None
    if err.http_status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse({"error": body}, status_code=err.http_status, headers=headers)


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


_HTTP_CODES = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
               406: "not_acceptable", 413: "upload_too_large", 415: "unsupported_media_type"}


def create_app(daemon: Daemon, *, token: str | None = None) -> FastAPI:
    app = FastAPI(title="edgekitd", version=edgekit_version,
                  description="On-device radiology report generation: studies in, reports out.")
    app.state.daemon = daemon

    # --- errors -------------------------------------------------------------------------------------------------
    @app.exception_handler(EdgekitError)
    async def _edgekit(request: Request, err: EdgekitError):
        return error_response(err, request.scope.get("edgekit.saved"), daemon.cfg.retry_after_s)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, err: RequestValidationError):
        parts = []
        for e in err.errors()[:5]:  # location and reason only: the offending value may be patient text
            loc = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body", "query", "header", "path"))
            parts.append(f"{loc or 'request'}: {e.get('msg', 'invalid')}")
        return _error(422, "validation_error", "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        cause = err.__cause__
        while cause is not None and not isinstance(cause, EdgekitError):
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, EdgekitError):
            return error_response(cause, request.scope.get("edgekit.saved"))
        code = _HTTP_CODES.get(err.status_code, "http_error")
        return _error(err.status_code, code, str(err.detail))

    @app.exception_handler(Exception)
    async def _bug(request: Request, err: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return _error(500, "internal_error", "internal error; the daemon logged it")

    # --- middleware: auth for TCP, body limit, access log and metrics --------------------------------------------
    limit_slack = 1 << 20  # multipart framing around the files

    async def guard(scope, receive, send, call_next):
        server = scope.get("server")
        over_tcp = isinstance(server, tuple) and isinstance(server[1], int)
        if over_tcp and token is not None:
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not _token_ok(auth, token):
                resp = error_response(UnauthorizedError("a bearer token is required on TCP"))
                return await resp(scope, receive, send)
        elif over_tcp:
            return await error_response(UnauthorizedError("TCP is not configured with a token"))(scope, receive, send)
        limit = daemon.cfg.max_upload_bytes + limit_slack
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            err = UploadTooLargeError(f"the upload exceeds the limit of {daemon.cfg.max_upload_bytes} bytes")
            return await error_response(err)(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise UploadTooLargeError(f"the upload exceeds the limit of {daemon.cfg.max_upload_bytes} bytes")
            return message

        return await call_next(scope, limited_receive, send)

    inner = app.build_middleware_stack

    def build_stack():
        stack = inner()

        async def outer(scope, receive, send):
            if scope["type"] != "http":
                return await stack(scope, receive, send)
            t0 = time.perf_counter()
            status = {"code": 500}

            async def send_wrapper(message):
                if message["type"] == "http.response.start":
                    status["code"] = message["status"]
                await send(message)

            try:
                await guard(scope, receive, send_wrapper, stack)
            finally:
                route = getattr(scope.get("route"), "path", "unmatched")
                dt = time.perf_counter() - t0
                daemon.metrics.requests.labels(route, str(status["code"])).inc()
                daemon.metrics.request_latency.labels(route).observe(dt)
                log.info("%s %s -> %d (%.1f ms)", scope["method"], route, status["code"], dt * 1e3)

        return outer

    app.build_middleware_stack = build_stack

    # --- helpers ------------------------------------------------------------------------------------------------
    # Ingest (pydicom, PyAV) is partly pure Python: a few threads, not one per waiting upload, so a burst of uploads
    # does not take the GIL from the model workers (measured: 16 parallel ingests slowed generation under load).
    ingest_pool = ThreadPoolExecutor(max_workers=max(1, daemon.cfg.workers), thread_name_prefix="edgekitd-ingest")

    def scheduler():
        if not daemon.ready or daemon.scheduler is None:
            raise NotReadyError("the model is still loading; retry shortly")
        return daemon.scheduler

    def options(max_new_tokens, temperature, top_p, seed) -> dict:
        limit = daemon.cfg.max_new_tokens_limit
        if max_new_tokens is not None and max_new_tokens > limit:
            raise EdgekitError(f"max_new_tokens must be <= {limit}, got {max_new_tokens}", code="validation_error")
        out = {"temperature": temperature, "top_p": top_p, "seed": seed}
        if max_new_tokens is not None:
            out["max_new_tokens"] = max_new_tokens
        return out

    async def ingest(request: Request, files, dest: Path, *, keep_evidence: bool):
        saved = await save_uploads(files, dest, daemon.cfg.max_upload_bytes, durable=keep_evidence)
        request.scope["edgekit.saved"] = saved
        from edgekit.ingest import load_study

        loop = asyncio.get_running_loop()
        study = await loop.run_in_executor(ingest_pool, functools.partial(load_study, saved.path,
                                                                          limits=daemon.limits()))
        evidence = await loop.run_in_executor(ingest_pool, collect_evidence, saved.path) if keep_evidence else None
        return saved, study, evidence

    def render(report: dict, fmt: str, evidence: list[dict] | None) -> Response:
        if fmt == "text":
            return PlainTextResponse(report["text"] + "\n")
        if fmt == "sr":
            ds = build_sr(report, evidence or [], algorithm_version=edgekit_version)
            return Response(sr_bytes(ds), media_type=DICOM_MEDIA_TYPE)
        return JSONResponse(report)

    # --- reports ------------------------------------------------------------------------------------------------
    @app.post("/v1/reports", tags=["reports"], summary="Write a report for an uploaded study (synchronous)")
    async def post_report(
        request: Request,
        files: list[UploadFile] = File(..., description="DICOM file(s), one zip of a series, or one video"),
        prompt: str = Form("", max_length=2000, description="Clinical indication or question"),
        variant: str | None = Form(None, min_length=1, max_length=128),
        max_new_tokens: int | None = Form(None, ge=1),
        temperature: float = Form(0.0, ge=0.0, le=5.0),
        top_p: float = Form(1.0, gt=0.0, le=1.0),
        seed: int | None = Form(None, ge=0, le=2**32 - 1),
        format: Format = Query("json"),
        stream: StreamFormat | None = Query(None, description="Stream the text as it is generated (json only)"),
    ):
        sched = scheduler()
        opts = options(max_new_tokens, temperature, top_p, seed)
        if stream is not None and format != "json":
            raise EdgekitError("stream needs format=json", code="validation_error")
        variant = variant or daemon.registry.active  # a switch during the upload does not move this request
        sched.reserve()
        tmp = Path(tempfile.mkdtemp(prefix="edgekitd-"))
        try:
            try:
                saved, study, evidence = await ingest(request, files, tmp / "in", keep_evidence=format == "sr")  # noqa: E501
            except BaseException:
                sched.release()
                raise
            work = Work(study_path=saved.path, prompt=prompt, options=opts, variant=variant, study=study,
                        stream=TokenStream() if stream else None)
            future = sched.submit(work, reserved=True)
            if stream:  # the study is in memory already: the upload folder can go now
                return StreamingResponse(report_events(work, stream), media_type=STREAM_MEDIA[stream])
            try:
                report = await asyncio.wait_for(asyncio.wrap_future(future), daemon.cfg.sync_timeout_s)
            except TimeoutError:
                return _error(504, "timeout", f"no report within {daemon.cfg.sync_timeout_s:.0f} s")
            return render(report, format, evidence)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    async def report_events(work: Work, fmt: str):
        """`token` events, then one `report` event (or an `error` event: the status line has already gone)."""
        cursor = 0
        deadline = time.monotonic() + daemon.cfg.sync_timeout_s
        while not work.future.done() and time.monotonic() < deadline:
            for delta in work.stream.since(cursor):
                yield _event(fmt, {"event": "token", "index": cursor, "text": delta})
                cursor += 1
            await work.stream.wait(0.25)
        for delta in work.stream.since(cursor):
            yield _event(fmt, {"event": "token", "index": cursor, "text": delta})
            cursor += 1
        if not work.future.done():
            yield _event(fmt, {"event": "error", "error": {"code": "timeout", "message": "no report in time"}})
        elif isinstance(work.future.exception(), EdgekitError):
            err = work.future.exception()
            yield _event(fmt, {"event": "error", "status": err.http_status, "error": err.to_json()})
        elif work.future.exception() is not None:
            yield _event(fmt, {"event": "error", "status": 500,
                               "error": {"code": "internal_error", "message": "internal error; the daemon logged it"}})
        else:
            yield _event(fmt, {"event": "report", "report": work.future.result()})

    # --- jobs ---------------------------------------------------------------------------------------------------
    @app.post("/v1/jobs", status_code=202, tags=["jobs"], summary="Queue a report (asynchronous, durable)")
    async def post_job(
        request: Request,
        files: list[UploadFile] = File(...),
        prompt: str = Form("", max_length=2000),
        variant: str | None = Form(None, min_length=1, max_length=128),
        max_new_tokens: int | None = Form(None, ge=1),
        temperature: float = Form(0.0, ge=0.0, le=5.0),
        top_p: float = Form(1.0, gt=0.0, le=1.0),
        seed: int | None = Form(None, ge=0, le=2**32 - 1),
        idempotency_key: str | None = Header(None, alias="Idempotency-Key"),
    ):
        sched = scheduler()
        if idempotency_key is not None and not IDEMPOTENCY_KEY.match(idempotency_key):
            raise IdempotencyError("Idempotency-Key must be 1-128 characters of A-Z a-z 0-9 . _ : -")
        opts = options(max_new_tokens, temperature, top_p, seed)
        if variant is not None and variant not in daemon.registry.specs:
            from .variants import UnknownVariantError

            raise UnknownVariantError(f"unknown variant {variant!r}")
        job_id = daemon.store.new_id()
        job_dir = daemon.store.job_dir(job_id)
        sched.reserve()
        submitted = False
        try:
            saved, study, evidence = await ingest(request, files, job_dir / "input", keep_evidence=True)
            fingerprint = hashlib.sha256(
                json.dumps([saved.digest, prompt, opts, variant], sort_keys=True).encode()).hexdigest()
            job = Job(id=job_id, idempotency_key=idempotency_key, fingerprint=fingerprint, state="queued",
                      variant=variant, prompt=prompt, options=opts, input=str(saved.path), created=time.time())
            daemon.save_evidence(job_id, evidence)
            stored = await asyncio.to_thread(daemon.store.insert, job)
            if stored.id != job_id:  # the key was used before: same request -> same job, else a conflict
                if stored.fingerprint != fingerprint:
                    raise IdempotencyConflictError("this Idempotency-Key was used for a different request")
                return JSONResponse(_job_links(stored.public()), status_code=200)
            work = daemon.work_for(job)
            work.study = study
            sched.submit(work, reserved=True)
            submitted = True
            log.info("job %s accepted study=%s", job_id, study.uid_hash)
            return JSONResponse(_job_links(job.public()), status_code=202,
                                headers={"Location": f"/v1/jobs/{job_id}"})
        finally:
            if not submitted:
                sched.release()
                shutil.rmtree(job_dir, ignore_errors=True)

    def find(job_id: str) -> Job:
        job = daemon.store.get(job_id) if JOB_ID.match(job_id) else None
        if job is None:
            raise JobNotFoundError("no such job (it may have passed its retention)")
        return job

    @app.get("/v1/jobs/{job_id}", tags=["jobs"])
    async def get_job(job_id: str, format: Format = Query("json")):
        job = find(job_id)
        if format == "json":
            return _job_links(job.public())
        if job.state not in TERMINAL:
            raise JobNotFinishedError(f"the job is {job.state}")
        if job.error is not None:
            return JSONResponse({"error": {k: v for k, v in job.error.items() if k != "status"}},
                                status_code=job.error.get("status", 400))
        return render(job.result, format, _evidence(job.id))

    def _evidence(job_id: str) -> list[dict]:
        path = daemon.evidence_path(job_id)
        return json.loads(path.read_text()) if path.is_file() else []

    @app.get("/v1/jobs/{job_id}/sr", tags=["jobs"], summary="The finished report as a DICOM Enhanced SR",
             response_class=Response, responses={200: {"content": {DICOM_MEDIA_TYPE: {}}}})
    async def get_job_sr(job_id: str):
        return await get_job(job_id, "sr")

    @app.get("/v1/jobs/{job_id}/stream", tags=["jobs"],
             summary="State changes, the report's text as it is generated, then the report (NDJSON or SSE)")
    async def stream_job(job_id: str, format: StreamFormat = Query("ndjson")):
        find(job_id)
        return StreamingResponse(job_events(job_id, format), media_type=STREAM_MEDIA[format])

    async def job_events(job_id: str, fmt: str):
        """`state` events as the job moves, a `token` event per text delta, and the final state with the report.
        Deltas joined are the report's text; a job no longer streamed from memory replays it as one delta."""
        last, cursor = None, 0
        while True:
            stream = daemon.streams.get(job_id)
            seen = len(stream.since(0)) if stream is not None else 0  # before the state: tokens imply running
            job = await asyncio.to_thread(daemon.store.get, job_id)
            if job is None:
                return
            if job.state in TERMINAL:
                rest = stream.since(cursor) if stream is not None else []
                if stream is None and cursor == 0 and job.result:
                    rest = [job.result["text"]]
                for delta in rest:
                    yield _event(fmt, {"event": "token", "index": cursor, "text": delta})
                    cursor += 1
                yield _event(fmt, {"event": "state", **job.public()})
                return
            if job.state != last:
                last = job.state
                yield _event(fmt, {"event": "state", **job.public()})
            if stream is not None:
                for delta in stream.since(cursor)[:seen - cursor]:
                    yield _event(fmt, {"event": "token", "index": cursor, "text": delta})
                    cursor += 1
                await stream.wait(0.25)
            else:
                await asyncio.sleep(0.1)

    # --- variants -----------------------------------------------------------------------------------------------
    @app.get("/v1/variants", tags=["variants"])
    async def get_variants():
        if daemon.registry is None:
            raise NotReadyError("the model is still loading; retry shortly")
        return {"active": daemon.registry.active, "variants": daemon.registry.describe()}

    @app.put("/v1/variants/active", tags=["variants"], summary="Load and warm a variant, then route new work to it")
    async def put_active(body: ActiveVariant):
        scheduler()
        loaded = await asyncio.to_thread(daemon.registry.activate, body.name)
        daemon.say(daemon.summary(f"switched to {loaded.name}"))
        return {"active": loaded.name, "variants": daemon.registry.describe()}

    # --- health and metrics -------------------------------------------------------------------------------------
    @app.get("/v2/health/live", tags=["health"])
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready", tags=["health"])
    async def ready():
        if not daemon.ready:
            return JSONResponse({"ready": False, "status": daemon.failed or "loading"}, status_code=503,
                                headers={"Retry-After": str(daemon.cfg.retry_after_s)})
        s = daemon.scheduler
        return {"ready": True, "active": daemon.registry.active, "queue_depth": s.depth, "running": s.running,
                "max_queue": s.max_queue, "recovered_jobs": daemon.recovered}

    @app.get("/metrics", tags=["health"], response_class=PlainTextResponse)
    async def metrics():
        return Response(daemon.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def _event(fmt: str, event: dict) -> str:
    """One NDJSON line or one SSE message; SSE messages stay unnamed (the kind is in the JSON), so a browser's
    EventSource.onmessage sees them all."""
    data = json.dumps(event)
    return f"data: {data}\n\n" if fmt == "sse" else data + "\n"


def _job_links(public: dict) -> dict:
    jid = public["id"]
    return {**public, "links": {"self": f"/v1/jobs/{jid}", "stream": f"/v1/jobs/{jid}/stream",
                                "sr": f"/v1/jobs/{jid}/sr"}}


def _token_ok(header: bytes, token: str) -> bool:
    import hmac

    scheme, _, value = header.decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())

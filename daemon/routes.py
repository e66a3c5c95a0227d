"""The route table and its handlers: methods on one object, as Ollama's server registers its routes.

A handler reads the request, hands it to the service (`Daemon`) and shapes the answer; what a request means (option
bounds, the variant, ingest, jobs and idempotency) is the service's. No handler touches a loaded variant's
lifetime: that is the registry's, behind the service.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated, Any, NamedTuple

from fastapi import Body, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from edgekit.errors import EdgekitError, TextModelError

from . import trace_spans
from .dicomweb import DICOM_JSON
from .events import job_events, report_events
from .forms import UPLOAD_OPENAPI, ReportForm, report_form
from .jobs import TERMINAL, DeliveryState, JobState
from .responses import DICOM_MEDIA_TYPE, STREAM_MEDIA, Format, StreamFormat, error_json, job_links, render
from .service import Daemon


class JobNotFinishedError(EdgekitError):
    code = "job_not_finished"
    http_status = 409


class ActiveVariant(BaseModel):
    name: str = Field(min_length=1, max_length=128)


# Checked by the service (a 400 `config_error` naming the key), so a typo is refused, never ignored.
PolicyUpdate = Annotated[
    dict[str, Any],
    Body(
        description="Any of: mode (performance | balanced | saver | fixed), fixed (a point id or variant), "
        "power_budget_w, energy_budget_j, quality_floor_f1, latency_slo_ms (null clears one), window_s, margin, "
        "balanced_f1_slack, battery_low_pct, thermal_margin_c, queue_high, allow_overrides",
        examples=[{"mode": "saver", "quality_floor_f1": 0.95}],
    ),
]


class Route(NamedTuple):
    method: str
    path: str
    endpoint: Callable[..., Any]
    options: dict[str, Any]


Upload = Annotated[ReportForm, Depends(report_form)]
# The STOW-RS body (multipart/related; type="application/dicom", PS3.18 10.5) is read raw by the handler, so it is
# described in words, not as an OpenAPI requestBody: schema-driven clients and fuzzers have no serializer for it.
STOW_DESCRIPTION = (
    'Body: `multipart/related; type="application/dicom"; boundary=...`, one DICOM Part 10 instance per part. '
    "Answer: the store response as DICOM JSON (`application/dicom+json`): ReferencedSOPSequence and "
    "FailedSOPSequence with a FailureReason per instance; 200 all stored, 202 some, 409 none. See "
    "docs/dicom-networking.md."
)
OutputFormat = Annotated[Format, Query(alias="format")]


class Routes:
    def __init__(self, daemon: Daemon):
        self.daemon = daemon

    def table(self) -> list[Route]:
        sr = {"response_class": Response, "responses": {200: {"content": {DICOM_MEDIA_TYPE: {}}}}}
        return [
            Route(
                "POST",
                "/v1/reports",
                self.post_report,
                {
                    "tags": ["reports"],
                    "summary": "Write a report for an uploaded study (synchronous)",
                    "openapi_extra": UPLOAD_OPENAPI,  # the form dependency reads the body itself (forms.py)
                },
            ),
            Route(
                "POST",
                "/v1/jobs",
                self.post_job,
                {
                    "tags": ["jobs"],
                    "status_code": 202,
                    "summary": "Queue a report (asynchronous, durable)",
                    "openapi_extra": UPLOAD_OPENAPI,
                },
            ),
            Route(
                "GET",
                "/v1/jobs",
                self.list_jobs,
                {"tags": ["jobs"], "summary": "Jobs, newest first; delivery=dead lists the dead letters"},
            ),
            Route("GET", "/v1/jobs/{job_id}", self.get_job, {"tags": ["jobs"]}),
            Route(
                "POST",
                "/v1/jobs/{job_id}/deliveries/retry",
                self.retry_deliveries,
                {"tags": ["jobs"], "summary": "Send a job's dead letters again (after fixing the destination)"},
            ),
            Route(
                "GET",
                "/v1/jobs/{job_id}/sr",
                self.get_job_sr,
                {"tags": ["jobs"], "summary": "The finished report as a DICOM Enhanced SR", **sr},
            ),
            Route(
                "GET",
                "/v1/jobs/{job_id}/stream",
                self.stream_job,
                {
                    "tags": ["jobs"],
                    "summary": "State changes, the report's text as it is generated, then the report (NDJSON or SSE)",
                },
            ),
            Route("GET", "/v1/variants", self.get_variants, {"tags": ["variants"]}),
            Route(
                "PUT",
                "/v1/variants/active",
                self.put_active,
                {"tags": ["variants"], "summary": "Load and warm a variant, then route new work to it"},
            ),
            Route(
                "POST",
                "/v1/variants/{name}/bundles",
                self.post_bundle,
                {
                    "tags": ["variants"],
                    "summary": "Install a new bundle (.ekb body) for a variant: verified, staged, gated, switched to, "
                    "then watched for a canary window that commits it or rolls back",
                    "openapi_extra": {
                        "requestBody": {
                            "required": True,
                            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
                        }
                    },
                },
            ),
            Route(
                "POST",
                "/v1/variants/{name}/rollback",
                self.post_rollback,
                {"tags": ["variants"], "summary": "Serve the variant's previous bundle again"},
            ),
            Route(
                "GET",
                "/v1/policy",
                self.get_policy,
                {"tags": ["policy"], "summary": "The energy-quality policy: settings, point served, why, signals"},
            ),
            Route(
                "PUT",
                "/v1/policy",
                self.put_policy,
                {"tags": ["policy"], "summary": "Change the policy's mode or constraints (decided on at once)"},
            ),
            Route(
                "POST",
                "/dicomweb/studies",
                self.stow,
                {
                    "tags": ["dicomweb"],
                    "summary": "STOW-RS: store instances; a report is written when each study is complete",
                    "description": STOW_DESCRIPTION,
                },
            ),
            Route(
                "POST",
                "/dicomweb/studies/{study_uid}",
                self.stow_study,
                {
                    "tags": ["dicomweb"],
                    "summary": "STOW-RS: store instances of one study (others are refused)",
                    "description": STOW_DESCRIPTION,
                },
            ),
            Route("GET", "/v2/health/live", self.live, {"tags": ["health"]}),
            Route("GET", "/v2/health/ready", self.ready, {"tags": ["health"]}),
            Route("GET", "/metrics", self.metrics, {"tags": ["health"], "response_class": PlainTextResponse}),
        ]

    # --- reports ------------------------------------------------------------------------------------------------
    async def post_report(
        self,
        form: Upload,
        fmt: OutputFormat = "json",
        stream: Annotated[
            StreamFormat | None, Query(description="Stream the text as it is generated (json only)")
        ] = None,
    ) -> Response:
        if stream is not None and fmt != "json":
            raise EdgekitError("stream needs format=json", code="validation_error")
        accepted = await self.daemon.report(form, keep_evidence=fmt == "sr", stream=stream is not None)
        work, timeout_s = accepted.work, self.daemon.cfg.sync_timeout_s
        if stream is not None and work.stream is not None:
            return StreamingResponse(
                report_events(work, work.stream, stream, timeout_s), media_type=STREAM_MEDIA[stream]
            )
        try:
            report = await asyncio.wait_for(asyncio.wrap_future(work.future), timeout_s)
        except TimeoutError:
            work.cancel.set()  # nobody will read it: its engine row goes to the next report
            return error_json(504, "timeout", f"no report within {timeout_s:.0f} s")
        except asyncio.CancelledError:  # the client went away
            work.cancel.set()
            raise
        if fmt == "sr":  # built here, under this request's span (a job's SR is built by its delivery)
            with trace_spans.render_sr_span(variant=work.variant):
                return render(report, fmt, accepted.evidence)
        return render(report, fmt, accepted.evidence)

    # --- jobs ---------------------------------------------------------------------------------------------------
    async def post_job(
        self,
        form: Upload,
        idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
    ) -> JSONResponse:
        submitted = await self.daemon.create_job(form, idempotency_key)
        body = job_links(submitted.job.public())
        if not submitted.created:  # the same request again: the same job
            return JSONResponse(body, status_code=200)
        return JSONResponse(body, status_code=202, headers={"Location": f"/v1/jobs/{submitted.job.id}"})

    async def list_jobs(
        self,
        state: Annotated[JobState | None, Query()] = None,
        delivery: Annotated[DeliveryState | None, Query(description="jobs with a delivery in this state")] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> dict[str, Any]:
        return {"jobs": [job_links(j) for j in self.daemon.list_jobs(state, delivery, limit)]}

    async def retry_deliveries(self, job_id: str) -> dict[str, Any]:
        return job_links(self.daemon.retry_deliveries(job_id))

    async def get_job(self, job_id: str, fmt: OutputFormat = "json") -> Response | dict[str, Any]:
        job = self.daemon.find_job(job_id)
        if fmt == "json":
            return job_links(self.daemon.job_public(job))
        if job.state not in TERMINAL:
            raise JobNotFinishedError(f"the job is {job.state}")
        if job.error is not None:
            return JSONResponse(
                {"error": {k: v for k, v in job.error.items() if k != "status"}},
                status_code=job.error.get("status", 400),
            )
        assert job.result is not None  # a succeeded job has its report
        if fmt == "sr" and not job.input:
            raise TextModelError("the job's report is a text model's: it has no source study to file an SR in")
        delivered = self.daemon.store.stored_sr(job.id) if fmt == "sr" else None
        if delivered is not None:  # the SR the destinations got
            return Response(delivered, media_type=DICOM_MEDIA_TYPE)
        if fmt == "sr":  # built now, in this request
            with trace_spans.render_sr_span(job_id=job.id, variant=job.result.get("variant")):
                return render(job.result, fmt, self.daemon.store.evidence(job.id))
        return render(job.result, fmt, self.daemon.store.evidence(job.id))

    async def get_job_sr(self, job_id: str) -> Response | dict[str, Any]:
        return await self.get_job(job_id, "sr")

    async def stream_job(
        self,
        job_id: str,
        fmt: Annotated[StreamFormat, Query(alias="format")] = "ndjson",
    ) -> StreamingResponse:
        self.daemon.find_job(job_id)
        return StreamingResponse(
            job_events(job_id, self.daemon.store, self.daemon.streams, fmt), media_type=STREAM_MEDIA[fmt]
        )

    # --- DICOMweb -----------------------------------------------------------------------------------------------
    async def stow(
        self,
        request: Request,
        complete: Annotated[bool, Query(description="report each study now, without its quiet period")] = False,
    ) -> Response:
        return await self._stow(request, None, complete)

    async def stow_study(
        self,
        request: Request,
        study_uid: str,
        complete: Annotated[bool, Query(description="report the study now, without its quiet period")] = False,
    ) -> Response:
        return await self._stow(request, study_uid, complete)

    async def _stow(self, request: Request, study_uid: str | None, complete: bool) -> Response:
        """The body is streamed to the service (spooled to disk as it arrives), never read whole into memory."""
        result = await self.daemon.store_instances(
            request.stream(), request.headers.get("content-type"), study_uid, complete
        )
        return JSONResponse(result.body, status_code=result.status, media_type=DICOM_JSON)

    # --- variants -----------------------------------------------------------------------------------------------
    async def get_variants(self) -> dict[str, Any]:
        return self.daemon.variants()

    async def put_active(self, body: ActiveVariant) -> dict[str, Any]:
        loaded = await asyncio.to_thread(self.daemon.activate, body.name)
        return {**self.daemon.variants(), "active": loaded.name}

    async def post_bundle(self, name: str, request: Request) -> dict[str, Any]:
        return await self.daemon.receive_bundle(name, request.stream())

    async def post_rollback(self, name: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.daemon.rollback, name)

    # --- policy -------------------------------------------------------------------------------------------------
    async def get_policy(self) -> dict[str, Any]:
        return self.daemon.get_policy()

    async def put_policy(self, body: PolicyUpdate) -> dict[str, Any]:
        return await asyncio.to_thread(self.daemon.put_policy, body)

    # --- health and metrics -------------------------------------------------------------------------------------
    async def live(self) -> dict[str, bool]:
        return {"live": True}

    async def ready(self) -> Response | dict[str, Any]:
        status = self.daemon.readiness()
        if status is None:
            return JSONResponse(
                {"ready": False, "status": self.daemon.not_ready_status()},
                status_code=503,
                headers={"Retry-After": str(self.daemon.cfg.retry_after_s)},
            )
        return status

    async def metrics(self) -> Response:
        return Response(self.daemon.metrics.render(), media_type="text/plain; version=0.0.4")

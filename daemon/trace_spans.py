"""The spans edgekitd records, in OpenTelemetry's words: the SERVER span of each request, a report's
`generate_content <variant>` with its stages (built after the report from its own timings), and a CLIENT span per
delivery attempt.

Why apart from `telemetry`: that module is the machinery (settings, the tracer, context carried in files and
jobs, the no-op guard); this one is what is said, with which attributes, and what is never said (docs/telemetry.md).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .telemetry import FINISH_REASONS, PROVIDER, clean, context_of, error_type, guarded, kind_of, span, tracing

if TYPE_CHECKING:
    from edgekit.reporter import Report

    from .dicom_config import Destination
    from .work import Work


# --- the server span (middleware.AccessLog) ------------------------------------------------------------------------
class ServerSpan:
    """One HTTP request's span: opened before the app runs (the route is not known yet), named by the route's
    template when it ends."""

    def __init__(self, scope: Mapping[str, Any]):
        from opentelemetry import context as otel_context
        from opentelemetry import trace as otel_trace

        st = tracing()
        assert st is not None
        headers: dict[str, str] = {}
        for k, v in scope.get("headers") or []:
            if k in (b"traceparent", b"tracestate"):
                headers[k.decode("latin-1")] = v.decode("latin-1")
        parent = st.propagator.extract(headers)  # a malformed traceparent gives an empty context: a new trace
        self.method = str(scope.get("method", "GET"))
        server = scope.get("server")
        tcp = isinstance(server, tuple) and isinstance(server[1], int)
        attrs = {
            "http.request.method": self.method,
            "url.scheme": scope.get("scheme", "http"),
            "network.transport": "tcp" if tcp else "unix",
        }
        self.span = st.tracer.start_span(self.method, context=parent, kind=kind_of("server"), attributes=attrs)
        self._token = otel_context.attach(otel_trace.set_span_in_context(self.span, parent))

    @guarded
    def end(self, route: str, status: int) -> None:
        from opentelemetry import context as otel_context
        from opentelemetry.trace import Status, StatusCode

        s = self.span
        s.update_name(f"{self.method} {route}")
        s.set_attribute("http.route", route)
        s.set_attribute("http.response.status_code", status)
        if status >= 500:
            s.set_attribute("error.type", str(status))
            s.set_status(Status(StatusCode.ERROR))
        try:
            otel_context.detach(self._token)
        finally:
            s.end()


@guarded
def server_span(scope: Mapping[str, Any]) -> ServerSpan | None:
    return ServerSpan(scope) if tracing() is not None else None


# --- reports -------------------------------------------------------------------------------------------------------
class _Clock:
    """perf_counter seconds to wall-clock nanoseconds (what spans are stamped with), fixed once per report."""

    def __init__(self):
        self.offset = time.time_ns() - int(time.perf_counter() * 1e9)

    def __call__(self, pc: float) -> int:
        return self.offset + int(pc * 1e9)


Stage = tuple[str, float, float]  # a child span: its name, start and end (perf_counter seconds)


@guarded
def record_report(
    work: Work,
    report: Report,
    *,
    started: float,
    called: float,
    ingested: tuple[float, float] | None,
    max_tokens: int | None,
    input_tokens: int | None,
    point: str | None,
) -> None:
    """`generate_content <variant>` and its children for one finished report, from its recorded timings.

    `started`: the runner took the work (perf_counter); `called`: the reporter was called; `ingested`: when the
    runner itself ingested the study (a recovered job), else the study's own ingest time is placed just before
    the work was accepted (it was ingested then)."""
    st = tracing()
    if st is None:
        return
    from opentelemetry import trace as otel_trace

    clock = _Clock()
    stages, decode_start, total_end = report_stages(work, report, started=started, called=called, ingested=ingested)
    begin = min([work.accepted, *(s for _, s, _ in stages)])
    attrs = report_attributes(work, report, first_token_s=decode_start - begin, max_tokens=max_tokens)
    attrs.update({"gen_ai.usage.input_tokens": input_tokens, "edgekit.policy.point": point})
    if st.capture_content:
        attrs.update(content_attributes(work, report))
    root = st.tracer.start_span(
        f"generate_content {work.variant}",
        context=context_of(work.trace),
        kind=kind_of("internal"),
        attributes=clean(attrs),
        start_time=clock(begin),
    )
    inside = otel_trace.set_span_in_context(root)
    for name, start, end in stages:
        child = st.tracer.start_span(name, context=inside, start_time=clock(start))
        child.end(end_time=clock(max(start, end)))
    root.end(end_time=clock(total_end))


def report_stages(
    work: Work, report: Report, *, started: float, called: float, ingested: tuple[float, float] | None
) -> tuple[list[Stage], float, float]:
    """A report's stages placed back to back from its timings (the wait to be ingested, ingest, queue wait,
    preprocessing, the engine's wait, image encoding, prefill, decode), with when decoding began and when the report
    ended."""
    t = report.timings
    ms = 1e-3
    total_end = called + t.get("total_ms", 0.0) * ms
    gen_start = total_end - t.get("generate_ms", 0.0) * ms
    decode_start = max(gen_start, total_end - t.get("decode_ms", 0.0) * ms)
    prefill_start = max(gen_start, decode_start - t.get("prefill_ms", 0.0) * ms)
    encode_start = max(gen_start, prefill_start - t.get("encode_ms", 0.0) * ms)
    stages: list[Stage] = []
    if ingested is not None:
        stages.append(("ingest", *ingested))
    elif "ingest_ms" in t:
        ingest_start = work.accepted - t["ingest_ms"] * ms
        if "ingest_wait_ms" in t:  # for an ingest thread and a busy ingest process, just before
            stages.append(("ingest_wait", ingest_start - t["ingest_wait_ms"] * ms, ingest_start))
        stages.append(("ingest", ingest_start, work.accepted))
    stages.append(("queue_wait", work.accepted, started))
    stages.append(("preprocess", called, called + t.get("preprocess_ms", 0.0) * ms))
    if t.get("wait_ms"):
        stages.append(("engine_wait", gen_start, min(encode_start, gen_start + t["wait_ms"] * ms)))
    if t.get("encode_ms"):
        stages.append(("encode_images", encode_start, prefill_start))
    stages.append(("prefill", prefill_start, decode_start))
    stages.append(("decode", decode_start, total_end))
    return stages, decode_start, total_end


def report_attributes(work: Work, report: Report, *, first_token_s: float, max_tokens: int | None) -> dict[str, Any]:
    """The GenAI conventions' attributes of a finished report and edgekit's own (no prompt, no report text)."""
    t = report.timings
    return {
        "gen_ai.operation.name": "generate_content",
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.model": work.variant,
        "gen_ai.response.model": report.model,
        "gen_ai.output.type": "text",
        "gen_ai.request.max_tokens": max_tokens,
        "gen_ai.request.stream": work.stream is not None,
        "gen_ai.usage.output_tokens": t.get("new_tokens"),
        "gen_ai.response.finish_reasons": [finish_reason(report)],
        "gen_ai.response.time_to_first_chunk": round(first_token_s, 6),
        "edgekit.time_to_first_token_ms": round(first_token_s * 1e3, 3),
        "edgekit.variant": work.variant,
        "edgekit.target": report.target,
        "edgekit.stop_reason": report.stop_reason,
        "edgekit.energy_j": report.energy_j,
        "edgekit.energy_source": report.energy_source,
        "edgekit.study": report.study or None,  # hashed by ingest (edgekit.ingest.phi.hash_uid), as in the logs
        "edgekit.modality": report.modality or None,
        "edgekit.job.id": work.job_id,
        "edgekit.decode_tokens_per_s": t.get("decode_tokens_per_s"),
        "edgekit.frames.used": report.frames.get("used"),
        "edgekit.routed": bool(work.routing) or None,
    }


def finish_reason(report: Report) -> str:
    return FINISH_REASONS.get(report.stop_reason, report.stop_reason)


def content_attributes(work: Work, report: Report) -> dict[str, str]:
    """The prompt and the report's text: only with `[telemetry] capture_content` (they may carry PII)."""
    return {
        "gen_ai.input.messages": json.dumps([{"role": "user", "parts": [{"type": "text", "content": work.prompt}]}]),
        "gen_ai.output.messages": json.dumps(
            [
                {
                    "role": "assistant",
                    "parts": [{"type": "text", "content": report.text}],
                    "finish_reason": finish_reason(report),
                }
            ]
        ),
    }


@guarded
def record_failure(work: Work, exc: BaseException, *, started: float) -> None:
    """A report that failed: `generate_content <variant>` from acceptance to now, an error with its code."""
    st = tracing()
    if st is None:
        return
    from opentelemetry.trace import Status, StatusCode

    clock = _Clock()
    attrs = {
        "gen_ai.operation.name": "generate_content",
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.model": work.variant,
        "edgekit.variant": work.variant,
        "edgekit.job.id": work.job_id,
        "edgekit.queue_ms": round((started - work.accepted) * 1e3, 3),
        "error.type": error_type(exc),
    }
    s = st.tracer.start_span(
        f"generate_content {work.variant}",
        context=context_of(work.trace),
        kind=kind_of("internal"),
        attributes=clean(attrs),
        start_time=clock(work.accepted),
    )
    s.set_status(Status(StatusCode.ERROR))
    s.end()


# --- the SR ---------------------------------------------------------------------------------------------------------
def render_sr_span(*, job_id: str | None = None, variant: str | None = None):
    """`render_sr` around building a report's DICOM SR: a job's, for its first delivery or `GET /v1/jobs/{id}/sr`
    (`job_id`), or a direct `POST /v1/reports?format=sr` (`variant`), a child of the current span."""
    return span("render_sr", attributes={"edgekit.job.id": job_id, "edgekit.variant": variant})


# --- deliveries ----------------------------------------------------------------------------------------------------
DELIVERY_NAMES = {"stow": "STOW-RS", "cstore": "C-STORE", "webhook": "webhook"}


def delivery_span(dest: Destination, job_id: str, attempt: int, trace: str | None):
    """A CLIENT span for one delivery attempt, child of the job's kept context; current inside, so the request
    it sends carries its `traceparent` (`inject`)."""
    attrs: dict[str, Any] = {
        "edgekit.destination": dest.name,
        "edgekit.destination.kind": dest.kind,
        "edgekit.delivery.attempt": attempt,
        "edgekit.job.id": job_id,
    }
    if dest.kind == "cstore":
        attrs.update({"server.address": dest.host, "server.port": dest.port, "rpc.system": "dicom"})
    else:
        parts = urlsplit(dest.url or "")  # host and port only: a URL can hold a token in its userinfo or query
        try:
            port = parts.port
        except ValueError:
            port = None
        attrs.update({"http.request.method": "POST", "server.address": parts.hostname, "server.port": port})
    name = f"{DELIVERY_NAMES.get(dest.kind, dest.kind)} {dest.name}"
    return span(name, trace=trace, kind="client", attributes=attrs)

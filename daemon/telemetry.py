"""OpenTelemetry traces of edgekitd: one trace per study, from the request that brought it to its SR's delivery.

Off by default. On with `[telemetry] enabled = true` (or, with no `enabled` key, when the standard
`OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set; `OTEL_SDK_DISABLED=true` turns it off),
exported by OTLP/HTTP (protobuf) through the opentelemetry SDK, which the `otel` extra installs. Without the extra
every function here is a no-op, and a config that asks for traces is one ConfigError line.

The spans (recorded by `trace_spans`; docs/telemetry.md):
- a SERVER span per HTTP request (`middleware.AccessLog`), child of the caller's W3C `traceparent` when it sends a
  valid one (a malformed one is ignored); named by the route's template, never the concrete path;
- `generate_content <variant>` per report (GenAI semantic conventions), with children `ingest`, `queue_wait`,
  `preprocess`, `engine_wait`, `encode_images`, `prefill` and `decode`. The token engine batches reports, so
  nothing hooks its loop: the children are built after the report from its own recorded timings, with explicit
  start and end times;
- `receive study` when a study received by STOW-RS becomes a job (child of the STOW-RS request's span, whose
  context is kept in the study's inbox folder), `render_sr`, and a CLIENT span per delivery attempt
  (`STOW-RS <destination>`, `C-STORE <destination>`, `webhook <destination>`); STOW-RS and webhook requests carry
  `traceparent`.
A job keeps its trace context in the jobs database (`jobs.trace`), so a report or a delivery after a restart joins
the trace it began in. Variant switches (and rollout steps) are span events: `event(name, **attrs)`.

What is never exported: patient data, raw UIDs (a study is `edgekit.study`, hashed as the logs hash it:
`edgekit.ingest.phi.hash_uid`), URLs' paths, userinfo and queries, exception messages (only `error.type`: an
error code or an exception class), and the prompt and the report text, unless `capture_content = true`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from edgekit.errors import ConfigError

log = logging.getLogger("edgekitd")

OTEL_HINT = "pip install 'edgekit[otel]'"
# What the otel extra provides, by module.
OTEL_MODULES = (
    "opentelemetry.trace",
    "opentelemetry.sdk.trace",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
)
TRACE_FILE = ".trace"  # in a received study's inbox folder: the context of the request that brought it
INSTRUMENTATION = "edgekit.daemon"
PROVIDER = "edgekit"
FINISH_REASONS = {"stop_token": "stop", "max_new_tokens": "length"}  # edgekit's stop reasons in GenAI's words


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Tracing never fails what it traces: a failure here is logged (its class only) and the caller goes on."""
    import functools

    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except Exception as exc:  # noqa: BLE001
            log.warning("telemetry: %s failed (%s); going on untraced", fn.__name__, type(exc).__name__)
            return None

    return call


# --- settings --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TelemetrySettings:
    """[telemetry]; every key optional. `enabled` None: on when an OTLP endpoint is set in the environment."""

    enabled: bool | None = None
    endpoint: str | None = None  # OTLP/HTTP: a base URL (/v1/traces is added) or the full traces URL
    service_name: str | None = None  # None: OTEL_SERVICE_NAME, else "edgekitd"
    capture_content: bool = False  # the prompt and the report text on generate_content spans (PII: opt in)
    sample_ratio: float | None = None  # parent-based ratio sampling; None: OTEL_TRACES_SAMPLER, else every trace

    def wanted(self, environ: Mapping[str, str] = os.environ) -> bool:
        if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return False
        if self.enabled is not None:
            return self.enabled
        return bool(environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))

    def traces_url(self) -> str | None:
        """The exporter's URL from `endpoint` (None: the exporter reads OTEL_* itself, default localhost:4318)."""
        if self.endpoint is None:
            return None
        parts = urlsplit(self.endpoint)
        return self.endpoint if parts.path not in ("", "/") else self.endpoint.rstrip("/") + "/v1/traces"


_KEYS: dict[str, type | tuple[type, ...]] = {
    "enabled": bool,
    "endpoint": str,
    "service_name": str,
    "capture_content": bool,
    "sample_ratio": (int, float),
}


def read_settings(table: Any, path: Path | None) -> TelemetrySettings:
    """[telemetry] of edgekitd.toml; with `enabled = true` the otel extra must be installed."""
    if not isinstance(table, dict):
        raise ConfigError("[telemetry] must be a table", path)
    for key, value in table.items():
        kind = _KEYS.get(key)
        if kind is None:
            raise ConfigError(f"unknown key telemetry.{key} (known: {', '.join(_KEYS)})", path)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ConfigError(f"telemetry.{key} has the wrong type ({type(value).__name__})", path)
    ratio = table.get("sample_ratio")
    if ratio is not None and not (math.isfinite(ratio) and 0 <= ratio <= 1):
        raise ConfigError(f"telemetry.sample_ratio must be within 0..1, got {ratio!r}", path)
    endpoint = table.get("endpoint")
    if endpoint is not None:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"telemetry.endpoint must be an http:// or https:// URL, got {endpoint!r}", path)
    settings = TelemetrySettings(
        enabled=table.get("enabled"),
        endpoint=endpoint,
        service_name=table.get("service_name"),
        capture_content=table.get("capture_content", False),
        sample_ratio=float(ratio) if ratio is not None else None,
    )
    if settings.enabled:
        missing = missing_module()
        if missing is not None:
            raise ConfigError(
                f"telemetry.enabled = true needs the otel extra (module {missing} is missing): {OTEL_HINT}", path
            )
    return settings


def missing_module() -> str | None:
    import importlib

    for name in OTEL_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            return name
    return None


# --- the process's tracing -------------------------------------------------------------------------------------
class _Tracing:
    def __init__(self, settings: TelemetrySettings):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from edgekit import __version__

        attrs: dict[str, Any] = {"service.version": __version__}
        if settings.service_name:
            attrs["service.name"] = settings.service_name
        elif not os.environ.get("OTEL_SERVICE_NAME"):
            attrs["service.name"] = "edgekitd"
        kw: dict[str, Any] = {"resource": Resource.create(attrs)}
        if settings.sample_ratio is not None:
            kw["sampler"] = ParentBased(TraceIdRatioBased(settings.sample_ratio))
        self.provider = TracerProvider(**kw)
        url = settings.traces_url()
        # endpoint None: the exporter reads OTEL_* itself
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
        self.tracer = self.provider.get_tracer(INSTRUMENTATION, __version__)
        self.propagator = TraceContextTextMapPropagator()  # W3C traceparent/tracestate only (no baggage)
        self.capture_content = settings.capture_content


_state: _Tracing | None = None
_lock = threading.Lock()


def setup(settings: TelemetrySettings) -> bool:
    """Start exporting when the settings (or the environment) ask; True when this call started it. A daemon
    enabled by the environment alone without the otel extra says so once and runs without traces."""
    global _state
    if not settings.wanted():
        return False
    missing = missing_module()
    if missing is not None:
        log.warning("telemetry: OTEL_* asks for traces but the otel extra is missing (%s): %s", missing, OTEL_HINT)
        return False
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol and protocol != "http/protobuf":
        log.warning("telemetry: OTEL_EXPORTER_OTLP_PROTOCOL=%s is not supported; exporting http/protobuf", protocol)
    with _lock:
        old, _state = _state, _Tracing(settings)
    if old is not None:
        old.provider.shutdown()
    where = settings.traces_url() or "from OTEL_EXPORTER_OTLP_* (default http://localhost:4318/v1/traces)"
    log.info("telemetry: exporting traces by OTLP/HTTP to %s", _safe_endpoint(where))
    return True


def shutdown() -> None:
    """Export what is left and stop (the daemon's stop)."""
    global _state
    with _lock:
        old, _state = _state, None
    if old is not None:
        old.provider.shutdown()


def enabled() -> bool:
    return _state is not None


def capture_content() -> bool:
    st = _state
    return st is not None and st.capture_content


def _safe_endpoint(url: str) -> str:
    parts = urlsplit(url)
    if not parts.scheme:
        return url
    return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}{parts.path}"


# --- context: what a job, a study and an outbound request carry -------------------------------------------------
@guarded
def carrier() -> str | None:
    """The current span's context as a W3C carrier (JSON: traceparent, and tracestate when there is one), for a
    job or a study to keep; None when off or outside any span."""
    st = _state
    if st is None:
        return None
    out: dict[str, str] = {}
    st.propagator.inject(out)
    return json.dumps(out, sort_keys=True) if "traceparent" in out else None


def context_of(trace: str | None):
    """The context a kept carrier names (None: the current one)."""
    st = _state
    if st is None or not trace:
        return None
    try:
        values = json.loads(trace)
    except ValueError:
        return None
    return st.propagator.extract(values if isinstance(values, dict) else {})


@guarded
def inject(headers: dict[str, str]) -> None:
    """Add `traceparent` (and `tracestate`) of the current span to an outbound request's headers."""
    st = _state
    if st is not None:
        st.propagator.inject(headers)


@guarded
def remember(folder: Path) -> None:
    """Keep the current context in a received study's inbox folder (first request wins), so the job it becomes
    joins the trace of the request that brought it, after a restart too."""
    trace = carrier()
    if trace is None:
        return
    try:
        fd = os.open(folder / TRACE_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:  # already kept, or the folder was handed over meanwhile
        return
    with os.fdopen(fd, "w") as f:
        f.write(trace)


def traced_receive(receive: Callable[[Path], None]) -> Callable[[Path], None]:
    """The inbox's hand-over under a `receive study` span, child of the context `remember` kept in the folder:
    the job made inside it keeps that span's context (`jobs.Job.trace`)."""

    def handover(folder: Path) -> None:
        if _state is None:
            return receive(folder)
        try:
            trace = (folder / TRACE_FILE).read_text()
        except OSError:
            trace = None
        with span("receive study", trace=trace):
            receive(folder)

    return handover


# --- spans -------------------------------------------------------------------------------------------------------
def kind_of(name: str):
    from opentelemetry.trace import SpanKind

    return {"internal": SpanKind.INTERNAL, "client": SpanKind.CLIENT, "server": SpanKind.SERVER}[name]


def error_type(exc: BaseException) -> str:
    """An error's stable code (EdgekitError) or its class: never its message, which can name files or values."""
    return str(getattr(exc, "code", None) or type(exc).__name__)


@contextlib.contextmanager
def span(
    name: str, *, trace: str | None = None, kind: str = "internal", attributes: Mapping[str, Any] | None = None
) -> Iterator[Any]:
    """A span around a block, current inside it; child of `trace` (a kept carrier) or else of the current span.
    An exception marks it as an error (`error.type` only) and goes on. Yields the span, or None when off."""
    st = _state
    if st is None:
        yield None
        return
    from opentelemetry import context as otel_context
    from opentelemetry import trace as otel_trace
    from opentelemetry.trace import Status, StatusCode

    parent = context_of(trace)
    s = st.tracer.start_span(name, context=parent, kind=kind_of(kind), attributes=clean(attributes or {}))
    token = otel_context.attach(otel_trace.set_span_in_context(s, parent))
    try:
        yield s
    except BaseException as exc:
        s.set_attribute("error.type", error_type(exc))
        s.set_status(Status(StatusCode.ERROR))
        raise
    finally:
        otel_context.detach(token)
        s.end()


@guarded
def set_attribute(key: str, value: Any) -> None:
    """An attribute on the current span (when recording)."""
    if _state is None or value is None:
        return
    from opentelemetry import trace as otel_trace

    s = otel_trace.get_current_span()
    if s.is_recording():
        s.set_attributes(clean({key: value}))


@guarded
def event(name: str, attributes: Mapping[str, Any] | None = None, **attrs: Any) -> None:
    """A span event: a variant switched, a rollout staged, switched or rolled back. On the current span when
    there is one (a request's), else on a span of its own named like the event. Keyword attributes are named
    `edgekit.<key>`; `attributes` gives full names. Values: str, bool, int, float or a list of one of them;
    None is left out. Say nothing here that names a patient."""
    st = _state
    if st is None:
        return
    from opentelemetry import trace as otel_trace

    values = clean({**{f"edgekit.{k}": v for k, v in attrs.items()}, **(attributes or {})})
    current = otel_trace.get_current_span()
    if current.is_recording():
        current.add_event(name, values)
        return
    with span(name, attributes=values) as own:
        if own is not None:
            own.add_event(name, values)


def clean(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """OTel attribute values: None left out, tuples as lists, anything else not a primitive as text."""
    out: dict[str, Any] = {}
    for key, value in attrs.items():
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            value = [v if isinstance(v, (str, bool, int, float)) else str(v) for v in value if v is not None]
        elif not isinstance(value, (str, bool, int, float)):
            value = str(value)
        out[key] = value
    return out


def tracing() -> _Tracing | None:
    """The tracer in force (None: traces are off); read at each call, as `setup` and `shutdown` change it."""
    return _state

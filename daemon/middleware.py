"""ASGI middleware: who may call (a bearer token on TCP), how much and how slowly they may send, and the access log
and metrics.

Plain ASGI classes, not FastAPI decorators, so they see every request, including the ones refused before a route
matched. The log line carries the method, the route's template (never the concrete path, which can hold ids), the
status and the time.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edgekit.errors import EdgekitError

from . import trace_spans
from .metrics import Metrics
from .responses import error_response
from .uploads import UploadTooLargeError

if TYPE_CHECKING:
    from .config import DaemonConfig

log = logging.getLogger("edgekitd")

LIMIT_SLACK = 1 << 20  # multipart framing around the files
SMALL_BODY = 64 * 1024  # a declared body up to this size is not an upload (PUT /v1/policy): not held to max_uploads


class UnauthorizedError(EdgekitError):
    code = "unauthorized"
    http_status = 401


def token_ok(header: bytes, token: str) -> bool:
    scheme, _, value = header.decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())


class UploadsBusyError(EdgekitError):
    code = "uploads_busy"
    http_status = 503


class BodyTimeoutError(EdgekitError):
    code = "request_timeout"
    http_status = 408


def route_template(scope: Scope) -> str:
    """The matched route's template (`/v1/jobs/{job_id}`), never the concrete path, which can hold ids and UIDs."""
    return getattr(scope.get("route"), "path", "unmatched")


class Guard:
    """Who may call, how much and how slowly they may send.

    TCP needs the bearer token (the Unix socket's file mode is its guard). A body past the upload limit is refused
    by its Content-Length, or as soon as more than that has been read. At most `max_uploads` bodies are read at
    once (more answer 503 at once, unread), and each must start within `body_timeout_s` and keep `min_body_rate`
    bytes/s after that (else 408): a thousand clients trickling a byte a second cannot hold the daemon's
    connections and file descriptors, while requests without a body (health probes) pass untouched."""

    def __init__(self, app: ASGIApp, *, token: str | None, limits: Callable[[], DaemonConfig], metrics: Metrics):
        self.app, self.token, self.limits, self.metrics = app, token, limits, metrics
        self.uploads = 0  # bodies being read now (the event loop's: no lock needed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        server = scope.get("server")
        if isinstance(server, tuple) and isinstance(server[1], int):  # TCP (a Unix socket has no port)
            if self.token is None:
                return await error_response(UnauthorizedError("TCP is not configured with a token"))(
                    scope, receive, send
                )
            if not token_ok(headers.get(b"authorization", b""), self.token):
                return await error_response(UnauthorizedError("a bearer token is required on TCP"))(
                    scope, receive, send
                )
        cfg = self.limits()
        allowed = cfg.max_upload_bytes
        limit = allowed + LIMIT_SLACK
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            err = UploadTooLargeError(f"the upload exceeds the limit of {allowed} bytes")
            return await error_response(err)(scope, receive, send)
        has_body = (length is not None and length not in (b"", b"0")) or b"transfer-encoding" in headers
        if not has_body:
            return await self.app(scope, receive, send)
        # an upload is a body that may be large; a small declared one (a JSON setting) has the deadline only
        upload = length is None or not length.isdigit() or int(length) > SMALL_BODY
        if upload and self.uploads >= cfg.max_uploads:
            self.metrics.rejected_uploads.inc()
            busy = UploadsBusyError(f"{self.uploads} uploads are being received (limits.max_uploads); retry shortly")
            return await error_response(busy, cfg.retry_after_s)(scope, receive, send)
        self.uploads += upload
        reading = True
        seen = 0
        start: float | None = None  # from the app's first read: time the daemon takes before it is not the client's

        def done() -> None:
            nonlocal reading
            if reading:
                reading = False
                self.uploads -= upload

        async def guarded_receive() -> Message:
            nonlocal seen, start
            if not reading:  # the body is in: later receives wait for a disconnect, which has no deadline
                return await receive()
            start = time.monotonic() if start is None else start
            deadline = start + cfg.body_timeout_s + seen / cfg.min_body_rate
            try:
                message = await asyncio.wait_for(receive(), max(0.001, deadline - time.monotonic()))
            except TimeoutError:
                done()
                self.metrics.slow_bodies.inc()
                raise BodyTimeoutError(
                    f"the request body came too slowly ({seen} bytes in {time.monotonic() - start:.0f} s; "
                    f"limits.min_body_rate is {cfg.min_body_rate} bytes/s after {cfg.body_timeout_s:.0f} s)"
                ) from None
            seen += len(message.get("body", b""))
            if seen > limit:
                done()
                raise UploadTooLargeError(f"the upload exceeds the limit of {allowed} bytes")
            if message["type"] != "http.request" or not message.get("more_body", False):
                done()
            return message

        try:
            return await self.app(scope, guarded_receive, send)
        finally:
            done()


class AccessLog:
    """One log line and the request metrics per HTTP request, whatever answered it (a crash counts as 500), and
    its server span when traces are on (the caller's W3C `traceparent` its parent)."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 500
        span = trace_spans.server_span(scope)

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = route_template(scope)
            dt = time.perf_counter() - t0
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.request_latency.labels(route).observe(dt)
            log.info("%s %s -> %d (%.1f ms)", scope["method"], route, status, dt * 1e3)
            if span is not None:
                span.end(route, status)

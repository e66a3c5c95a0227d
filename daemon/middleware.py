"""ASGI middleware: who may call (a bearer token on TCP), how much they may send, and the access log and metrics.

Plain ASGI classes, not FastAPI decorators, so they see every request, including the ones refused before a route
matched. The log line carries the method, the route's template (never the concrete path, which can hold ids), the
status and the time.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edgekit.errors import EdgekitError

from .metrics import Metrics
from .responses import error_response
from .uploads import UploadTooLargeError

log = logging.getLogger("edgekitd")

LIMIT_SLACK = 1 << 20  # multipart framing around the files


class UnauthorizedError(EdgekitError):
    code = "unauthorized"
    http_status = 401


def token_ok(header: bytes, token: str) -> bool:
    scheme, _, value = header.decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())


class Guard:
    """TCP needs the bearer token (the Unix socket's file mode is its guard); a body past the upload limit is
    refused by its Content-Length, or as soon as more than that has been read."""

    def __init__(self, app: ASGIApp, *, token: str | None, max_upload_bytes: Callable[[], int]):
        self.app, self.token, self.max_upload_bytes = app, token, max_upload_bytes

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
        allowed = self.max_upload_bytes()
        limit = allowed + LIMIT_SLACK
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            err = UploadTooLargeError(f"the upload exceeds the limit of {allowed} bytes")
            return await error_response(err)(scope, receive, send)
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise UploadTooLargeError(f"the upload exceeds the limit of {allowed} bytes")
            return message

        return await self.app(scope, limited_receive, send)


class AccessLog:
    """One log line and the request metrics per HTTP request, whatever answered it (a crash counts as 500)."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            dt = time.perf_counter() - t0
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.request_latency.labels(route).observe(dt)
            log.info("%s %s -> %d (%.1f ms)", scope["method"], route, status, dt * 1e3)

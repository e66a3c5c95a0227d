"""How answers look on the wire: the one error shape, the three report formats, job links, stream messages.

Every error is `{"error": {"code", "message"}}` with the `EdgekitError`'s stable code and HTTP status; a 503 says
when to retry, a 401 which scheme to use.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.responses import JSONResponse, PlainTextResponse, Response

from edgekit import __version__ as edgekit_version
from edgekit.errors import EdgekitError

from .sr import render_sr

DICOM_MEDIA_TYPE = "application/dicom"
Format = Literal["json", "text", "sr"]
StreamFormat = Literal["ndjson", "sse"]
STREAM_MEDIA = {"sse": "text/event-stream", "ndjson": "application/x-ndjson"}


def error_response(err: EdgekitError, retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if err.http_status == 503 and retry_after else None
    if err.http_status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse({"error": err.to_json()}, status_code=err.http_status, headers=headers)


def error_json(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def render(report: dict[str, Any], fmt: Format, evidence: list[dict[str, Any]] | None) -> Response:
    """A finished report as JSON, plain text, or a DICOM SR in the source study (`evidence`: its headers)."""
    if fmt == "text":
        return PlainTextResponse(report["text"] + "\n")
    if fmt == "sr":
        return Response(
            render_sr(report, evidence or [], algorithm_version=edgekit_version), media_type=DICOM_MEDIA_TYPE
        )
    return JSONResponse(report)


def job_links(public: dict[str, Any]) -> dict[str, Any]:
    jid = public["id"]
    return {
        **public,
        "links": {"self": f"/v1/jobs/{jid}", "stream": f"/v1/jobs/{jid}/stream", "sr": f"/v1/jobs/{jid}/sr"},
    }


def event(fmt: StreamFormat, body: dict[str, Any]) -> str:
    """One NDJSON line or one SSE message; SSE messages stay unnamed (the kind is in the JSON), so a browser's
    EventSource.onmessage sees them all."""
    data = json.dumps(body)
    return f"data: {data}\n\n" if fmt == "sse" else data + "\n"

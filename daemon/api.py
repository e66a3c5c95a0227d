"""The HTTP app (FastAPI, versioned, OpenAPI at /openapi.json): error handlers, middleware and the route table.

`/docs` is Swagger UI served from the daemon's own copy of its assets (`swagger-ui-bundle`), never a CDN: the
device it runs on is often offline. ReDoc, which would need a CDN, is off.

Every error is `{"error": {"code", "message"}}`; input problems are 4xx with the `EdgekitError` code, a full queue
is 503 with Retry-After, and nothing a client sends answers 500. Logs carry the route, the status and the hashed
study id, never names or prompts. The handlers are in `routes.py`, the middleware in `middleware.py`.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from edgekit import __version__ as edgekit_version
from edgekit.errors import EdgekitError

from .middleware import AccessLog, Guard, route_template
from .responses import error_json, error_response
from .routes import Routes
from .service import Daemon

log = logging.getLogger("edgekitd")

DOCS_ASSETS = "/docs/assets"
HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    413: "upload_too_large",
    415: "unsupported_media_type",
}


def create_app(daemon: Daemon, *, token: str | None = None) -> FastAPI:
    app = FastAPI(
        title="edgekitd",
        version=edgekit_version,
        description="On-device radiology report generation: studies in, reports out.",
        docs_url=None,  # FastAPI's own pages load their assets from a CDN, which an offline device cannot reach
        redoc_url=None,
    )
    app.state.daemon = daemon
    install_docs(app)
    install_error_handlers(app, daemon)
    app.add_middleware(Guard, token=token, limits=lambda: daemon.cfg, metrics=daemon.metrics)
    app.add_middleware(AccessLog, metrics=daemon.metrics)  # added last: outermost, so it sees the guard's refusals
    for route in Routes(daemon).table():
        app.add_api_route(route.path, route.endpoint, methods=[route.method], response_model=None, **route.options)
    return app


def install_docs(app: FastAPI) -> None:
    """`/docs`: Swagger UI from the assets the `swagger-ui-bundle` package ships, served by the daemon itself, so
    the page works on a device with no network; the validator badge (an external call) is off."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.staticfiles import StaticFiles
    from swagger_ui_bundle import swagger_ui_path

    app.mount(DOCS_ASSETS, StaticFiles(directory=str(swagger_ui_path)), name="docs-assets")

    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} API",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png",
            swagger_ui_parameters={"validatorUrl": None},
        )

    app.add_api_route("/docs", docs, methods=["GET"], include_in_schema=False)


def install_error_handlers(app: FastAPI, daemon: Daemon) -> None:
    async def edgekit_error(_request: Request, err: EdgekitError) -> JSONResponse:
        return error_response(err, daemon.cfg.retry_after_s)

    async def validation_error(_request: Request, err: RequestValidationError) -> JSONResponse:
        parts = []
        for e in err.errors()[:5]:  # location and reason only: the offending value may be patient text
            loc = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body", "query", "header", "path"))
            parts.append(f"{loc or 'request'}: {e.get('msg', 'invalid')}")
        return error_json(422, "validation_error", "; ".join(parts) or "invalid request")

    async def http_error(_request: Request, err: StarletteHTTPException) -> Response:
        """Starlette's own refusals (404, 405, a body it cannot parse); one caused by our error keeps its code."""
        cause = err.__cause__
        while cause is not None and not isinstance(cause, (EdgekitError, ClientDisconnect)):
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, EdgekitError):
            return error_response(cause, daemon.cfg.retry_after_s)
        if isinstance(cause, ClientDisconnect):  # FastAPI wraps a failed form read in a 400
            return await disconnected(_request, cause)
        return error_json(err.status_code, HTTP_CODES.get(err.status_code, "http_error"), str(err.detail))

    async def disconnected(request: Request, _err: ClientDisconnect) -> Response:
        """The client went away mid-request (an aborted upload): one quiet line, nobody to answer."""
        log.info("client disconnected during %s %s", request.method, route_template(request.scope))
        return Response(status_code=499)  # nginx's "client closed request"; never sent, but the access log says it

    async def bug(request: Request, _err: Exception) -> JSONResponse:
        # the route's template, never the concrete path: it can hold a Study Instance UID or a job id
        log.exception("unhandled error on %s %s", request.method, route_template(request.scope))
        return error_json(500, "internal_error", "internal error; the daemon logged it")

    # Starlette types a handler as taking any Exception, though it calls each with the class it is registered for
    app.add_exception_handler(EdgekitError, edgekit_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(ClientDisconnect, disconnected)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, bug)

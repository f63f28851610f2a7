"""The HTTP surface of a node (Starlette): the routes of gateways/http/routes.py (API v1, its
streams, the WebSocket, OpenAPI, metrics, MCP, the console) behind the middlewares, outermost
first, and the error handlers (DESIGN.md 6)."""

from __future__ import annotations

import secrets
from collections.abc import Iterable

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from gateways.api.common import ApiError, Runtime
from gateways.api.health import VERSION
from gateways.http.auth import Guard, TokenTable
from gateways.http.errors import error_response
from gateways.http.keys import KeyRing
from gateways.http.origins import Cors, Reach
from gateways.http.readiness import Readiness
from gateways.http.routes import table
from gateways.http.routing import IndexedRouter
from gateways.http.telemetry import Telemetry
from gateways.streams.tokens import StreamTokens

__all__ = ["VERSION", "create_app"]

log = structlog.get_logger("dispach.http")


def create_app(
    rt: Runtime,
    *,
    tokens: Iterable[str] = (),
    loopback: bool = True,
    allowed_hosts: Iterable[str] = (),
    allowed_origins: Iterable[str] = (),
    secret: bytes | None = None,
    max_body: int = 1_000_000,
) -> Starlette:
    """The app. ``secret`` signs stream tokens (None: a random one, good for this process only);
    ``allowed_origins`` are the web pages, besides the node's own, that may call it."""
    origins = list(allowed_origins)
    stream_tokens = StreamTokens(secret if secret is not None else secrets.token_bytes(32))
    tokens = tuple(tokens)
    key_ring = KeyRing(rt, may_open=loopback and not tokens)
    routes = table(max_body)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(
            exc.status, exc.code, exc.message, exc.hint, field=exc.field, headers=exc.headers
        )

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            return error_response(
                405,
                "method_not_allowed",
                f"{request.method} is not allowed on {request.url.path}",
                f"use one of: {(exc.headers or {}).get('Allow', 'GET')}",
                headers=dict(exc.headers or {}),
            )
        return error_response(
            exc.status_code,
            "not_found" if exc.status_code == 404 else "http_error",
            f"no route for {request.method} {request.url.path}"
            if exc.status_code == 404
            else str(exc.detail),
            "check the method and path against GET /v1/openapi.json",
        )

    async def client_gone(request: Request, exc: Exception) -> Response:
        # The client left (or its body timed out) while the body was read: nobody reads this
        # answer, and it is not a failure of the server's (no traceback in the log).
        log.info("request_abandoned", method=request.method, path=request.url.path)
        return error_response(
            400,
            "client_disconnected",
            "the connection ended before the request body did",
            "send the whole body",
        )

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error("request_failed", method=request.method, path=request.url.path, exc_info=exc)
        return error_response(
            500,
            "internal_error",
            "the server failed to answer this request",
            "retry; if it persists, the node's log has the cause",
        )

    app = Starlette(
        routes=routes,
        exception_handlers={
            ApiError: api_error,
            HTTPException: http_error,
            ClientDisconnect: client_gone,
            Exception: internal_error,
        },
        # Outermost first: what every request leaves behind (metrics, access line, span), then
        # where it comes from (Host, Origin), then CORS for the allowed origins (so a preflight
        # needs no token and a refusal is readable by the page), then what it must carry (a
        # JSON body within the cap, credentials).
        middleware=[
            Middleware(Telemetry, routes=routes),
            Middleware(
                Reach, loopback=loopback, allowed_hosts=allowed_hosts, allowed_origins=origins
            ),
            *([Middleware(Cors, allowed_origins=origins)] if origins else []),
            Middleware(
                Guard,
                tokens=TokenTable(tokens),
                keys=key_ring,
                stream_tokens=stream_tokens,
                max_body=max_body,
            ),
            Middleware(Readiness, runtime=rt),
        ],
    )
    app.router = IndexedRouter(routes)
    app.state.runtime = rt
    app.state.max_body = max_body  # read_body's cap, on every transfer encoding
    app.state.stream_tokens = stream_tokens
    app.state.keys = key_ring
    return app

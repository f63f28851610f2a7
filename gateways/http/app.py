"""The HTTP surface of a node (Starlette): API v1, its streams, the WebSocket, OpenAPI and
metrics, behind the :class:`gateways.http.auth.Guard` (DESIGN.md 6)."""

from __future__ import annotations

import importlib
import secrets
from collections.abc import Awaitable, Callable, Iterable

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from eventstore.bridge import blocking
from gateways import console
from gateways.api import (
    activity,
    agents,
    approvals,
    context,
    deliveries,
    fork,
    hooks,
    keys,
    schedules,
    sessions,
    turns,
)
from gateways.api.common import ApiError, Runtime
from gateways.api.schemas import Health, Ready
from gateways.http import openapi
from gateways.http.auth import Guard, TokenTable
from gateways.http.errors import error_response, json_response
from gateways.http.keys import KeyRing
from gateways.http.metrics import metrics_endpoint
from gateways.http.origins import Cors, Reach
from gateways.http.readiness import Readiness
from gateways.http.routing import IndexedRouter
from gateways.http.telemetry import Telemetry
from gateways.streams import sse, ws
from gateways.streams.tokens import StreamTokens

log = structlog.get_logger("dispach.http")

VERSION = "0.1.0"


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

    async def health(request: Request) -> Response:
        return json_response(
            Health(
                status="ok",
                version=VERSION,
                node_id=rt.node_id,
                uptime_ms=rt.uptime_ms(),
                agents=len(rt.agent_details()),
            )
        )

    async def ready(request: Request) -> Response:
        ok, phase, checks = rt.readiness()
        if ok:
            return json_response(
                Ready(ready=True, phase=phase, checks=checks, warnings=rt.warnings())
            )
        failing = ", ".join(name for name, good in checks.items() if not good) or phase
        return error_response(
            503,
            "not_ready",
            f"the node is {phase} (waiting on: {failing})"
            if phase != "ready"
            else f"the node cannot serve now (down: {failing})",
            "retry shortly; a starting node becomes ready once Postgres and NATS are up",
            headers={"Retry-After": "1"},
        )

    async def openapi_json(request: Request) -> Response:
        return Response(openapi.document(), media_type="application/json")

    stream_tokens = StreamTokens(secret if secret is not None else secrets.token_bytes(32))
    tokens = tuple(tokens)
    key_ring = KeyRing(rt, may_open=loopback and not tokens)
    agent = "/v1/agents/{agent}"
    turn = agent + "/turns/{turn_id}"
    session = agent + "/sessions/{key}"
    schedule = agent + "/schedules/{schedule}"
    routes = [
        Route("/v1/health", health, methods=["GET"]),
        Route("/v1/ready", ready, methods=["GET"]),
        Route("/v1/openapi.json", openapi_json, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/v1/cluster", agents.cluster, methods=["GET"]),
        Route("/v1/activity", activity.get_activity, methods=["GET"]),
        _methods("/v1/keys", GET=keys.list_keys, POST=keys.create_key),
        Route("/v1/keys/{key_id}", keys.revoke_key, methods=["DELETE"]),
        Route("/v1/agents", agents.list_agents, methods=["GET"]),
        Route(agent, agents.get_agent, methods=["GET"]),
        Route(agent + "/tools", agents.agent_tools, methods=["GET"]),
        Route(agent + "/skills", agents.agent_skills, methods=["GET"]),
        Route(agent + "/reload", agents.reload_agent, methods=["POST"]),
        Route(agent + "/messages", turns.post_message, methods=["POST"]),
        Route(agent + "/turns", turns.list_turns, methods=["GET"]),
        Route(turn, turns.get_turn, methods=["GET"]),
        Route(turn + "/stop", turns.stop_turn, methods=["POST"]),
        Route(turn + "/events", turns.turn_events, methods=["GET"]),
        Route(turn + "/stream", sse.turn_stream, methods=["GET"]),
        Route(turn + "/context", context.turn_context, methods=["GET"]),
        Route("/v1/turns/{turn_id}", turns.get_turn_any, methods=["GET"]),
        Route(agent + "/sessions", sessions.list_sessions, methods=["GET"]),
        Route(session, sessions.session, methods=["GET", "DELETE"]),
        Route(session + "/messages", sessions.session, methods=["GET", "DELETE"]),
        Route(session + "/phase", sessions.set_phase, methods=["POST"]),
        Route(session + "/fork", fork.fork_session, methods=["POST"]),
        Route("/v1/events", sse.events_stream, methods=["GET"]),
        Route(agent + "/context", context.session_context, methods=["GET"]),
        Route(agent + "/approvals", approvals.list_approvals, methods=["GET"]),
        Route(agent + "/deliveries", deliveries.list_deliveries, methods=["GET"]),
        Route(agent + "/approvals/{approval}", approvals.decide, methods=["POST"]),
        _methods(
            agent + "/schedules", GET=schedules.list_schedules, POST=schedules.create_schedule
        ),
        _methods(
            schedule,
            GET=schedules.get_schedule,
            PUT=schedules.replace_schedule,
            PATCH=schedules.replace_schedule,
            DELETE=schedules.delete_schedule,
        ),
        Route(schedule + "/run", schedules.run_schedule, methods=["POST"]),
        Route("/v1/channels/{channel}/webhook/{agent}", hooks.channel_webhook, methods=["POST"]),
        Route("/v1/stream-tokens", sse.create_stream_token, methods=["POST"]),
        WebSocketRoute("/v1/ws", ws.websocket_endpoint),
        # MCP over streamable HTTP (an ASGI app: every method it takes; gateways/mcp/server.py).
        Route("/v1/mcp", _McpEndpoint(VERSION, max_body)),
        *console.routes(),
    ]

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


Endpoint = Callable[[Request], Awaitable[Response]]


def _methods(path: str, **endpoints: Endpoint) -> Route:
    """One route for a path that several handlers serve, one per method: Starlette answers a
    405 from the first route whose path matches, so separate routes would announce only that
    route's methods in ``Allow``."""

    async def dispatch(request: Request) -> Response:
        method = "GET" if request.method == "HEAD" else request.method
        return await endpoints[method](request)

    return Route(path, dispatch, methods=list(endpoints), name=path)


class _McpEndpoint:
    """``/v1/mcp``, with the MCP SDK imported (on a worker thread) at the first request: it
    costs a node that never serves MCP about 25 MiB."""

    def __init__(self, version: str, max_body: int) -> None:
        self.version = version
        self.max_body = max_body
        self._app: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._app is None:
            module = await blocking(importlib.import_module, "gateways.mcp.server")
            self._app = module.HttpEndpoint(self.version, self.max_body)
        await self._app(scope, receive, send)

"""Every route a node serves. API v1's operations are each declared once, as an
:class:`~gateways.http.operation.Operation` beside its handler (``agents.GET_AGENT`` in
gateways/api/agents.py); :data:`OPERATIONS` lists them, and both Starlette's routes
(:func:`table`) and ``GET /v1/openapi.json`` (:func:`document`) are made from that list. A new
route is one declaration beside its handler and its line here.

:data:`OPERATIONS` is in the document's order, which is the order generated requests run in
(tests/test_openapi.py): a fork before the session's DELETE, a schedule's run before its DELETE.
Starlette's order does not matter here: no two routes' paths match the same path.

The routes the document does not describe are :func:`table`'s others: ``GET /metrics``
(Prometheus's format), the WebSocket ``/v1/ws``, MCP over streamable HTTP (``/v1/mcp``) and the
console's files."""

from __future__ import annotations

import functools
import importlib

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
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
    health,
    hooks,
    keys,
    schedules,
    sessions,
    tokens,
    turns,
    usage,
    webhooks,
)
from gateways.http import openapi
from gateways.http.metrics import metrics_endpoint
from gateways.http.operation import Operation, answer, serve
from gateways.streams import sse, ws


async def openapi_json(request: Request) -> Response:
    return Response(document(), media_type="application/json")


OPENAPI = Operation(
    "GET",
    "/v1/openapi.json",
    openapi_json,
    "This document",
    {"200": answer({"type": "object"}, "OpenAPI 3.1")},
    errors=(),
    security="open",
)

OPERATIONS: tuple[Operation, ...] = (
    health.HEALTH,
    health.READY,
    OPENAPI,
    agents.CLUSTER,
    activity.ACTIVITY,
    keys.LIST_KEYS,
    keys.CREATE_KEY,
    keys.REVOKE_KEY,
    webhooks.LIST_WEBHOOKS,
    webhooks.CREATE_WEBHOOK,
    webhooks.GET_WEBHOOK,
    webhooks.WEBHOOK_DELIVERIES,
    webhooks.DELETE_WEBHOOK,
    agents.LIST_AGENTS,
    agents.GET_AGENT,
    agents.AGENT_TOOLS,
    agents.AGENT_SKILLS,
    agents.RELOAD_AGENT,
    agents.STOP_AGENT,
    agents.START_AGENT,
    turns.POST_MESSAGE,
    turns.LIST_TURNS,
    turns.GET_TURN,
    context.TURN_CONTEXT,
    context.SESSION_CONTEXT,
    turns.GET_TURN_ANY,
    turns.STOP_TURN,
    turns.TURN_EVENTS,
    sse.TURN_STREAM,
    sse.EVENTS_STREAM,
    tokens.CREATE_STREAM_TOKEN,
    sessions.LIST_SESSIONS,
    fork.FORK_SESSION,  # before the session's DELETE (a clear leaves no turn to fork at)
    sessions.GET_SESSION,
    sessions.CLEAR_SESSION,
    deliveries.LIST_DELIVERIES,
    usage.AGENT_USAGE,
    usage.USAGE,
    approvals.LIST_APPROVALS,
    approvals.DECIDE,
    schedules.LIST_SCHEDULES,
    schedules.CREATE_SCHEDULE,
    schedules.RUN_SCHEDULE,  # before the schedule's DELETE (it would leave nothing to run)
    schedules.GET_SCHEDULE,
    schedules.REPLACE_SCHEDULE,
    schedules.PATCH_SCHEDULE,
    schedules.DELETE_SCHEDULE,
    hooks.CHANNEL_WEBHOOK,
    sessions.SET_PHASE,
    sessions.SESSION_MESSAGES,
    sessions.CLEAR_MESSAGES,
)


@functools.cache
def document() -> bytes:
    """The OpenAPI document of :data:`OPERATIONS` (made once per process)."""
    return openapi.render(OPERATIONS)


def table(max_body: int) -> list[BaseRoute]:
    """Starlette's routes: API v1's operations, then the routes outside the document."""
    return [
        *serve(OPERATIONS),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        WebSocketRoute("/v1/ws", ws.websocket_endpoint),
        # MCP over streamable HTTP (an ASGI app: every method it takes; gateways/mcp/server.py).
        Route("/v1/mcp", _McpEndpoint(health.VERSION, max_body)),
        *console.routes(),
    ]


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

"""The HTTP surface of a node (Starlette). This issue: liveness and readiness."""

from __future__ import annotations

from typing import Protocol

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateways.errors import error_response, json_response


class NodeStatus(Protocol):
    """What the gateway needs to know about the node hosting it."""

    node_id: str

    def uptime_ms(self) -> int: ...

    def readiness(self) -> tuple[bool, str, dict[str, bool]]:
        """``(ready, phase, checks)``: phase is e.g. starting, ready, draining."""
        ...


class Health(msgspec.Struct, frozen=True, rename="camel"):
    status: str
    node_id: str
    uptime_ms: int


class Ready(msgspec.Struct, frozen=True, rename="camel"):
    ready: bool
    phase: str
    checks: dict[str, bool]


def create_app(node: NodeStatus) -> Starlette:
    async def health(request: Request) -> Response:
        return json_response(Health("ok", node.node_id, node.uptime_ms()))

    async def ready(request: Request) -> Response:
        ok, phase, checks = node.readiness()
        if ok:
            return json_response(Ready(True, phase, checks))
        failing = ", ".join(name for name, good in checks.items() if not good) or phase
        return error_response(
            503,
            "not_ready",
            f"the node is {phase} (waiting on: {failing})",
            "retry shortly; a starting node becomes ready once Postgres and NATS are up",
            headers={"Retry-After": "1"},
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
            "check the method and path against the API reference in README.md",
        )

    return Starlette(
        routes=[
            Route("/v1/health", health, methods=["GET"]),
            Route("/v1/ready", ready, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error},
    )

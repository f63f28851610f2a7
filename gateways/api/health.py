"""The node's own state, open to anyone: liveness (``GET /v1/health``) and readiness
(``GET /v1/ready``, the 503 a load balancer reads while the node cannot serve)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateways.api.common import runtime
from gateways.api.schemas import Health, Ready
from gateways.http.errors import error_response, json_response
from gateways.http.operation import Operation, answer

VERSION = "0.1.0"


async def health(request: Request) -> Response:
    rt = runtime(request)
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
    rt = runtime(request)
    ok, phase, checks = rt.readiness()
    if ok:
        return json_response(Ready(ready=True, phase=phase, checks=checks, warnings=rt.warnings()))
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


HEALTH = Operation(
    "GET", "/v1/health", health, "Liveness", {"200": answer(Health, "Alive")}, errors=(),
    security="open",
)  # fmt: skip
READY = Operation(
    "GET", "/v1/ready", ready, "Readiness", {"200": answer(Ready, "Ready")}, errors=("503",),
    security="open",
)  # fmt: skip

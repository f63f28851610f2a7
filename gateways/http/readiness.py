"""Readiness at the door: a request the node cannot serve now is answered ``503`` at once, with
``Retry-After``, instead of a wrong answer (a starting node has no agents yet: ``404``, ``[]``) or
a 30 s wait on a dependency that is known down.

:class:`Readiness` reads the node's :meth:`~gateways.api.common.Runtime.readiness` (the same checks
``GET /v1/ready`` reports) and refuses, in this order:

- ``not_ready`` while the node starts or drains, or a background task of it died;
- ``store_unavailable`` while Postgres is known down (every route reads or writes the log);
- ``nats_unavailable`` while NATS is down, for what sends a command to a session's actor over
  NATS: every method but ``GET``/``HEAD``, and the WebSocket. Reads go on from Postgres.

A refused SSE stream is the exception: it gets an empty ``200`` event stream with ``retry:``, the
one answer after which a browser's EventSource reconnects. Health, readiness, the API document
and ``/metrics`` are always answered; a path no route
serves still gets its ``404``. A refused request did nothing: retrying it is safe (a message
with the same ``Idempotency-Key`` at most replays its turn).
"""

from __future__ import annotations

from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from gateways import console
from gateways.api.common import Runtime
from gateways.http.auth import OPEN_PATHS, SSE_STREAMS
from gateways.http.errors import deny, error_response

POSTGRES = "postgres"
NATS = "nats"
PROJECTIONS = "projections"
CLUSTER = "cluster"
"""The node has read the lease bucket: it knows where every session's commands go."""
"""The names of the readiness checks (runtime/node.py computes them, this module reads them)."""

RETRY_AFTER_S = 1
ALWAYS_OPEN = OPEN_PATHS | {"/metrics"}
_READS = ("GET", "HEAD")


def _always_open(path: str) -> bool:
    """Answered whatever the node's state: health, readiness, the API document, metrics, and the
    console's files (the page then reports what the API answers)."""
    return path in ALWAYS_OPEN or console.is_console(path)


class Readiness:
    """ASGI middleware in front of the routes (innermost: after the Host, Origin and token
    checks, so a refusal says nothing to a caller that may not call)."""

    def __init__(self, app: ASGIApp, *, runtime: Runtime) -> None:
        self.app = app
        self.runtime = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] in ("http", "websocket") and not _always_open(path):
            refusal = self.refusal(scope)
            if refusal is not None and _routed(scope):
                code, message, hint = refusal
                if scope["type"] == "websocket":
                    await deny(scope, send, 503, code, message, hint)
                elif scope["method"] == "GET" and SSE_STREAMS.fullmatch(scope["path"]):
                    await _come_back(scope, receive, send, code, message)
                else:
                    headers = {"Retry-After": str(RETRY_AFTER_S)}
                    response = error_response(503, code, message, hint, headers=headers)
                    await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> tuple[str, str, str] | None:
        """``(code, message, hint)`` when this request cannot be served now, else None."""
        ready, phase, checks = self.runtime.readiness()
        if ready:
            return None
        retry = f"nothing was done; retry in {RETRY_AFTER_S} s (Retry-After)"
        if phase != "ready":
            return ("not_ready", f"the node is {phase}, not ready yet",
                    f"{retry}; GET /v1/ready says when it is ready")  # fmt: skip
        if not checks.get(POSTGRES, True):
            return ("store_unavailable", "the node cannot reach Postgres",
                    f"{retry}; a message with the same Idempotency-Key makes one turn at "
                    "most")  # fmt: skip
        if not checks.get(NATS, True):
            if scope["type"] == "http" and scope["method"] in _READS:
                return None
            return ("nats_unavailable", "the node has lost its connection to NATS",
                    f"{retry}; reads (GET) are still served")  # fmt: skip
        failing = ", ".join(name for name, good in checks.items() if not good)
        return ("not_ready", f"the node is not ready (waiting on: {failing})",
                f"{retry}; GET /v1/ready says when it is ready")  # fmt: skip


async def _come_back(scope: Scope, receive: Receive, send: Send, code: str, message: str) -> None:
    """A stream asked for now: an empty event stream that says when to reconnect. A browser's
    ``EventSource`` fails for good on any answer but 200 (it would never resume the turn it
    watched across a restart); on this one it reconnects after ``retry`` with its
    ``Last-Event-ID``, as after any dropped stream. The Python client reconnects the same way."""
    body = f"retry: {RETRY_AFTER_S * 1000}\n: {code}: {message}\n\n".encode()
    headers = {"Retry-After": str(RETRY_AFTER_S), "Cache-Control": "no-cache"}
    response = Response(body, 200, headers, media_type="text/event-stream; charset=utf-8")
    await response(scope, receive, send)


def _routed(scope: Scope) -> bool:
    """Whether a route serves this path (else the router's own 404 is the truer answer). Only
    asked on the way to a refusal, so a ready node pays nothing for it."""
    app = scope.get("app")
    routes = getattr(getattr(app, "router", None), "routes", ())
    return any(route.matches(scope)[0] is Match.FULL for route in routes)

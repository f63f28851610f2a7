"""What every request leaves behind: its metrics, one access-log line and (tracing on) a server
span, from one pure-ASGI middleware, the outermost.

Requests are told apart by route template (``/v1/agents/{agent}/turns/{turn_id}``: Starlette's
``scope["route"]`` once routed, else the route the path fits, for a request a guard refused
before routing; ``unmatched`` when no route fits the path), never by raw path,
so the series stay as few as the routes. The latency histogram ends at the response's start:
a stream (SSE) answers its headers at once and then lives for minutes, which would swamp the
histogram; its whole life is in the access line's ``duration_ms``. A WebSocket is counted and
logged when it closes, and not timed.

The access line has the path without its query string (a stream token travels there), never a
body nor a header but the request id: ``X-Request-Id`` when the client sent a sane one (at most
128 of ``[A-Za-z0-9._-]``), else one made here; the response carries it back.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence
from typing import Any

import structlog
from prometheus_client import Counter, Histogram
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from actors.tracing import enabled
from actors.tracing import request as request_span
from gateways.http.metrics import HTTP_REQUEST_SECONDS, HTTP_REQUESTS

access = structlog.get_logger("dispach.access")

UNMATCHED = "unmatched"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_SANE_ID = re.compile(rb"[A-Za-z0-9._-]{1,128}")
_ids = random.Random()  # noqa: S311 - a request id must be unique, not secret


def request_id(sent: bytes | None) -> str:
    """The client's ``X-Request-Id`` if it is sane, else a new one (16 hex digits)."""
    if sent is not None and _SANE_ID.fullmatch(sent):
        return sent.decode("ascii")
    return f"{_ids.getrandbits(64):016x}"


def route_of(scope: Scope, routes: Sequence[BaseRoute] = ()) -> str:
    """The template of the route that took the request, or of the first of ``routes`` that fits
    it (a request refused before routing); ``unmatched`` if none does."""
    route = scope.get("route")
    if route is None:
        route = next((r for r in routes if r.matches(scope)[0] is not Match.NONE), None)
    path = getattr(route, "path", None)
    return path if isinstance(path, str) and path else UNMATCHED


class Telemetry:
    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute] = ()) -> None:
        self.app = app
        self.routes = routes
        # The labelled series, looked up once each (``labels`` costs a few µs a call); as few
        # as the label values: methods, routes and statuses.
        self._counted: dict[tuple[str, str, int], Counter] = {}
        self._timed: dict[tuple[str, str], Histogram] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        sent_id: bytes | None = None
        carrier: dict[str, str] = {}
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                sent_id = value
            elif enabled() and name in (b"traceparent", b"tracestate"):
                carrier[name.decode()] = value.decode("latin-1")
        rid = request_id(sent_id)
        answer = _Answer(rid.encode())

        async def send_noting(message: Message) -> None:
            await send(answer.note(message))

        method = scope.get("method", "GET") if kind == "http" else "GET"
        method = method if method in _METHODS else "OTHER"
        try:
            if enabled() and kind == "http":
                with request_span(method, scope["path"], carrier) as span:
                    try:
                        await self.app(scope, receive, send_noting)
                    finally:
                        span.answered(method, route_of(scope, self.routes), answer.status or 500)
            else:
                await self.app(scope, receive, send_noting)
        finally:
            self._record(scope, kind, method, rid, answer, began)

    def _record(
        self, scope: Scope, kind: str, method: str, rid: str, answer: _Answer, began: float
    ) -> None:
        route = route_of(scope, self.routes)
        status = answer.status or (403 if kind == "websocket" else 500)
        counted = self._counted.get((method, route, status))
        if counted is None:
            counted = HTTP_REQUESTS.labels(method, route, str(status))
            self._counted[(method, route, status)] = counted
        counted.inc()
        if kind == "http":
            timed = self._timed.get((method, route))
            if timed is None:
                timed = self._timed[(method, route)] = HTTP_REQUEST_SECONDS.labels(method, route)
            timed.observe((answer.started or time.perf_counter()) - began)
        client = scope.get("client")
        access.info("request", method=method if kind == "http" else "WS", route=route,
                    path=scope["path"], status=status,
                    duration_ms=round((time.perf_counter() - began) * 1000, 2),
                    bytes=answer.bytes, request_id=rid,
                    remote=client[0] if client else None)  # fmt: skip


class _Answer:
    """What the response said so far: its status, when it started, its body's size."""

    def __init__(self, rid: bytes) -> None:
        self._rid = rid
        self.status = 0
        self.started: float | None = None
        self.bytes = 0

    def note(self, message: Message) -> Message:
        match message["type"]:
            case "http.response.start" | "websocket.http.response.start":
                self.status = message["status"]
                self.started = time.perf_counter()
                return self._with_id(message)
            case "http.response.body" | "websocket.http.response.body":
                self.bytes += len(message.get("body", b""))
            case "websocket.accept":
                self.status = 101
                return self._with_id(message)
            case "websocket.close" if not self.status:
                self.status = 403  # closed before the upgrade: the server answers 403
        return message

    def _with_id(self, message: Message) -> Message:
        headers: list[Any] = [*message.get("headers", ()), (b"x-request-id", self._rid)]
        return {**message, "headers": headers}

"""An operation of API v1, declared once (gateways/http/routes.py lists them): its method, path
and handler, which Starlette serves (:func:`serve`), and what the OpenAPI document says of it
(gateways/http/openapi.py renders it). Wherever a declaration holds a JSON Schema, a msgspec
type stands for its component (``answer(Health, "Alive")``, ``array(ToolInfo)``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateways.http.constraints import CURSOR, NO_NUL, event_types

Endpoint = Callable[[Request], Awaitable[Response]]
Schema = Any
"""A JSON Schema (a dict), or a msgspec type standing for its component's ``$ref``."""

SSE = "text/event-stream"
# One SSE frame, as schemathesis and other tools parse them.
SSE_FRAME = {
    "type": "object",
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
    "required": ["data"],
}


@dataclass(frozen=True)
class Operation:
    """One method on one path. ``answers`` are its own statuses; ``errors`` the statuses it
    shares with others (the error envelope, described once in gateways/http/openapi.py), to
    which every operation but the always-open ones adds 503 (gateways/http/readiness.py).
    ``security``: a bearer token, none, or a bearer token or a stream token (``?st=``)."""

    method: str
    path: str
    handler: Endpoint
    summary: str
    answers: Mapping[str, Mapping[str, Any]]
    params: Sequence[Mapping[str, Any]] = ()
    body: type[Any] | None = None
    errors: tuple[str, ...] = ("400", "401", "404")
    security: Literal["bearer", "open", "stream"] = "bearer"
    body_required: bool = True
    """False: the body may be left out (every field of it is optional)."""


def param(
    name: str,
    where: str,
    description: str,
    schema: Schema = None,
    required: bool | None = None,
) -> dict[str, Any]:
    """A parameter: a path's is required, a query's or a header's optional, unless told."""
    return {
        "name": name,
        "in": where,
        "description": description,
        "required": where == "path" if required is None else required,
        # No NUL anywhere in a URL: the server refuses one (bad_request_url) before any route.
        "schema": schema
        or (
            {"type": "string", "minLength": 1, "pattern": NO_NUL}
            if where == "path"
            else {"type": "string", "pattern": NO_NUL}
        ),
    }


def answer(schema: Schema, description: str) -> dict[str, Any]:
    """A JSON answer."""
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def array(kind: type[Any]) -> dict[str, Any]:
    return {"type": "array", "items": kind}


def serve(operations: Sequence[Operation]) -> list[Route]:
    """Starlette's routes: one per path, in the order the paths first appear, with every method
    declared on it (a handler that serves several methods itself is the route's endpoint)."""
    paths: dict[str, dict[str, Endpoint]] = {}
    for op in operations:
        endpoints = paths.setdefault(op.path, {})
        if op.method in endpoints:
            raise ValueError(f"{op.method} {op.path} is declared twice")
        endpoints[op.method] = op.handler
    return [
        Route(path, next(iter(endpoints.values())), methods=list(endpoints))
        if len(set(endpoints.values())) == 1
        else _methods(path, endpoints)
        for path, endpoints in paths.items()
    ]


def _methods(path: str, endpoints: dict[str, Endpoint]) -> Route:
    """One route for a path that several handlers serve, one per method: Starlette answers a
    405 from the first route whose path matches, so separate routes would announce only that
    route's methods in ``Allow``."""

    async def dispatch(request: Request) -> Response:
        method = "GET" if request.method == "HEAD" else request.method
        return await endpoints[method](request)

    return Route(path, dispatch, methods=list(endpoints), name=path)


# The parameters several operations take.
AGENT = param("agent", "path", "Agent id")
TURN = param("turn_id", "path", "Turn id")
KEY = param("key", "path", "Session key (URL-encoded)")
LIMIT = param(
    "limit", "query", "Page size", {"type": "integer", "minimum": 1, "maximum": 500}, required=False
)
AFTER = param(
    "after",
    "query",
    "Resume after this cursor (an event's `cursor`, an SSE `id`)",
    {"type": "string", "pattern": CURSOR},
    required=False,
)
CHUNKS = param(
    "chunks", "query", "Include model.chunk text deltas", {"type": "boolean"}, required=False
)
REASONING = param(
    "reasoning",
    "query",
    "Include model.chunk deltas of the model's thinking (kind `reasoning`), with or "
    "without `chunks`",
    {"type": "boolean"},
    required=False,
)
TYPES = param(
    "types",
    "query",
    "Comma-separated event types (docs/events.md lists them)",
    {"type": "string", "pattern": event_types()},
    required=False,
)

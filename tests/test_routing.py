"""gateways/http/routing.py: the indexed router answers every request as Starlette's router does.

Both routers get the node's own route table (paths, methods, route kinds, order), with endpoints
that say which route took the request, and the same requests: every route's path with sample
values, and the paths around them (a segment more or less, a trailing slash, an empty segment, a
parameter holding a slash, a newline at the end, a root path, paths no route has), by every
method, over HTTP and as a WebSocket. What each sends back must be the same, message by message:
the route that answered, or Starlette's own 404, 405 (with ``Allow``) or redirect.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route, Router, WebSocketRoute
from starlette.types import Message, Scope
from starlette.websockets import WebSocket

from gateways.http.app import create_app
from gateways.http.routing import IndexedRouter

METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
VALUES = ("a", "t_01HZX", "x.y", "a b", "a/b", "-", "new", "7", "first")


def probes(table: list[BaseRoute]) -> list[BaseRoute]:
    """The table's routes, in order, each answering with its own index."""

    def answer(index: int) -> Any:
        async def http(request: Request) -> Response:
            return PlainTextResponse(f"{index} {sorted(request.path_params.items())}")

        async def websocket(socket: WebSocket) -> None:
            await socket.close(code=4000 + index)

        return http, websocket

    made: list[BaseRoute] = []
    for index, route in enumerate(table):
        http, websocket = answer(index)
        if isinstance(route, WebSocketRoute):
            made.append(WebSocketRoute(route.path, websocket))
        else:
            assert isinstance(route, Route)
            made.append(Route(route.path, http, methods=route.methods))
    return made


def paths(table: list[BaseRoute]) -> list[str]:
    found = {"", "/", "/v1", "/v1/", "/nowhere", "/v1/agents//messages", "//v1/health"}
    for route in table:
        template = getattr(route, "path", "/")
        for value in VALUES:
            path = re.sub(r"\{[^}]+\}", value, template)
            parent = path.rsplit("/", 1)[0]
            found |= {path, path + "/", path + "/more", parent, path + "\n", path.upper()}
    return sorted(found)


async def answered(router: Router, scope: Scope) -> list[Message]:
    sent: list[Message] = []

    async def receive() -> Message:
        if scope["type"] == "websocket":
            return {"type": "websocket.connect"}
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await router(dict(scope), receive, send)
    return sent


def node_table() -> list[BaseRoute]:
    return list(create_app(None).router.routes)  # type: ignore[arg-type]


async def nothing(request: Request) -> Response:
    return PlainTextResponse("")


def overlapping_table() -> list[BaseRoute]:
    """Routes that match the same paths, where order decides: a parameter before a literal,
    a ``:path`` route between them, a method split over two routes of one path."""
    return [
        Route("/items/{item}", nothing, methods=["GET"]),
        Route("/items/new", nothing, methods=["GET", "POST"]),
        Route("/{rest:path}", nothing, methods=["PUT"]),
        Route("/items/{item}", nothing, methods=["POST"]),
        Route("/items/{item:int}/parts/{part}", nothing),
        Route("/items/{item}/parts/first", nothing, methods=["DELETE"]),
        WebSocketRoute("/items/{item}", nothing),
        Route("/file-{name}.txt", nothing),
        Route("/", nothing),
    ]


@pytest.mark.asyncio
@pytest.mark.parametrize("tabled", [node_table, overlapping_table])
async def test_the_indexed_router_answers_every_request_as_starlettes_does(tabled: Any) -> None:
    table = tabled()
    routes = probes(table)
    indexed, plain = IndexedRouter(routes), Router(routes)
    tried = 0
    for path, root in itertools.product(paths(table), ("", "/v1")):
        base = {"path": path, "root_path": root, "query_string": b"", "server": ("127.0.0.1", 80)}
        scopes: list[Scope] = [
            {**base, "type": "websocket", "headers": [], "scheme": "ws"},
            *(
                {
                    **base,
                    "type": "http",
                    "method": method,
                    "scheme": "http",
                    "headers": [(b"host", b"127.0.0.1")],
                }
                for method in METHODS
            ),
        ]
        for scope in scopes:
            assert await answered(indexed, scope) == await answered(plain, scope), scope
            tried += 1
        await asyncio.sleep(0)  # the suite's guard against blocking the loop watches each step
    assert tried > 40 * len(table)


def test_a_request_tries_only_the_routes_its_path_may_match() -> None:
    table = node_table()
    router = IndexedRouter(probes(table))
    templates = [getattr(route, "path", "") for route in table]
    for path, template in (
        ("/v1/agents/bench/messages", "/v1/agents/{agent}/messages"),
        ("/v1/agents/bench/turns/t_1", "/v1/agents/{agent}/turns/{turn_id}"),
        ("/v1/turns/t_1", "/v1/turns/{turn_id}"),
        ("/v1/ws", "/v1/ws"),
    ):
        assert [templates[i] for i in router.candidates(path)] == [template]
    console = [templates[i] for i in router.candidates("/console/app.js")]
    assert console == ["/console/{path:path}"]

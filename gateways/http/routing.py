"""Starlette's router, with its routes indexed by their paths' literal segments.

Starlette tries every route's regex in order until one matches: the routes a turn's requests
take (``POST …/messages``, ``GET …/turns/{turnId}``) stand eleventh and thirteenth, 7-8 µs of
regex per request. :class:`IndexedRouter` first walks a tree of the routes' path segments (a
literal segment, or a parameter for any other) to the few routes the path could match, and tries
only those, in the routes' order, with the routes' own ``matches``; a route with a ``:path``
parameter is tried for every path that reaches its segment, and a route of another kind (a
mount, a host) always. When none of those matches, Starlette's own walk answers (its 405s come
from a partial match found here; its redirects and 404s from that walk), so every answer is the
one Starlette's router gives (tests/test_routing.py; ``get_route_path`` is Starlette's, of the
pinned version).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette._utils import get_route_path
from starlette.routing import BaseRoute, Match, Route, Router, WebSocketRoute
from starlette.types import Receive, Scope, Send

_PARAM = object()
"""The tree's key for a segment that is (or holds) a path parameter."""
_ROUTES = object()
"""The tree's key for the routes (their indexes) whose path ends at a node."""
_REST = object()
"""The tree's key for the routes whose ``:path`` parameter takes the segments from a node on."""

Tree = dict[object, Any]


class IndexedRouter(Router):
    def __init__(self, routes: Sequence[BaseRoute]) -> None:
        super().__init__(routes=routes)
        self._tree: Tree = {}
        self._always: list[int] = []
        for index, route in enumerate(self.routes):
            if not isinstance(route, Route | WebSocketRoute):
                self._always.append(index)
                continue
            node = self._tree
            key: object = _ROUTES
            for segment in route.path.split("/"):
                if ":path}" in segment:  # this segment and all after it
                    key = _REST
                    break
                node = node.setdefault(_PARAM if "{" in segment else segment, {})
            node.setdefault(key, []).append(index)

    def candidates(self, path: str) -> list[int]:
        """The indexes, in order, of the routes that may match ``path``: every route that
        does is among them."""
        found = list(self._always)
        nodes = [self._tree]
        for segment in path.split("/"):
            deeper = []
            for node in nodes:
                if _REST in node:
                    found += node[_REST]
                child = node.get(segment)
                if child is not None:
                    deeper.append(child)
                child = node.get(_PARAM) if segment else None
                if child is not None:
                    deeper.append(child)
            nodes = deeper
        for node in nodes:
            found += node.get(_ROUTES, ())
        if len(found) > 1:
            found.sort()
        return found

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = get_route_path(scope) if scope["type"] in ("http", "websocket") else ""
        # A path that ends in a newline: the routes' regexes end in ``$``, which matches before
        # it; Starlette's walk knows what that means.
        if path and not path.endswith("\n"):
            partial: tuple[BaseRoute, Scope] | None = None
            for index in self.candidates(path):
                route = self.routes[index]
                match, child_scope = route.matches(scope)
                if match is Match.FULL:
                    scope.setdefault("router", self)
                    scope["route"] = route
                    scope.update(child_scope)
                    await route.handle(scope, receive, send)
                    return
                if match is Match.PARTIAL and partial is None:
                    partial = (route, child_scope)
            if partial is not None:
                scope.setdefault("router", self)
                scope["route"], child_scope = partial
                scope.update(child_scope)
                await partial[0].handle(scope, receive, send)
                return
        await super().app(scope, receive, send)

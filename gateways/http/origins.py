"""Where a request may come from: the Host check and the Origin policy, then CORS.

A node on loopback with no token trusts whoever can reach its port, and a web page the user
visits can reach it: through DNS rebinding (a name of the attacker's that resolves to 127.0.0.1;
the ``Host`` check answers only loopback names and ``DISPACH_ALLOWED_HOSTS``), by a cross-site
request (a ``no-cors`` POST, a form) or a cross-site WebSocket. Browsers name the page that made a
request in ``Origin`` and scripts cannot forge it, so :class:`Reach` answers ``403
origin_not_allowed`` to any ``Origin`` that is neither the node's own (``http(s)://<Host>``: a
page the node serves itself) nor listed in ``DISPACH_ALLOWED_ORIGINS``; a WebSocket is refused
before the upgrade. A request without ``Origin`` does not come from a page (curl, the CLI, a
server) and is unaffected. :class:`Cors` (Starlette's CORS middleware) then lets the listed
origins read the answers. docs/security.md has the threat model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from gateways.http.asgi import header
from gateways.http.errors import deny, error_response

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
CORS_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
CORS_HEADERS = ("Authorization", "Content-Type", "Idempotency-Key", "Last-Event-ID",
                "Mcp-Protocol-Version", "Mcp-Session-Id", "Mcp-Method", "Mcp-Name")  # fmt: skip
"""What a page of an allowed origin may send: the API's headers, and those of an MCP host in
a browser talking to /v1/mcp."""
CORS_EXPOSED = ("Retry-After", "Content-Type")


def normal_origin(origin: str) -> str:
    """An origin as browsers write it: lower case, no trailing slash."""
    return origin.strip().lower().rstrip("/")


class Reach:
    """ASGI middleware in front of everything: the Host check, then the Origin policy."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        loopback: bool,
        allowed_hosts: Iterable[str] = (),
        allowed_origins: Iterable[str] = (),
    ) -> None:
        self.app = app
        self.loopback = loopback
        self.allowed_hosts = frozenset(h.lower() for h in allowed_hosts) | LOOPBACK_HOSTS
        self.allowed_origins = frozenset(normal_origin(o) for o in allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = header(scope, b"host") or ""
        if self.loopback and _hostname(host) not in self.allowed_hosts:
            await deny(
                scope,
                send,
                403,
                "host_not_allowed",
                f"this server answers to loopback host names, not {host!r}",
                "use http://127.0.0.1:<port>, or list the name in DISPACH_ALLOWED_HOSTS",
            )
            return
        origin = header(scope, b"origin")
        if origin is not None and not self._allows(origin, host):
            await deny(
                scope,
                send,
                403,
                "origin_not_allowed",
                f"requests from the web page at {origin[:200]!r} are not allowed",
                "a page may call this node only from the node's own origin or one listed in "
                "DISPACH_ALLOWED_ORIGINS (see docs/security.md)",
            )
            return
        await self.app(scope, receive, send)

    def _allows(self, origin: str, host: str) -> bool:
        origin = normal_origin(origin)
        if origin in self.allowed_origins:
            return True
        own = host.strip().lower()
        return bool(own) and origin in (f"http://{own}", f"https://{own}")


class Cors(CORSMiddleware):
    """Starlette's CORS middleware for the allowed origins, answering a refused preflight (a
    method or header it does not allow) with the error envelope instead of plain text."""

    def __init__(self, app: ASGIApp, *, allowed_origins: Sequence[str]) -> None:
        super().__init__(
            app,
            allow_origins=[normal_origin(o) for o in allowed_origins],
            allow_methods=CORS_METHODS,
            allow_headers=CORS_HEADERS,
            expose_headers=CORS_EXPOSED,
            max_age=600,
        )

    def preflight_response(self, request_headers: Headers) -> Response:
        answer = super().preflight_response(request_headers)
        if answer.status_code < 400:
            return answer
        reason = bytes(answer.body).decode(errors="replace")
        return error_response(
            answer.status_code,
            "cors_preflight_refused",
            f"the preflight asks for what CORS here does not allow ({reason})",
            f"methods: {', '.join(CORS_METHODS)}; headers: {', '.join(CORS_HEADERS)}",
            headers={k: v for k, v in answer.headers.items() if k.startswith("access-control")},
        )


def _hostname(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host

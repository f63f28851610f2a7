"""Who may call the API: bearer tokens (each optionally scoped to agents), the Host check that
keeps a loopback server out of reach of DNS rebinding, and the request body cap.

Tokens come from ``DISPACH_API_TOKEN``: comma-separated, each ``secret`` or
``secret@agent1+agent2`` (scoped). Presented tokens are compared in constant time against every
configured one (SHA-256 digests with ``hmac.compare_digest``, no early exit), so neither the
length nor the position of a match leaks. An agent outside a token's scope answers 404, exactly as
an agent that does not exist would.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec
from starlette.datastructures import Headers, QueryParams
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateways.errors import ErrorBody, ErrorEnvelope

OPEN_PATHS = frozenset({"/v1/health", "/v1/ready", "/v1/openapi.json"})
WEBHOOK_PREFIX = "/v1/channels/"
SUBPROTOCOL = "dispach.bearer"
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
_ENCODE = msgspec.json.Encoder()


@dataclass(frozen=True)
class Principal:
    """The caller: which agents it may see (None: all of them)."""

    agents: frozenset[str] | None = None

    def sees(self, agent_id: str) -> bool:
        return self.agents is None or agent_id in self.agents


EVERYONE = Principal()


def parse_token(raw: str) -> tuple[str, frozenset[str] | None]:
    """``secret`` or ``secret@a+b`` → (secret, scope)."""
    secret, sep, scope = raw.partition("@")
    if not sep:
        return secret, None
    return secret, frozenset(a for a in scope.split("+") if a)


class TokenTable:
    def __init__(self, raw_tokens: Iterable[str]) -> None:
        self._entries = [
            (hashlib.sha256(secret.encode()).digest(), Principal(scope))
            for secret, scope in map(parse_token, raw_tokens)
        ]

    @property
    def open(self) -> bool:
        """No token is configured (allowed on loopback binds only; config enforces it)."""
        return not self._entries

    def principal(self, presented: str | None) -> Principal | None:
        if self.open:
            return EVERYONE
        if not presented:
            return None
        digest = hashlib.sha256(presented.encode()).digest()
        found: Principal | None = None
        for known, principal in self._entries:
            if hmac.compare_digest(digest, known) and found is None:
                found = principal
        return found


class Guard:
    """ASGI middleware in front of every route: Host check, authentication, body cap."""

    def __init__(
        self,
        app: ASGIApp,
        tokens: TokenTable,
        *,
        loopback: bool,
        allowed_hosts: Iterable[str] = (),
        max_body: int = 1_000_000,
    ) -> None:
        self.app = app
        self.tokens = tokens
        self.loopback = loopback
        self.allowed_hosts = frozenset(h.lower() for h in allowed_hosts) | LOOPBACK_HOSTS
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.loopback and _hostname(headers.get("host", "")) not in self.allowed_hosts:
            await _deny(
                scope,
                send,
                403,
                "host_not_allowed",
                f"this server answers to loopback host names, not {headers.get('host')!r}",
                "use http://127.0.0.1:<port>, or list the name in DISPACH_ALLOWED_HOSTS",
            )
            return
        if "\x00" in scope["path"] or b"%00" in scope.get("query_string", b""):
            await _deny(scope, send, 400, "bad_request_url", "the URL contains a NUL character",
                        "remove %00 from the path and the query")  # fmt: skip
            return
        if kind == "http" and _too_large(headers, self.max_body):
            await _deny(
                scope,
                send,
                413,
                "body_too_large",
                f"the request body is over {self.max_body} bytes",
                "send a smaller body",
            )
            return
        principal = self.tokens.principal(_presented(scope, headers))
        if principal is None and not _open(scope["path"]):
            await _deny(
                scope,
                send,
                401,
                "unauthorized",
                "a valid bearer token is required",
                "send `Authorization: Bearer <token>` (for a WebSocket: the header, or "
                f'the subprotocols ["{SUBPROTOCOL}", <token>])',
            )
            return
        scope.setdefault("state", {})["principal"] = principal or EVERYONE
        await self.app(scope, receive, send)


def _open(path: str) -> bool:
    """Paths anyone may call: health, readiness, the API document, and providers' webhooks
    (each channel checks its provider's own secret)."""
    return path in OPEN_PATHS or path.startswith(WEBHOOK_PREFIX)


def _presented(scope: Scope, headers: Headers) -> str | None:
    auth = headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    if scope["type"] == "websocket":
        offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",")]
        if len(offered) >= 2 and offered[0] == SUBPROTOCOL:
            return offered[1]
        token = QueryParams(scope.get("query_string", b"")).get("token")  # v1 clients (deprecated)
        if token:
            return token
    return None


def _hostname(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _too_large(headers: Headers, limit: int) -> bool:
    length = headers.get("content-length")
    return length is not None and length.isdigit() and int(length) > limit


async def _deny(scope: Scope, send: Send, status: int, code: str, message: str, hint: str) -> None:
    body = _ENCODE.encode(ErrorEnvelope(ErrorBody(code=code, message=message, hint=hint)))
    start: Message = {
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
    }
    if scope["type"] == "websocket":
        if "websocket.http.response" in scope.get("extensions", {}):
            await send({**start, "type": "websocket.http.response.start"})
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": 1008, "reason": code})
        return
    await send(start)
    await send({"type": "http.response.body", "body": body})

"""Who may call the API and what a request must carry: bearer tokens (each optionally scoped to
agents), API keys (gateways/http/keys.py), the boot claim, stream tokens for browsers' streams,
JSON bodies within the cap. (Where a request may come from, its Host and Origin, is
gateways/http/origins.py.)

Tokens come from ``DISPACH_API_TOKEN``: comma-separated, each ``secret`` or
``secret@agent1+agent2`` (scoped). Presented tokens are compared in constant time against every
configured one (SHA-256 digests with ``hmac.compare_digest``, no early exit), so neither the
length nor the position of a match leaks. A token is ``admin``; a key holds the scope it was
minted with, and a route its scope does not reach answers ``403 scope_insufficient`` naming the
scope it needs (gateways/http/scopes.py). An agent outside a token's or key's agent list answers
404, exactly as an agent that does not exist would.

A token-less loopback node is open (every caller is an unrestricted admin) until the first key
is minted; from then on it asks for a credential, even if every key is revoked later.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

from starlette.datastructures import QueryParams
from starlette.types import ASGIApp, Receive, Scope, Send

from eventstore import StoreError
from gateways import console
from gateways.http import scopes
from gateways.http.asgi import header
from gateways.http.errors import deny
from gateways.http.keys import CLAIM_PREFIX, PREFIX, KeyRing
from gateways.streams.tokens import StreamGrant, StreamTokens

OPEN_PATHS = frozenset({"/v1/health", "/v1/ready", "/v1/openapi.json"})
WEBHOOK_PREFIX = "/v1/channels/"
SUBPROTOCOL = "dispach.bearer"
STREAM_TOKEN_QUERY = "st"  # noqa: S105 - a query parameter's name
_NO_QUERY = QueryParams()
"""What a request without a query string carries (immutable; parsing ``b""`` costs 1.7 µs)."""


@dataclass(frozen=True)
class Principal:
    """The caller: which agents it may see (None: all of them), what it may do (its scope), and,
    for a stream token, the one stream it may read (see gateways/streams/tokens.py); for an API
    key, its id; for the boot claim, ``claim`` (it may only mint the first key)."""

    agents: frozenset[str] | None = None
    stream: StreamGrant | None = None
    scope: scopes.Scope = "admin"
    key_id: str | None = None
    claim: bool = False
    anonymous: bool = False
    """No credential, on a node open to anyone (loopback, no token, no key yet)."""

    def sees(self, agent_id: str) -> bool:
        return self.agents is None or agent_id in self.agents


EVERYONE = Principal()
ANYONE = Principal(anonymous=True)
CLAIMANT = Principal(agents=frozenset(), scope="read", claim=True)
KEYS_PATH = "/v1/keys"


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
        if not presented or self.open:
            return None
        digest = hashlib.sha256(presented.encode()).digest()
        found: Principal | None = None
        for known, principal in self._entries:
            if hmac.compare_digest(digest, known) and found is None:
                found = principal
        return found


class Guard:
    """ASGI middleware in front of every route (behind :class:`gateways.http.origins.Reach`): what a
    request must carry. A body is JSON and within the cap; the caller is authenticated by a
    bearer token, or reads a stream with a stream token (``?st=``, gateways/streams/tokens.py)."""

    def __init__(
        self,
        app: ASGIApp,
        tokens: TokenTable,
        *,
        keys: KeyRing,
        stream_tokens: StreamTokens | None = None,
        max_body: int = 1_000_000,
    ) -> None:
        self.app = app
        self.tokens = tokens
        self.keys = keys
        self.stream_tokens = stream_tokens
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if "\x00" in path or b"%00" in scope.get("query_string", b""):
            await deny(scope, send, 400, "bad_request_url", "the URL contains a NUL character",
                       "remove %00 from the path and the query")  # fmt: skip
            return
        if kind == "http":
            refusal = _body_refusal(scope, path, self.max_body)
            if refusal is not None:
                await deny(scope, send, *refusal)
                return
        state = scope.setdefault("state", {})
        raw_query = scope.get("query_string", b"")
        query = QueryParams(raw_query) if raw_query else _NO_QUERY
        stream_token = query.get(STREAM_TOKEN_QUERY)
        if stream_token is not None:
            refusal = self._stream_refusal(scope, stream_token, state)
            if refusal is not None:
                unauthorized = refusal[0] == 401
                await deny(scope, send, *refusal, [challenge(refused=True)] if unauthorized else [])
                return
            await self.app(scope, receive, send)
            return
        presented = _presented(scope, query)
        try:
            found = await self._principal(presented)
        except StoreError as e:
            if not _open(path):  # as the Readiness gate refuses: come back in a second
                await deny(scope, send, 503, e.code, e.message, e.hint, [(b"retry-after", b"1")])
                return
            found = UNAUTHORIZED  # health, readiness and the document need no one: answered
        principal = found if isinstance(found, Principal) else None
        if principal is None and not _open(path):
            assert isinstance(found, tuple)
            unauthorized = found[0] == 401
            refused = presented is not None
            await deny(scope, send, *found, [challenge(refused=refused)] if unauthorized else [])
            return
        if principal is not None and not _open(path):
            refusal = _scope_refusal(principal, scope.get("method", "GET"), path)
            if refusal is not None:
                await deny(scope, send, *refusal)
                return
        state["principal"] = principal or EVERYONE
        await self.app(scope, receive, send)

    async def _principal(self, presented: str | None) -> Principal | tuple[int, str, str, str]:
        """Who presented this: a token, a key, the claim, or (on an open node) anyone; else
        the refusal."""
        if presented is not None and presented.startswith(CLAIM_PREFIX):
            if not self.keys.claim_matches(presented):
                return UNAUTHORIZED
            if self.keys.claim_spent:
                return CLAIM_SPENT
            return CLAIMANT
        if presented is not None and presented.startswith(PREFIX):
            row = await self.keys.verify(presented)
            if row is not None:
                agents = None if row.agents is None else frozenset(row.agents)
                return Principal(
                    agents=agents, scope=cast(scopes.Scope, row.scope), key_id=row.key_id
                )
        found = self.tokens.principal(presented)
        if found is not None:
            return found
        if self.tokens.open and await self.keys.is_open():
            return ANYONE
        return UNAUTHORIZED

    def _stream_refusal(
        self, scope: Scope, token: str, state: dict[str, object]
    ) -> tuple[int, str, str, str] | None:
        """Check a stream token (``?st=``): only on the streams, only to read, only while valid
        and signed by this node's secret. On success the caller sees only the token's agent."""
        reads = scope["type"] == "websocket" or scope["method"] in ("GET", "HEAD")
        if reads and asks_private(QueryParams(scope.get("query_string", b""))):
            return PRIVATE_NEEDS_TOKEN
        path = scope["path"]
        stream = path == WEBSOCKET_PATH or SSE_STREAMS.fullmatch(path)
        if not (reads and stream) or self.stream_tokens is None:
            return (403, "stream_token_read_only",
                    f"a stream token cannot be used for {scope.get('method', 'GET')} "
                    f"{scope['path']}", STREAM_READ_ONLY_HINT)  # fmt: skip
        grant = self.stream_tokens.verify(token)
        if not isinstance(grant, StreamGrant):
            return (401, grant.code, grant.message, grant.hint)
        state["principal"] = Principal(frozenset({grant.agent}), stream=grant, scope="read")
        return None


REALM = "dispach"


def challenge(*, refused: bool) -> tuple[bytes, bytes]:
    """The ``WWW-Authenticate`` every 401 carries (RFC 9110 11.6.1): the Bearer scheme of RFC
    6750, with ``error="invalid_token"`` when a token was sent and refused. MCP clients read it
    on ``/v1/mcp``. No ``resource_metadata`` (RFC 9728): the MCP authorization flow it points
    to is OAuth, and this node's tokens are issued by its operator, not by an authorization
    server a client could discover."""
    value = f'Bearer realm="{REALM}"' + (', error="invalid_token"' if refused else "")
    return (b"www-authenticate", value.encode())


UNAUTHORIZED = (
    401,
    "unauthorized",
    "a valid bearer token or API key is required",
    "send `Authorization: Bearer <token or key>` (for a WebSocket: the header, or "
    f'the subprotocols ["{SUBPROTOCOL}", <token>]; for a stream in a browser: a '
    "stream token as ?st=)",
)
CLAIM_SPENT = (
    401,
    "claim_spent",
    "the boot claim was used, or a key exists already",
    "sign in with a key (or DISPACH_API_TOKEN); a node prints a claim only while no key exists",
)


def _scope_refusal(who: Principal, method: str, path: str) -> tuple[int, str, str, str] | None:
    if who.claim:
        if method == "POST" and path == KEYS_PATH:
            return None
        return (403, "claim_only_mints_keys",
                "the boot claim is good for one thing: POST /v1/keys, to mint the first key",
                "mint an admin key with it, then call the API with that key")  # fmt: skip
    needed = scopes.required(method, path)
    if scopes.allows(who.scope, needed):
        return None
    return (403, "scope_insufficient",
            f"{method} {path} needs the scope {needed!r}; this key's scope is {who.scope!r}",
            f"mint a key with scope {needed!r} (or higher: read < chat < write < admin) "
            "and call with it")  # fmt: skip


STREAM_READ_ONLY_HINT = "a stream token only reads streams; send the API token for anything else"
PRIVATE_QUERY = "private"
"""``?private=true``: a turn's stored events with the tool arguments and outputs
(gateways/api/turns.py ``turn_events``)."""
PRIVATE_NEEDS_TOKEN = (
    403,
    "private_needs_token",
    "a stream token never reads private event fields (tool arguments and outputs)",
    "ask with the API token (Authorization: Bearer), from a back end: GET "
    "/v1/agents/{agent}/turns/{turnId}/events?private=true",
)
"""Said to a stream token that asks for private fields, wherever it asks: a browser holds the
stream token, and what a tool was given or returned stays with whoever holds the API token."""


def asks_private(query: QueryParams) -> bool:
    """The request asks for private fields (any value but ``false``: a stream token that asks
    with a malformed value is refused all the same)."""
    value = query.get(PRIVATE_QUERY)
    return value is not None and value != "false"


JSON_TYPES = frozenset({"application/json"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
SSE_STREAMS = re.compile(r"/v1/agents/[^/]+/turns/[^/]+/stream|/v1/events")
"""The SSE streams' paths: a turn's stream and the firehose. A stream token is accepted there
and on the WebSocket."""
WEBSOCKET_PATH = "/v1/ws"


def _body_refusal(scope: Scope, path: str, limit: int) -> tuple[int, str, str, str] | None:
    """A request body must be JSON (a page cannot send that cross-site without a preflight, so
    a ``no-cors`` or form POST never reaches a route) and within the cap. Providers' webhooks
    keep their own content types."""
    if scope["method"] not in _BODY_METHODS:
        return None
    length = header(scope, b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        return (413, "body_too_large", f"the request body is over {limit} bytes",
                "send a smaller body")  # fmt: skip
    if path.startswith(WEBHOOK_PREFIX):
        return None
    declared = header(scope, b"content-type")
    chunked = header(scope, b"transfer-encoding") is not None
    has_body = (length is not None and length != "0") or chunked
    if declared is None and not has_body:
        return None
    media = (declared or "").split(";", 1)[0].strip().lower()
    if media not in JSON_TYPES:
        return (415, "content_type_unsupported",
                f"the body is {media or 'of no declared type'!s}, not application/json",
                "send the body as JSON with `Content-Type: application/json`")  # fmt: skip
    return None


def _open(path: str) -> bool:
    """Paths anyone may call: health, readiness, the API document, providers' webhooks (each
    channel checks its provider's own secret), and the console's files (they hold no data)."""
    return path in OPEN_PATHS or path.startswith(WEBHOOK_PREFIX) or console.is_console(path)


def _presented(scope: Scope, query: QueryParams) -> str | None:
    auth = header(scope, b"authorization") or ""
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    if scope["type"] == "websocket":
        offered = [p.strip() for p in (header(scope, b"sec-websocket-protocol") or "").split(",")]
        if len(offered) >= 2 and offered[0] == SUBPROTOCOL:
            return offered[1]
        token = query.get("token")  # v1 clients (deprecated)
        if token:
            return token
    return None

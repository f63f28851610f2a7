"""Stream tokens: short-lived, read-only credentials for one turn's stream, one session's, or
an agent's (all of its sessions: a grant with neither turn nor session).

A browser's ``EventSource`` cannot send an ``Authorization`` header, so a page whose back end holds
the API token asks ``POST /v1/stream-tokens`` for a token that opens exactly one stream, and hands
that to the browser as ``?st=``. The token is ``st1.<payload>.<mac>``: the payload (agent, turn or
session, expiry) in base64url JSON, the MAC an HMAC-SHA256 over ``st1.<payload>`` with a key
derived from the node secret (``DISPACH_SECRET``, or the one kept in the data directory), compared
in constant time. Nothing is stored: any node with the same secret verifies it. The token grants
reading only (the SSE turn stream, the session firehose, WebSocket subscriptions); the Guard
refuses it anywhere else, and it is never logged (the access log is off and no error echoes it).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import time

import msgspec

PREFIX = "st1"
DEFAULT_TTL_S = 300
MAX_TTL_S = 3600
QUERY = "st"
"""The query parameter that carries a stream token."""
_KEY_LABEL = b"dispach stream token v1"


class StreamGrant(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a stream token lets its bearer read (its signed payload)."""

    agent: str = msgspec.field(name="a")
    turn: str | None = msgspec.field(default=None, name="t")
    session: str | None = msgspec.field(default=None, name="s")
    """Neither turn nor session: the agent's token, for every one of its sessions."""
    expires: int = msgspec.field(name="x")
    """Unix time, seconds."""
    nonce: str = msgspec.field(name="n")


def grant(agent: str, *, turn: str | None, session: str | None, ttl_s: int) -> StreamGrant:
    """A grant for ``ttl_s`` seconds from now (a random nonce makes every token unique)."""
    expires = int(time.time()) + ttl_s
    nonce = _b64(secrets.token_bytes(9))
    return StreamGrant(agent=agent, turn=turn, session=session, expires=expires, nonce=nonce)


class TokenRefused(msgspec.Struct, frozen=True):
    code: str
    message: str
    hint: str


_ENCODE = msgspec.json.Encoder()
_DECODE = msgspec.json.Decoder(StreamGrant)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class StreamTokens:
    """Issues and verifies stream tokens with one node secret."""

    def __init__(self, secret: bytes) -> None:
        self._key = hmac.new(secret, _KEY_LABEL, hashlib.sha256).digest()

    def __repr__(self) -> str:  # the key stays out of logs and tracebacks
        return "StreamTokens(<secret>)"

    def _mac(self, signed: str) -> bytes:
        return hmac.new(self._key, signed.encode(), hashlib.sha256).digest()

    def issue(self, grant: StreamGrant) -> str:
        signed = f"{PREFIX}.{_b64(_ENCODE.encode(grant))}"
        return f"{signed}.{_b64(self._mac(signed))}"

    def verify(self, token: str, now: float | None = None) -> StreamGrant | TokenRefused:
        """The token's grant, or why not (``stream_token_invalid`` for anything not signed by
        this secret, ``stream_token_expired`` past its expiry). A value, not an exception: the
        Guard (gateways/http/auth.py) needs no import of this module."""
        prefix, _, rest = token.partition(".")
        payload, _, mac = rest.partition(".")
        try:
            given = _unb64(mac)
            raw = _unb64(payload)
        except (binascii.Error, ValueError):
            given, raw = b"", b""
        expected = self._mac(f"{prefix}.{payload}")
        if prefix != PREFIX or not hmac.compare_digest(given, expected):
            return TokenRefused(
                "stream_token_invalid",
                "the stream token is not one this node issued (malformed, altered, or signed "
                "with another secret)",
                "ask POST /v1/stream-tokens for a new one; nodes that share a database must "
                "share DISPACH_SECRET",
            )
        try:
            grant = _DECODE.decode(raw)
        except msgspec.DecodeError:  # signed by us, so only another version's shape
            return TokenRefused(
                "stream_token_invalid",
                "the stream token's payload is not understood by this node",
                "ask POST /v1/stream-tokens for a new one",
            )
        if grant.expires <= (time.time() if now is None else now):
            return TokenRefused(
                "stream_token_expired",
                "the stream token has expired",
                "ask POST /v1/stream-tokens for a new one (tokens live 5 minutes by default)",
            )
        return grant

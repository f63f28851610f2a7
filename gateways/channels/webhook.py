"""The webhook channel: each chunk is POSTed as signed JSON to a configured URL.

Wire contract (docs/channels.md): the body is deterministic for an item (a resend carries the
same bytes), with headers ``Idempotency-Key`` (the item's derived key), ``X-Dispach-Timestamp``
(Unix seconds) and ``X-Dispach-Signature: v1=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>``;
``X-Dispach-Attempt`` counts attempts and ``X-Dispach-Uncertain: 1`` marks a resend of an item
that may have arrived already (after a crash, or a send whose answer was lost). The receiver
deduplicates by key, so the channel is declared idempotent: such a resend is exact. It is flagged
all the same (``delivery.uncertain``, ``uncertain: true`` on the record, the header), since the
record cannot know the receiver kept its promise, and ``on_uncertain: skip`` is honoured as on
any channel. What an answer (or its absence) says is gateways/channels/post.py's.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Mapping
from typing import Annotated, Literal

import msgspec

from actors.outbox import Outbound, SendResult
from gateways.channels.config import ChannelKind, ChannelSettings, secret
from gateways.channels.post import OutboundOnly, Poster


class WebhookConfig(ChannelSettings, frozen=True, kw_only=True, tag="webhook", tag_field="type"):
    url: str
    secret_env: str = "DISPACH_WEBHOOK_SECRET"  # noqa: S105 - the name of a variable
    max_message_chars: Annotated[int, msgspec.Meta(ge=64)] = 100_000
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=120)] = 10.0
    concurrency: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 64


def build(agent_id: str, config: WebhookConfig, env: Mapping[str, str]) -> WebhookChannel:
    return WebhookChannel(config, secret(agent_id, config.id, config.secret_env, env))


class _Chunk(msgspec.Struct, frozen=True):
    index: int
    total: int


class _Payload(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    id: str
    agent_id: str
    session_key: str
    turn_id: str
    to: str
    thread: str | None = None
    chunk: _Chunk
    text: str


_ENCODE = msgspec.json.Encoder()


class WebhookChannel(OutboundOnly):
    type = "webhook"
    ordered = False
    idempotent = True

    def __init__(self, config: WebhookConfig, secret: str) -> None:
        self.id = config.id
        self.on_uncertain: Literal["resend", "skip"] = config.on_uncertain
        self.max_chars = config.max_message_chars
        self.backoff_s = tuple(config.backoff_s)
        self.concurrency = config.concurrency
        self.measure: Callable[[str], int] = len
        self.allow_from: frozenset[str] = frozenset()
        self.singleton: str | None = None
        self._url = config.url
        self._secret = secret.encode()
        self._poster = Poster(config.timeout_s, config.concurrency)

    def __repr__(self) -> str:  # the secret stays out of logs and tracebacks
        return f"WebhookChannel(id={self.id!r}, url={self._url!r})"

    def target_problem(self, to: str, thread: str | None) -> str | None:
        return None  # `to` is a label for the receiver: anything goes

    async def aclose(self) -> None:
        await self._poster.aclose()

    def sign(self, body: bytes, timestamp: int) -> str:
        mac = hmac.new(self._secret, f"{timestamp}.".encode() + body, hashlib.sha256)
        return "v1=" + mac.hexdigest()

    async def send(self, item: Outbound) -> SendResult:
        body = _ENCODE.encode(
            _Payload(
                id=item.key, agent_id=item.agent_id, session_key=item.session_key,
                turn_id=item.turn_id, to=item.to, thread=item.thread,
                chunk=_Chunk(item.chunk_index, item.chunk_total), text=item.text,
            )
        )  # fmt: skip
        timestamp = int(time.time())
        headers = {
            "content-type": "application/json",
            "idempotency-key": item.key,
            "x-dispach-timestamp": str(timestamp),
            "x-dispach-signature": self.sign(body, timestamp),
            "x-dispach-attempt": str(item.attempt),
        }
        if item.uncertain:
            headers["x-dispach-uncertain"] = "1"
        return await self._poster.post(self._url, body, headers)


KIND = ChannelKind(WebhookConfig, build)
"""Outbound only: it takes no messages in."""

"""The webhook channel: each chunk is POSTed as signed JSON to a configured URL.

Wire contract (docs/channels.md): the body is deterministic for an item (a resend carries the
same bytes), with headers ``Idempotency-Key`` (the item's derived key), ``X-Dispach-Timestamp``
(Unix seconds) and ``X-Dispach-Signature: v1=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>``;
``X-Dispach-Attempt`` counts attempts and ``X-Dispach-Uncertain: 1`` marks a resend of an item
that may have arrived already (after a crash, or a send whose answer was lost). The receiver
deduplicates by key, so the channel is declared idempotent: such a resend is exact. It is flagged
all the same (``delivery.uncertain``, ``uncertain: true`` on the record, the header), since the
record cannot know the receiver kept its promise, and ``on_uncertain: skip`` is honoured as on
any channel. An answer is the receiver's word (2xx kept; anything else not), so only a lost
answer is in doubt, and a connection that never opened is retried blindly.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Mapping
from email.utils import parsedate_to_datetime
from typing import Annotated, Literal

import aiohttp
import msgspec

from actors.outbox import Inbound, Outbound, SendResult
from gateways.channels.config import ChannelKind, ChannelSettings, secret


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

NOT_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError, aiohttp.InvalidURL)
"""Raised before a byte of the request went out: no connection (refused, DNS, TLS, proxy), none
in time, or no URL to connect to. aiohttp never resends a POST on its own (it retries a dropped
keep-alive connection only for idempotent methods), so every other failure may follow a request
the receiver read."""


class WebhookChannel:
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
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        self._session: aiohttp.ClientSession | None = None
        """Made on the first send: a session belongs to the event loop it is made on."""

    def __repr__(self) -> str:  # the secret stays out of logs and tracebacks
        return f"WebhookChannel(id={self.id!r}, url={self._url!r})"

    def target_problem(self, to: str, thread: str | None) -> str | None:
        return None  # `to` is a label for the receiver: anything goes

    async def start(self, inbound: Inbound) -> None:
        return None  # outbound only

    async def stop(self) -> None:
        return None

    async def pause(self, paused: bool) -> None:
        return None  # nothing comes in

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _client(self) -> aiohttp.ClientSession:
        # aiohttp, not httpx2: measured on the outbox bench, its client costs ~0.17 ms of CPU
        # per POST against httpx2's ~0.9 ms (its pool polls every idle connection per request),
        # which capped the drain at ~280 items/s.
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.concurrency),
                timeout=self._timeout,
                raise_for_status=False,
            )
        return self._session

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
        try:
            async with self._client().post(
                self._url, data=body, headers=headers, allow_redirects=False
            ) as response:
                return outcome(response.status, await response.read(), response.headers)
        except NOT_SENT as e:  # before TimeoutError: a connect timeout is one
            return SendResult(ok=False, retryable=True, code="delivery_unreachable",
                              error=f"{type(e).__name__}: {e}")  # fmt: skip
        except TimeoutError as e:
            return SendResult(ok=False, retryable=True, in_doubt=True, code="delivery_timeout",
                              error=f"the webhook did not answer in time: {e!r}")  # fmt: skip
        except aiohttp.ClientError as e:
            # Reset, or closed before an answer: the receiver may or may not have the item.
            return SendResult(ok=False, retryable=True, in_doubt=True,
                              code="delivery_connection_lost",
                              error=f"{type(e).__name__}: {e}")  # fmt: skip


def outcome(status: int, raw: bytes, headers: Mapping[str, str]) -> SendResult:
    if 200 <= status < 300:
        provider_id = None
        try:
            answer = msgspec.json.decode(raw) if raw else None
            if isinstance(answer, dict) and isinstance(answer.get("id"), str | int):
                provider_id = str(answer["id"])
        except msgspec.DecodeError:
            pass
        return SendResult(ok=True, provider_message_id=provider_id)
    detail = raw[:200].decode("utf-8", "replace")
    retry_after = _retry_after(headers.get("retry-after"))
    if status in (408, 425, 429) or status >= 500:
        return SendResult(ok=False, retryable=True, code=f"delivery_http_{status}",
                          error=f"the webhook answered {status}: {detail}",
                          retry_after_s=retry_after)  # fmt: skip
    # Any other 4xx (and a redirect, which is not followed) will not get better by retrying.
    return SendResult(ok=False, retryable=False, code=f"delivery_http_{status}",
                      error=f"the webhook answered {status}: {detail}")  # fmt: skip


def _retry_after(value: str | None) -> float | None:
    """Retry-After as seconds: a number, or an HTTP date."""
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        return max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
    except (TypeError, ValueError):
        return None


KIND = ChannelKind(WebhookConfig, build)
"""Outbound only: it takes no messages in."""

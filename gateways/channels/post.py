"""One POST to a receiver that answers for itself, for the outbound HTTP channels (the webhook
channel, gateways/channels/webhook.py, and the event webhooks, gateways/webhooks/channel.py):
the client they send with and what an attempt's end says of the item.

The receiver's answer is its word: 2xx delivered; 408, 425, 429 and 5xx retried (honouring
``Retry-After``); any other 4xx, and a redirect (never followed), dead. A request that never went
out is retried blindly; only a lost answer (a timeout, a connection cut after the request was
written) leaves the item in doubt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from email.utils import parsedate_to_datetime

import aiohttp
import aiohttp.abc
import msgspec

from actors.outbox import Inbound, SendResult

NOT_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError, aiohttp.InvalidURL)
"""Raised before a byte of the request went out: no connection (refused, DNS, TLS, proxy), none
in time, or no URL to connect to. aiohttp never resends a POST on its own (it retries a dropped
keep-alive connection only for idempotent methods), so every other failure may follow a request
the receiver read."""


class OutboundOnly:
    """The lifecycle of a channel that takes nothing in: nothing to start, stop or pause."""

    async def start(self, inbound: Inbound) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def pause(self, paused: bool) -> None:
        return None


class Poster:
    """A channel's POSTs: one aiohttp session, made on the first send (a session and a resolver
    belong to the event loop they are made on), at most ``concurrency`` connections; ``resolver``
    makes the connector's resolver (None: aiohttp's own).

    aiohttp, not httpx2: measured on the outbox bench, its client costs ~0.17 ms of CPU per POST
    against httpx2's ~0.9 ms (its pool polls every idle connection per request), which capped
    the drain at ~280 items/s."""

    def __init__(
        self,
        timeout_s: float,
        concurrency: int,
        resolver: Callable[[], aiohttp.abc.AbstractResolver] | None = None,
    ) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._concurrency = concurrency
        self._resolver = resolver
        self._session: aiohttp.ClientSession | None = None

    async def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        not_sent: Callable[[Exception], SendResult | None] | None = None,
    ) -> SendResult:
        """One attempt, never raising for the network or the receiver. ``not_sent`` may give
        its own result for a request that never went out (a refused target, say)."""
        try:
            async with self._client().post(
                url, data=body, headers=headers, allow_redirects=False
            ) as response:
                return outcome(response.status, await response.read(), response.headers)
        except NOT_SENT as e:  # before TimeoutError: a connect timeout is one
            own = not_sent(e) if not_sent is not None else None
            return own or SendResult(ok=False, retryable=True, code="delivery_unreachable",
                                     error=f"{type(e).__name__}: {e}")  # fmt: skip
        except TimeoutError as e:
            return SendResult(ok=False, retryable=True, in_doubt=True, code="delivery_timeout",
                              error=f"the webhook did not answer in time: {e!r}")  # fmt: skip
        except aiohttp.ClientError as e:
            # Reset, or closed before an answer: the receiver may or may not have the item.
            return SendResult(ok=False, retryable=True, in_doubt=True,
                              code="delivery_connection_lost",
                              error=f"{type(e).__name__}: {e}")  # fmt: skip

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            resolver = self._resolver() if self._resolver is not None else None
            connector = aiohttp.TCPConnector(limit=self._concurrency, resolver=resolver)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, raise_for_status=False
            )
        return self._session


def outcome(status: int, raw: bytes, headers: Mapping[str, str]) -> SendResult:
    """What the receiver's answer says of the item."""
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

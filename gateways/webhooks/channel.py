"""The transport of event webhooks: the outbox channel ``webhooks`` (one for the node; an
item's recipient is its subscription). Each item is one event, POSTed as the JSON the fan-out
made (actors/webhooks/plan.py), signed as Standard Webhooks signs:

- ``webhook-id``: the delivery's id (stable: a resend carries the same id and the same body),
- ``webhook-timestamp``: Unix seconds,
- ``webhook-signature``: ``v1,`` + base64 HMAC-SHA256 over ``<id>.<timestamp>.<body>`` with the
  secret's key (the secret is ``whsec_`` + base64 of the key),
- ``webhook-attempt``: the attempt's number, and ``webhook-redelivery: 1`` on a resend of a
  delivery whose earlier POST went unanswered (it may have arrived: deduplicate by id).

The receiver's answer is its word (2xx delivered; 408, 425, 429, 5xx retried; other 4xx dead);
only a lost answer is in doubt (gateways/channels/post.py, as for the webhook channel).
The target is checked against the policy at every attempt, on the addresses it connects to.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from typing import Literal
from urllib.parse import urlsplit

from actors.outbox import Outbound, SendResult
from actors.webhooks.plan import CHANNEL
from eventstore import EventStore, StoreError
from eventstore import webhooks as table
from gateways.channels.post import OutboundOnly, Poster
from gateways.webhooks.target import (
    CheckedResolver,
    TargetPolicy,
    TargetRefused,
    literal,
    refusal,
)

PREFIX = "whsec_"


def new_secret() -> str:
    return PREFIX + base64.b64encode(secrets.token_bytes(24)).decode()


def sign(secret: str, delivery_id: str, timestamp: int, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix(PREFIX))
    mac = hmac.new(key, f"{delivery_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


class SubscriptionChannel(OutboundOnly):
    type = "webhook"
    id = CHANNEL
    ordered = True
    """One subscription's deliveries go in log order, each after the last is settled."""
    idempotent = True
    """The receiver deduplicates by ``webhook-id``: a flagged resend is exact."""
    on_uncertain: Literal["resend", "skip"] = "resend"
    max_chars = 1 << 30
    allow_from: frozenset[str] = frozenset()
    singleton: str | None = None

    def __init__(
        self,
        store: EventStore,
        policy: TargetPolicy,
        backoff_s: tuple[float, ...],
        *,
        timeout_s: float = 10.0,
        concurrency: int = 64,
    ) -> None:
        self._store = store
        self._policy = policy
        self.backoff_s = backoff_s
        self.concurrency = concurrency
        self.measure: Callable[[str], int] = len
        self._poster = Poster(timeout_s, concurrency, lambda: CheckedResolver(policy))

    def __repr__(self) -> str:
        return "SubscriptionChannel()"

    def target_problem(self, to: str, thread: str | None) -> str | None:
        return "a webhook subscription is not a reply's recipient"

    async def aclose(self) -> None:
        await self._poster.aclose()

    async def send(self, item: Outbound) -> SendResult:
        try:
            found = await table.target(self._store, item.to)
        except StoreError as e:
            return SendResult(ok=False, retryable=True, code="delivery_store_unavailable",
                              error=e.message)  # fmt: skip
        if found is None or found.deleted:
            return SendResult(ok=False, code="webhook_deleted",
                              error=f"the subscription {item.to} was deleted")  # fmt: skip
        host = urlsplit(found.url).hostname or ""
        if literal(host) and (why := refusal(self._policy, host, [host])) is not None:
            return _refused(why)
        body = item.text.encode()
        timestamp = int(time.time())
        headers = {
            "content-type": "application/json",
            "webhook-id": item.key,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(found.secret, item.key, timestamp, body),
            "webhook-attempt": str(item.attempt),
        }
        if item.uncertain:
            headers["webhook-redelivery"] = "1"
        return await self._poster.post(found.url, body, headers, not_sent=_refused_target)


def _refused_target(e: Exception) -> SendResult | None:
    """A connection the resolver refused: the policy's word, not the network's."""
    refused = getattr(e, "os_error", None)
    return _refused(str(refused)) if isinstance(refused, TargetRefused) else None


def _refused(why: str) -> SendResult:
    """Retried (DNS may change back) until the bound, then dead: never sent inside."""
    return SendResult(ok=False, retryable=True, code="webhook_target_refused", error=why)

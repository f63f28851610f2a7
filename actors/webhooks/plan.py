"""What a webhook subscription is sent, as pure functions: which event types it may name, which
events of the log it wants, and the outbox item each one becomes.

A subscription names types (``turn.end``), prefixes (``turn.*``) or ``*``. ``model.chunk`` is
never sent (a delta stream is not for a POST per delta) and cannot be named. Every event is sent
as the public stream shows it (:func:`eventstore.envelope.encode_wire`: no tool arguments). A
webhook delivery's own ``delivery.*`` events, and the fan-out's promises, are never sent: a
subscription to ``delivery.*`` would otherwise feed itself.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable, Sequence

import msgspec

from eventstore import Metadata, NewEvent
from eventstore.catalogue import DeliveryEnqueued
from eventstore.envelope import RecordedEvent, encode_wire
from eventstore.event import REGISTRY
from eventstore.webhooks import Live

CHANNEL = "webhooks"
"""The outbox channel every webhook delivery goes through (recipient: the subscription)."""
NEVER = frozenset({"model.chunk"})
"""Types no subscription may name, nor be sent."""
_FEED = "webhookfeed"
_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"
_IDS = uuid.UUID("6f1d6a52-5a4e-4b8e-9a53-2f0c3c9e7a11")


def pattern_problem(pattern: str) -> tuple[str, str] | None:
    """Why ``pattern`` cannot be subscribed to, as ``(code, message)``, or None."""
    if pattern in NEVER:
        return "webhook_type_refused", f"{pattern!r} is never sent to a webhook"
    if pattern == "*":
        return None
    if pattern.endswith(".*"):
        prefix = pattern[:-1]
        if any(t.startswith(prefix) and t not in NEVER for t in REGISTRY):
            return None
        return "webhook_type_invalid", f"{pattern!r} matches no event type"
    if pattern not in REGISTRY:
        return "webhook_type_invalid", f"{pattern!r} is not an event type"
    return None


def subscribable() -> list[str]:
    """Every pattern a subscription may name: ``*``, each prefix, each type (the document's
    enum)."""
    types = sorted(t for t in REGISTRY if t not in NEVER)
    prefixes = sorted({t.rsplit(".", 1)[0] + ".*" for t in types if "." in t})
    return ["*", *prefixes, *types]


def matches(patterns: Iterable[str], type_name: str) -> bool:
    if type_name in NEVER:
        return False
    for p in patterns:
        if p in ("*", type_name) or (p.endswith(".*") and type_name.startswith(p[:-1])):
            return True
    return False


def own(event: RecordedEvent) -> bool:
    """The webhooks' own traffic: never fanned out."""
    if event.category == _FEED:
        return True
    return (
        event.type.startswith("delivery.")
        and event.metadata.agent_id is None  # an agent's own channel may be named so too
        and getattr(event.data, "channel_id", "") == CHANNEL
    )


def wants(sub: Live, event: RecordedEvent) -> bool:
    if event.checkpoint <= sub.cursor or own(event) or not matches(sub.events, event.type):
        return False
    return sub.agents is None or event.metadata.agent_id in sub.agents


def item_key(webhook_id: str, event_id: str) -> str:
    """A delivery's id (the ``webhook-id`` header), derived, so the same event promised twice
    to a subscription is one item: ``w_`` + 25 base36 digits of a SHA-256."""
    digest = hashlib.sha256(f"{webhook_id}\0{event_id}".encode()).digest()[:16]
    number, digits = int.from_bytes(digest, "big"), ""
    while number:
        number, r = divmod(number, 36)
        digits = _ALPHABET[r] + digits
    return "w_" + digits.rjust(25, "0")[-25:]


class _Body(msgspec.Struct, frozen=True, rename="camel"):
    id: str
    webhook_id: str
    type: str
    event: msgspec.Raw


_ENCODE = msgspec.json.Encoder()


def body(delivery_id: str, webhook_id: str, event: RecordedEvent) -> str:
    """The POST's JSON: the delivery's id, the subscription, the event's type and the event as
    the public stream shows it (its ``id``, ``cursor``, ``position``, ``agentId``, ``data``)."""
    wire = msgspec.Raw(encode_wire(event))
    return _ENCODE.encode(_Body(delivery_id, webhook_id, event.type, wire)).decode()


def promise(sub: Live, event: RecordedEvent) -> NewEvent:
    """The ``delivery.enqueued`` that promises ``event`` to ``sub``: its event id is derived
    too, so a fan-out that read the same events again (after a crash, or two during a lease
    hand-over) appends nothing new (the log answers a known id with the stored event)."""
    key = item_key(sub.webhook_id, str(event.event_id))
    enqueued = DeliveryEnqueued(
        channel_id=CHANNEL, to=sub.webhook_id, key=key, chunk_index=0, chunk_total=1,
        text=body(key, sub.webhook_id, event), ordered=True,
    )  # fmt: skip
    return NewEvent(
        event=enqueued,
        metadata=Metadata(causation_id=str(event.event_id)),
        event_id=uuid.uuid5(_IDS, key),
    )


def backoff_schedule(base_s: float, attempts: int, cap_s: float = 3600.0) -> tuple[float, ...]:
    """Pauses before the 2nd ... ``attempts``-th attempt: doubling from ``base_s``, capped (the
    outbox adds ±20 % jitter); after the last, a delivery is dead."""
    return tuple(min(base_s * 2**i, cap_s) for i in range(max(attempts - 1, 0)))


def fan(subs: Sequence[Live], events: Sequence[RecordedEvent]) -> dict[str, list[NewEvent]]:
    """Each subscription's promises for a page of events, in log order."""
    out: dict[str, list[NewEvent]] = {}
    for event in events:
        for sub in subs:
            if wants(sub, event):
                out.setdefault(sub.webhook_id, []).append(promise(sub, event))
    return out

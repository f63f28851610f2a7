"""Delivery of a reply through the outbox (stream ``outbox-<itemId>``; the enqueue is in the
turn's stream, in the same commit as its end)."""

from __future__ import annotations

from typing import ClassVar

from eventstore.event import Event, register

# --- delivery (stream outbox-<itemId>) -----------------------------------------------------------


class DeliveryEnqueued(Event, frozen=True):
    """One chunk of a reply promised to a channel: appended to the turn's stream in the same
    transaction as its ``turn.end``, so a reply is never lost between the two. ``key`` is the
    outbox item's id, derived from (agent, session, turn, channel, recipient, chunk): enqueueing
    the same reply again names the same items. Later events of the item are in
    ``outbox-<key>``."""

    TYPE: ClassVar[str] = "delivery.enqueued"
    channel_id: str
    to: str
    key: str
    chunk_index: int
    chunk_total: int
    text: str
    thread: str | None = None
    ordered: bool = False
    """The channel keeps a recipient's replies in order (a chat): this item waits for every
    earlier item to the same recipient, not only for the earlier chunks of its own reply."""


class DeliveryAttempted(Event, frozen=True):
    """Committed before the send: after a crash it marks a send whose outcome is unknown."""

    TYPE: ClassVar[str] = "delivery.attempted"
    channel_id: str
    chunk_index: int
    chunk_total: int
    attempt: int
    node: str = ""


class DeliverySent(Event, frozen=True):
    TYPE: ClassVar[str] = "delivery.sent"
    channel_id: str
    chunk_index: int
    chunk_total: int
    attempts: int
    provider_message_id: str | None = None
    uncertain: bool = False


class DeliveryRetry(Event, frozen=True):
    TYPE: ClassVar[str] = "delivery.retry"
    channel_id: str
    chunk_index: int
    attempts: int
    delay_ms: int
    error: str
    code: str = ""


class DeliveryFailed(Event, frozen=True):
    TYPE: ClassVar[str] = "delivery.failed"
    channel_id: str
    chunk_index: int
    chunk_total: int
    attempts: int
    exhausted: bool
    abandoned: int
    error: str
    code: str = ""


class DeliveryUncertain(Event, frozen=True):
    """An item whose send may have reached the provider with no answer to say so: after a crash
    in its send window (at the next start), or when the send's connection dropped or timed out
    after the request went out."""

    TYPE: ClassVar[str] = "delivery.uncertain"
    channel_id: str
    chunk_index: int
    chunk_total: int
    attempts: int
    idempotent_send: bool
    resend: bool = True
    """False when the channel says ``on_uncertain: skip`` (or the attempts are used up): the item
    is settled as uncertain, never sent again."""
    code: str = ""
    """Why it is in doubt: ``delivery_interrupted`` (the node died in the send window; empty in
    events from before this field), or the send's failure (``delivery_connection_lost``,
    ``delivery_timeout``, ``telegram_500``, ...)."""
    error: str = ""
    delay_ms: int = 0
    """With ``resend``: the pause before the resend (the channel's backoff)."""


register(
    DeliveryEnqueued,
    DeliveryAttempted,
    DeliverySent,
    DeliveryRetry,
    DeliveryFailed,
    DeliveryUncertain,
)

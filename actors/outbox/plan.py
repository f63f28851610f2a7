"""The outbox's decisions, as pure functions: what a reply becomes (enqueue), and what a send's
outcome becomes (sent, a retry after a pause, a failure, or uncertain when it may have been
taken)."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence

import msgspec

from actors.outbox.channel import Channel, Outbound, SendResult
from actors.outbox.chunks import split
from eventstore.catalogue import (
    Deliver,
    DeliveryEnqueued,
    DeliveryFailed,
    DeliveryRetry,
    DeliverySent,
    DeliveryUncertain,
    EndReason,
)

_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"
_MAX_RETRY_AFTER_S = 3600.0
_JITTER = 0.2

UNFINISHED_NOTE = {
    "timeout": "Sorry, I ran out of time before I could answer.",
    "max_steps": "Sorry, I could not finish this within my step limit.",
    "output_limit": "Sorry, my answer ran past its length limit.",
    "truncated": "Sorry, my answer ran past its length limit.",
    "refused": "Sorry, I can't help with that.",
    "error": "Sorry, something went wrong and I could not answer.",
}
"""What a person on a channel is told when a turn ended with no text: silence reads as being
ignored. A stopped turn without text says nothing (someone stopped it on purpose)."""


class Item(msgspec.Struct, frozen=True, kw_only=True):
    """An outbox row, as the actor reads it."""

    item_id: str
    agent_id: str
    session_key: str
    turn_id: str
    channel_id: str
    recipient: str
    thread: str | None
    chunk_index: int
    chunk_total: int
    body: str
    status: str
    attempts: int
    uncertain: bool
    version: int


def item_key(
    agent_id: str, session_key: str, turn_id: str, deliver: Deliver, chunk_index: int
) -> str:
    """An item's id, derived from what it is (never generated), so the same reply enqueued twice
    names the same items: ``o_`` + 25 base36 digits of a SHA-256 (a valid stream and subject
    token, and no user text in it)."""
    parts = [agent_id, session_key, turn_id, deliver.channel, deliver.to, deliver.thread or "",
             str(chunk_index)]  # fmt: skip
    number = int.from_bytes(hashlib.sha256("\0".join(parts).encode()).digest()[:16], "big")
    digits = ""
    while number:
        number, r = divmod(number, 36)
        digits = _ALPHABET[r] + digits
    return "o_" + digits.rjust(25, "0")[-25:]


def reply_text(text: str, reason: EndReason) -> str:
    if text.strip():
        return text
    return UNFINISHED_NOTE.get(reason, "")


def enqueue(
    deliver: Deliver,
    *,
    max_chars: int,
    measure: Callable[[str], int],
    ordered: bool = False,
    agent_id: str,
    session_key: str,
    turn_id: str,
    text: str,
) -> list[DeliveryEnqueued]:
    """The items of a reply: one per chunk, in order (empty for a blank reply)."""
    chunks = split(text, max_chars, measure)
    return [
        DeliveryEnqueued(
            channel_id=deliver.channel,
            to=deliver.to,
            thread=deliver.thread,
            key=item_key(agent_id, session_key, turn_id, deliver, index),
            chunk_index=index,
            chunk_total=len(chunks),
            text=chunk,
            ordered=ordered,
        )
        for index, chunk in enumerate(chunks)
    ]


def outbound(item: Item, attempt: int) -> Outbound:
    return Outbound(
        key=item.item_id, agent_id=item.agent_id, session_key=item.session_key,
        turn_id=item.turn_id, to=item.recipient, thread=item.thread, text=item.body,
        chunk_index=item.chunk_index, chunk_total=item.chunk_total, attempt=attempt,
        uncertain=item.uncertain,
    )  # fmt: skip


def backoff(
    schedule: Sequence[float], attempts: int, retry_after_s: float | None, rng: random.Random
) -> float:
    """Seconds to wait before attempt ``attempts + 1``: the provider's ask if it made one (kept
    exactly, capped at an hour), else the schedule's pause with ±20 % jitter so a fleet of items
    that failed together does not retry together."""
    if retry_after_s is not None:
        return min(max(retry_after_s, 0.0), _MAX_RETRY_AFTER_S)
    base = schedule[min(attempts - 1, len(schedule) - 1)] if schedule else 1.0
    return base * (1 + rng.uniform(-_JITTER, _JITTER))


def settle(
    item: Item, channel: Channel, attempt: int, result: SendResult, rng: random.Random
) -> DeliverySent | DeliveryRetry | DeliveryFailed | DeliveryUncertain:
    """The event that records a send's outcome. A send in doubt (it may have been taken) is never
    retried blindly: it is uncertain, and resent flagged only where the channel says
    ``on_uncertain: resend`` and attempts are left; otherwise it is settled as uncertain (not
    failed: it may well have arrived)."""
    if result.ok:
        return DeliverySent(
            channel_id=item.channel_id, chunk_index=item.chunk_index,
            chunk_total=item.chunk_total, attempts=attempt,
            provider_message_id=result.provider_message_id, uncertain=item.uncertain,
        )  # fmt: skip
    exhausted = attempt >= len(channel.backoff_s) + 1
    if result.in_doubt:
        resend = channel.on_uncertain == "resend" and not exhausted
        delay = backoff(channel.backoff_s, attempt, result.retry_after_s, rng) if resend else 0.0
        return DeliveryUncertain(
            channel_id=item.channel_id, chunk_index=item.chunk_index,
            chunk_total=item.chunk_total, attempts=attempt, idempotent_send=channel.idempotent,
            resend=resend, code=result.code, error=result.error, delay_ms=round(delay * 1000),
        )  # fmt: skip
    if result.retryable and not exhausted:
        delay = backoff(channel.backoff_s, attempt, result.retry_after_s, rng)
        return DeliveryRetry(
            channel_id=item.channel_id, chunk_index=item.chunk_index, attempts=attempt,
            delay_ms=round(delay * 1000), error=result.error, code=result.code,
        )  # fmt: skip
    return DeliveryFailed(
        channel_id=item.channel_id, chunk_index=item.chunk_index, chunk_total=item.chunk_total,
        attempts=attempt, exhausted=result.retryable, error=result.error, code=result.code,
        abandoned=item.chunk_total - item.chunk_index - 1,
    )  # fmt: skip

"""The outbox projection: one row per outbox item, folded from its ``delivery.*`` events.

An item is born by ``delivery.enqueued`` in its turn's stream (in the transaction of the turn's
``turn.end``) and lives on in ``outbox-<itemId>``, whose only writer is the outbox actor. The row
is what the actor works from (which items are due) and what recovery reads after a crash; like
every projection it can be rebuilt from the log.

A row holds its chunk's text (``body``) only while it may still be sent: the actor reads it from
pending and in-flight rows alone (actors/outbox/sql/due.sql, inflight.sql), and the deliveries
page never shows it. The statement that settles an item (sent, failed, uncertain without a
resend) sets it to NULL; the text stays in the item's ``delivery.enqueued`` (migration 0015).
"""

from __future__ import annotations

from collections.abc import Iterable

from eventstore import streams
from eventstore.catalogue import (
    DeliveryAttempted,
    DeliveryEnqueued,
    DeliveryFailed,
    DeliveryRetry,
    DeliverySent,
    DeliveryUncertain,
)
from eventstore.envelope import RecordedEvent
from eventstore.projector import Statement

ABANDONED = "delivery_chunk_abandoned"


def group_key(turn_id: str, channel_id: str, to: str, thread: str | None) -> str:
    """The chunks of one reply to one recipient: sent in order, abandoned together."""
    return "|".join([turn_id, channel_id, to, thread or ""])


def _item(event: RecordedEvent) -> str:
    return event.stream.removeprefix("outbox-")


class OutboxProjection:
    name: str = "outbox"
    tables: tuple[str, ...] = ("outbox",)
    types: frozenset[str] = frozenset(
        t.TYPE
        for t in (
            DeliveryEnqueued,
            DeliveryAttempted,
            DeliverySent,
            DeliveryRetry,
            DeliveryFailed,
            DeliveryUncertain,
        )
    )

    def statements(self, event: RecordedEvent) -> Iterable[Statement]:
        at, meta = event.recorded_at, event.metadata
        if not isinstance(event.data, DeliveryEnqueued) and streams.category(event.stream) != (
            "outbox"
        ):
            return []
        item = _item(event)
        match event.data:
            case DeliveryEnqueued() as e:
                turn_id = meta.turn_id or ""
                return [
                    (
                        """INSERT INTO outbox (item_id, agent_id, session_key, turn_id,
                                  channel_id, recipient, thread, group_key, chunk_index,
                                  chunk_total, ordered, position, body, status,
                                  next_attempt_at, created_at, updated_at)
                           VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s,
                                   'pending', %s, %s, %s)
                           ON CONFLICT (item_id) DO NOTHING""",
                        [e.key, meta.agent_id or "", meta.session_key or "", turn_id,
                         e.channel_id, e.to, e.thread,
                         group_key(turn_id, e.channel_id, e.to, e.thread), e.chunk_index,
                         e.chunk_total, e.ordered, event.position, e.text, at, at, at],
                    )
                ]  # fmt: skip
            case DeliveryAttempted(attempt=attempt, node=node):
                return [
                    (
                        """UPDATE outbox SET status = 'inflight', attempts = %s, version = %s,
                                  node = %s, updated_at = %s
                            WHERE item_id = %s""",
                        [attempt, event.version, node, at, item],
                    )
                ]
            case DeliverySent() as e:
                return [
                    (
                        """UPDATE outbox SET status = 'sent', attempts = %s, body = NULL,
                                  provider_message_id = %s, uncertain = uncertain OR %s,
                                  error_code = NULL, error = NULL, version = %s, updated_at = %s
                            WHERE item_id = %s""",
                        [e.attempts, e.provider_message_id, e.uncertain, event.version, at, item],
                    )
                ]
            case DeliveryRetry() as e:
                return [
                    (
                        """UPDATE outbox SET status = 'pending', attempts = %s,
                                  next_attempt_at = %s + make_interval(secs => %s / 1000.0),
                                  error_code = %s, error = %s, version = %s, updated_at = %s
                            WHERE item_id = %s""",
                        [e.attempts, at, e.delay_ms, e.code or None, e.error, event.version, at,
                         item],
                    )
                ]  # fmt: skip
            case DeliveryFailed() as e:
                # Half a message is worse than none: the later chunks of the reply go with it
                # (they are all still pending, since a chunk waits for its predecessor).
                return [
                    (
                        """UPDATE outbox SET status = 'failed', attempts = %s, error_code = %s,
                                  error = %s, version = %s, updated_at = %s, body = NULL
                            WHERE item_id = %s""",
                        [e.attempts, e.code or None, e.error, event.version, at, item],
                    ),
                    (
                        """UPDATE outbox o SET status = 'failed', error_code = %s, body = NULL,
                                  error = 'an earlier chunk of this reply failed', updated_at = %s
                             FROM outbox f
                            WHERE f.item_id = %s AND o.group_key = f.group_key
                              AND o.chunk_index > f.chunk_index AND o.status = 'pending'""",
                        [ABANDONED, at, item],
                    ),
                ]
            case DeliveryUncertain() as e:
                return [
                    (
                        """UPDATE outbox SET uncertain = true, attempts = %s,
                                  status = CASE WHEN %s THEN 'pending' ELSE 'uncertain' END,
                                  body = CASE WHEN %s THEN body END,
                                  next_attempt_at = %s + make_interval(secs => %s / 1000.0),
                                  error_code = %s, error = %s, version = %s, updated_at = %s
                            WHERE item_id = %s""",
                        [e.attempts, e.resend, e.resend, at, e.delay_ms, e.code or None,
                         e.error or None, event.version, at, item],
                    )
                ]  # fmt: skip
        return []

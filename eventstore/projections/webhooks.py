"""The webhooks projection: each subscription (``webhook-<id>``), and which event each of its
deliveries carries (the ``delivery.enqueued`` of ``webhookfeed-<id>``; where the delivery stands
is the outbox's row of the same item). Inline: ``POST /v1/webhooks`` answers with the row."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from eventstore import streams
from eventstore.catalogue import DeliveryEnqueued, WebhookCreated, WebhookDeleted
from eventstore.envelope import RecordedEvent
from eventstore.projector import Statement


class _Carried(msgspec.Struct, frozen=True):
    id: str
    type: str
    cursor: str


class _Body(msgspec.Struct, frozen=True):
    """What the projection reads of a delivery's body (actors/webhooks/plan.py writes it)."""

    event: _Carried


_BODY = msgspec.json.Decoder(_Body)


class WebhooksProjection:
    name: str = "webhooks"
    tables: tuple[str, ...] = ("webhooks", "webhook_deliveries")
    types: frozenset[str] = frozenset(
        {WebhookCreated.TYPE, WebhookDeleted.TYPE, DeliveryEnqueued.TYPE}
    )

    def statements(self, event: RecordedEvent) -> Iterable[Statement]:
        at = event.recorded_at
        match event.data:
            case WebhookCreated() as e:
                return [
                    (
                        """INSERT INTO webhooks (webhook_id, url, events, agents, description,
                                  created_at, created_txid, created_position, version)
                           VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)
                           ON CONFLICT (webhook_id) DO NOTHING""",
                        [e.webhook_id, e.url, e.events, e.agents, e.description, at,
                         event.txid, event.position, event.version],
                    )
                ]  # fmt: skip
            case WebhookDeleted(webhook_id=webhook_id):
                return [
                    (
                        """UPDATE webhooks SET deleted_at = %s, version = %s
                            WHERE webhook_id = %s""",
                        [at, event.version, webhook_id],
                    )
                ]
            case DeliveryEnqueued(key=key, text=text) if (
                streams.category(event.stream) == "webhookfeed"
            ):
                carried = _BODY.decode(text).event
                return [
                    (
                        """INSERT INTO webhook_deliveries (item_id, webhook_id, event_id,
                                  event_type, cursor, position)
                           VALUES (%s, %s, %s, %s, %s, %s)
                           ON CONFLICT (item_id) DO NOTHING""",
                        [key, event.stream.removeprefix("webhookfeed-"), carried.id,
                         carried.type, carried.cursor, event.position],
                    )
                ]  # fmt: skip
        return []

"""Outbound event webhooks' events (issue 37): a subscription is made and removed in its own
stream, ``webhook-<id>``. Its signing secret is never in an event (it is kept beside the
projection, in ``webhook_secrets``: eventstore/webhooks.py). What each subscription is sent is
promised by ``delivery.enqueued`` events in ``webhookfeed-<id>`` (actors/webhooks/fanout.py), and
lives on as outbox items (channel ``webhooks``, recipient the subscription)."""

from __future__ import annotations

from typing import ClassVar

from eventstore.event import Event, register


class WebhookCreated(Event, frozen=True):
    """A subscription: the events it wants (types, or prefixes such as ``turn.*``), the agents
    (None: every agent) and where they go. Events after this one in the log are delivered."""

    TYPE: ClassVar[str] = "webhook.created"
    webhook_id: str
    url: str
    events: list[str]
    agents: list[str] | None = None
    description: str | None = None


class WebhookDeleted(Event, frozen=True):
    """The subscription is gone: nothing more is promised to it, and what was promised and not
    yet sent is settled dead (``webhook_deleted``)."""

    TYPE: ClassVar[str] = "webhook.deleted"
    webhook_id: str


register(WebhookCreated, WebhookDeleted)

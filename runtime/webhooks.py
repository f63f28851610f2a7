"""The node's outbound event webhooks, wired: the outbox channel that delivers them, and the
fan-out, run by one node at a time under the ``webhooks`` singleton lease.

Configuration (README; read in runtime/config.py, ``Settings.webhook_*``):
``DISPACH_WEBHOOK_ALLOW_PRIVATE`` (1: any target), ``DISPACH_WEBHOOK_ALLOW`` (host names and
CIDRs allowed although internal), ``DISPACH_WEBHOOK_MAX_ATTEMPTS`` (default 8; then a delivery
is dead), ``DISPACH_WEBHOOK_BACKOFF_SECONDS`` (the first pause, doubled each time; default 1),
``DISPACH_WEBHOOK_TIMEOUT_SECONDS`` (one POST; default 10).
"""

from __future__ import annotations

from typing import NamedTuple

from actors.cluster.ownership import Ownership
from actors.webhooks.fanout import Fanout
from actors.webhooks.plan import CHANNEL, backoff_schedule
from eventstore import EventStore
from eventstore.feed import Feed
from gateways.webhooks.channel import SubscriptionChannel
from runtime.config import Settings

__all__ = ["CHANNEL", "Webhooks", "start"]


class Webhooks(NamedTuple):
    channel: SubscriptionChannel
    """The outbox channel that delivers them."""
    fanout: Fanout
    """What promises the log's events to them (running where the lease is)."""


def start(settings: Settings, store: EventStore, feed: Feed, ownership: Ownership) -> Webhooks:
    backoff = backoff_schedule(settings.webhook_backoff_seconds, settings.webhook_max_attempts)
    channel = SubscriptionChannel(store, settings.webhook_policy, backoff,
                                  timeout_s=settings.webhook_timeout_seconds)  # fmt: skip
    fanout = Fanout(store, feed)
    ownership.singleton("webhooks", fanout.start, fanout.stop)
    return Webhooks(channel, fanout)

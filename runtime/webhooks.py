"""The node's outbound event webhooks, wired: the target policy the API checks subscriptions
against, the outbox channel that delivers them, and the fan-out, run by one node at a time
under the ``webhooks`` singleton lease.

Configuration (README): ``DISPACH_WEBHOOK_ALLOW_PRIVATE`` (1: any target), ``DISPACH_WEBHOOK_ALLOW``
(host names and CIDRs allowed although internal), ``DISPACH_WEBHOOK_MAX_ATTEMPTS`` (default 8;
then a delivery is dead), ``DISPACH_WEBHOOK_BACKOFF_SECONDS`` (the first pause, doubled each
time; default 1), ``DISPACH_WEBHOOK_TIMEOUT_SECONDS`` (one POST; default 10).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from actors.cluster.ownership import Ownership
from actors.webhooks.fanout import Fanout
from actors.webhooks.plan import CHANNEL, backoff_schedule
from eventstore import EventStore
from eventstore.feed import Feed
from gateways.webhooks.channel import SubscriptionChannel
from gateways.webhooks.target import TargetPolicy
from runtime.errors import ConfigError

__all__ = ["CHANNEL", "Webhooks", "policy", "start"]


def _number(env: Mapping[str, str], name: str, default: float, low: float, high: float) -> float:
    raw = env.get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise ConfigError(f"{name}={raw!r} is out of range", f"use {low:g} to {high:g}", name)
    return value


def policy(env: Mapping[str, str]) -> TargetPolicy:
    return TargetPolicy.from_env(env)


class Webhooks(NamedTuple):
    channel: SubscriptionChannel
    """The outbox channel that delivers them."""
    fanout: Fanout
    """What promises the log's events to them (running where the lease is)."""


def start(env: Mapping[str, str], store: EventStore, feed: Feed, ownership: Ownership) -> Webhooks:
    attempts = int(_number(env, "DISPACH_WEBHOOK_MAX_ATTEMPTS", 8, 1, 100))
    base = _number(env, "DISPACH_WEBHOOK_BACKOFF_SECONDS", 1.0, 0.01, 3600)
    timeout = _number(env, "DISPACH_WEBHOOK_TIMEOUT_SECONDS", 10.0, 0.1, 120)
    channel = SubscriptionChannel(
        store, policy(env), backoff_schedule(base, attempts), timeout_s=timeout
    )
    fanout = Fanout(store, feed)
    ownership.singleton("webhooks", fanout.start, fanout.stop)
    return Webhooks(channel, fanout)

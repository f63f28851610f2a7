"""Stream names: ``category-id`` (Message DB's convention), one writer per stream."""

from __future__ import annotations

from eventstore.subjects import session_token


def category(stream: str) -> str:
    return stream.split("-", 1)[0]


def turn(turn_id: str) -> str:
    return f"turn-{turn_id}"


def session(agent_id: str, session_key: str) -> str:
    return f"session-{agent_id}-{session_token(session_key)}"


def outbox(item_id: str) -> str:
    return f"outbox-{item_id}"


def schedule(agent_id: str, schedule_id: str) -> str:
    return f"schedule-{agent_id}-{schedule_id}"


def channel(agent_id: str, channel_id: str) -> str:
    return f"channel-{agent_id}-{channel_id}"


def agent(agent_id: str) -> str:
    """An agent's lifecycle: ``agent.reloaded``, ``agent.stopped``, ``agent.started``."""
    return f"agent-{agent_id}"


def webhook(webhook_id: str) -> str:
    """A webhook subscription's lifecycle: ``webhook.created``, ``webhook.deleted``."""
    return f"webhook-{webhook_id}"


def webhook_feed(webhook_id: str) -> str:
    """What a subscription is promised: one ``delivery.enqueued`` per event it is sent."""
    return f"webhookfeed-{webhook_id}"

"""Every NATS subject Dispach uses, built in one place (DESIGN.md 5).

It lives in the lowest package so that the store (commit hints), the actors (commands) and the
gateways (ingress) all build subjects the same way. Tokens never contain raw user text: agent ids
are validated slugs, session keys appear only as a hash, and anything else unsafe is hashed too.
"""

from __future__ import annotations

import hashlib
import re

PREFIX = "dispach"
_SAFE = re.compile(r"[A-Za-z0-9_-]{1,64}")
NONE = "_"


def token(value: str | None) -> str:
    """A subject token for an identifier: itself when it is a plain slug, else a hash of it."""
    if value is None:
        return NONE
    if _SAFE.fullmatch(value):
        return value
    return "h" + hashlib.sha256(value.encode()).hexdigest()[:24]


def session_token(session_key: str) -> str:
    """The stable, opaque token of a session key (used in subjects and stream names)."""
    return hashlib.sha256(session_key.encode()).hexdigest()[:24]


def events(agent_id: str | None, session_key: str | None, turn_id: str | None) -> str:
    """Post-commit hint: some events about this agent, session and turn were committed."""
    session = NONE if session_key is None else session_token(session_key)
    return f"{PREFIX}.events.{token(agent_id)}.{session}.{token(turn_id)}"


def events_filter(agent_id: str | None = None, session_key: str | None = None) -> str:
    """A wildcard subject matching the hints of one agent (and session), or of everything."""
    if agent_id is None:
        return f"{PREFIX}.events.>"
    if session_key is None:
        return f"{PREFIX}.events.{token(agent_id)}.>"
    return f"{PREFIX}.events.{token(agent_id)}.{session_token(session_key)}.>"


def ingress(agent_id: str) -> str:
    """Request/reply for internal producers submitting a message to an agent."""
    return f"{PREFIX}.ingress.{token(agent_id)}"


def session(agent_id: str, session_key: str) -> str:
    return f"{PREFIX}.session.{token(agent_id)}.{session_token(session_key)}"


def session_admin(agent_id: str, session_key: str) -> str:
    """Commands about a session other than a message (clearing it)."""
    return f"{PREFIX}.sessionadmin.{token(agent_id)}.{session_token(session_key)}"


def turn(turn_id: str) -> str:
    return f"{PREFIX}.turn.{token(turn_id)}"


def approval(agent_id: str) -> str:
    """Answers to approval requests of an agent's turns (any node finds the turn's session)."""
    return f"{PREFIX}.approval.{token(agent_id)}"


def outbox(channel: str) -> str:
    """Replies were promised to ``channel``: outboxes on other nodes look now, not at their poll."""
    return f"{PREFIX}.outbox.{token(channel)}"


OUTBOX_ALL = f"{PREFIX}.outbox.*"

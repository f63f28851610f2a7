"""Every NATS subject Dispach uses, built in one place (DESIGN.md 5).

It lives in the lowest package so that the store (commit hints), the actors (commands) and the
gateways (ingress) all build subjects the same way. Tokens never contain raw user text: agent ids
are validated slugs, session keys appear only as a hash, and anything else unsafe is hashed too.
"""

from __future__ import annotations

import functools
import hashlib
import re

DEFAULT_CLUSTER = "dispach"
CLUSTER_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
"""A deployment name: a subject token and a JetStream bucket name alike."""
PREFIX = DEFAULT_CLUSTER
"""The first token of every subject: the deployment's name (DISPACH_CLUSTER), set once at start
by :func:`use`, so that two deployments on one NATS cluster never hear each other."""
_SAFE = re.compile(r"[A-Za-z0-9_-]{1,64}")
NONE = "_"


def use(cluster: str) -> None:
    """Name the deployment every subject (and queue group, and bucket) belongs to."""
    global PREFIX  # noqa: PLW0603 - one deployment per process, named once at start
    if not CLUSTER_NAME.fullmatch(cluster):
        raise ValueError(f"{cluster!r} is not a deployment name")
    PREFIX = cluster


def queue(name: str) -> str:
    """A queue group of this deployment."""
    return f"{PREFIX}-{name}"


def bucket(name: str) -> str:
    """A JetStream key-value bucket of this deployment."""
    return f"{PREFIX}-{name}"


def token(value: str | None) -> str:
    """A subject token for an identifier: itself when it is a plain slug, else a hash of it."""
    if value is None:
        return NONE
    if _SAFE.fullmatch(value):
        return value
    return "h" + hashlib.sha256(value.encode()).hexdigest()[:24]


@functools.lru_cache(maxsize=4096)  # asked for several times per turn, of a few live sessions
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


def node_commands(node_id: str) -> str:
    """Commands for the sessions a node owns: ``<prefix>.node.<node>.<kind>.<partition>``
    (actors/cluster/commands.py)."""
    return f"{PREFIX}.node.{token(node_id)}"


def node_command(node_id: str, kind: str, partition: int) -> str:
    return f"{node_commands(node_id)}.{kind}.{partition}"


def cluster_changed() -> str:
    """A lease was given back: every node reads the lease bucket now."""
    return f"{PREFIX}.cluster.changed"


def agents_changed() -> str:
    """An agent's stream has a new event (reloaded, stopped, started): every node folds it from
    the log now rather than at its next poll (runtime/lifecycle.py). Carries the agent's id."""
    return f"{PREFIX}.agents.changed"


def outbox(channel: str) -> str:
    """Replies were promised to ``channel``: outboxes on other nodes look now, not at their poll."""
    return f"{PREFIX}.outbox.{token(channel)}"


def outbox_all() -> str:
    return f"{PREFIX}.outbox.*"


def ingress_all() -> str:
    return f"{PREFIX}.ingress.*"


def keys_changed() -> str:
    """An API key was minted or revoked: every node drops its cached copy of it now (the cache's
    age bound is the fallback when this is lost; gateways/http/keys.py)."""
    return f"{PREFIX}.keys.changed"


def activity() -> str:
    """Request to every node: answer what it is doing (``GET /v1/activity``, gathered by the
    asking node; actors/cluster/activity.py)."""
    return f"{PREFIX}.activity"

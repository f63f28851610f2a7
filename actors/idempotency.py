"""Idempotent acceptance: a message sent twice with one ``Idempotency-Key`` is one turn.

The key is claimed by the acceptance itself. A keyed turn's id is derived from the agent and the
key (:func:`actors.ids.keyed_turn_id`), and its ``turn.start`` is appended to a stream that must
not exist yet; so of two racing acceptances with one key, however many nodes they reach, exactly
one commits and the other collides on the stream. Whoever collides, or finds the turn already
there, answers from the stored ``turn.start``: a replay of the first acceptance when the request
is the same, ``idempotency_key_reused`` when it is not. Keys are remembered as long as the log
keeps the turn (at least 24 hours, as the API promises; in practice until the turn is archived).
"""

from __future__ import annotations

import hashlib

import msgspec

from actors import ids
from actors.messages import Accepted, Refused
from eventstore import EventStore, streams
from eventstore.catalogue import Deliver, TurnStart

MAX_KEY = 255
_ENCODE = msgspec.json.Encoder(order="deterministic")


def key_problem(key: str) -> str | None:
    """Why ``key`` is not a valid ``Idempotency-Key`` (1-255 printable ASCII), or None."""
    if not 1 <= len(key) <= MAX_KEY:
        return f"is {len(key)} characters long; use 1 to {MAX_KEY}"
    if not all(" " <= c <= "~" for c in key):
        return "has characters outside printable ASCII"
    return None


def key_refused(key: str) -> Refused | None:
    """The refusal of an invalid ``Idempotency-Key``, or None (every door and the engine use it)."""
    problem = key_problem(key)
    if problem is None:
        return None
    return Refused(
        code="idempotency_key_invalid",
        message=f"the Idempotency-Key {problem}",
        hint="send 1-255 printable ASCII characters, e.g. a UUID",
        field="Idempotency-Key",
    )


def request_hash(session_key: str, text: str, deliver: Deliver | None) -> str:
    """What a replay must repeat: the text, the session and the delivery target."""
    body = _ENCODE.encode([session_key, text, deliver])
    return hashlib.sha256(body).hexdigest()


def replay(turn_id: str, stored: TurnStart, session_key: str, digest: str) -> Accepted | Refused:
    """The answer to a keyed request whose turn already exists (``stored`` is its turn.start)."""
    if stored.request_hash == digest:
        return Accepted(turn_id=turn_id, session_key=session_key, replayed=True)
    return Refused(
        code="idempotency_key_reused",
        message=f"this Idempotency-Key was already used for turn {turn_id} with another request",
        hint="send the same text, session and delivery to replay it, or use a new key for a "
        "new message",
        field="Idempotency-Key",
    )


async def stored(store: EventStore, turn_id: str, digest: str) -> Accepted | Refused | None:
    """The answer for a keyed request whose turn is already stored, or None if it is not."""
    first = await store.aread_stream(streams.turn(turn_id), 0, 1)
    if not first or not isinstance(first[0].data, TurnStart):
        return None
    return replay(turn_id, first[0].data, first[0].metadata.session_key or "", digest)


async def look_up(
    store: EventStore, agent_id: str, key: str, session_key: str, text: str, deliver: Deliver | None
) -> Accepted | Refused | None:
    """What a request with ``key`` would be answered from the log: its turn if stored (see
    :func:`replay`), None if no turn holds the key yet. A gateway whose acceptance timed out
    asks this (gateways/api/acceptance.py)."""
    digest = request_hash(session_key, text, deliver)
    return await stored(store, ids.keyed_turn_id(agent_id, key), digest)

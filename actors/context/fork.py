"""Forking a session: the history a new session starts from, read from the source session's
read models as committed (the turns and messages projections, both inline), and the
``session.forked`` event that carries it to the new session's stream.

Reading here, on the node that owns the new session, keeps the command small on the wire (a
long history does not travel over NATS twice) and leaves the source session alone: nothing is
asked of its actor and nothing is appended to its streams. Its turns up to the one asked for
have all ended (a session runs one turn at a time, and that one must have ended), so their rows
no longer change; only a clear could take them away, and it shows in the same snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Any

import msgspec

from actors.messages import Forked, ForkSession, Refused
from eventstore import EventStore
from eventstore.catalogue import ForkedMessage, SessionForked

_SQL = resources.files("actors.context").joinpath("sql")
_TURNS = _SQL.joinpath("fork_turns.sql").read_text().encode()
_ROWS = _SQL.joinpath("fork_rows.sql").read_text().encode()
_SESSION = _SQL.joinpath("fork_session.sql").read_text().encode()
_JSON = msgspec.json.Decoder(Any)


@dataclass(frozen=True)
class Plan:
    """What the new session's actor appends, and what the caller is answered once it is."""

    event: SessionForked
    answer: Forked


async def plan(store: EventStore, fork: ForkSession) -> Plan | Refused:
    """The fork of ``fork``'s source at its turn, or why there is none."""
    source = {"agent_id": fork.source_agent_id, "session_key": fork.source_session_key}
    turns = [(t, s, status) for t, s, status in await store.afetch(_TURNS, source)]
    if not turns and not await store.afetch(_SESSION, source):
        return Refused(
            code="session_not_found",
            message=f"agent {fork.source_agent_id!r} has no session {fork.source_session_key!r}",
            hint=f"GET /v1/agents/{fork.source_agent_id}/sessions lists them",
            field="sessionKey",
        )
    found = _turn(turns, fork.at_turn)
    if found is None:
        return _no_turn(fork, len(turns))
    turn_id, start, status = found
    if status == "running":
        return Refused(
            code="turn_not_ended",
            message=f"turn {turn_id} of session {fork.source_session_key!r} is still running",
            hint="wait for its turn.end (or stop it), then fork at it",
            field="atTurn",
        )
    rows = await store.afetch(_ROWS, {**source, "through": start})
    if not any(row[0] == turn_id for row in rows):
        return Refused(
            code="fork_turn_cleared",
            message=f"session {fork.source_session_key!r} was cleared after turn {turn_id}: its "
            "history up to that turn is gone",
            hint="fork at a turn accepted after the clear (GET /v1/agents/"
            f"{fork.source_agent_id}/turns?sessionKey=... lists the session's turns)",
            field="atTurn",
        )
    messages = [
        ForkedMessage(turn_id=t, position=position, role=role, content=_JSON.decode(text))
        for t, position, role, text, ran in rows
        if ran
    ]
    copied = list(dict.fromkeys(m.turn_id for m in messages))
    event = SessionForked(
        source_agent_id=fork.source_agent_id,
        source_session_key=fork.source_session_key,
        at_turn_id=turn_id,
        turns=copied,
        messages=messages,
    )
    answer = Forked(
        agent_id=fork.agent_id,
        session_key=fork.session_key,
        source_agent_id=fork.source_agent_id,
        source_session_key=fork.source_session_key,
        turn_id=turn_id,
        turns=len(copied),
        messages=len(messages),
    )
    return Plan(event, answer)


async def taken(store: EventStore, agent_id: str, session_key: str) -> Refused | None:
    """Why the session cannot be a fork's (it has a history of its own already), or None."""
    found = await store.afetch(_SESSION, {"agent_id": agent_id, "session_key": session_key})
    return exists(agent_id, session_key) if found else None


def exists(agent_id: str, session_key: str) -> Refused:
    return Refused(
        code="session_exists",
        message=f"agent {agent_id!r} already has a session {session_key!r}",
        hint="a fork starts a new session: name one that has no turns in newKey, or leave "
        "newKey out for a generated one",
        field="newKey",
    )


def _turn(turns: list[tuple[str, int, str]], at: str | int) -> tuple[str, int, str] | None:
    if isinstance(at, int):
        return turns[at - 1] if 1 <= at <= len(turns) else None
    return next((t for t in turns if t[0] == at), None)


def _no_turn(fork: ForkSession, count: int) -> Refused:
    key = fork.source_session_key
    if isinstance(fork.at_turn, int):
        turns = "1 turn" if count == 1 else f"{count} turns"
        message = f"session {key!r} has {turns}, no turn {fork.at_turn}"
    else:
        message = f"session {key!r} has no turn {fork.at_turn!r}"
    return Refused(
        code="turn_not_found",
        message=message,
        hint=f"GET /v1/agents/{fork.source_agent_id}/turns?sessionKey=... lists the session's "
        "turns; atTurn is one of their turnIds or an index from 1 (the oldest)",
        field="atTurn",
    )

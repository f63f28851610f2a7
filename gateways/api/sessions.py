"""Sessions and their history: ``/v1/agents/{agent}/sessions[/{key}[/messages]]``, read from the
sessions and messages projections; clearing goes to the session's actor (``session.cleared``)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from actors.messages import ClearSession, Refused, SetPhase
from gateways.api.common import (
    MAX_PAGE,
    ApiError,
    agent,
    commands_of,
    decode_body,
    fetch,
    int_param,
    read_body,
    refused,
)
from gateways.api.schemas import (
    AgentDetail,
    ClearedBody,
    ForkOrigin,
    MessagePage,
    PhaseBody,
    PhaseSet,
    SessionSummary,
    StoredMessage,
)
from gateways.api.turns import STATUSES
from gateways.http.errors import ErrorEnvelope, json_response
from gateways.http.operation import AGENT, KEY, LIMIT, Operation, answer, array, param


async def list_sessions(request: Request) -> Response:
    """``GET …/sessions?q&status&limit``: most recently active first; ``q`` a part of the key
    (case aside), ``status`` that of the session's last turn (``running`` or an end reason)."""
    agent_id = agent(request).id
    limit = int_param(request, "limit", 100, 1, MAX_PAGE, "sessions_page_invalid")
    status = request.query_params.get("status")
    if status is not None and status not in STATUSES:
        raise ApiError(
            400,
            "invalid_value",
            f"status={status!r} is not a turn status",
            f"use one of: {', '.join(STATUSES)}",
            "status",
        )
    rows = await fetch(
        request,
        "sessions",
        {"agent_id": agent_id, "session_key": None, "limit": limit,
         "q": request.query_params.get("q") or None, "status": status},
    )  # fmt: skip
    target = agent(request)
    return json_response([_session(r, target) for r in rows])


LIST_SESSIONS = Operation(
    "GET",
    "/v1/agents/{agent}/sessions",
    list_sessions,
    "Sessions, most recently active first",
    {"200": answer(array(SessionSummary), "Sessions")},
    params=[
        AGENT,
        param(
            "q",
            "query",
            "Only sessions whose key contains this (case-insensitive, literally)",
            required=False,
        ),
        param(
            "status",
            "query",
            "Only sessions whose last turn has this status",
            {"type": "string", "enum": list(STATUSES)},
            required=False,
        ),
        LIMIT,
    ],
)


async def get_session(request: Request) -> Response:
    target = agent(request)
    agent_id = target.id
    key = request.path_params["key"]
    rows = await fetch(
        request,
        "sessions",
        {"agent_id": agent_id, "session_key": key, "limit": 1, "q": None, "status": None},
    )
    if not rows:
        raise ApiError(
            404,
            "session_not_found",
            f"agent {agent_id!r} has no session {key!r}",
            "GET /v1/agents/{agent}/sessions lists them",
            "sessionKey",
        )
    return json_response(_session(rows[0], target))


GET_SESSION = Operation(
    "GET",
    "/v1/agents/{agent}/sessions/{key}",
    get_session,
    "One session",
    {"200": answer(SessionSummary, "The session")},
    params=[AGENT, KEY],
)


def _session(row: tuple[Any, ...], target: AgentDetail) -> SessionSummary:
    agent_id, key, turns, messages, first, last, last_turn, cleared = row[:8]
    last_status, last_at, phase = row[8:11]  # the last turn's status and start (sessions.sql)
    origin = row[-1]  # forked_from, the query's last column (see sessions.sql)
    return SessionSummary(
        agent_id=agent_id,
        session_key=key,
        turns=turns,
        messages=messages,
        created_at=first,
        updated_at=last,
        last_activity_at=last,
        last_turn_id=last_turn,
        cleared_at=cleared,
        last_turn_status=last_status,
        last_turn_at=last_at,
        forked_from=None if origin is None else msgspec.json.decode(origin, type=ForkOrigin),
        phase=_resolved(phase, target),
    )


def _resolved(phase: str | None, target: AgentDetail) -> str | None:
    """The phase a session is in: its stored one while the agent declares it, else the entry
    phase (a phase renamed since); None for an agent without phases."""
    if not target.phases:
        return None
    return phase if phase in target.phases else target.entry_phase


async def session_messages(request: Request) -> Response:
    agent_id = agent(request).id
    key = request.path_params["key"]
    limit = int_param(request, "limit", 50, 1, MAX_PAGE, "messages_page_invalid")
    raw_before = request.query_params.get("before")
    before = None
    if raw_before is not None:
        before = int_param(request, "before", 0, 1, 2**62, "messages_page_invalid")
    rows = await fetch(
        request,
        "messages",
        {"agent_id": agent_id, "session_key": key, "before": before, "limit": limit},
    )
    messages = [stored_message(r) for r in rows]
    return json_response(
        MessagePage(
            messages=messages, next_before=messages[-1].id if len(messages) == limit else None
        )
    )


SESSION_MESSAGES = Operation(
    "GET",
    "/v1/agents/{agent}/sessions/{key}/messages",
    session_messages,
    "History, newest first",
    {"200": answer(MessagePage, "A page")},
    params=[
        AGENT,
        KEY,
        param(
            "before",
            "query",
            "nextBefore of the previous page",
            {"type": "integer", "minimum": 1, "maximum": 2**62},
            required=False,
        ),
        LIMIT,
    ],
)


def stored_message(row: tuple[Any, ...]) -> StoredMessage:
    position, key, turn_id, role, content_text, at = row
    content = json.loads(content_text)
    common = {"id": position, "session_key": key, "turn_id": turn_id, "created_at": at}
    if role == "user":
        return StoredMessage(role="user", content=content.get("text", ""), **common)
    if role == "tool":
        body = content.get("content", "")
        text = body if isinstance(body, str) else json.dumps(body)
        return StoredMessage(
            role="tool",
            content=text,
            tool_call_id=content.get("tool_use_id"),
            origin="observation",
            is_error=bool(content.get("is_error")),
            **common,
        )
    blocks = content if isinstance(content, list) else [content]
    text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
    calls = [
        {"id": b.get("id", ""), "name": b.get("name", "")}
        for b in blocks
        if b.get("type") == "tool_use"
    ]
    return StoredMessage(
        role="assistant",
        content=text,
        tool_calls=calls or None,
        origin="call" if calls else None,
        **common,
    )


async def clear_session(request: Request) -> Response:
    agent_id = agent(request).id
    key = request.path_params["key"]
    result = await commands_of(request).clear(
        ClearSession(agent_id=agent_id, session_key=key, by="api")
    )
    if isinstance(result, Refused):
        raise refused(result)
    return json_response(ClearedBody(cleared=result.session_key, memory_files_kept=True))


CLEAR_SESSION = Operation(
    "DELETE",
    "/v1/agents/{agent}/sessions/{key}",
    clear_session,
    "Clear the session's history (appends session.cleared)",
    {"200": answer(ClearedBody, "Cleared"), "409": answer(ErrorEnvelope, "A turn is running")},
    params=[AGENT, KEY],
)
CLEAR_MESSAGES = Operation(
    "DELETE",
    "/v1/agents/{agent}/sessions/{key}/messages",
    clear_session,
    "Clear the session's history",
    {"200": answer(ClearedBody, "Cleared"), "409": answer(ErrorEnvelope, "A turn is running")},
    params=[AGENT, KEY],
)


PHASE_INVALID = Refused(code="phase_invalid",
                        message="`phase` must be a string, or null for the entry phase",
                        hint='send {"phase": "triage"} or {"phase": null}',
                        field="phase")  # fmt: skip


async def set_phase(request: Request) -> Response:
    """``POST …/sessions/{key}/phase``: moves the session to a phase its agent declares (null:
    the entry phase), as ``phase.changed`` (``by: api``) in the session's stream; its next turn
    sees that phase's tools (a running turn keeps the phase it is in). A phase the agent does
    not declare is ``400 phase_invalid``, naming the declared ones."""
    target = agent(request)
    key = request.path_params["key"]
    body = decode_body(await read_body(request, 10_000), PhaseBody,
                       lambda field, text: PHASE_INVALID)  # fmt: skip
    declared = target.phases
    to = target.entry_phase if body.phase is None else body.phase
    if to is None or to not in declared:
        raise ApiError(
            400,
            "phase_invalid",
            f"agent {target.id!r} declares no phase {body.phase!r}"
            if declared else f"agent {target.id!r} declares no phases",
            f"phases of {target.id!r}: {', '.join(declared)}" if declared
            else "declare `phases` in the agent's manifest (docs/agents.md) to scope its tools",
            "phase",
        )  # fmt: skip
    rows = await fetch(request, "sessions",
                       {"agent_id": target.id, "session_key": key, "limit": 1, "q": None,
                        "status": None})  # fmt: skip
    left = _resolved(rows[0][10] if rows else None, target)
    # The session's owner appends it (any node may be asked): fenced by its partition's epoch
    # and ordered with the session's other events, as a clear is.
    moved = await commands_of(request).set_phase(
        SetPhase(agent_id=target.id, session_key=key, to=to, left=left, tools=declared[to])
    )
    if isinstance(moved, Refused):
        raise refused(moved)
    return json_response(PhaseSet(phase=moved.phase, tools=declared[to]))


SET_PHASE = Operation(
    "POST",
    "/v1/agents/{agent}/sessions/{key}/phase",
    set_phase,
    "Move the session to a phase its agent declares (null: the entry phase); its next turn "
    "sees that phase's tools. `400 phase_invalid` for any other",
    {"200": answer(PhaseSet, "The session's phase now")},
    params=[AGENT, KEY],
    body=PhaseBody,
    errors=("400", "401", "404", "413", "415", "503"),
)

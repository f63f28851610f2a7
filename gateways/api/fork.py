"""``POST /v1/agents/{agent}/sessions/{key}/fork``: a new session whose history is this session's
up to and including one of its turns, to try another turn from there (with the same agent, or
with another one: the same agent under a changed manifest, say).

Checked here: the body, the new key, and the agents this caller may see. The command then goes
to the new session's owner, which reads the source's history from the read models
(actors/context/fork.py) and has the new session's actor append ``session.forked``. The source
session is not touched: no event, no actor.
"""

from __future__ import annotations

import secrets

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from actors.messages import ForkSession, Refused
from gateways import ingress
from gateways.api.common import commands_of, decode_body, read_body, refused, visible_agent
from gateways.api.schemas import ForkBody, ForkedBody, ForkSource
from gateways.http.errors import ErrorEnvelope, json_response
from gateways.http.operation import AGENT, KEY, Operation, answer

MAX_INDEX = 2**62
"""The largest ``atTurn`` index taken (no session has that many turns: past the count it is
``turn_not_found``, past this ``fork_invalid``)."""
_SUFFIX = len(".fork-") + 6

FORK_INVALID_HINT = (
    'send {"atTurn": "<a turnId of the session>"} or {"atTurn": <n>}, n counting the '
    "session's turns from 1 (the oldest)"
)


async def fork_session(request: Request) -> Response:
    # The path's agent is named by no field: `agent` is the body's (the new session's).
    source = visible_agent(request, request.path_params["agent"], None)
    key = request.path_params["key"]
    body: ForkBody = decode_body(await read_body(request, 10_000), ForkBody, _misfit)
    at_turn = _at_turn(body.at_turn)
    target = source if body.agent is None else visible_agent(request, body.agent, "agent")
    new_key = default_key(key) if body.new_key is None else body.new_key
    problem = ingress.session_key_problem(new_key)
    if problem is not None:
        raise refused(msgspec.structs.replace(problem, field="newKey"))
    result = await commands_of(request).fork(
        ForkSession(
            agent_id=target.id,
            session_key=new_key,
            source_agent_id=source.id,
            source_session_key=key,
            at_turn=at_turn,
        )
    )
    if isinstance(result, Refused):
        raise refused(result)
    origin = ForkSource(agent_id=result.source_agent_id, session_key=result.source_session_key,
                        turn_id=result.turn_id, turns=result.turns)  # fmt: skip
    answer = ForkedBody(agent_id=result.agent_id, session_key=result.session_key,
                        forked_from=origin, messages=result.messages)  # fmt: skip
    return json_response(answer, 201)


FORK_SESSION = Operation(
    "POST",
    "/v1/agents/{agent}/sessions/{key}/fork",
    fork_session,
    "Fork the session: a new session (of this agent or another) whose history is this one's "
    "up to and including a turn (appends session.forked to it)",
    {
        "201": answer(ForkedBody, "Forked"),
        "409": answer(
            ErrorEnvelope,
            "The turn still runs, or was cleared; the new session exists or is busy",
        ),
    },
    params=[AGENT, KEY],
    body=ForkBody,
    errors=("400", "401", "404", "413", "415", "503"),
)


def default_key(key: str) -> str:
    """``<key>.fork-<6 hex digits>``, the key shortened so that the whole stays a valid key."""
    return f"{key[: ingress.MAX_SESSION_KEY - _SUFFIX]}.fork-{secrets.token_hex(3)}"


def _at_turn(value: int | float | str) -> int | str:
    if isinstance(value, float):
        if not value.is_integer():
            raise refused(_invalid(f"`atTurn` is {value}: a turn index is a whole number"))
        value = int(value)
    if isinstance(value, int) and not 1 <= value <= MAX_INDEX:
        raise refused(_invalid(f"`atTurn` is {value}: turn indexes start at 1"))
    if isinstance(value, str) and not value:
        raise refused(_invalid("`atTurn` is empty"))
    return value


def _misfit(field: str | None, detail: str) -> Refused | None:
    """The body's codes of its own: ``fork_invalid`` for ``atTurn`` (missing, or not a number or
    a string), ``session_key_invalid`` for a ``newKey`` that is not a string."""
    if field == "atTurn":
        return _invalid(f"`atTurn` does not fit: {detail}")
    if field == "newKey":
        return Refused(code="session_key_invalid", message=f"`newKey` does not fit: {detail}",
                       hint="send the new session's key as a string, or leave it out",
                       field="newKey")  # fmt: skip
    return None


def _invalid(message: str) -> Refused:
    return Refused(code="fork_invalid", message=message, hint=FORK_INVALID_HINT, field="atTurn")

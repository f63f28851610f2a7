"""``GET /v1/agents/{agent}/context`` and ``GET …/turns/{turnId}/context``: what the model reads.

The first is the context the next turn of a session would assemble, block by block with its
tokens (for an input too, with ``?input=``, as in Dispach v1): "why did it do that?" starts
here. The second rebuilds, from the log alone, what each model call of a past turn was sent.
Both are read by this node's engine: a session's live actor answers with the history it holds,
else the history is rebuilt from the log's read models; no session actor is activated to answer.
"""

from __future__ import annotations

from typing import Protocol

from starlette.requests import Request
from starlette.responses import Response

from actors.messages import Refused, SessionContext, TurnContext
from eventstore import StoreError
from gateways.api.common import ApiError, agent, not_ready, refused, runtime, store_error
from gateways.api.turns import load_turn
from gateways.http.constraints import NO_NUL, SESSION_KEY
from gateways.http.errors import json_response
from gateways.http.operation import AGENT, TURN, Operation, answer, param
from gateways.ingress import MAX_SESSION_KEY

MAX_INPUT = 4000
"""Characters of a previewed input (``?input=``): it travels in the URL, and the server reads
URLs of up to 64 KiB (4,000 characters of 4 bytes percent-encode to 48 KiB)."""


class ContextReader(Protocol):
    """What these routes need of the engine (actors/session/directory.py)."""

    async def context(
        self, agent_id: str, session_key: str | None, text: str = "", messages: bool = False
    ) -> SessionContext | Refused: ...

    async def turn_context(self, agent_id: str, turn_id: str) -> TurnContext | Refused: ...


def _reader(request: Request) -> ContextReader:
    engine: ContextReader | None = runtime(request).engine
    if engine is None:
        raise not_ready()
    return engine


async def session_context(request: Request) -> Response:
    target = agent(request)
    key = _session_key(request)
    text = request.query_params.get("input", "")
    if len(text) > MAX_INPUT:
        raise ApiError(400, "context_query_invalid", f"the input has {len(text)} characters",
                       f"preview at most {MAX_INPUT} characters", "input")  # fmt: skip
    messages = _flag(request, "messages")
    try:
        result = await _reader(request).context(target.id, key, text, messages)
    except StoreError as e:
        raise store_error(e) from e
    if isinstance(result, Refused):
        raise refused(result)
    return json_response(result)


SESSION_CONTEXT = Operation(
    "GET",
    "/v1/agents/{agent}/context",
    session_context,
    "The context the session's next turn would assemble (without sessionKey: a new session's "
    "first turn), block by block with tokens",
    {"200": answer(SessionContext, "The context (no input yet)")},
    params=[
        AGENT,
        param(
            "sessionKey",
            "query",
            "The session (any key: a session without turns has an empty history); left out: a "
            "new session",
            {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_SESSION_KEY,
                "pattern": SESSION_KEY,
            },
            required=False,
        ),
        param(
            "input",
            "query",
            "A message to assemble as the next turn's input (none: no input slot)",
            {"type": "string", "maxLength": MAX_INPUT, "pattern": NO_NUL},
            required=False,
        ),
        param(
            "messages",
            "query",
            "`true`: add the request's `messages` and `system` as the model gets them",
            {"type": "boolean"},
            required=False,
        ),
    ],
    errors=("400", "401", "404", "503"),
)


async def turn_context(request: Request) -> Response:
    target = agent(request)
    turn = await load_turn(request, request.path_params["turn_id"], target.id)
    try:
        result = await _reader(request).turn_context(target.id, turn.turn_id)
    except StoreError as e:
        raise store_error(e) from e
    if isinstance(result, Refused):
        raise refused(result)
    return json_response(result)


TURN_CONTEXT = Operation(
    "GET",
    "/v1/agents/{agent}/turns/{turn_id}/context",
    turn_context,
    "What each model call of the turn was sent, rebuilt from the log",
    {"200": answer(TurnContext, "One step per model call, in order")},
    params=[AGENT, TURN],
    errors=("400", "401", "404", "503"),
)


def _session_key(request: Request) -> str | None:
    """The session asked about; None without ``?sessionKey`` (a new session's context)."""
    key = request.query_params.get("sessionKey")
    if key is None:
        return None
    if "/" in key or not key or len(key) > MAX_SESSION_KEY:
        why = "contains '/'" if "/" in key else f"has {len(key)} characters"
        raise ApiError(400, "session_key_invalid", f"the session key {why}: no session has it",
                       f"session keys have 1 to {MAX_SESSION_KEY} characters and no '/'",
                       "sessionKey")  # fmt: skip
    return key


def _flag(request: Request, name: str) -> bool:
    raw = request.query_params.get(name)
    if raw is None or raw == "false":
        return False
    if raw == "true":
        return True
    raise ApiError(400, "context_query_invalid", f"{name}={raw!r} is not true or false",
                   f"pass {name}=true or leave it out", name)  # fmt: skip

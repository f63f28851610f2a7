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
from gateways.http.errors import json_response
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

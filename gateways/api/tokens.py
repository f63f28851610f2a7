"""``POST /v1/stream-tokens``: a short-lived, read-only token for one turn's stream, one
session's, or an agent's (gateways/streams/tokens.py makes and checks them; the streams of
gateways/streams/ take them as ``?st=``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateways.api.common import ApiError, decode_body, read_body, refused, visible_agent
from gateways.api.turns import load_turn
from gateways.http.errors import json_response
from gateways.http.operation import Operation, answer
from gateways.ingress import session_key_problem
from gateways.streams.tokens import DEFAULT_TTL_S, MAX_TTL_S, StreamTokens, grant


class TokenRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel",
                   forbid_unknown_fields=True):  # fmt: skip
    agent_id: str
    turn_id: str | None = None
    session_key: str | None = None
    ttl_s: float = float(DEFAULT_TTL_S)
    """Whole seconds; a float so that ``300.0`` (an integer to JSON Schema) is one too."""


class IssuedToken(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    token: str
    expires_at: str
    agent_id: str
    ttl_s: int
    scope: Literal["turn", "session", "agent"]
    """What the token reads: one turn's stream, one session's, or every session of the agent
    (the firehose with ``agentId``, and any of its turns' streams)."""
    turn_id: str | None = None
    session_key: str | None = None


async def create_stream_token(request: Request) -> Response:
    """``POST /v1/stream-tokens``: a read-only token for one turn's stream, one session's, or
    (``agentId`` alone) the agent's: all of its sessions."""
    tokens: StreamTokens = request.app.state.stream_tokens
    body: TokenRequest = decode_body(await read_body(request), TokenRequest)
    if body.turn_id is not None and body.session_key is not None:
        raise ApiError(
            400,
            "stream_token_target_invalid",
            "a stream token is for one turn, one session, or all of an agent's sessions",
            "send turnId or sessionKey, not both (neither: a token for the agent's whole stream)",
            "turnId",
        )
    if not (1 <= body.ttl_s <= MAX_TTL_S and float(body.ttl_s).is_integer()):
        raise ApiError(
            400,
            "stream_token_ttl_invalid",
            f"ttlS={body.ttl_s:g} is not a whole number from 1 to {MAX_TTL_S}",
            f"ask for 1 to {MAX_TTL_S} seconds (default {DEFAULT_TTL_S})",
            "ttlS",
        )
    agent_id = visible_agent(request, body.agent_id, "agentId").id
    if body.turn_id is not None:
        await load_turn(request, body.turn_id, agent_id)  # 404 unless the turn is the agent's
    elif body.session_key is not None and (problem := session_key_problem(body.session_key)):
        raise refused(problem)
    ttl_s = int(body.ttl_s)
    given = grant(agent_id, turn=body.turn_id, session=body.session_key, ttl_s=ttl_s)
    issued = IssuedToken(
        token=tokens.issue(given),
        expires_at=datetime.fromtimestamp(given.expires, UTC).isoformat().replace("+00:00", "Z"),
        agent_id=agent_id,
        ttl_s=ttl_s,
        scope=_scope(body),
        turn_id=body.turn_id,
        session_key=body.session_key,
    )
    return json_response(issued, 201)


def _scope(body: TokenRequest) -> Literal["turn", "session", "agent"]:
    if body.turn_id is not None:
        return "turn"
    return "agent" if body.session_key is None else "session"


CREATE_STREAM_TOKEN = Operation(
    "POST",
    "/v1/stream-tokens",
    create_stream_token,
    "A short-lived read-only token for one turn's stream, one session's, or (agentId alone) the "
    "agent's, all of its sessions: for a browser (`?st=` on the SSE streams and /v1/ws)",
    {"201": answer(IssuedToken, "Issued")},
    body=TokenRequest,
    errors=("400", "401", "404", "413", "415", "503"),
)

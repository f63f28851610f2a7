"""Messages and turns of API v1: ``POST …/messages`` accepts a message as a turn; the turn
resource (from this node's memory, else the turns projection), the turns of an agent, a turn's
stop and its stored events (DESIGN.md 6).

Reads come from the projections and the log; commands go to the session actors over NATS, like
any other producer's, so any node can answer any request.
"""

from __future__ import annotations

import typing
from datetime import datetime
from typing import Any

import msgspec
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response

from actors.messages import Accepted, Refused, StopTurn
from eventstore import START, StoreError, to_wire
from eventstore.catalogue import EndReason
from eventstore.feed import Feed
from eventstore.projections.turns import turn_row
from gateways import ingress
from gateways.api import acceptance
from gateways.api.common import (
    MAX_PAGE,
    ApiError,
    agent,
    commands_of,
    cursor_param,
    decode_body,
    fetch,
    int_param,
    not_addressable,
    principal,
    private_param,
    read_body,
    refused,
    runtime,
    store_error,
    store_of,
)
from gateways.api.schemas import (
    AcceptedBody,
    CallUsage,
    DeliveryInfo,
    EventsPage,
    HandoffInfo,
    MessageBody,
    StopAnswer,
    TurnPage,
    TurnResource,
)
from gateways.api.usage import priced
from gateways.http.constraints import TURN_ID
from gateways.http.errors import ErrorEnvelope, json_response
from gateways.http.operation import (
    AFTER,
    AGENT,
    LIMIT,
    SSE,
    SSE_FRAME,
    TURN,
    Operation,
    answer,
    param,
)

STATUSES: tuple[str, ...] = ("running", *typing.get_args(EndReason))


_TURN_COLUMNS = [f for f in TurnResource.__struct_fields__
                 if f not in ("archived", "archive_id", "cost_usd", "cost_reason")]  # fmt: skip


def turn_resource(row: tuple[Any, ...]) -> TurnResource:
    # turn.sql and turns.sql select the columns in the order of TurnResource's fields.
    fields = dict(zip(_TURN_COLUMNS, row, strict=True))
    fields["deliveries"] = msgspec.convert(fields["deliveries"], list[DeliveryInfo])
    fields["calls"] = msgspec.convert(fields["calls"], list[CallUsage])
    fields["handoffs"] = msgspec.convert(fields["handoffs"], list[HandoffInfo])
    return TurnResource(**fields, cost_usd=None)


def turn_in_memory(feed: Feed | None, turn_id: str) -> TurnResource | None:
    """The resource of a turn this node ran and holds from its first event, with nothing
    promised to a channel (eventstore/projections/turns.py ``turn_row``): the projection's row,
    without the query. Ended, it is final, kept as that row (``Feed.ended``, also once memory
    lets the turn's events go); running, it is served only while memory holds all of the turn
    (``Feed.whole``: this node still owns its session under the same epoch), or else another
    node may have taken the turn over and Postgres knows more."""
    if feed is None:
        return None
    row = feed.ended(turn_id)
    if row is None:
        held = feed.held(turn_id)
        row = turn_row(held) if held else None
        if row is None or (row["status"] == "running" and feed.whole(turn_id) is None):
            return None
    row["calls"] = msgspec.convert(row["calls"], list[CallUsage])
    row["handoffs"] = msgspec.convert(row["handoffs"], list[HandoffInfo])
    return TurnResource(**row, cost_usd=None)


async def load_turn(request: HTTPConnection, turn_id: str, agent_id: str | None) -> TurnResource:
    turn = turn_in_memory(runtime(request).feed, turn_id)
    if turn is None:
        rows = await fetch(request, "turn", {"turn_id": turn_id})
        turn = turn_resource(rows[0]) if rows else None
    if (
        turn is None
        or (agent_id is not None and turn.agent_id != agent_id)
        or not principal(request).sees(turn.agent_id)
    ):
        raise ApiError(
            404,
            "turn_not_found",
            f"no turn {turn_id!r}" + (f" of agent {agent_id!r}" if agent_id else ""),
            "check the turnId returned by POST .../messages",
            "turnId",
        )
    return priced(turn, runtime(request).prices)


async def post_message(request: Request) -> Response:
    """Accept a message as a turn: ``202`` once its turn.start is committed."""
    target = agent(request)
    body: MessageBody = decode_body(await read_body(request), MessageBody, ingress.shape_refused)
    message = ingress.IngressMessage(
        text=body.text,
        session_key=body.session_key,
        source="api",
        concurrency=body.concurrency,
        deliver=None if body.deliver in (None, "none") else body.deliver,  # type: ignore[arg-type]
        idempotency_key=request.headers.get("idempotency-key"),
        sender=body.sender,
    )
    problem = not_addressable(target) or ingress.check(message)
    if problem is not None:
        raise refused(problem)
    rt = runtime(request)
    result = await ingress.submit(commands_of(request), target.id, message, rt.accept_timeout)
    if isinstance(result, Refused) and result.code == "accept_timeout":
        result = await acceptance.after_timeout(rt.store, target.id, message, rt.accept_timeout)
        if isinstance(result, Refused) and result.code == "accept_timeout":
            return acceptance.unknown(result)
    if isinstance(result, Refused):
        raise refused(result)
    return accepted_response(request, target.id, result, body)


def _accepted(description: str) -> dict[str, Any]:
    """202/200 of POST messages: JSON, or the turn's SSE stream with ``stream: true``."""
    return {
        "description": description,
        "content": {"application/json": {"schema": AcceptedBody}, SSE: {"schema": SSE_FRAME}},
    }


POST_MESSAGE = Operation(
    "POST",
    "/v1/agents/{agent}/messages",
    post_message,
    "Send a message: 202 once its turn is durably accepted",
    {
        "202": _accepted("Accepted: the turn runs without the caller"),
        "200": _accepted("Replayed (same Idempotency-Key and body)"),
        "409": answer(
            ErrorEnvelope, "Idempotency key reused, the session is busy, or the agent is stopped"
        ),
    },
    params=[
        AGENT,
        param(
            "Idempotency-Key",
            "header",
            "1-255 printable ASCII; a retry with the same key and body replays the first "
            "acceptance",
            {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[\\x20-\\x7e]+$"},
            required=False,
        ),
    ],
    body=MessageBody,
    errors=("400", "401", "403", "404", "413", "503", "504"),
)


def accepted_response(
    request: Request, agent_id: str, result: Accepted, body: MessageBody
) -> Response:
    answer = AcceptedBody(
        turn_id=result.turn_id, session_key=result.session_key, replayed=result.replayed
    )
    if body.stream:
        from gateways.streams.sse import turn_stream_response

        return turn_stream_response(
            request,
            agent_id,
            result.turn_id,
            after=START,
            chunks=body.chunks,
            reasoning=body.reasoning,
            status=200 if result.replayed else 202,
            accepted=answer,
        )
    return json_response(answer, 200 if result.replayed else 202)


async def get_turn(request: Request) -> Response:
    agent_id = agent(request).id
    turn = await load_turn(request, request.path_params["turn_id"], agent_id)
    return json_response(await with_archive(request, turn))


GET_TURN = Operation(
    "GET",
    "/v1/agents/{agent}/turns/{turn_id}",
    get_turn,
    "The turn resource",
    {"200": answer(TurnResource, "The turn")},
    params=[AGENT, TURN],
)


async def get_turn_any(request: Request) -> Response:
    """``GET /v1/turns/{turnId}``: the turn whatever its agent (an extension of v1)."""
    turn = await load_turn(request, request.path_params["turn_id"], None)
    return json_response(await with_archive(request, turn))


GET_TURN_ANY = Operation(
    "GET",
    "/v1/turns/{turn_id}",
    get_turn_any,
    "The turn resource, by id alone",
    {"200": answer(TurnResource, "The turn")},
    params=[TURN],
)


async def with_archive(request: Request, turn: TurnResource) -> TurnResource:
    """The turn, saying whether its events were archived (the projection is kept). Without
    any archive (the store's cached view, reloaded at most once a second) no query is made:
    the turn resource is on the hot path."""
    store = store_of(request)
    try:
        if not await store.archived.aranges(store.apool):
            return turn
    except StoreError as e:
        raise store_error(e) from e
    rows = await fetch(request, "turn_archive", {"turn_id": turn.turn_id})
    if not rows:
        return turn
    return msgspec.structs.replace(turn, archived=True, archive_id=rows[0][0])


async def list_turns(request: Request) -> Response:
    agent_id = agent(request).id
    status = request.query_params.get("status")
    if status is not None and status not in STATUSES:
        raise ApiError(
            400,
            "turns_page_invalid",
            f"status={status!r} is not a turn status",
            f"use one of: {', '.join(STATUSES)}",
            "status",
        )
    limit = int_param(request, "limit", 50, 1, MAX_PAGE, "turns_page_invalid")
    before = request.query_params.get("before")
    before_at: datetime | None = None
    if before:
        rows = await fetch(request, "turn", {"turn_id": before})
        if not rows or rows[0][1] != agent_id:
            raise ApiError(
                400,
                "turns_page_invalid",
                f"before={before!r} is not a turn here",
                "pass the nextBefore of the previous page",
                "before",
            )
        before_at = turn_resource(rows[0]).started_at
    rows = await fetch(
        request,
        "turns",
        {
            "agent_id": agent_id,
            "session_key": request.query_params.get("sessionKey"),
            "status": status,
            "before_at": before_at,
            "before_id": before,
            "limit": limit,
        },
    )
    prices = runtime(request).prices
    turns = [priced(turn_resource(r), prices) for r in rows]
    return json_response(
        TurnPage(turns=turns, next_before=turns[-1].turn_id if len(turns) == limit else None)
    )


LIST_TURNS = Operation(
    "GET",
    "/v1/agents/{agent}/turns",
    list_turns,
    "Turns, newest first",
    {"200": answer(TurnPage, "A page")},
    params=[
        AGENT,
        param("sessionKey", "query", "Only this session", required=False),
        param(
            "status",
            "query",
            "Only this status",
            {"type": "string", "enum": list(STATUSES)},
            required=False,
        ),
        param(
            "before",
            "query",
            "nextBefore of the previous page (a turn id of this agent)",
            {"type": "string", "pattern": TURN_ID},
            required=False,
        ),
        LIMIT,
    ],
)


async def stop_turn(request: Request) -> Response:
    agent_id = agent(request).id
    turn = await load_turn(request, request.path_params["turn_id"], agent_id)
    if turn.status != "running":
        raise ApiError(
            409,
            "turn_not_running",
            f"turn {turn.turn_id} already ended ({turn.status})",
            "nothing to stop; GET the turn for its result",
        )
    result = await commands_of(request).stop(StopTurn(turn_id=turn.turn_id, by="api"))
    if isinstance(result, Refused):
        raise refused(result)
    if not result.stopping:
        raise ApiError(
            409,
            "turn_not_running",
            f"turn {turn.turn_id} is not running ({result.state})",
            "it may have just ended; GET the turn for its result",
        )
    return json_response(StopAnswer(turn_id=turn.turn_id, stopping=True, state=result.state), 202)


STOP_TURN = Operation(
    "POST",
    "/v1/agents/{agent}/turns/{turn_id}/stop",
    stop_turn,
    "Stop a running turn (cooperative)",
    {
        "202": answer(StopAnswer, "Stopping"),
        "409": answer(ErrorEnvelope, "The turn is not running"),
    },
    params=[AGENT, TURN],
)


async def turn_events(request: Request) -> Response:
    """``GET …/turns/{turnId}/events``: the turn's stored events, public fields only, unless
    ``private=true`` asks for the tool calls' ``args`` and the tool results' ``output`` (the
    events' ``REVEALABLE`` fields, nothing else private) with the API token."""
    agent_id = agent(request).id
    reveal = private_param(request)
    turn = await load_turn(request, request.path_params["turn_id"], agent_id)
    after = cursor_param(request) or START
    limit = int_param(request, "limit", 1000, 1, 10_000, "events_page_invalid")
    try:
        events = await store_of(request).aread_turn(turn.turn_id, after, limit)
    except StoreError as e:
        raise store_error(e) from e
    node = runtime(request).node_id
    page = [to_wire(e, node, reveal=reveal) for e in events]
    return json_response(EventsPage(events=page, next=page[-1].cursor if page else None))


TURN_EVENTS = Operation(
    "GET",
    "/v1/agents/{agent}/turns/{turn_id}/events",
    turn_events,
    "Stored events of a turn",
    {"200": answer(EventsPage, "Events in log order")},
    params=[
        AGENT,
        TURN,
        AFTER,
        param(
            "limit",
            "query",
            "Page size",
            {"type": "integer", "minimum": 1, "maximum": 10_000},
            required=False,
        ),
        param(
            "private",
            "query",
            "`true`: tool.call events with their `args` and tool.result events with their "
            "`output` (nothing else private); API token only, a stream token is refused with "
            "`private_needs_token`. The streams never carry them",
            {"type": "boolean"},
            required=False,
        ),
    ],
    errors=("400", "401", "403", "404"),
)

"""The REST handlers of API v1: agents, messages, turns, sessions (DESIGN.md 6).

Reads come from the projections (the turn resource, sessions, history) and the log (a turn's
events); commands go to the session actors over NATS, like any other producer's, so any node can
answer any request.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable
from datetime import datetime
from importlib import resources
from typing import Any, Protocol

import msgspec
import nats.aio.client
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response

from actors.messages import (
    TOO_DEEP,
    Accepted,
    ClusterStatus,
    CommandPath,
    Refused,
    StopTurn,
    too_deep,
)
from actors.outbox import Channel
from eventstore import START, Checkpoint, EventStore, InvalidCursor, StoreError, to_wire
from eventstore.catalogue import EndReason
from eventstore.feed import Feed
from eventstore.projections.turns import turn_row
from gateways import ingress
from gateways.api import acceptance
from gateways.api.schemas import (
    AcceptedBody,
    AgentDetail,
    AgentInfo,
    CallUsage,
    DeliveryInfo,
    EventsPage,
    MessageBody,
    SkillList,
    StopAnswer,
    TurnPage,
    TurnResource,
)
from gateways.http.auth import EVERYONE, PRIVATE_NEEDS_TOKEN, PRIVATE_QUERY, Principal
from gateways.http.errors import json_response

STATUSES: tuple[str, ...] = ("running", *typing.get_args(EndReason))
MAX_PAGE = 500


class Runtime(Protocol):
    """What the gateway needs of the node hosting it (runtime/node.py implements it)."""

    node_id: str
    store: EventStore | None
    nc: nats.aio.client.Client | None
    feed: Feed | None
    scheduler: Any
    """The scheduler actor's ref (None until the node is ready)."""
    engine: Any
    """The node's engine (None until the node is ready): the context routes read through it
    (see gateways/api/context.py)."""

    @property
    def commands(self) -> CommandPath | None:
        """The one command path to the sessions' owners (None until the node is ready)."""
        ...

    accept_timeout: float
    """Seconds ``POST …/messages`` waits for its session's acceptance (gateways/api/acceptance.py
    says what a client is told after that)."""

    def uptime_ms(self) -> int: ...

    def cluster_status(self) -> ClusterStatus | None:
        """The lease bucket as this node reads it (None until the node has read it)."""
        ...

    def readiness(self) -> tuple[bool, str, dict[str, bool]]: ...

    def warnings(self) -> list[str]:
        """What a ready node serves less well than it should (a stray transaction holding the
        live streams back), for ``GET /v1/ready``."""
        ...

    def agent_details(self) -> dict[str, AgentDetail]: ...

    def channel(self, agent_id: str, channel_id: str) -> Channel | None:
        """An agent's channel, if it has that one."""
        ...


class ApiError(Exception):
    """An answer other than success; rendered as the error envelope by the app."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        hint: str,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.hint = status, code, message, hint
        self.field, self.headers = field, headers


# Refusals from the engine and what HTTP status each one is.
_STATUS = {
    "invalid_value": 400,
    "agent_not_found": 404,
    "turn_not_found": 404,
    "session_not_found": 404,
    "approval_not_found": 404,
    "approval_busy": 409,
    "session_busy": 409,
    "session_exists": 409,
    "turn_not_ended": 409,
    "fork_turn_cleared": 409,
    "session_moving": 503,
    "cursor_archived": 410,
    "idempotency_key_reused": 409,
    "accept_conflict": 409,
    "no_node": 503,
    "session_unavailable": 503,
    "store_unavailable": 503,
    "store_overloaded": 503,
    "store_closed": 503,
    "accept_timeout": 504,
    "command_timeout": 504,
}


def refused(r: Refused) -> ApiError:
    status = _STATUS.get(r.code, 400 if r.field is not None else 503)
    headers = {"Retry-After": "1"} if r.code == "session_moving" else None
    return ApiError(status, r.code, r.message, r.hint, r.field, headers=headers)


def store_error(e: StoreError) -> ApiError:
    return ApiError(_STATUS.get(e.code, 503), e.code, e.message, e.hint)


@functools.cache
def sql(name: str) -> bytes:
    return resources.files("gateways.api").joinpath("sql", f"{name}.sql").read_bytes()


# --- plumbing --------------------------------------------------------------------------------


def runtime(request: HTTPConnection) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


def principal(request: HTTPConnection) -> Principal:
    p: Principal = getattr(request.state, "principal", EVERYONE)
    return p


async def refuse_archived(
    request: HTTPConnection, after: Checkpoint, turn_id: str | None = None
) -> None:
    """``410 cursor_archived`` before a stream starts (its status is sent first) when its
    catch-up would pass over archived events (eventstore/archive_ranges.py)."""
    store = store_of(request)
    try:
        await store.archived.acheck(store.apool, after, turn_id=turn_id)
    except StoreError as e:
        raise store_error(e) from e


def store_of(request: HTTPConnection) -> EventStore:
    store = runtime(request).store
    if store is None:
        raise not_ready()
    return store


def nats_of(request: HTTPConnection) -> nats.aio.client.Client:
    nc = runtime(request).nc
    if nc is None:
        raise not_ready()
    return nc


def commands_of(request: HTTPConnection) -> CommandPath:
    """The node's one command path (to each session's owner), once the node is ready."""
    commands = runtime(request).commands
    if commands is None:
        raise not_ready()
    return commands


def not_ready() -> ApiError:
    return ApiError(
        503,
        "not_ready",
        "the node is not ready yet",
        "retry shortly; GET /v1/ready says when",
        headers={"Retry-After": "1"},
    )


def visible_agent(conn: HTTPConnection, agent_id: str, field: str | None) -> AgentDetail:
    """The agent, if the caller may see it (else 404 ``agent_not_found``, as if it did not
    exist: a scoped token learns nothing about other agents)."""
    found = runtime(conn).agent_details().get(agent_id)
    if found is None or not principal(conn).sees(agent_id):
        raise ApiError(
            404,
            "agent_not_found",
            f"no agent {agent_id!r}",
            "GET /v1/agents lists the agents you can reach",
            field,
        )
    return found


def agent(request: Request) -> AgentDetail:
    """The path's agent (see :func:`visible_agent`)."""
    return visible_agent(request, request.path_params["agent"], "agent")


MAX_BODY = 1_000_000
"""The body cap when the app names none (``create_app``'s ``max_body`` sets the node's)."""


async def read_body(request: Request, max_bytes: int | None = None) -> bytes:
    """The request's body within the node's bounds, whatever its transfer encoding: at most
    ``DISPACH_MAX_BODY`` bytes (``app.state.max_body``; less where a route passes a smaller
    ``max_bytes``), else ``413 body_too_large``; and, since every route's body is JSON, nested
    at most :data:`~actors.messages.MAX_DEPTH` levels, else ``400 body_too_deep`` (checked here,
    before any decoding, so that no route can forget it)."""
    cap: int = getattr(request.app.state, "max_body", MAX_BODY)
    limit = cap if max_bytes is None else min(cap, max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(
                413,
                "body_too_large",
                f"the request body is over {limit} bytes",
                "send a smaller body",
            )
    raw = bytes(body)
    if too_deep(raw):
        raise ApiError(400, TOO_DEEP.code, TOO_DEEP.message, TOO_DEEP.hint)
    return raw


def decode_body(
    raw: bytes,
    kind: type[Any],
    refine: Callable[[str | None, str], Refused | None] | None = None,
) -> Any:
    """``raw`` decoded as ``kind``, else ``400 request_body_invalid`` naming the field, or the
    refusal ``refine`` gives for that field and error (a code of its own, v1's)."""
    try:
        return msgspec.json.decode(raw or b"{}", type=kind)
    except msgspec.ValidationError as e:
        text = str(e)
        field = ingress.field_of(text)
        problem = refine(field, text) if refine is not None else None
        if problem is not None:
            raise refused(problem) from e
        raise ApiError(
            400,
            "request_body_invalid",
            f"the body does not fit: {text}",
            "see GET /v1/openapi.json for the request schema",
            field,
        ) from e
    except msgspec.DecodeError as e:
        raise ApiError(
            400,
            "body_not_json",
            f"the body is not JSON: {e}",
            "send a JSON object with Content-Type: application/json",
        ) from e


def int_param(request: Request, name: str, default: int, low: int, high: int, code: str) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise ApiError(
            400,
            code,
            f"{name}={raw!r} is not a number from {low} to {high}",
            f"pass {name} between {low} and {high}",
            name,
        )
    return value


def cursor_param(request: Request, name: str = "after") -> Checkpoint | None:
    raw = request.query_params.get(name) or request.headers.get("last-event-id")
    if not raw:
        return None
    try:
        return Checkpoint.from_cursor(raw.strip())
    except InvalidCursor as e:
        raise ApiError(
            400,
            "cursor_invalid",
            f"{raw!r} is not a cursor of this server",
            "pass the `id` of an SSE frame or the `cursor` of an event",
            name,
        ) from e


async def fetch(
    request: HTTPConnection, query: str, params: dict[str, object]
) -> list[tuple[Any, ...]]:
    try:
        return await store_of(request).afetch(sql(query), params)
    except StoreError as e:
        raise store_error(e) from e


# What turn.sql and turns.sql select, in TurnResource's order; the archive is looked up apart.
_TURN_COLUMNS = [f for f in TurnResource.__struct_fields__ if f not in ("archived", "archive_id")]


def turn_resource(row: tuple[Any, ...]) -> TurnResource:
    # turn.sql and turns.sql select the columns in the order of TurnResource's fields.
    fields = dict(zip(_TURN_COLUMNS, row, strict=True))
    fields["deliveries"] = msgspec.convert(fields["deliveries"], list[DeliveryInfo])
    fields["calls"] = msgspec.convert(fields["calls"], list[CallUsage])
    return TurnResource(**fields)


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
    return TurnResource(**row)


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
    return turn


# --- handlers --------------------------------------------------------------------------------


async def list_agents(request: Request) -> Response:
    who = principal(request)
    agents = [
        AgentInfo(id=a.id, name=a.name, status=a.status, model=a.model, provider=a.provider)
        for a in runtime(request).agent_details().values()
        if who.sees(a.id)
    ]
    return json_response(agents)


async def cluster(request: Request) -> Response:
    """``GET /v1/cluster``: nodes, the partitions each holds, epochs and lease ages."""
    status = runtime(request).cluster_status()
    if status is None:
        raise not_ready()
    return json_response(status)


async def get_agent(request: Request) -> Response:
    return json_response(agent(request))


async def agent_tools(request: Request) -> Response:
    """``GET …/tools``: the agent's tools as v1 lists them, with their policy and timeout."""
    return json_response(agent(request).tool_list)


async def agent_skills(request: Request) -> Response:
    """``GET …/skills``: v1 0.1.0's answer for a runtime without skills. ``supported: false``
    says the runtime has none, which an empty list alone would not."""
    agent(request)
    return json_response(SkillList(skills=[], supported=False))


async def reload_agent(request: Request) -> Response:
    """``POST …/reload``: refused, as v1 0.1.0 refuses it. An agent is built once per node
    start; its pinned prompt prefix (instructions, tools) must stay byte-stable for the
    provider's cache and for every session's turns, so a live reload would change a
    conversation under it. A restart (or a rolling restart of the cluster) loads the manifest."""
    found = agent(request)
    raise ApiError(
        501,
        "reload_not_supported",
        f"agent {found.id!r} cannot be reloaded while the node runs: an agent's manifest is "
        "read once, at the node's start",
        "restart the node to load a changed manifest; in a cluster, roll it: start nodes with "
        "the new manifest, then stop the old ones one by one (SIGTERM drains them)",
    )


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
    problem = ingress.check(message)
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


async def get_turn_any(request: Request) -> Response:
    """``GET /v1/turns/{turnId}``: the turn whatever its agent (an extension of v1)."""
    turn = await load_turn(request, request.path_params["turn_id"], None)
    return json_response(await with_archive(request, turn))


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
    turns = [turn_resource(r) for r in rows]
    return json_response(
        TurnPage(turns=turns, next_before=turns[-1].turn_id if len(turns) == limit else None)
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


def private_param(request: Request) -> bool:
    """``private``: ``true`` or ``false`` (else ``400 invalid_value``), and ``true`` only for a
    caller with the API token. The Guard already refuses a stream token that asks (it may only
    read streams, which never reveal); this says the same should a route ever let one through."""
    raw = request.query_params.get(PRIVATE_QUERY)
    if raw is None or raw == "false":
        return False
    if raw != "true":
        raise ApiError(400, "invalid_value", f"{PRIVATE_QUERY}={raw!r} is not true or false",
                       f"pass {PRIVATE_QUERY}=true or leave it out", PRIVATE_QUERY)  # fmt: skip
    if principal(request).stream is not None:
        raise ApiError(*PRIVATE_NEEDS_TOKEN, field=PRIVATE_QUERY)
    return True

"""What every handler of API v1 shares: the node it serves (:class:`Runtime`), the error it
raises (:class:`ApiError`, rendered as the envelope by the app), and reading a request: its
caller, its agent, its body, its query parameters; the projection queries' SQL (``sql/``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from importlib import resources
from typing import Any, Literal, Protocol

import msgspec
import nats.aio.client
from starlette.requests import HTTPConnection, Request

from actors.messages import TOO_DEEP, ClusterStatus, CommandPath, Refused, too_deep
from actors.messages import not_addressable as refused_unaddressable
from actors.outbox import Channel
from actors.prices import PriceTable
from eventstore import Checkpoint, EventStore, InvalidCursor, StoreError
from eventstore.feed import Feed
from gateways import ingress
from gateways.api.schemas import AgentDetail, AgentState, SkillList
from gateways.http.auth import EVERYONE, PRIVATE_NEEDS_TOKEN, PRIVATE_QUERY, Principal

MAX_PAGE = 500
AgentChange = Literal["reload", "stop", "start"]


class Runtime(Protocol):
    """What the gateway needs of the node hosting it (runtime/node.py implements it)."""

    node_id: str
    store: EventStore | None
    nc: nats.aio.client.Client | None
    feed: Feed | None
    scheduler: Any
    """The scheduler actor's ref (None until the node is ready)."""
    activity: Any
    """The node's activity replies (actors/cluster/activity.py; None until the node is ready)."""
    engine: Any
    """The node's engine (None until the node is ready): the context routes read through it
    (see gateways/api/context.py)."""

    @property
    def commands(self) -> CommandPath | None:
        """The one command path to the sessions' owners (None until the node is ready)."""
        ...

    prices: PriceTable
    """What model calls cost (actors/prices.py): usage and the turn resource are priced by it."""
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

    def agent_detail(self, agent_id: str) -> AgentDetail | None:
        """One agent of :meth:`agent_details` (None: no such agent), without the others'."""
        ...

    def skills(self, agent_id: str) -> SkillList | None:
        """The agent's skills and how its turns select them (None: no such agent)."""
        ...

    def channel(self, agent_id: str, channel_id: str) -> Channel | None:
        """An agent's channel, if it has that one."""
        ...

    async def change_agent(
        self, kind: AgentChange, agent_id: str, by: str, reason: str | None
    ) -> AgentState | Refused:
        """Reload, stop or start an agent on every node (runtime/lifecycle.py)."""
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
    "invalid_manifest": 400,
    "agent_not_found": 404,
    "agent_not_addressable": 403,
    "turn_not_found": 404,
    "session_not_found": 404,
    "approval_not_found": 404,
    "approval_busy": 409,
    "session_busy": 409,
    "agent_stopped": 409,
    "agent_change_conflict": 409,
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
    "budget_exhausted": 429,
}


def refused(r: Refused) -> ApiError:
    status = _STATUS.get(r.code, 400 if r.field is not None else 503)
    headers = {"Retry-After": "1"} if r.code == "session_moving" else None
    if r.retry_after is not None:
        headers = {"Retry-After": str(math.ceil(r.retry_after))}
    return ApiError(status, r.code, r.message, r.hint, r.field, headers=headers)


def store_error(e: StoreError) -> ApiError:
    return ApiError(_STATUS.get(e.code, 503), e.code, e.message, e.hint)


@functools.cache
def sql(name: str) -> bytes:
    return resources.files("gateways.api").joinpath("sql", f"{name}.sql").read_bytes()


def runtime(request: HTTPConnection) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


def principal(request: HTTPConnection) -> Principal:
    p: Principal = getattr(request.state, "principal", EVERYONE)
    return p


def unrestricted(request: HTTPConnection, code: str, what: str) -> Principal:
    """The caller, if its credential names no agent list (else ``403 code``): what spans every
    agent (keys, the cluster's activity) is not for a caller confined to some of them."""
    who = principal(request)
    if who.agents is not None and not who.claim:
        raise ApiError(403, code, f"{what} needs a key or token with no agent list",
                       "call with an admin key minted without `agents` (or an unscoped "
                       "DISPACH_API_TOKEN)")  # fmt: skip
    return who


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
    found = runtime(conn).agent_detail(agent_id)
    if found is None or not principal(conn).sees(agent_id):
        raise ApiError(
            404,
            "agent_not_found",
            f"no agent {agent_id!r}",
            "GET /v1/agents lists the agents you can reach",
            field,
        )
    return found


def not_addressable(found: AgentDetail) -> Refused | None:
    """The refusal of a message to an agent that takes work only from its supervisor (a member
    of a team, runtime/teams.py), or None (the session's owner says the same at every door)."""
    return refused_unaddressable(found.id, found.addressable, None)


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

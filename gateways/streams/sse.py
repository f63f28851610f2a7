"""Server-sent event streams: one turn (``/v1/agents/{agent}/turns/{turnId}/stream``) and the
firehose (``/v1/events``). Both are read from the log through the node's :class:`Feed`, so a
reader that comes late or reconnects with ``Last-Event-ID`` (or ``?after=``) gets every event
after that cursor, in order, once. Each event frame's ``id:`` is its opaque cursor; control frames
(``turn.accepted``, ``stream.replay``, ``stream.subscribed``, ``stream.ended``) carry none, so
they never move a client's resume point.
"""

from __future__ import annotations

import asyncio
import difflib
from collections.abc import AsyncIterator, Iterator

import msgspec
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Send
from starlette.types import Scope as AsgiScope

from eventstore import REGISTRY, Checkpoint, RecordedEvent, StoreError, encode_wire, streams
from eventstore.catalogue import TurnEnd, TurnStart
from eventstore.feed import CHUNK, Feed, Scope, Subscription
from gateways.api.common import (
    ApiError,
    agent,
    cursor_param,
    not_ready,
    principal,
    refuse_archived,
    runtime,
    visible_agent,
)
from gateways.api.schemas import AcceptedBody
from gateways.api.turns import load_turn
from gateways.http import metrics
from gateways.http.operation import (
    AFTER,
    AGENT,
    CHUNKS,
    REASONING,
    SSE,
    SSE_FRAME,
    TURN,
    TYPES,
    Operation,
    param,
)
from gateways.streams.tokens import StreamGrant

HEARTBEAT_S = 15.0
HEADERS = {
    "Cache-Control": "no-cache, no-transform",
    "Connection": "keep-alive",
    "X-Accel-Buffering": "no",
}
_ENCODE = msgspec.json.Encoder()


class Replay(msgspec.Struct, frozen=True, rename="camel"):
    """``stream.replay``: what the stream replays before it goes live (Dispach v1's preamble;
    ``truncated`` and ``dropped`` are always false and 0 here: the log keeps every event)."""

    turn_id: str
    state: str
    events: int
    truncated: bool
    dropped: int
    chunks: str
    reasoning: bool
    """Ours: ``model.chunk`` deltas of the model's thinking follow too."""
    implied: bool
    """``chunks`` is on because ``types`` names ``model.chunk``, not because it was asked."""
    from_: str | None = msgspec.field(name="from")
    to: str | None


class Ended(msgspec.Struct, frozen=True, rename="camel"):
    turn_id: str
    status: str
    steps: int


class Subscribed(msgspec.Struct, frozen=True, rename="camel"):
    agent_id: str | None
    session_key: str | None
    types: list[str] | None
    chunks: bool
    reasoning: bool
    implied: bool
    after: str | None


def frame(event: str, data: bytes, cursor: str | None = None) -> bytes:
    head = f"event: {event}\n" + (f"id: {cursor}\n" if cursor else "")
    return head.encode() + b"data: " + data + b"\n\n"


_WRITE = 64 << 10
"""Frames are joined into writes of about this size at most."""


def joined(frames: list[bytes]) -> Iterator[bytes]:
    """``frames`` as a few writes of at most about ``_WRITE`` bytes (a long replay is not one
    huge buffer)."""
    start, size = 0, 0
    for end, data in enumerate(frames, 1):
        size += len(data)
        if size >= _WRITE:
            yield b"".join(frames[start:end])
            start, size = end, 0
    if start < len(frames):
        yield b"".join(frames[start:])


def event_frame(event: RecordedEvent, node: str) -> bytes:
    return frame(event.type, encode_wire(event, node), event.checkpoint.cursor())


class EventStream(StreamingResponse):
    """Starlette's StreamingResponse, with the client's leaving watched by one plain task
    instead of an anyio task group: uvicorn speaks ASGI 2.3, so Starlette listens for the
    disconnect in a task group whose cancel scopes, task lookups and task reprs cost a streamed
    turn 7 % of its CPU (py-spy, a closed-loop run). When the client leaves, the watcher cancels
    the streaming task, which ends the frames' generator at the await it is in (so its
    subscription closes); a cancellation from elsewhere (the server stopping) goes on up. A
    cancellation can be swallowed by a wait that finished at the same moment (``wait_for`` in
    Python 3.11 does that: a busy firehose wakes every few milliseconds), where a cancel scope
    would cancel again at the next wait: so the loop also stops at the next frame once the
    client has left, and at the latest at the next heartbeat."""

    async def __call__(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        if scope["type"] != "http" or streaming is None:
            await super().__call__(scope, receive, send)
            return
        left = False

        async def watch() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            left = True
            streaming.cancel()

        watcher = asyncio.get_running_loop().create_task(watch(), name="sse-watch")
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})  # fmt: skip
            async for chunk in self.body_iterator:
                if left:  # the cancellation was swallowed: it is not pending, only counted
                    streaming.uncancel()
                    break
                body = chunk.encode(self.charset) if isinstance(chunk, str) else chunk
                await send({"type": "http.response.body", "body": body, "more_body": True})
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not left or streaming.uncancel() > 0:
                raise
        finally:
            watcher.cancel()
            # Left (or cancelled while a frame was being sent), the frames' generator still
            # waits at its yield: closed here, its subscription closes now.
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


PING = b": ping\n\n"


def feed_of(request: HTTPConnection) -> Feed:
    feed = runtime(request).feed
    if feed is None:
        raise not_ready()
    return feed


def flag(request: Request, name: str) -> bool:
    return request.query_params.get(name, "").lower() in ("1", "true", "yes")


def types_param(request: Request) -> frozenset[str] | None:
    raw = request.query_params.get("types")
    if not raw:
        return None
    return known_types([t.strip() for t in raw.split(",") if t.strip()])


def known_types(names: list[str]) -> frozenset[str]:
    """``names`` as a filter, if each is an event type (else ``400 unknown_event_type`` with
    the nearest name): the SSE ``types`` parameter and a WebSocket subscription's ``types``."""
    for name in names:
        if name not in REGISTRY:
            close = difflib.get_close_matches(name, list(REGISTRY), n=1)
            hint = f"did you mean {close[0]!r}?" if close else "docs/events.md lists the types"
            raise ApiError(
                400, "unknown_event_type", f"{name!r} is not an event type", hint, "types"
            )
    return frozenset(names)


def chunk_options(asked: bool, types: frozenset[str] | None) -> tuple[bool, bool]:
    """Whether text chunks are sent, and whether that is only *implied*: naming ``model.chunk``
    in ``types`` asks for them as ``chunks=true`` does (v1), and the preamble says which it was.
    Reasoning chunks are never implied: the thinking comes only with ``reasoning=true``."""
    implied = not asked and types is not None and CHUNK in types
    return asked or implied, implied


# --- one turn ----------------------------------------------------------------------------------


async def turn_stream(request: Request) -> Response:
    stream = principal(request).stream
    if stream is not None and stream.agent != request.path_params["agent"]:
        # Said before the agent is looked up: the token sees only its agent, so the lookup
        # would answer 404 and hide that the token is the problem.
        raise wrong_agent(stream, request.path_params["agent"])
    agent_id = agent(request).id
    turn_id: str = request.path_params["turn_id"]
    reconnect = bool(request.headers.get("last-event-id"))
    # A fresh stream needs only the turn's agent and session, which never change: a turn this
    # node holds in memory has them in its turn.start. A browser's reconnect needs its status.
    session_key = None if reconnect else held_session(request, turn_id, agent_id)
    running = True
    if session_key is None:
        turn = await load_turn(request, turn_id, agent_id)
        session_key, running = turn.session_key, turn.status == "running"
    if stream is not None:
        problem = turn_problem(stream, agent_id, turn_id, session_key)
        if problem is not None:
            raise problem
    after = cursor_param(request)
    await refuse_archived(request, after or Checkpoint(), turn_id)
    if (
        after is not None
        and not running
        and reconnect
        and await _ended_before(feed_of(request), turn_id, after) is not None
    ):
        # A browser reconnecting after the end: 204 is what makes an EventSource stop.
        return Response(status_code=204, headers={"Cache-Control": "no-cache"})
    types = types_param(request)
    chunks, implied = chunk_options(flag(request, "chunks"), types)
    return turn_stream_response(
        request,
        agent_id,
        turn_id,
        after=after,
        chunks=chunks,
        reasoning=flag(request, "reasoning"),
        implied=implied,
        types=types,
    )


TURN_STREAM = Operation(
    "GET",
    "/v1/agents/{agent}/turns/{turn_id}/stream",
    turn_stream,
    "Live stream of a turn (SSE), lossless resume",
    {
        "200": {
            "description": "SSE: `stream.replay`, then event frames (`id:` is the cursor), then "
            "`stream.ended` after `turn.end`",
            "content": {SSE: {"schema": SSE_FRAME}},
        },
        "204": {
            "description": "A reconnect whose `Last-Event-ID` is at or past the turn's "
            "`turn.end`: nothing more will come (an EventSource stops)"
        },
    },
    params=[AGENT, TURN, AFTER, CHUNKS, REASONING, TYPES],
    errors=("400", "401", "403", "404"),
    security="stream",
)


def held_session(request: HTTPConnection, turn_id: str, agent_id: str) -> str | None:
    """The session of a turn of ``agent_id`` that memory holds from its ``turn.start`` and the
    caller may see, or None (then the turn is looked up in Postgres, which also says 404)."""
    held = feed_of(request).held(turn_id)
    if not held or not isinstance(held[0].data, TurnStart):
        return None
    meta = held[0].metadata
    if meta.agent_id != agent_id or not principal(request).sees(agent_id):
        return None
    return meta.session_key


def turn_stream_response(
    request: Request,
    agent_id: str,
    turn_id: str,
    *,
    after: Checkpoint | None,
    chunks: bool,
    reasoning: bool = False,
    implied: bool = False,
    types: frozenset[str] | None = None,
    status: int = 200,
    accepted: AcceptedBody | None = None,
) -> Response:
    feed = feed_of(request)
    node = runtime(request).node_id
    # The stream ends with its turn, so it always follows turn.end, shown or not.
    wanted = None if types is None else types | {TurnEnd.TYPE}
    scope = Scope(turn_id=turn_id, agent_id=agent_id, types=wanted, chunks=chunks,
                  reasoning=reasoning)  # fmt: skip
    start = after or Checkpoint()

    def shown(event: RecordedEvent) -> bool:
        return types is None or event.type in types

    async def frames() -> AsyncIterator[bytes]:
        with metrics.STREAM_SUBSCRIBERS.labels("sse_turn").track_inprogress():
            if accepted is not None:
                yield frame("turn.accepted", _ENCODE.encode(accepted))
            async with feed.subscribe(scope, start) as sub:
                backlog, ended = await turn_backlog(feed, sub, turn_id, start)
                visible = [e for e in backlog if shown(e)]
                replay = Replay(
                    turn_id=turn_id,
                    state="ended" if ended else "running",
                    events=len(visible),
                    truncated=False,
                    dropped=0,
                    chunks="start" if chunks else "none",
                    reasoning=reasoning,
                    implied=implied,
                    from_=after.cursor() if after else None,
                    to=visible[-1].checkpoint.cursor() if visible else None,
                )
                out = [frame("stream.replay", _ENCODE.encode(replay))]
                batch = backlog
                while True:
                    # What one read brought goes out in one write (a commit's events arrive
                    # together from memory), not one per frame: each write is a trip through
                    # the middlewares' send and a system call.
                    out.extend(event_frame(event, node) for event in batch if shown(event))
                    if ended is not None:
                        out.append(_ended_frame(turn_id, ended))
                    for chunk in joined(out):
                        yield chunk
                    if ended is not None:
                        return
                    batch = await sub.read(HEARTBEAT_S)
                    out = [] if batch else [PING]
                    ended = next((e for e in batch if isinstance(e.data, TurnEnd)), None)

    return EventStream(
        frames(), status, headers=HEADERS, media_type="text/event-stream; charset=utf-8"
    )


async def turn_backlog(
    feed: Feed, sub: Subscription, turn_id: str, start: Checkpoint
) -> tuple[list[RecordedEvent], RecordedEvent | None]:
    """What a turn subscription replays before it goes live, and the turn's ``turn.end`` if the
    reader will see no more (it is in the replay, or the reader resumed after it).

    A turn this node committed from its start is replayed from memory, without a query (read
    after subscribing, so nothing falls between); the subscription's catch-up from Postgres then
    goes on after it (eventstore/feed.py)."""
    held = feed.recent(turn_id, start)
    if held:
        return sub.start_after(held), next((e for e in held if isinstance(e.data, TurnEnd)), None)
    backlog = await sub.backlog()
    ended = next((e for e in backlog if isinstance(e.data, TurnEnd)), None)
    if ended is None and not backlog:
        ended = await _ended_before(feed, turn_id, start)
    return backlog, ended


async def _ended_before(feed: Feed, turn_id: str, start: Checkpoint) -> RecordedEvent | None:
    """The turn's ``turn.end`` if the reader's cursor is already past it (nothing will come)."""
    try:
        last = await feed.store.alast(streams.turn(turn_id))
    except StoreError:
        return None
    ended = last is not None and isinstance(last.data, TurnEnd) and last.checkpoint <= start
    return last if ended else None


def _ended_frame(turn_id: str, event: RecordedEvent) -> bytes:
    assert isinstance(event.data, TurnEnd)
    end = Ended(turn_id=turn_id, status=event.data.reason, steps=event.data.steps)
    return frame("stream.ended", _ENCODE.encode(end))


# --- stream tokens (gateways/streams/tokens.py): what one may read -----------------------------


def wrong_agent(allowed: StreamGrant, agent_id: str) -> ApiError:
    return ApiError(
        403,
        "stream_token_wrong_agent",
        f"this stream token is for agent {allowed.agent!r}, not {agent_id!r}",
        "ask POST /v1/stream-tokens for a token of this agent",
    )


def turn_problem(
    allowed: StreamGrant, agent_id: str, turn_id: str, session_key: str
) -> ApiError | None:
    """Why the stream token ``allowed`` may not read the turn, or None."""
    if allowed.agent != agent_id:
        return wrong_agent(allowed, agent_id)
    if allowed.turn is not None and allowed.turn != turn_id:
        return ApiError(
            403,
            "stream_token_wrong_turn",
            f"this stream token is for turn {allowed.turn}, not {turn_id}",
            "ask POST /v1/stream-tokens for a token of this turn",
        )
    if allowed.turn is None and allowed.session is not None and allowed.session != session_key:
        return ApiError(
            403,
            "stream_token_wrong_session",
            "this stream token is for another session than this turn's",
            "ask POST /v1/stream-tokens for a token of this turn or its session",
        )
    return None


def session_problem(
    allowed: StreamGrant, agent_id: str, session_key: str | None
) -> ApiError | None:
    """Why the stream token ``allowed`` may not follow the agent's session ``session_key``
    (None: all of its sessions), or None. An agent's token (neither turn nor session) follows
    any of its agent's sessions, or all of them."""
    if allowed.agent != agent_id:
        return wrong_agent(allowed, agent_id)
    if allowed.turn is not None:
        return ApiError(
            403,
            "stream_token_wrong_session",
            f"this stream token is for turn {allowed.turn} only",
            "follow the turn's stream, or ask POST /v1/stream-tokens for a session token",
        )
    if allowed.session is not None and session_key != allowed.session:
        return ApiError(
            403,
            "stream_token_wrong_session",
            "this stream token is for another session",
            "pass the token's own sessionKey (or none), or ask for a token of this session",
        )
    return None


# --- the firehose ------------------------------------------------------------------------------


async def events_stream(request: Request) -> Response:
    """``GET /v1/events?agentId&sessionKey&types&after&chunks&reasoning``: every event the caller
    may see, live from now, or from ``after`` / ``Last-Event-ID``; it never ends by itself."""
    feed = feed_of(request)
    who = principal(request)
    agent_id = request.query_params.get("agentId") or None
    session_key = request.query_params.get("sessionKey") or None
    if who.stream is not None:  # a session's token follows its session, named or not
        agent_id = agent_id or who.stream.agent
        session_key = session_key or who.stream.session
        problem = session_problem(who.stream, agent_id, session_key)
        if problem is not None:
            raise problem
    if agent_id is not None:
        visible_agent(request, agent_id, "agentId")
    types = types_param(request)
    chunks, implied = chunk_options(flag(request, "chunks"), types)
    reasoning = flag(request, "reasoning")
    after = cursor_param(request)
    if after is not None:
        await refuse_archived(request, after)
    scope = Scope(
        agent_id=agent_id,
        session_key=session_key,
        types=types,
        agents=who.agents,
        chunks=chunks,
        reasoning=reasoning,
    )
    subscribed = Subscribed(
        agent_id=agent_id,
        session_key=scope.session_key,
        types=sorted(types) if types else None,
        chunks=chunks,
        reasoning=reasoning,
        implied=implied,
        after=after.cursor() if after else None,
    )
    node = runtime(request).node_id

    async def frames() -> AsyncIterator[bytes]:
        with metrics.STREAM_SUBSCRIBERS.labels("sse_events").track_inprogress():
            async with feed.subscribe(scope, after) as sub:
                # Sent once registered: a client that acts on it misses nothing after it.
                yield frame("stream.subscribed", _ENCODE.encode(subscribed))
                while True:
                    batch = await sub.read(HEARTBEAT_S)
                    if not batch:
                        yield PING
                    for event in batch:
                        yield event_frame(event, node)

    return EventStream(frames(), headers=HEADERS, media_type="text/event-stream; charset=utf-8")


EVENTS_STREAM = Operation(
    "GET",
    "/v1/events",
    events_stream,
    "Firehose (SSE)",
    {"200": {"description": "SSE", "content": {SSE: {"schema": SSE_FRAME}}}},
    params=[
        param("agentId", "query", "Only this agent", required=False),
        param("sessionKey", "query", "Only this session", required=False),
        TYPES,
        AFTER,
        CHUNKS,
        REASONING,
    ],
    errors=("400", "401", "403", "404"),
    security="stream",
)

"""Server-sent event streams: one turn (``/v1/agents/{agent}/turns/{turnId}/stream``) and the
firehose (``/v1/events``). Both are read from the log through the node's :class:`Feed`, so a
reader that comes late or reconnects with ``Last-Event-ID`` (or ``?after=``) gets every event
after that cursor, in order, once. Each event frame's ``id:`` is its opaque cursor; control frames
(``turn.accepted``, ``stream.replay``, ``stream.subscribed``, ``stream.ended``) carry none, so
they never move a client's resume point.
"""

from __future__ import annotations

import difflib
from collections.abc import AsyncIterator

import msgspec
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response, StreamingResponse

from eventstore import REGISTRY, Checkpoint, RecordedEvent, StoreError, encode_wire, streams
from eventstore.catalogue import TurnEnd
from eventstore.feed import CHUNK, Feed, Scope, Subscription
from gateways import metrics
from gateways.api import (
    ApiError,
    agent,
    cursor_param,
    load_turn,
    not_ready,
    principal,
    runtime,
    visible_agent,
)
from gateways.schemas import AcceptedBody

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
    after: str | None


def frame(event: str, data: bytes, cursor: str | None = None) -> bytes:
    head = f"event: {event}\n" + (f"id: {cursor}\n" if cursor else "")
    return head.encode() + b"data: " + data + b"\n\n"


def event_frame(event: RecordedEvent) -> bytes:
    return frame(event.type, encode_wire(event), event.checkpoint.cursor())


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
    names = [t.strip() for t in raw.split(",") if t.strip()]
    for name in names:
        if name not in REGISTRY:
            close = difflib.get_close_matches(name, list(REGISTRY), n=1)
            hint = f"did you mean {close[0]!r}?" if close else "docs/events.md lists the types"
            raise ApiError(
                400, "unknown_event_type", f"{name!r} is not an event type", hint, "types"
            )
    return frozenset(names)


# --- one turn ----------------------------------------------------------------------------------


async def turn_stream(request: Request) -> Response:
    agent_id = agent(request).id
    turn = await load_turn(request, request.path_params["turn_id"], agent_id)
    return turn_stream_response(
        request,
        agent_id,
        turn.turn_id,
        after=cursor_param(request),
        chunks=flag(request, "chunks"),
        types=types_param(request),
    )


def turn_stream_response(
    request: Request,
    agent_id: str,
    turn_id: str,
    *,
    after: Checkpoint | None,
    chunks: bool,
    types: frozenset[str] | None = None,
    status: int = 200,
    accepted: AcceptedBody | None = None,
) -> Response:
    feed = feed_of(request)
    # The stream ends with its turn, so it always follows turn.end, shown or not.
    wanted = None if types is None else types | {TurnEnd.TYPE}
    scope = Scope(turn_id=turn_id, agent_id=agent_id, types=wanted, chunks=chunks)
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
                    from_=after.cursor() if after else None,
                    to=visible[-1].checkpoint.cursor() if visible else None,
                )
                yield frame("stream.replay", _ENCODE.encode(replay))
                batch = backlog
                while True:
                    for event in batch:
                        if shown(event):
                            yield event_frame(event)
                    if ended is not None:
                        yield _ended_frame(turn_id, ended)
                        return
                    batch = await sub.read(HEARTBEAT_S)
                    if not batch:
                        yield PING
                    ended = next((e for e in batch if isinstance(e.data, TurnEnd)), None)

    return StreamingResponse(
        frames(), status, headers=HEADERS, media_type="text/event-stream; charset=utf-8"
    )


async def turn_backlog(
    feed: Feed, sub: Subscription, turn_id: str, start: Checkpoint
) -> tuple[list[RecordedEvent], RecordedEvent | None]:
    """What a turn subscription replays before it goes live, and the turn's ``turn.end`` if the
    reader will see no more (it is in the replay, or the reader resumed after it)."""
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


# --- the firehose ------------------------------------------------------------------------------


async def events_stream(request: Request) -> Response:
    """``GET /v1/events?agentId&sessionKey&types&after&chunks``: every event the caller may see,
    live from now, or from ``after`` / ``Last-Event-ID``; it never ends by itself."""
    feed = feed_of(request)
    who = principal(request)
    agent_id = request.query_params.get("agentId") or None
    if agent_id is not None:
        visible_agent(request, agent_id, "agentId")
    types = types_param(request)
    chunks = flag(request, "chunks") or (types is not None and CHUNK in types)
    after = cursor_param(request)
    scope = Scope(
        agent_id=agent_id,
        session_key=request.query_params.get("sessionKey") or None,
        types=types,
        agents=who.agents,
        chunks=chunks,
    )
    subscribed = Subscribed(
        agent_id=agent_id,
        session_key=scope.session_key,
        types=sorted(types) if types else None,
        chunks=chunks,
        after=after.cursor() if after else None,
    )

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
                        yield event_frame(event)

    return StreamingResponse(
        frames(), headers=HEADERS, media_type="text/event-stream; charset=utf-8"
    )

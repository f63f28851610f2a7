"""The WebSocket gateway ``/v1/ws``: send messages, watch turns, sessions or agents from a cursor,
stop turns, on one socket (DESIGN.md 6).

Client frames (JSON objects with ``type``): ``message``, ``subscribe``, ``unsubscribe``, ``stop``,
``approve``, ``ping``. Server frames: ``ws.open``, ``ws.accepted``, ``ws.subscribed``,
``stream.replay``, event envelopes (with ``sub``, the subscription they belong to),
``stream.live``, ``stream.ended``, ``ws.unsubscribed``, ``ws.stopping``, ``ws.error``, ``pong``.

Memory per socket is bounded: subscriptions catch up from the log instead of buffering, and the
frames waiting for a slow socket are capped; past the cap the socket is closed with
:data:`SLOW_CONSUMER` and the client resumes each subscription from its last cursor. A client
that does not take even the close frame within :data:`CLOSE_GRACE_S` has its connection aborted
(see :func:`_shed`). Closing a socket never stops a turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import struct
from typing import Any, Literal, Protocol, cast

import msgspec
import structlog
from starlette import types as asgi
from starlette.websockets import WebSocket, WebSocketDisconnect

from actors.messages import TOO_DEEP, Refused, StopResult, StopTurn, too_deep
from eventstore import Checkpoint, InvalidCursor, RecordedEvent, encode_wire
from eventstore.catalogue import Deliver, Sender, TurnEnd
from eventstore.feed import Scope
from gateways import ingress
from gateways.api import approvals
from gateways.api.common import (
    ApiError,
    commands_of,
    not_addressable,
    principal,
    refuse_archived,
    runtime,
    visible_agent,
)
from gateways.api.turns import load_turn
from gateways.http import metrics
from gateways.http.auth import STREAM_READ_ONLY_HINT, SUBPROTOCOL
from gateways.ingress import field_of, shape_refused
from gateways.streams.sse import (
    chunk_options,
    feed_of,
    known_types,
    session_problem,
    turn_backlog,
    turn_problem,
)

log = structlog.get_logger("dispach.ws")

SLOW_CONSUMER = 4008
"""Close code: the socket did not read its frames fast enough; resume from your cursors."""
CLOSE_GRACE_S = 2.0
"""Seconds a slow consumer has, from its overflow, to take the close frame before its
connection is aborted."""
MAX_PENDING = 1024
"""Frames that may wait for one socket before it counts as a slow consumer."""
MAX_SUBSCRIPTIONS = 64
REPLAY_WAIT = 10.0
"""Seconds a replayed frame may wait for room in a socket's queue."""
HEARTBEAT_S = 15.0


class _Frame(msgspec.Struct, frozen=True, kw_only=True, rename="camel", tag_field="type"):
    pass


class MessageFrame(_Frame, tag="message", frozen=True):
    text: str
    agent_id: str | None = None
    session_key: str = ingress.DEFAULT_SESSION
    idempotency_key: str | None = None
    concurrency: Literal["queue", "reject", "interrupt"] | None = None
    deliver: Deliver | None = None
    sender: Sender | None = msgspec.field(default=None, name="from")
    ref: str | None = None


class SubscribeFrame(_Frame, tag="subscribe", frozen=True):
    turn_id: str | None = None
    agent_id: str | None = None
    session_key: str | None = None
    after: str | None = None
    chunks: bool = False
    """``model.chunk`` text deltas (also when ``types`` names ``model.chunk``)."""
    reasoning: bool = False
    """``model.chunk`` deltas of the model's thinking, with or without ``chunks``."""
    types: list[str] | None = None
    """Only these event types (a turn's subscription still ends at its ``turn.end``)."""
    sub: str | None = None


class UnsubscribeFrame(_Frame, tag="unsubscribe", frozen=True):
    sub: str


class StopFrame(_Frame, tag="stop", frozen=True):
    turn_id: str


class ApproveFrame(_Frame, tag="approve", frozen=True):
    approval_id: str
    granted: bool
    agent_id: str | None = None
    """The approval's agent (default: the socket's ``?agentId=``)."""
    ref: str | None = None


class PingFrame(_Frame, tag="ping", frozen=True):
    ref: str | None = None


ClientFrame = (
    MessageFrame | SubscribeFrame | UnsubscribeFrame | StopFrame | ApproveFrame | PingFrame
)
_DECODE = msgspec.json.Decoder(ClientFrame)
_ENCODE = msgspec.json.Encoder()


class SlowConsumer(Exception):
    pass


class Terms(msgspec.Struct, frozen=True, kw_only=True):
    """What a subscription gets, as ``ws.subscribed`` says it: its ``types`` (None: all),
    whether text chunks come (``implied``: only because ``types`` names ``model.chunk``), and
    whether reasoning chunks do."""

    types: list[str] | None
    chunks: bool
    reasoning: bool
    implied: bool


class Socket:
    """One connected client: its outgoing queue and its subscriptions."""

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws
        self.outbox: asyncio.Queue[bytes] = asyncio.Queue(MAX_PENDING)
        self.subs: dict[str, asyncio.Task[None]] = {}
        self._ids = itertools.count(1)
        self.default_agent = ws.query_params.get("agentId") or None
        self.overflowed = asyncio.Event()
        self.stream = principal(ws).stream
        self.scope = principal(ws).scope
        """The stream token the socket came with: then it may only subscribe, within it."""

    def send(self, kind: str, **data: Any) -> None:
        self.push(_ENCODE.encode({"type": kind, **data}))

    def push(self, frame: bytes) -> None:
        if self.overflowed.is_set():
            raise SlowConsumer
        try:
            self.outbox.put_nowait(frame)
        except asyncio.QueueFull:
            self.overflowed.set()
            raise SlowConsumer from None

    async def put(self, frame: bytes) -> None:
        """Queue a replayed frame, waiting up to :data:`REPLAY_WAIT` for room: a prompt reader
        may replay any length of history, a reader that stops reading is a slow consumer."""
        if self.overflowed.is_set():
            raise SlowConsumer
        try:
            await asyncio.wait_for(self.outbox.put(frame), REPLAY_WAIT)
        except TimeoutError:
            self.overflowed.set()
            raise SlowConsumer from None

    def error(self, code: str, message: str, hint: str, **extra: Any) -> None:
        self.send("ws.error", code=code, message=message, hint=hint, **extra)

    async def writer(self) -> None:
        while True:
            frame = await self.outbox.get()
            await self.ws.send_text(frame.decode())

    # --- frames --------------------------------------------------------------------------------

    async def handle(self, raw: str) -> None:
        if too_deep(raw):  # before decoding: msgspec would recurse into it
            self.error(TOO_DEEP.code, TOO_DEEP.message, TOO_DEEP.hint)
            return
        try:
            frame = _DECODE.decode(raw)
        except msgspec.ValidationError as e:
            shape = shape_refused(field_of(str(e)), str(e))  # a message's deliver or from
            if shape is not None:
                self.error(shape.code, shape.message, shape.hint, field=shape.field)
                return
            code = "unknown_frame_type" if "type" in str(e) else "frame_invalid"
            self.error(
                code,
                f"the frame does not fit: {e}",
                "frame types: message, subscribe, unsubscribe, stop, approve, ping",
            )
            return
        except msgspec.DecodeError:
            self.error("frame_not_json", "the frame is not JSON", "send one JSON object per frame")
            return
        refusal = self._refusal(frame)
        if refusal is not None:
            self.error(*refusal, ref=getattr(frame, "ref", None))
            return
        match frame:
            case PingFrame(ref=ref):
                self.send("pong", ref=ref)
            case MessageFrame():
                await self._message(frame)
            case SubscribeFrame():
                await self._subscribe(frame)
            case UnsubscribeFrame(sub=sub):
                task = self.subs.pop(sub, None)
                if task is None:
                    self.error(
                        "subscription_not_found",
                        f"no subscription {sub!r}",
                        "use the `sub` of a ws.subscribed frame",
                        sub=sub,
                    )
                    return
                task.cancel()
                self.send("ws.unsubscribed", sub=sub)
            case StopFrame(turn_id=turn_id):
                await self._stop(turn_id)
            case ApproveFrame():
                await self._approve(frame)

    def _refusal(self, frame: object) -> tuple[str, str, str] | None:
        """A frame that acts (message, stop, approve) on a socket that may only read: one
        opened with a stream token, or with a key whose scope is ``read``."""
        if not isinstance(frame, MessageFrame | StopFrame | ApproveFrame):
            return None
        kind = type(frame).__name__[:-5].lower()
        if self.stream is not None:
            return ("stream_token_read_only", f"a stream token cannot send a {kind} frame",
                    STREAM_READ_ONLY_HINT)  # fmt: skip
        if self.scope == "read":
            return ("scope_insufficient",
                    f"a {kind} frame needs the scope 'chat'; this key's scope is 'read'",
                    "mint a key with scope chat (or higher) and connect with it")  # fmt: skip
        return None

    async def _message(self, frame: MessageFrame) -> None:
        agent_id = frame.agent_id or self.default_agent
        if agent_id is None:
            self.error(
                "agent_id_required",
                "the message names no agent",
                "send agentId in the frame (or ?agentId= on the socket URL)",
                ref=frame.ref,
            )
            return
        if self._refuses_agent(agent_id, ref=frame.ref, message=True):
            return
        message = ingress.IngressMessage(
            text=frame.text,
            session_key=frame.session_key,
            source="ws",
            concurrency=frame.concurrency,
            deliver=frame.deliver,
            idempotency_key=frame.idempotency_key,
            sender=frame.sender,
        )
        result = ingress.check(message) or await ingress.submit(
            commands_of(self.ws), agent_id, message
        )
        if isinstance(result, Refused):
            self.error(result.code, result.message, result.hint, ref=frame.ref)
            return
        extra = {"replayed": True} if result.replayed else {}
        self.send(
            "ws.accepted",
            ref=frame.ref,
            turnId=result.turn_id,
            sessionKey=result.session_key,
            **extra,
        )

    async def _subscribe(self, frame: SubscribeFrame) -> None:
        sub_id = frame.sub or f"s{next(self._ids)}"
        if sub_id in self.subs:
            self.error(
                "subscription_exists",
                f"subscription {sub_id!r} exists",
                "unsubscribe first, or pick another `sub`",
                sub=sub_id,
            )
            return
        if len(self.subs) >= MAX_SUBSCRIPTIONS:
            self.error(
                "too_many_subscriptions",
                f"a socket may hold {MAX_SUBSCRIPTIONS}",
                "unsubscribe from what you no longer watch",
                sub=sub_id,
            )
            return
        try:
            after = Checkpoint.from_cursor(frame.after) if frame.after else None
        except InvalidCursor:
            self.error(
                "cursor_invalid",
                f"{frame.after!r} is not a cursor of this server",
                "pass the `cursor` of an event you received",
                sub=sub_id,
            )
            return
        try:
            types = None if frame.types is None else known_types(frame.types)
        except ApiError as e:
            self.error(e.code, e.message, e.hint, sub=sub_id, field=e.field)
            return
        chunks, implied = chunk_options(frame.chunks, types)
        reasoning = frame.reasoning
        if frame.turn_id is not None:
            try:
                turn = await load_turn(self.ws, frame.turn_id, None)
                # Its catch-up would pass over archived events: refused first (see sse.py).
                await refuse_archived(self.ws, after or Checkpoint(), turn.turn_id)
            except ApiError as e:
                self.error(e.code, e.message, e.hint, sub=sub_id)
                return
            if self.stream is not None and (
                problem := turn_problem(self.stream, turn.agent_id, turn.turn_id, turn.session_key)
            ):
                self.error(problem.code, problem.message, problem.hint, sub=sub_id)
                return
            # A turn's subscription ends with it, so it always follows turn.end, shown or not.
            wanted = None if types is None else types | {TurnEnd.TYPE}
            scope = Scope(turn_id=turn.turn_id, agent_id=turn.agent_id, types=wanted,
                          chunks=chunks, reasoning=reasoning)  # fmt: skip
        elif frame.agent_id is not None:
            if self.stream is not None and (
                problem := session_problem(self.stream, frame.agent_id, frame.session_key)
            ):
                self.error(problem.code, problem.message, problem.hint, sub=sub_id)
                return
            if self._refuses_agent(frame.agent_id, ref=None, sub=sub_id) or (
                after is not None and await self._archived(after, sub_id)
            ):
                return
            scope = Scope(agent_id=frame.agent_id, session_key=frame.session_key, types=types,
                          chunks=chunks, reasoning=reasoning)  # fmt: skip
        else:
            self.error(
                "subscribe_needs_target",
                "subscribe names neither a turn nor an agent",
                "send turnId, or agentId (and sessionKey)",
                sub=sub_id,
            )
            return
        terms = Terms(types=sorted(types) if types is not None else None, chunks=chunks,
                      reasoning=reasoning, implied=implied)  # fmt: skip
        pump = self._pump(sub_id, scope, after, terms)
        task = asyncio.create_task(pump, name=f"ws-{sub_id}")
        task.add_done_callback(_log_failure)
        self.subs[sub_id] = task

    async def _archived(self, after: Checkpoint, sub_id: str) -> bool:
        """Whether a catch-up from ``after`` would pass over archived events: then refused
        (``cursor_archived``), as the SSE streams refuse it."""
        try:
            await refuse_archived(self.ws, after)
        except ApiError as e:
            self.error(e.code, e.message, e.hint, sub=sub_id)
            return True
        return False

    async def _pump(
        self, sub_id: str, scope: Scope, after: Checkpoint | None, terms: Terms
    ) -> None:
        feed = feed_of(self.ws)
        node = runtime(self.ws).node_id
        prefix = b'{"sub":' + _ENCODE.encode(sub_id) + b","
        turn_id = scope.turn_id
        shown = None if terms.types is None else frozenset(terms.types)
        # A turn is watched from its beginning; an agent or session from now, unless resumed.
        start = after if after is not None or turn_id is None else Checkpoint()
        async with feed.subscribe(scope, start) as sub:
            # Confirmed once registered: whatever the client does next, it misses nothing.
            self.send("ws.subscribed", sub=sub_id, turnId=turn_id, agentId=scope.agent_id,
                      sessionKey=scope.session_key, **msgspec.to_builtins(terms))  # fmt: skip
            ended = None
            if turn_id is not None:
                assert start is not None
                backlog, ended = await turn_backlog(feed, sub, turn_id, start)
            else:
                backlog = await sub.backlog()
            if shown is not None:  # a turn's end is followed, not shown, unless asked for
                backlog = [e for e in backlog if e.type in shown]
            self.send("stream.replay", sub=sub_id, events=len(backlog),
                      **{"from": after.cursor() if after else None},
                      to=backlog[-1].checkpoint.cursor() if backlog else None)  # fmt: skip
            for event in backlog:  # a replay may be long: wait (boundedly) for a reader
                await self.put(prefix + encode_wire(event, node)[1:])
            if ended is not None:
                self._ended(sub_id, ended)
                return
            self.send("stream.live", sub=sub_id)
            while True:
                for event in await sub.read(HEARTBEAT_S):
                    if shown is None or event.type in shown:
                        self.push(prefix + encode_wire(event, node)[1:])
                    if turn_id is not None and isinstance(event.data, TurnEnd):
                        self._ended(sub_id, event)
                        return

    def _ended(self, sub_id: str, event: RecordedEvent) -> None:
        assert isinstance(event.data, TurnEnd)
        self.send("stream.ended", sub=sub_id, turnId=event.metadata.turn_id,
                  status=event.data.reason, steps=event.data.steps)  # fmt: skip
        self.subs.pop(sub_id, None)

    async def _approve(self, frame: ApproveFrame) -> None:
        agent_id = frame.agent_id or self.default_agent
        if agent_id is None:
            self.error("agent_id_required", "the approve frame names no agent",
                       "send agentId in the frame (or ?agentId= on the socket URL)",
                       ref=frame.ref)  # fmt: skip
            return
        if self._refuses_agent(agent_id, ref=frame.ref):
            return
        answer = await approvals.resolve(self.ws, agent_id, frame.approval_id, frame.granted,
                                         "ws")  # fmt: skip
        if isinstance(answer, Refused):
            self.error(answer.code, answer.message, answer.hint, ref=frame.ref)
            return
        self.send("ws.approved", ref=frame.ref, approvalId=answer.approval_id,
                  granted=answer.granted)  # fmt: skip

    async def _stop(self, turn_id: str) -> None:
        try:
            turn = await load_turn(self.ws, turn_id, None)
        except ApiError as e:
            self.error(e.code, e.message, e.hint, turnId=turn_id)
            return
        found = False
        if turn.status == "running":
            result = await commands_of(self.ws).stop(StopTurn(turn_id=turn_id, by="ws"))
            found = isinstance(result, StopResult) and result.stopping
        self.send("ws.stopping", turnId=turn_id, found=found)

    def _refuses_agent(self, agent_id: str, *, message: bool = False, **extra: Any) -> bool:
        """Send ``agent_not_found`` (as the HTTP routes answer it) unless the caller may see
        the agent, and for a ``message``, ``agent_not_addressable`` for a team's member; True
        when it was refused."""
        try:
            found = visible_agent(self.ws, agent_id, "agentId")
        except ApiError as e:
            self.error(e.code, e.message, e.hint, **extra)
            return True
        problem = not_addressable(found) if message else None
        if problem is not None:
            self.error(problem.code, problem.message, problem.hint, **extra)
            return True
        return False


class _Transport(Protocol):
    """The part of an asyncio (or uvloop) transport that :func:`_shed` uses."""

    def abort(self) -> None: ...

    def is_closing(self) -> bool: ...

    def get_write_buffer_size(self) -> int: ...

    def get_extra_info(self, name: str, default: Any = None) -> Any: ...


def _transport_of(receive: asgi.Receive) -> _Transport | None:
    """The connection under a WebSocket, to abort it. ASGI can only close a socket with a close
    frame, which waits behind the frames the client has not read: uvicorn's ``send`` waits for
    the transport to be writable, and ``transport.close()`` waits for its buffer to flush, so a
    client that never reads would keep its connection (and our send buffer) for good. uvicorn
    (either WebSocket protocol) passes the app its protocol's bound ``receive``, which no
    middleware of ours wraps, and the protocol holds its transport. Another server: None, and
    a slow consumer is only closed."""
    transport = getattr(getattr(receive, "__self__", None), "transport", None)
    needs = ("abort", "is_closing", "get_write_buffer_size", "get_extra_info")
    usable = all(callable(getattr(transport, name, None)) for name in needs)
    return cast("_Transport", transport) if usable else None


async def _shed(ws: WebSocket, transport: _Transport | None) -> None:
    """Drop a slow consumer: close it with :data:`SLOW_CONSUMER` as soon as it can take a frame,
    and abort the connection unless the closing handshake is over within :data:`CLOSE_GRACE_S`
    (the client read up to the close frame and answered it, and uvicorn closed the transport).
    Nothing short of that says the client has the frame: what left this process may still sit
    in the kernel's send buffer, which a closed socket keeps trying to deliver for minutes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CLOSE_GRACE_S
    with contextlib.suppress(Exception):  # TimeoutError: not writable in time; or it is gone
        async with asyncio.timeout_at(deadline):
            await ws.close(SLOW_CONSUMER, "slow_consumer: reconnect and resume from cursors")
    if transport is not None:
        loop.call_at(deadline, _abort_unless_closed, transport)


def _abort_unless_closed(transport: _Transport) -> None:
    unsent = transport.get_write_buffer_size()
    if transport.is_closing() and not unsent:
        return  # closed after the client's answer (or it went away)
    log.info("ws_aborted", reason="slow_consumer", unsent=unsent)
    # A reset, not a close: a closed socket's kernel buffer would still wait for the client to
    # read it (an orphan holding the connection for minutes); with SO_LINGER 0 it is dropped.
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class WebSocketEndpoint:
    """The ASGI app of ``/v1/ws``: a plain ASGI callable (Starlette routes it as is), so that it
    sees the server's own ``receive`` (:func:`_transport_of`)."""

    async def __call__(self, scope: asgi.Scope, receive: asgi.Receive, send: asgi.Send) -> None:
        await serve(WebSocket(scope, receive, send), _transport_of(receive))


async def serve(ws: WebSocket, transport: _Transport | None = None) -> None:
    offered = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",")]
    await ws.accept(subprotocol=SUBPROTOCOL if offered and offered[0] == SUBPROTOCOL else None)
    sock = Socket(ws)
    writer = asyncio.create_task(sock.writer(), name="ws-writer")
    overflow = asyncio.create_task(sock.overflowed.wait(), name="ws-overflow")
    reader: asyncio.Task[None] | None = None
    with metrics.STREAM_SUBSCRIBERS.labels("ws").track_inprogress():
        try:
            sock.send("ws.open", agentId=sock.default_agent, node=runtime(ws).node_id)
            reader = asyncio.create_task(_read(ws, sock), name="ws-reader")
            reader.add_done_callback(_log_failure)
            await asyncio.wait({reader, writer, overflow}, return_when=asyncio.FIRST_COMPLETED)
            if sock.overflowed.is_set():
                log.info("ws_slow_consumer", pending=sock.outbox.qsize())
                metrics.WS_SLOW_CONSUMERS.inc()
                writer.cancel()  # what is queued is dropped: the client resumes from its cursors
                await _shed(ws, transport)
        finally:
            tasks = [t for t in (reader, writer, overflow, *sock.subs.values()) if t is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


websocket_endpoint = WebSocketEndpoint()


def _log_failure(task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    error = task.exception()
    if error is not None and not isinstance(error, SlowConsumer | WebSocketDisconnect):
        log.warning("ws_task_failed", task=task.get_name(), error=repr(error))


async def _read(ws: WebSocket, sock: Socket) -> None:
    while True:
        try:
            raw = await ws.receive_text()
        except WebSocketDisconnect:
            return
        except KeyError:  # a binary frame
            sock.error("frame_not_json", "binary frames are not understood", "send JSON text")
            continue
        try:
            await sock.handle(raw)
        except ApiError as e:  # e.g. the node is not ready: the socket stays usable
            sock.error(e.code, e.message, e.hint)

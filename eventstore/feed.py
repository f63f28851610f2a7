"""One live reader of the log per node, shared by every stream the node serves.

A thousand SSE and WebSocket readers must not mean a thousand tails polling Postgres. The
:class:`Feed` runs a single :meth:`EventStore.subscribe` and hands each new event to the
subscriptions whose :class:`Scope` wants it. A subscription that starts in the past (a cursor, or
a turn from its beginning) first catches up from Postgres with a query narrowed to its scope, then
switches to the feed without a gap or a repeat:

1. It registers with the feed first, so every event the feed hands out from then on is queued.
2. It reads the log after its cursor until a short page. Everything the feed handed out before
   registration was committed then, so this read sees it.
3. It drains the queue, dropping what it already delivered: both sources are in checkpoint order,
   so "already delivered" is "checkpoint <= last delivered".

Memory stays bounded: a subscription whose reader falls behind by more than its buffer drops its
queue and catches up from Postgres again, from the last event it delivered. Lossless either way.

A turn this node runs is also held in memory as the writer commits it (:meth:`Feed.remember`,
handed the node's own commits on the loop, in commit order): a reader of that turn gets what
memory holds at once, without a query, and then reads from memory: each new commit of the turn
is handed to it as it is remembered, before the tail has read it (:class:`Subscription`).
Memory serves a turn only while it holds the turn's stream complete, from its first event
without a gap, and it holds with it the node's events on other streams that carry the turn's id
(a note the turn's tool writes on the session's stream): the turn's scope is every event with
its id, so memory must hold all of the scope up to its last event. Those come through the same
writer, so in the same order as the log's; another node's appends to the turn come after this
node's last (behind the ownership fence), and an outbox's events after the ``turn.end`` that
promised them. Memory can still lack what another node wrote after it took the turn over, so a
reader of memory watches the tail: an event of its scope that memory does not give soon, memory
letting the turn go, or a long silence sends it to Postgres, after the last event it gave.

Whether what memory holds of a turn is *all* of it, now, is a question of ownership
(:meth:`Feed.whole`): only the owner of a session's partition appends to its turns, under the
partition's epoch, so while this node owns it under the epoch it owned it under at the turn's
first event, no other node can have written to the turn. A lost partition drops its epoch here,
and one won back has a higher one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from typing import Any

import msgspec
import structlog

from eventstore.catalogue import TurnEnd
from eventstore.envelope import START, Checkpoint, Metadata, RecordedEvent
from eventstore.errors import StoreUnavailable
from eventstore.event import UnknownEvent, encode_data
from eventstore.projections.turns import TURN_COLUMNS, turn_row
from eventstore.store import EventStore

log = structlog.get_logger("dispach.feed")

_PAGE = 500
_RECENT_EVENTS = 4096
"""Events of recent turns held in memory, all turns together (the oldest turns go first)."""
_RECENT_BYTES = 8 << 20
"""And their data's size as stored, all together: a turn's input, a tool's output or a model's
reply can each be large (a request body may be 1 MB), and 4,096 of them must not be."""
_ENDED_TURNS = 4096
"""Turns that ended while held, kept as their final turn rows (what a poll of the turn reads)
after their events go, the newest this many..."""
_ENDED_BYTES = 2 << 20
"""...and within this size all together, counting a row's texts and ``_ENDED_ROW``."""
_ENDED_ROW = 600
"""About what a final row costs besides its texts: the tuple, its numbers and times."""
_WITNESS_GRACE = 0.1
"""How long memory may take to give an event the tail has read (it is handed over on the loop
right after its commit, so a millisecond or so) before the reader catches up from Postgres."""
_SILENCE = 1.0
"""How long a reader of memory waits for the next event before it looks in Postgres too."""
_TURN_STREAM = "turn-"
CHUNK = "model.chunk"
REASONING = "reasoning"
"""The ``kind`` of a ``model.chunk`` that carries the model's thinking, not its answer."""

OwnerOf = Callable[[Metadata], Hashable | None]
"""Under what this node writes a session's turns now (its partition's epoch), from an event's
metadata; None when it does not own the session."""


class Scope(msgspec.Struct, frozen=True, kw_only=True):
    """What a subscription wants: one turn, or an agent (and a session), and some types."""

    turn_id: str | None = None
    agent_id: str | None = None
    session_key: str | None = None
    types: frozenset[str] | None = None
    agents: frozenset[str] | None = None
    """The agents the reader may see at all (a scoped token); None means every agent."""
    chunks: bool = True
    """Whether ``model.chunk`` events of kind ``text`` (the answer's deltas) are wanted."""
    reasoning: bool = False
    """Whether ``model.chunk`` events of kind ``reasoning`` (the model's thinking) are wanted:
    only when asked, whatever ``chunks`` says; thinking is not part of the answer."""

    def matches(self, event: RecordedEvent) -> bool:
        if event.type == CHUNK and not (
            self.reasoning if getattr(event.data, "kind", "text") == REASONING else self.chunks
        ):
            return False
        meta = event.metadata
        if self.turn_id is not None and meta.turn_id != self.turn_id:
            return False
        if self.agent_id is not None and meta.agent_id != self.agent_id:
            return False
        if self.agents is not None and meta.agent_id not in self.agents:
            return False
        if self.session_key is not None and meta.session_key != self.session_key:
            return False
        return self.types is None or event.type in self.types


class Subscription:
    """Events of one scope after a checkpoint, in log order, read with :meth:`read`.

    A subscription to a turn that memory holds whole (:meth:`start_after`) reads from memory:
    this node's commits of the turn, handed over as they commit, and no query while that lasts.
    The tail's events then only witness that the log went on: one that memory has not given
    within ``_WITNESS_GRACE`` (another node wrote to the turn), memory letting the turn go, an
    overflow, or ``_SILENCE`` without an event (the turn may go on elsewhere) end the reading
    from memory, and the subscription catches up from Postgres after its last event, as any
    other does (see the module docstring for why memory's events are a prefix of the turn's)."""

    def __init__(self, feed: Feed, scope: Scope, after: Checkpoint | None, buffer: int) -> None:
        self.scope = scope
        self._feed = feed
        self._buffer = buffer
        self._queue: deque[RecordedEvent] = deque()
        self._wake = asyncio.Event()
        self._catch_up = after is not None
        self._memory = False
        """Reading from memory (see the class docstring)."""
        self._witness: Checkpoint | None = None
        """The furthest event the tail offered beyond ``last`` while reading from memory."""
        self._witnessed_at = 0.0
        """When memory must have given the witnessed event (loop time)."""
        self._heard = 0.0
        """When memory last gave an event (loop time)."""
        self.last: Checkpoint = after if after is not None else feed.position
        """The checkpoint of the last event handed to the reader (or where it started)."""
        self.overflows = 0
        """How often the reader fell behind by more than ``buffer`` and caught up again."""
        self.closed = False

    def offer(self, event: RecordedEvent) -> None:
        """Called by the feed's tail, on the loop, for every event of this scope."""
        if self._memory:
            checkpoint = event.checkpoint
            if checkpoint > self.last and (self._witness is None or checkpoint > self._witness):
                if self._witness is None:
                    self._witnessed_at = asyncio.get_running_loop().time() + _WITNESS_GRACE
                self._witness = checkpoint
                self._wake.set()
            return
        self._queue_up(event)

    def offer_held(self, event: RecordedEvent) -> None:
        """Called by :meth:`Feed.remember`, on the loop, for this node's commits of the turn."""
        if self._memory:
            self._heard = asyncio.get_running_loop().time()
            self._queue_up(event)

    def _queue_up(self, event: RecordedEvent) -> None:
        if len(self._queue) >= self._buffer:
            self._queue.clear()
            self._catch_up = True
            self._reading_memory(False)
            self.overflows += 1
        else:
            self._queue.append(event)
        self._wake.set()

    def leave_memory(self) -> None:
        """Catch up from Postgres after the last event given, then follow the tail."""
        if self._memory:
            self._reading_memory(False)
            self._witness = None
            self._catch_up = True
            self._wake.set()

    def _reading_memory(self, reading: bool) -> None:
        if reading != self._memory:
            self._memory = reading
            self._feed._memory_readers += 1 if reading else -1

    async def read(self, timeout: float) -> list[RecordedEvent]:
        """The next events, or ``[]`` when none arrived within ``timeout`` seconds."""
        while True:
            if self._catch_up:
                overflows = self.overflows
                page = await self._read_page()
                if page is None:  # the store is down: the caller gets to send a heartbeat
                    await asyncio.sleep(min(timeout, self._feed.store.poll_interval))
                    return []
                if len(page) < _PAGE and self.overflows == overflows:
                    # Caught up; unless the queue overflowed during the read, which dropped
                    # events this page (an older snapshot) may not hold: then read again.
                    self._catch_up = False
                if page:
                    self.last = page[-1].checkpoint
                    matching = [e for e in page if self.scope.matches(e)]
                    if matching:
                        return matching
                continue
            if self._queue:
                fresh = self._drain()
                if fresh:
                    return fresh
                continue
            wait, memory_due = timeout, False
            left = self._memory_left()
            if left is not None and left <= 0:
                self.leave_memory()
                continue
            if left is not None and left < timeout:
                wait, memory_due = left, True
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
            except TimeoutError:
                if memory_due:
                    self.leave_memory()
                    continue
                return []

    def _drain(self) -> list[RecordedEvent]:
        """What the queue holds after ``last``: after a catch-up it may hold what the page
        held already. Each event once, in order."""
        fresh = []
        last = self.last
        for event in self._queue:
            checkpoint = event.checkpoint
            if checkpoint > last:
                fresh.append(event)
                last = checkpoint
        self._queue.clear()
        self.last = last
        return fresh

    def _memory_left(self) -> float | None:
        """Seconds left before a reader of memory looks in Postgres (None: not reading from
        memory): until a witnessed event is due from memory, or the silence is too long."""
        if not self._memory:
            return None
        if self._witness is not None and self._witness <= self.last:
            self._witness = None  # memory gave it: the tail had read it first
        due = self._heard + _SILENCE if self._witness is None else self._witnessed_at
        return due - asyncio.get_running_loop().time()

    def start_after(self, events: Sequence[RecordedEvent]) -> list[RecordedEvent]:
        """The reader has ``events`` already, what :meth:`Feed.recent` held of its turn right
        after it subscribed: it goes on from memory after the last of them (see the class
        docstring). Returns those of this subscription's scope."""
        if events:
            self.last = max(self.last, events[-1].checkpoint)
        if self.scope.turn_id is not None and self._feed.held(self.scope.turn_id) is not None:
            self._catch_up, self._witness = False, None
            self._heard = asyncio.get_running_loop().time()
            self._reading_memory(True)
        return [e for e in events if self.scope.matches(e)]

    @property
    def catching_up(self) -> bool:
        return self._catch_up

    async def backlog(self, limit: int = 10_000) -> list[RecordedEvent]:
        """Everything there is to read right now (the catch-up, then what the feed queued),
        without waiting for new events; at most about ``limit`` events."""
        out: list[RecordedEvent] = []
        while self._catch_up and len(out) < limit:
            got = await self.read(self._feed.store.poll_interval)
            if not got and self._catch_up:
                break  # the store is unavailable: the live loop will catch up later
            out.extend(got)
        if self._queue and len(out) < limit:
            out.extend(await self.read(0))
        return out

    async def _read_page(self) -> list[RecordedEvent] | None:
        store, scope = self._feed.store, self.scope
        try:
            if scope.turn_id is not None:
                page = await store.aread_turn(scope.turn_id, self.last, _PAGE)
            else:
                page = await store.aread_scoped(
                    self.last,
                    _PAGE,
                    agent_id=scope.agent_id,
                    session_key=scope.session_key,
                    types=sorted(scope.types) if scope.types is not None else None,
                )
        except StoreUnavailable as e:
            log.warning("catch_up_failed", error=e.message)
            return None
        return page  # the queries narrow most of it; read() applies the whole scope

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._reading_memory(False)
            self._feed._remove(self)


class Feed:
    """The node's one tail of the log (see the module docstring).

    The tail runs only while someone subscribes (plus a short grace), so a node nobody streams
    from pays nothing for it; a subscription that arrives while it is idle starts it from the head
    of the log at that moment.
    """

    def __init__(self, store: EventStore, *, grace: float = 5.0) -> None:
        self.store = store
        self.grace = grace
        self.position: Checkpoint = START
        self._turns: dict[str, set[Subscription]] = {}
        self._wide: set[Subscription] = set()
        self._turn_readers = 0
        """Subscriptions in ``_turns``, all turns together."""
        self._memory_readers = 0
        """Of those, the ones reading from memory (they need no tail for this node's commits)."""
        self._ready = asyncio.Event()
        self._tail: asyncio.Task[None] | None = None
        self._starting = asyncio.Lock()
        self._idle: asyncio.TimerHandle | None = None
        self._recent: OrderedDict[str, list[RecordedEvent]] = OrderedDict()
        """Per turn stream: the turn's events this node committed, in commit order."""
        self._heads: dict[str, int] = {}
        """Per turn stream held: the version of its last event."""
        self._held = 0
        self._bytes: dict[str, int] = {}
        """Per turn stream held: the size of its events' data, as stored."""
        self._held_bytes = 0
        self._owners: dict[str, Hashable] = {}
        """Per turn stream held: what ``owner_of`` said at its first event, if not None."""
        self._ended: OrderedDict[str, tuple[Any, ...]] = OrderedDict()
        """Per turn id, of a turn held to its end: its size as counted, then its final row
        (``TURN_COLUMNS``' values), the oldest first."""
        self._ended_bytes = 0
        self.owner_of: OwnerOf | None = None
        """Set by the node once its ownership is known; without it no turn is :meth:`whole`."""

    def remember(self, committed: Sequence[RecordedEvent]) -> None:
        """This node's own commits, in commit order (on the loop): turn streams are held while
        complete from their first event, with the events of other streams that carry a held
        turn's id, up to ``_RECENT_EVENTS`` events and ``_RECENT_BYTES`` of data in all."""
        for event in committed:
            held = self._holder(event)
            if held is None:
                continue
            stream, events = held
            events.append(event)
            data = event.data  # ours, so known (an UnknownEvent only comes from reading)
            size = len(data.raw if isinstance(data, UnknownEvent) else encode_data(data))
            self._bytes[stream] = self._bytes.get(stream, 0) + size
            self._held += 1
            self._held_bytes += size
            subs = self._turns.get(stream[len(_TURN_STREAM) :]) if self._turns else None
            if subs:
                for sub in subs:
                    if sub.scope.matches(event):
                        sub.offer_held(event)
            if isinstance(data, TurnEnd) and stream == event.stream:
                self._end(stream, events)
        while (self._held > _RECENT_EVENTS or self._held_bytes > _RECENT_BYTES) and self._recent:
            self._forget(next(iter(self._recent)))

    def _holder(self, event: RecordedEvent) -> tuple[str, list[RecordedEvent]] | None:
        """The held turn stream an event of this node's joins, and what memory holds of it;
        None when memory does not hold (or stops holding) that turn."""
        if event.stream.startswith(_TURN_STREAM):
            stream = event.stream
            if self._ended:
                # Nothing follows a turn's end; if something does, its row is not final.
                self._unend(stream[len(_TURN_STREAM) :])
            held = self._recent.get(stream)
            if held is None:
                if event.version != 0:
                    return None  # begun elsewhere (a resumed turn): Postgres has its start
                held = self._hold(stream, event.metadata)
            elif self._heads[stream] + 1 != event.version:
                self._forget(stream)  # a gap: another node wrote to it meanwhile
                return None
            self._heads[stream] = event.version
            return stream, held
        if event.metadata.turn_id is None:
            return None
        stream = _TURN_STREAM + event.metadata.turn_id
        held = self._recent.get(stream)
        return None if held is None else (stream, held)  # else a turn memory does not serve

    def _end(self, stream: str, held: Sequence[RecordedEvent]) -> None:
        """A held turn ended: its final row is kept (:meth:`ended`), folded once, when nothing
        was promised to a channel. It outlives the turn's events, which memory lets go after
        about 500 turns (under a second at full load): a client that polls a turn a few
        seconds after its end is still not a query."""
        row = turn_row(held)
        if row is None or row["status"] == "running":
            return
        size = _ENDED_ROW + len(row["input"]) + len(row["text"]) + len(row["reasoning"])
        self._ended[stream[len(_TURN_STREAM) :]] = (size, *map(row.__getitem__, TURN_COLUMNS))
        self._ended_bytes += size
        while len(self._ended) > _ENDED_TURNS or self._ended_bytes > _ENDED_BYTES:
            self._ended_bytes -= self._ended.popitem(last=False)[1][0]

    def _unend(self, turn_id: str) -> None:
        kept = self._ended.pop(turn_id, None)
        if kept is not None:
            self._ended_bytes -= kept[0]

    def _hold(self, stream: str, metadata: Metadata) -> list[RecordedEvent]:
        """Begin holding a turn stream, noting under which epoch this node writes it."""
        held: list[RecordedEvent] = []
        self._recent[stream] = held
        owner = self.owner_of(metadata) if self.owner_of is not None else None
        if owner is not None:
            self._owners[stream] = owner
        return held

    def _forget(self, stream: str) -> None:
        self._held -= len(self._recent.pop(stream, ()))
        self._held_bytes -= self._bytes.pop(stream, 0)
        self._heads.pop(stream, None)
        self._owners.pop(stream, None)
        for sub in self._turns.get(stream[len(_TURN_STREAM) :], ()):
            sub.leave_memory()

    def recent(self, turn_id: str, after: Checkpoint) -> list[RecordedEvent] | None:
        """The turn's events after ``after`` from memory, or None when memory does not hold
        the turn from its first event (read it from Postgres)."""
        held = self.held(turn_id)
        if held is None:
            return None
        return [e for e in held if e.checkpoint > after]

    def held(self, turn_id: str) -> Sequence[RecordedEvent] | None:
        """Every event memory holds of the turn (its stream from the first event, with the
        node's events on other streams that carry its id), or None. Not to be changed."""
        return self._recent.get(_TURN_STREAM + turn_id)

    def ended(self, turn_id: str) -> dict[str, Any] | None:
        """The final row (``turn_row``'s) of a turn memory held to its end, with nothing
        promised to a channel, while it is among the newest kept (its events may be gone);
        else None. A new dict each call."""
        kept = self._ended.get(turn_id)
        return None if kept is None else dict(zip(TURN_COLUMNS, kept[1:], strict=True))

    def whole(self, turn_id: str) -> Sequence[RecordedEvent] | None:
        """:meth:`held`, when it is all of the turn's scope in the log now: this node has owned
        the turn's session, under one epoch, since the turn's first event (so only this node
        wrote to it, and each of its commits is here from the writer's hand-over on, the moment
        its appender is answered). None otherwise, or when it cannot know."""
        stream = _TURN_STREAM + turn_id
        held = self._recent.get(stream)
        owner = self._owners.get(stream)
        if held is None or owner is None or self.owner_of is None:
            return None
        return held if self.owner_of(held[0].metadata) == owner else None

    @property
    def subscribers(self) -> int:
        return len(self._wide) + self._turn_readers

    @property
    def tails_own_commits(self) -> bool:
        """Whether a reader needs the tail to read this node's own commits right away (the
        node wakes it after each of them only then): not while every reader is one of a turn
        memory holds, which memory hands those commits to. Other nodes' commits still wake the
        tail (their hints come over NATS), and it polls besides."""
        return bool(self._wide) or self._turn_readers > self._memory_readers

    @property
    def tailing(self) -> bool:
        return self._tail is not None and not self._tail.done()

    async def run(self) -> None:
        """Own the tail until cancelled (the node runs this as a task)."""
        self._ready.set()
        try:
            await asyncio.Event().wait()
        finally:
            await self._stop_tail()

    async def ready(self) -> None:
        await self._ready.wait()

    @contextlib.asynccontextmanager
    async def subscribe(
        self, scope: Scope, after: Checkpoint | None = None, *, buffer: int = 1024
    ) -> AsyncIterator[Subscription]:
        """A subscription to ``scope``: from ``after`` (a checkpoint, catching up from Postgres),
        or live from now when ``after`` is None. Closed when the block exits."""
        await self._ready.wait()
        await self._ensure_tail()
        sub = Subscription(self, scope, after, buffer)
        if scope.turn_id is not None:
            self._turns.setdefault(scope.turn_id, set()).add(sub)
            self._turn_readers += 1
        else:
            self._wide.add(sub)
        try:
            if after is None:
                # "From now" is the head of the log, not what the tail has handed out so far:
                # events committed before this point but not yet tailed are not the reader's.
                with contextlib.suppress(StoreUnavailable):  # then the tail's position
                    sub.last = max(sub.last, await self.store.ahead())
            yield sub
        finally:
            sub.close()

    async def _ensure_tail(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        async with self._starting:
            if self.tailing:
                return
            # Live-only subscriptions start at this position: nothing committed after this read
            # can be missed, because the tail reads everything after it.
            self.position = await self.store.ahead()
            self._tail = asyncio.create_task(self._follow(self.position), name="feed-tail")
            self._tail.add_done_callback(_report)

    async def _follow(self, start: Checkpoint) -> None:
        async for event in self.store.subscribe(start):
            self.position = event.checkpoint
            if self._wide:
                for sub in self._wide:
                    if sub.scope.matches(event):
                        sub.offer(event)
            turn_id = event.metadata.turn_id
            if turn_id is not None and self._turns:
                for sub in self._turns.get(turn_id, ()):
                    if sub.scope.matches(event):
                        sub.offer(event)

    def _maybe_idle(self) -> None:
        if self.subscribers == 0 and self._idle is None and self.tailing:
            loop = asyncio.get_running_loop()
            self._idle = loop.call_later(self.grace, self._stop_if_idle)

    def _stop_if_idle(self) -> None:
        self._idle = None
        if self.subscribers == 0 and self._tail is not None:
            self._tail.cancel()
            self._tail = None

    async def _stop_tail(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        tail, self._tail = self._tail, None
        if tail is not None:
            tail.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tail

    def _remove(self, sub: Subscription) -> None:
        turn_id = sub.scope.turn_id
        if turn_id is None:
            self._wide.discard(sub)
            self._maybe_idle()
            return
        subs = self._turns.get(turn_id)
        if subs is not None and sub in subs:
            subs.discard(sub)
            self._turn_readers -= 1
            if not subs:
                del self._turns[turn_id]
        self._maybe_idle()


def _report(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("feed_tail_failed", exc_info=task.exception())

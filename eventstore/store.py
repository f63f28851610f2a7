"""The event store: the one door to the log.

Callers on the event loop (actors, gateways, subscriptions, projection runners) use the
``a``-prefixed coroutines and :meth:`EventStore.submit` (awaited with
``eventstore.bridge.settled``); the CLI's commands, which run without a loop, use the blocking
reads. Every append goes through
one :class:`GroupCommitWriter`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import psycopg
import psycopg_pool

from eventstore._sql import connect_kwargs, decode_row, load
from eventstore.archive_ranges import Archived
from eventstore.bridge import blocking, settled
from eventstore.decision import AppendResult
from eventstore.envelope import START, Checkpoint, NewEvent, RecordedEvent
from eventstore.errors import InvalidAppend, InvalidValue, StoreError, StoreUnavailable
from eventstore.fencing import Fence, FencingHook, OnFenced
from eventstore.health import PostgresHealth
from eventstore.hints import Hints
from eventstore.migrations import migrate
from eventstore.projector import Projection
from eventstore.versions import ANY, NO_STREAM
from eventstore.writer import GroupCommitWriter, OnCommit

EventFilter = Callable[[RecordedEvent], bool]
_FIRST_RETRY = 0.001


class EventStore:
    def __init__(
        self,
        conninfo: str,
        *,
        schema: str = "dispach",
        inline: Sequence[Projection] = (),
        on_commit: OnCommit | None = None,
        pool_size: int = 8,
        writer_queue: int = 10_000,
        poll_interval: float = 0.25,
        fencing: FencingHook | None = None,
        on_fenced: OnFenced | None = None,
    ) -> None:
        self.conninfo = conninfo
        self.fencing = fencing
        """Which fence an append runs under when its caller passes none (eventstore/fencing.py);
        set by the node once it knows its partitions."""
        self.on_fenced = on_fenced
        """Told each partition whose fence refused an append (in the writer's thread)."""
        self.schema = schema
        self.poll_interval = poll_interval
        self.hints = Hints()
        self.subscribers = 0
        """How many :meth:`subscribe` loops are live on this store (the node's feed tail is
        one): the node wakes them after its own commits only when one needs it."""
        self.archived = Archived()
        """The archived ranges of the log: every read below checks, after its query, that it
        passed over none of them (eventstore/archive_ranges.py)."""
        # Reads are single statements: autocommit spares each a BEGIN and a COMMIT round trip.
        kwargs = connect_kwargs(schema) | {"autocommit": True}
        self._pool = psycopg_pool.ConnectionPool(
            conninfo, min_size=1, max_size=pool_size, kwargs=kwargs, open=False, name="dispach"
        )
        self._apool = psycopg_pool.AsyncConnectionPool(
            conninfo, min_size=1, max_size=pool_size, kwargs=kwargs, open=False, name="dispach-a"
        )
        self.health = PostgresHealth(conninfo, schema)
        """Whether Postgres is up, as the writer and the probe last saw (eventstore/health.py)."""
        self._writer = GroupCommitWriter(
            conninfo, schema, inline=inline, on_commit=on_commit, queue_size=writer_queue,
            health=self.health, on_fenced=self._tell_fenced,
        )  # fmt: skip

    def _tell_fenced(self, partition: int) -> None:
        """The writer's door to :attr:`on_fenced`, read at each call: it is set after start."""
        on_fenced = self.on_fenced
        if on_fenced is not None:
            on_fenced(partition)

    # --- lifecycle -----------------------------------------------------------------------------

    def open(self) -> list[str]:
        """Apply migrations and start the writer; returns the migrations applied now."""
        applied = migrate(self.conninfo, self.schema)
        try:
            self._pool.open(wait=True, timeout=10)
        except psycopg_pool.PoolTimeout as e:
            raise StoreUnavailable(
                "cannot open connections to Postgres", "check DATABASE_URL and that it is up"
            ) from e
        self._writer.start()
        return applied

    async def aopen(self) -> list[str]:
        """:meth:`open` from an event loop, plus the pool the coroutine readers use. Appends
        submitted on this loop are answered on it, and ``on_commit`` is called on it."""
        self._writer.deliver_on(asyncio.get_running_loop())
        applied = await blocking(self.open)
        await self._apool.open(wait=True, timeout=10)
        return applied

    def close(self) -> None:
        self._writer.stop()
        self._pool.close()

    async def aclose(self) -> None:
        await blocking(self._writer.stop)
        await self._apool.close()
        await blocking(self._pool.close)

    async def probe(self) -> None:
        """Watch Postgres until cancelled (see eventstore/health.py). After an outage the
        pools' idle connections are checked at once: those that died with the server are
        replaced before a request would draw one and fail on it."""

        async def renew() -> None:
            with contextlib.suppress(psycopg.Error, psycopg_pool.PoolTimeout):
                await self._apool.check()
                await blocking(self._pool.check)

        await self.health.probe(renew)

    @property
    def pool(self) -> psycopg_pool.ConnectionPool[psycopg.Connection[Any]]:
        return self._pool

    @property
    def apool(self) -> psycopg_pool.AsyncConnectionPool[psycopg.AsyncConnection[Any]]:
        return self._apool

    # --- appending -----------------------------------------------------------------------------

    def submit(
        self,
        stream: str,
        events: Sequence[NewEvent],
        expected_version: int = ANY,
        fence: Fence | None = None,
        *,
        blocking: bool = False,
    ) -> Future[AppendResult]:
        """Queue an append; the future resolves once it is committed (or refused).

        Under a ``fence`` (by default the one :attr:`fencing` names for the stream and its first
        event's metadata) the append is refused with ``Fenced`` once the partition's fence is
        at a newer epoch. Submitted on the loop that opened the store (:meth:`aopen`), the
        future is answered on that loop (await it with ``eventstore.bridge.settled``); pass
        ``blocking`` to wait on it with ``result()`` instead."""
        if not events:
            raise InvalidAppend("an append needs at least one event", "pass one or more events")
        if expected_version < ANY:
            raise InvalidAppend(
                f"expected_version {expected_version} is not a version",
                "pass a version >= 0, NO_STREAM (-1) or ANY (-2)",
            )
        if fence is None and self.fencing is not None:
            fence = self.fencing(stream, events[0].metadata)
        return self._writer.submit(stream, events, expected_version, fence, blocking=blocking)

    async def aappend(
        self,
        stream: str,
        events: Sequence[NewEvent],
        expected_version: int = ANY,
        fence: Fence | None = None,
    ) -> AppendResult:
        return await settled(self.submit(stream, events, expected_version, fence))

    # --- fences (eventstore/fencing.py) --------------------------------------------------------

    async def araise_fences(self, fences: Sequence[Fence]) -> dict[int, int]:
        """Raise partitions' fences to these epochs (greatest wins) and return each one's epoch
        now; committed when it returns. It waits for the appends in flight under the partitions'
        current fences: once it returns, no append under an older epoch commits. A caller whose
        epoch is lower than the one returned has been superseded by a newer lease."""
        highest: dict[int, int] = {}
        for fence in fences:  # one row per partition: ON CONFLICT updates a row once
            highest[fence.partition] = max(fence.epoch, highest.get(fence.partition, fence.epoch))
        if not highest:
            return {}
        parts = sorted(highest)  # the order appends lock the rows in (sql/append.sql)
        params = {"parts": parts, "epochs": [highest[p] for p in parts]}
        try:
            # Pool connections are autocommit: the statement is committed when it returns.
            async with self._apool.connection() as conn:
                cur = await conn.execute(load("raise_fences").encode(), params)
                rows = await cur.fetchall()
        except psycopg.Error as e:
            raise StoreUnavailable(
                f"cannot raise the partitions' fences: {e}".strip(),
                "the database is down or overloaded; raise them again before serving the "
                "partitions (raising is idempotent)",
            ) from e
        return {int(partition): int(epoch) for partition, epoch in rows}

    async def afences(self) -> dict[int, int]:
        """Every partition's fence epoch."""
        rows = await self.afetch(load("all_fences").encode())
        return {int(partition): int(epoch) for partition, epoch in rows}

    # --- queries of the projections ------------------------------------------------------------

    async def afetch(
        self, query: bytes, params: Sequence[object] | Mapping[str, object] | None = None
    ) -> list[tuple[Any, ...]]:
        """Rows of a read-only query on the projections (the read models), on the event loop.
        Driver errors come back as ``StoreUnavailable``."""
        try:
            async with self._apool.connection() as conn:
                cur = await conn.execute(query, params)
                return await cur.fetchall()
        except psycopg.Error as e:
            raise _unavailable(e) from e

    async def astatement(
        self, query: bytes, params: Mapping[str, object], *, what: str
    ) -> list[tuple[Any, ...]]:
        """One statement on a table beside the log (API keys, webhooks' secrets and cursors) in
        its own transaction, on the event loop: its rows, if it returns any. Driver errors come
        back as ``StoreUnavailable`` naming ``what`` (see :func:`unavailable_for`), at once
        while Postgres is known down: the pool's wait for a connection would take 30 s."""
        if not self.health.up:
            raise StoreUnavailable(
                f"cannot read or write {what}: Postgres is down ({self.health.reason})",
                "the database is down; retry",
            )
        try:
            async with self._apool.connection() as conn, conn.transaction():
                cur = await conn.execute(query, params)
                return await cur.fetchall() if cur.description is not None else []
        except psycopg.Error as e:
            raise unavailable_for(what, e) from e

    # --- reading (threads) ---------------------------------------------------------------------

    def read_stream(
        self, stream: str, from_version: int = 0, limit: int = 10_000
    ) -> list[RecordedEvent]:
        with self._pool.connection() as conn:
            rows = conn.execute(
                load("read_stream").encode(),
                {"stream": stream, "from_version": from_version, "limit": limit},
            ).fetchall()
        events = [decode_row(r) for r in rows]
        self.archived.check_stream(self._pool, stream, from_version, events)
        return events

    def stream_version(self, stream: str) -> int:
        """The version of the stream's last event, or NO_STREAM (-1)."""
        with self._pool.connection() as conn:
            row = conn.execute(load("head").encode(), {"stream": stream}).fetchone()
        return NO_STREAM if row is None else int(row[0])

    def read_all(self, after: Checkpoint = START, limit: int = 1000) -> list[RecordedEvent]:
        """Up to ``limit`` events after ``after``, in checkpoint order, none ever skipped."""
        with self._pool.connection() as conn:
            rows = conn.execute(load("read_all").encode(), _page(after, limit)).fetchall()
        self.archived.check(self._pool, after)
        return [decode_row(r) for r in rows]

    def head(self) -> Checkpoint:
        """The checkpoint of the newest event a reader can see now."""
        with self._pool.connection() as conn:
            row = conn.execute(load("log_head").encode()).fetchone()
        return START if row is None else Checkpoint(int(row[0]), row[1])

    # --- reading (event loop) ------------------------------------------------------------------

    async def aread_stream(
        self, stream: str, from_version: int = 0, limit: int = 10_000
    ) -> list[RecordedEvent]:
        rows = await self.afetch(
            load("read_stream").encode(),
            {"stream": stream, "from_version": from_version, "limit": limit},
        )
        events = [decode_row(r) for r in rows]
        await self.archived.acheck_stream(self._apool, stream, from_version, events)
        return events

    async def aread_all(self, after: Checkpoint = START, limit: int = 1000) -> list[RecordedEvent]:
        rows = await self.afetch(load("read_all").encode(), _page(after, limit))
        await self.archived.acheck(self._apool, after)
        return [decode_row(r) for r in rows]

    async def ahead(self) -> Checkpoint:
        """:meth:`head` on the event loop."""
        rows = await self.afetch(load("log_head").encode())
        return START if not rows else Checkpoint(int(rows[0][0]), rows[0][1])

    async def alast(self, stream: str) -> RecordedEvent | None:
        """The last event of ``stream``, or None if it has none."""
        rows = await self.afetch(load("read_last").encode(), {"stream": stream})
        return decode_row(rows[0]) if rows else None

    async def aread_turn(
        self, turn_id: str, after: Checkpoint = START, limit: int = 1000
    ) -> list[RecordedEvent]:
        """Events about one turn (any stream) after ``after``, in checkpoint order."""
        rows = await self.afetch(
            load("read_turn").encode(), {"turn_id": turn_id, **_page(after, limit)}
        )
        await self.archived.acheck(self._apool, after, turn_id=turn_id)
        return [decode_row(r) for r in rows]

    async def aread_turns(
        self, turn_ids: Sequence[str], types: Sequence[str]
    ) -> list[RecordedEvent]:
        """The events of ``types`` about the given turns (any stream), in log order."""
        rows = await self.afetch(
            load("read_turns").encode(), {"turn_ids": list(turn_ids), "types": list(types)}
        )
        await self.archived.acheck_turns(self._apool, turn_ids)
        return [decode_row(r) for r in rows]

    async def aread_scoped(
        self,
        after: Checkpoint = START,
        limit: int = 1000,
        *,
        agent_id: str | None = None,
        session_key: str | None = None,
        types: Sequence[str] | None = None,
    ) -> list[RecordedEvent]:
        """:meth:`aread_all` narrowed in Postgres to an agent, a session and some types."""
        params: dict[str, object] = {
            **_page(after, limit),
            "agent_id": agent_id,
            "session_key": session_key,
            "types": list(types) if types is not None else None,
        }
        rows = await self.afetch(load(_scoped_query(agent_id, session_key)).encode(), params)
        await self.archived.acheck(self._apool, after)
        return [decode_row(r) for r in rows]

    async def subscribe(
        self,
        after: Checkpoint = START,
        *,
        where: EventFilter | None = None,
        batch: int = 1000,
        types: Sequence[str] | None = None,
    ) -> AsyncIterator[RecordedEvent]:
        """Every event after ``after``, then every new one as it commits, forever.

        Catch-up and live are the same loop: read a page after the last checkpoint; when the page
        is empty, wait for a commit hint or the poll interval. The caller's checkpoint is the
        ``checkpoint`` of the last event it processed; resuming from it repeats and misses nothing.

        ``types`` narrows the read in Postgres (a tail of rare events then transfers and decodes
        only those). Such a tail cannot tell an announced commit it cannot see yet from one of
        other types, so it waits for the next hint or poll instead of looking again at once.
        """
        self.subscribers += 1
        try:
            async for event in self._subscribe(after, where, batch, types):
                yield event
        finally:
            self.subscribers -= 1

    async def _subscribe(
        self,
        after: Checkpoint,
        where: EventFilter | None,
        batch: int,
        types: Sequence[str] | None,
    ) -> AsyncIterator[RecordedEvent]:
        checkpoint = after
        backoff = _FIRST_RETRY
        while True:
            generation = self.hints.generation
            try:
                if types is None:
                    page = await self.aread_all(checkpoint, batch)
                else:
                    page = await self.aread_scoped(checkpoint, batch, types=types)
            except StoreUnavailable:
                # A tail outlives a broken connection: the pool replaces it, we read again
                # from the same checkpoint, so nothing is missed or repeated.
                await asyncio.sleep(self.poll_interval)
                continue
            for event in page:
                checkpoint = event.checkpoint
                if where is None or where(event):
                    yield event
            if page:
                backoff = _FIRST_RETRY
            if len(page) == batch:
                continue
            if types is None and self.hints.latest > checkpoint and backoff < self.poll_interval:
                # A commit was announced that this read did not see yet (the hint can overtake
                # the read's snapshot on another connection): look again shortly.
                await asyncio.sleep(backoff)
                backoff *= 2
            else:
                await self.hints.wait(generation, self.poll_interval)


def unavailable_for(what: str, e: psycopg.Error) -> StoreError:
    """A statement on ``what`` (``the API keys``) failed in the driver: Postgres is down or
    overloaded, and the caller may retry."""
    return StoreUnavailable(
        f"cannot read or write {what} in Postgres: {e}".strip(),
        "the database is down or overloaded; retry",
    )


def _unavailable(e: psycopg.Error) -> StoreError:
    if isinstance(e, psycopg.DataError):
        return InvalidValue(
            f"Postgres refused a value of this read: {e}".strip(),
            "a parameter holds something Postgres cannot compare (e.g. a NUL character)",
        )
    return StoreUnavailable(
        f"cannot read from Postgres: {e}".strip(),
        "the database is down or overloaded; the read can be retried",
    )


def _scoped_query(agent_id: str | None, session_key: str | None) -> str:
    """The statement for a scope's shape: each shape its own, so a prepared (generic) plan still
    uses the scope's index (see sql/read_agent.sql)."""
    if agent_id is None:
        return "read_scoped"
    return "read_agent" if session_key is None else "read_session"


def _page(after: Checkpoint, limit: int) -> dict[str, int]:
    return {"txid": after.txid, "position": after.position, "limit": limit}

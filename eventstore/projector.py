"""Projections: read models derived from the log, each rebuildable from it.

A projection is pure: :meth:`Projection.statements` turns one recorded event into SQL statements.
Where they run decides the kind:

- *inline* projections run inside the group-commit writer's transaction, so a caller that just
  appended reads its own write (the turn resource);
- *asynchronous* projections are applied by :class:`ProjectionRunner`, which writes the rows and
  the projection's checkpoint in one transaction, as a compare-and-set on the previous checkpoint,
  so a batch is applied exactly once even with two runners racing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
import structlog

from eventstore.envelope import START, Checkpoint, RecordedEvent
from eventstore.errors import StoreError

if TYPE_CHECKING:
    from eventstore.store import EventStore

Statement = tuple[str, Sequence[Any] | Mapping[str, Any]]

log = structlog.get_logger("dispach.projection")


class Projection(Protocol):
    name: str
    tables: tuple[str, ...]
    """Tables owned by the projection (replaced by a rebuild with copies built from the log)."""
    types: frozenset[str]
    """Event types it reacts to; other events are skipped without a call."""

    def statements(self, event: RecordedEvent) -> Iterable[Statement]: ...


def statements_for(
    projections: Sequence[Projection], events: Sequence[RecordedEvent]
) -> list[Statement]:
    """Each projection's statements for the events it reacts to, projection by projection (so
    every transaction touches the read models' tables in one order), each projection's in
    the events' order. A projection with a ``statements_many`` method (the turns projection)
    is given all its events of the batch at once, to say the same in fewer statements."""
    found: list[Statement] = []
    for projection in projections:
        relevant = [event for event in events if event.type in projection.types]
        if not relevant:
            continue
        many = getattr(projection, "statements_many", None)
        if many is not None:
            found.extend(many(relevant))
        else:
            for event in relevant:
                found.extend(projection.statements(event))
    return found


def run_statements(cur: psycopg.Cursor[Any], statements: Sequence[Statement]) -> None:
    for query, params in statements:
        cur.execute(query.encode(), params)


async def arun_statements(cur: psycopg.AsyncCursor[Any], statements: Sequence[Statement]) -> None:
    for query, params in statements:
        await cur.execute(query.encode(), params)


class ProjectionRunner:
    """Keeps one asynchronous projection up to date by tailing the log from its checkpoint.

    The read position is kept in memory; the stored checkpoint moves with every batch that
    holds events the projection applies (rows and checkpoint in one transaction, a
    compare-and-set on the stored value) and otherwise at most every ``persist_every`` seconds,
    so a log full of events it ignores costs reads, not commits. After a crash it re-reads from
    the stored checkpoint: what it re-reads it either ignores or had not applied.
    """

    def __init__(
        self,
        store: EventStore,
        projection: Projection,
        *,
        batch: int = 1000,
        persist_every: float = 5.0,
    ) -> None:
        self._store = store
        self._projection = projection
        self._batch = batch
        self._persist_every = persist_every
        self._stored: Checkpoint | None = None  # None: read it from the database first
        self._stored_seen: Checkpoint | None = None
        self._position = START
        self._persisted_at = 0.0
        self._verified_at = 0.0

    @property
    def name(self) -> str:
        return self._projection.name

    async def checkpoint(self) -> Checkpoint:
        async with self._store.apool.connection() as conn:
            cur = await conn.execute(
                "SELECT txid, position FROM projection_checkpoints WHERE name = %s",
                [self._projection.name],
            )
            row = await cur.fetchone()
        return START if row is None else Checkpoint(row[0], row[1])

    async def catch_up(self) -> int:
        """Apply every batch visible now; returns the number of events applied."""
        if time.monotonic() - self._verified_at >= self._persist_every:
            # Now and then, look at the stored checkpoint: a rebuild may have reset it.
            self._stored = None
        applied = 0
        while True:
            n = await self._step()
            if n < 0:
                break
            applied += n
        if self._stored is not None and self._position > self._stored:
            await self._commit([], self._position)
        return applied

    async def run(self, settle: float = 0.05) -> None:
        """Apply forever: woken by commit hints, polling as a fallback. After each wake-up it
        lets ``settle`` seconds of commits gather, so a busy log costs one read per interval
        rather than one per commit (asynchronous projections are not read-your-writes)."""
        while True:
            generation = self._store.hints.generation
            try:
                await self.catch_up()
            except (psycopg.Error, StoreError) as e:
                log.warning("projection_retry", projection=self.name, error=str(e))
                self._stored = None
            if await self._store.hints.wait(generation, self._store.poll_interval):
                await asyncio.sleep(settle)

    async def _step(self) -> int:
        """One batch. Returns events applied, or -1 when there was nothing new to read."""
        if self._stored is None:
            stored = await self.checkpoint()
            if stored != self._stored_seen:  # first look, or moved by someone else
                self._position = stored
            self._stored = self._stored_seen = stored
            self._verified_at = time.monotonic()
        page = await self._store.aread_all(self._position, limit=self._batch)
        if not page:
            return -1
        last = page[-1].checkpoint
        relevant = [e for e in page if e.type in self._projection.types]
        if not relevant and time.monotonic() - self._persisted_at < self._persist_every:
            self._position = last
            return 0
        return len(relevant) if await self._commit(relevant, last) else 0

    async def _commit(self, relevant: list[RecordedEvent], last: Checkpoint) -> bool:
        """Apply ``relevant`` and move the stored checkpoint to ``last``; False when another
        runner or a rebuild moved it first (the position is then re-read)."""
        stored = self._stored
        assert stored is not None
        try:
            async with (
                self._store.apool.connection() as conn,
                conn.transaction(),
                conn.cursor() as cur,
            ):
                await cur.execute(
                    """UPDATE projection_checkpoints SET txid = %s, position = %s,
                              updated_at = now()
                        WHERE name = %s AND txid = %s AND position = %s""",
                    [last.txid, last.position, self.name, stored.txid, stored.position],
                )
                if cur.rowcount == 0 and stored == START:
                    await cur.execute(
                        """INSERT INTO projection_checkpoints (name, txid, position)
                           VALUES (%s, %s, %s) ON CONFLICT (name) DO NOTHING""",
                        [self.name, last.txid, last.position],
                    )
                if cur.rowcount == 0:
                    raise _CheckpointMovedError
                await arun_statements(cur, statements_for([self._projection], relevant))
        except _CheckpointMovedError:
            # The rollback undid nothing of theirs: re-read the checkpoint, go on from there.
            self._stored = None
            return False
        self._stored = self._stored_seen = self._position = last
        self._persisted_at = self._verified_at = time.monotonic()
        return True


class _CheckpointMovedError(Exception):
    pass

"""Which ranges of the log are archived, for the readers: a read that would pass over an
archived event is refused with ``CursorArchived`` (HTTP 410), never answered without it.

What "pass over" means per read: a read of the log (or of an agent or session of it) after a
checkpoint earlier than an archive's last one; a read of some turns' events when one of those
turns has events in an archive (its span in the turns projection overlaps it: a live turn is
read whatever is archived before it); a read of one stream that misses versions (versions are
dense; ``archived_heads`` knows a stream archived whole).

The archived ranges are the ``log_archives`` rows not restored (migration 0014), cached per
store and reloaded when older than :data:`TTL`. The archiver commits its row, then lets at
least :data:`GUARD_DELAY` (more than ``TTL``) pass before it detaches the partition, and every
read checks *after* its query ran: a query that ran once the partition was gone is checked
against ranges loaded after the row was committed, so it is refused. A query that ran before
still saw the events; it may be refused too (nothing is skipped either way).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import psycopg
import psycopg_pool

from eventstore.envelope import Checkpoint, RecordedEvent
from eventstore.errors import CursorArchived, StoreUnavailable

TTL = 1.0
"""Seconds a store trusts the ranges it loaded."""
GUARD_DELAY = 2.5 * TTL
"""Seconds between recording an archive and detaching its partition (eventstore/archive.py)."""

_RANGES = b"""SELECT archive_id, partition_name, first_position, last_position, last_txid::text
                FROM log_archives WHERE restored_at IS NULL ORDER BY last_position"""
# The archive holding events of one of these turns: its span in the log (the turns projection's
# first and last positions) overlaps the archive's.
_TURNS_ARCHIVED = b"""SELECT a.archive_id
                        FROM turns t
                        JOIN log_archives a ON a.restored_at IS NULL
                                           AND t.start_position <= a.last_position
                                           AND t.last_position >= a.first_position
                       WHERE t.turn_id = ANY(%s) AND a.archive_id = ANY(%s)
                       LIMIT 1"""
_ARCHIVED_HEAD = b"SELECT stream_version FROM archived_heads WHERE stream_id = %s"


class ArchivedRange(NamedTuple):
    archive_id: str
    partition: str
    first: int
    last: int
    last_checkpoint: Checkpoint

    def refusal(self) -> CursorArchived:
        return CursorArchived(self.archive_id, self.partition, self.first, self.last)


def passed_over(ranges: Sequence[ArchivedRange], after: Checkpoint) -> ArchivedRange | None:
    """The first range a read of the log after ``after`` would pass over: one with an event
    after the checkpoint (its last checkpoint is later)."""
    return next((r for r in ranges if r.last_checkpoint > after), None)


def stream_gap(events: Sequence[RecordedEvent], from_version: int, archived_head: int | None
               ) -> bool:  # fmt: skip
    """Whether a read of one stream from ``from_version`` misses versions: versions are dense,
    so a first event after ``from_version``, or none where an archived head says there were
    some, means the missing ones are archived."""
    if events:
        return events[0].version > from_version
    return archived_head is not None and archived_head >= from_version


class Archived:
    """The store's view of the archived ranges (see the module docstring)."""

    def __init__(self) -> None:
        self._ranges: tuple[ArchivedRange, ...] = ()
        self._loaded = float("-inf")

    def forget(self) -> None:
        """Reload at the next check (this process archived or restored something)."""
        self._loaded = float("-inf")

    def _fresh(self) -> bool:
        return time.monotonic() - self._loaded < TTL

    def _keep(self, rows: list[tuple[Any, ...]], started: float) -> tuple[ArchivedRange, ...]:
        self._ranges = tuple(
            ArchivedRange(a, p, int(f), int(last), Checkpoint(int(t), int(last)))
            for a, p, f, last, t in rows
        )
        self._loaded = started
        return self._ranges

    def ranges(self, pool: psycopg_pool.ConnectionPool[psycopg.Connection[Any]]
               ) -> tuple[ArchivedRange, ...]:  # fmt: skip
        if self._fresh():
            return self._ranges
        started = time.monotonic()
        with _reading(), pool.connection() as conn:
            return self._keep(conn.execute(_RANGES).fetchall(), started)

    async def aranges(
        self, pool: psycopg_pool.AsyncConnectionPool[psycopg.AsyncConnection[Any]]
    ) -> tuple[ArchivedRange, ...]:
        if self._fresh():
            return self._ranges
        started = time.monotonic()
        with _reading():
            async with pool.connection() as conn:
                cur = await conn.execute(_RANGES)
                return self._keep(await cur.fetchall(), started)

    def check(self, pool: psycopg_pool.ConnectionPool[psycopg.Connection[Any]],
              after: Checkpoint) -> None:  # fmt: skip
        """Refuse a read of the log after ``after`` that ran over an archived range."""
        found = passed_over(self.ranges(pool), after)
        if found is not None:
            raise found.refusal()

    async def acheck(
        self,
        pool: psycopg_pool.AsyncConnectionPool[psycopg.AsyncConnection[Any]],
        after: Checkpoint,
        *,
        turn_id: str | None = None,
    ) -> None:
        """:meth:`check` on the event loop; for one turn's events (``turn_id``), see
        :meth:`acheck_turns`."""
        ranges = await self.aranges(pool)
        candidates = [r for r in ranges if r.last_checkpoint > after]
        if turn_id is not None:
            await self._turns(pool, [turn_id], candidates)
        elif candidates:
            raise candidates[0].refusal()

    async def acheck_turns(
        self,
        pool: psycopg_pool.AsyncConnectionPool[psycopg.AsyncConnection[Any]],
        turn_ids: Sequence[str],
    ) -> None:
        """Refuse a read of some turns' events when one of them has events in an archived
        range: its span in the log (the turns projection's first and last positions) overlaps
        it. A live turn is read whatever is archived before it."""
        await self._turns(pool, turn_ids, await self.aranges(pool))

    async def _turns(
        self,
        pool: psycopg_pool.AsyncConnectionPool[psycopg.AsyncConnection[Any]],
        turn_ids: Sequence[str],
        candidates: Sequence[ArchivedRange],
    ) -> None:
        if not candidates or not turn_ids:
            return
        with _reading():
            async with pool.connection() as conn:
                cur = await conn.execute(
                    _TURNS_ARCHIVED, [list(turn_ids), [r.archive_id for r in candidates]]
                )
                row = await cur.fetchone()
        if row is not None:
            raise next(r for r in candidates if r.archive_id == row[0]).refusal()

    async def acheck_stream(
        self, pool: psycopg_pool.AsyncConnectionPool[psycopg.AsyncConnection[Any]],
        stream: str, from_version: int, events: Sequence[RecordedEvent],
    ) -> None:  # fmt: skip
        """Refuse a read of one stream that misses archived versions (:func:`stream_gap`)."""
        ranges = await self.aranges(pool)
        if not ranges or (events and events[0].version == from_version):
            return
        with _reading():
            async with pool.connection() as conn:
                cur = await conn.execute(_ARCHIVED_HEAD, [stream])
                row = await cur.fetchone()
        if stream_gap(events, from_version, None if row is None else int(row[0])):
            raise _stream_refusal(ranges, stream, events)

    def check_stream(
        self, pool: psycopg_pool.ConnectionPool[psycopg.Connection[Any]],
        stream: str, from_version: int, events: Sequence[RecordedEvent],
    ) -> None:  # fmt: skip
        ranges = self.ranges(pool)
        if not ranges or (events and events[0].version == from_version):
            return
        with _reading(), pool.connection() as conn:
            row = conn.execute(_ARCHIVED_HEAD, [stream]).fetchone()
        if stream_gap(events, from_version, None if row is None else int(row[0])):
            raise _stream_refusal(ranges, stream, events)


@contextlib.contextmanager
def _reading() -> Iterator[None]:
    """A driver error of these lookups is the store's: ``StoreUnavailable``, as for the reads
    they guard (a caller answers 503, never 500)."""
    try:
        yield
    except psycopg.Error as e:
        raise StoreUnavailable(
            f"cannot read the log's archives: {e}".strip(),
            "the database is down or overloaded; the read can be retried",
        ) from e


def _stream_refusal(ranges: Sequence[ArchivedRange], stream: str,
                    events: Sequence[RecordedEvent]) -> CursorArchived:  # fmt: skip
    """The archive that holds the stream's missing versions: the last range before its first
    live event (the newest one when none is live)."""
    before = events[0].position if events else None
    held = [r for r in ranges if before is None or r.last < before]
    return (held[-1] if held else ranges[-1]).refusal()

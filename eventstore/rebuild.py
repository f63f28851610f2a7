"""Rebuilding projections from the log without stopping it: replay into copies of the tables in
short transactions, then swap the copies in under a short lock, retried (``dispach projections
rebuild``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
import structlog
from psycopg import errors as pgerrors
from psycopg import sql

from eventstore._sql import check_schema_name, connect_kwargs
from eventstore.envelope import START, Checkpoint, RecordedEvent
from eventstore.errors import StoreError, StoreUnavailable

if TYPE_CHECKING:
    from eventstore.store import EventStore

from eventstore.projector import Projection, run_statements, statements_for

log = structlog.get_logger("dispach.projection")


REBUILD_PAGE = 2000
"""Events a rebuild replays per transaction: each page commits in milliseconds, so the replay
holds a transaction open, and locks on its copies, only that long (and none on the live
tables)."""
SWAP_TAIL = 100
"""The replay goes on until a page comes back with fewer events than this, so the swap, which
writers wait for, applies only the few committed while it asked for its lock (a full page left
to it took a 2-core machine 300 ms under three writers)."""
SWAP_LOCK_TIMEOUT = "250ms"
"""How long a swap waits for its tables' locks. Appends queue behind a lock request, so a swap
that cannot have them soon gives up, catches up again and retries, rather than stall writers
behind a slow reader; below Postgres's deadlock_timeout (1 s), so a lock-order cycle with a
reader ends in our retry, not in the reader's abort."""
SWAP_ATTEMPTS = 20
_TAIL_READS = 3


@dataclass(frozen=True)
class Rebuilt:
    """What a rebuild did: events applied (of the projection's types), how many of them the
    swap applied under the lock, how long writers of the tables waited on the swap at most
    (from its lock request to its commit), and at which attempt it swapped."""

    events: int
    tail: int
    lock_ms: float
    attempts: int


@dataclass(frozen=True)
class _Schemas:
    """Where a rebuild works: the live tables' schema, the copies', and the one the replaced
    tables are moved to by the swap and dropped from after it."""

    live: str
    copies: str
    retired: str

    @classmethod
    def of(cls, schema: str) -> _Schemas:
        return cls(schema, check_schema_name(f"{schema}__rebuild"),
                   check_schema_name(f"{schema}__retired"))  # fmt: skip


def rebuild(
    store: EventStore,
    projection: Projection,
    *,
    inline: bool,
    page: int = REBUILD_PAGE,
    progress: Callable[[int], None] | None = None,
) -> Rebuilt:
    """Replay the whole log into fresh copies of ``projection``'s tables, then swap them in.

    The copies are built beside the live tables, under the same names in the schema
    ``<schema>__rebuild``: the projection's statements name their tables unqualified, so with
    that schema first on ``search_path`` they write the copies, unchanged. The log is read with
    :meth:`EventStore.read_all`, a page per short transaction, while writers go on using the
    live tables. The swap is one short transaction: it locks the live tables (an inline
    projection's writer waits here, inside its append), applies the events committed since the
    last page, moves the live tables out (to ``<schema>__retired``) and the copies in, and points
    the views on them at the copies. A writer that waited on the lock then finds the new tables:
    Postgres looks a name up again after a lock wait on a relation that moved, and plans again
    a cached plan whose tables changed. The replaced tables are dropped after the commit, so
    the swap does not wait for their files.

    An asynchronous projection's checkpoint moves to the swap's last event in the same
    transaction: its runner's next compare-and-set fails, and it re-reads the checkpoint and
    goes on from there over the new rows, repeating and skipping nothing.

    A rebuild killed before its swap leaves the live tables as they were; the next one drops the
    leftover copies first. Two rebuilds of one projection at once are refused.
    """
    schemas = _Schemas.of(store.schema)
    try:
        with psycopg.connect(
            store.conninfo, autocommit=True, **connect_kwargs(store.schema)
        ) as conn:
            _claim(conn, store.schema, projection)
            _prepare(conn, schemas, projection, inline=inline)
            checkpoint, applied = START, 0
            for attempt in range(1, SWAP_ATTEMPTS + 1):
                checkpoint, applied = _catch_up(
                    store, conn, schemas, projection, checkpoint, page, applied, progress
                )
                swapped = _swap(store, conn, schemas, projection, checkpoint, inline=inline)
                if swapped is not None:
                    tail, lock_ms = swapped
                    _drop_retired(conn, schemas, projection)
                    return Rebuilt(applied + tail, tail, lock_ms, attempt)
                time.sleep(0.05 * attempt)  # the lock's holder, or the reader, needs a moment
    except psycopg.OperationalError as e:
        raise StoreUnavailable(
            f"the rebuild of {projection.name} lost Postgres: {e}".strip(),
            "the live tables are as they were; run the rebuild again once Postgres is up",
        ) from e
    except psycopg.Error as e:
        raise StoreError(
            f"Postgres refused the rebuild of {projection.name}: {e.diag.message_primary or e}",
            "the live tables are as they were (the swap is one transaction); an object that "
            "depends on them other than a view (a foreign key, a serial column's sequence) "
            "stops the swap",
        ) from e
    raise StoreError(
        f"rebuild of {projection.name} could not swap its tables in after {SWAP_ATTEMPTS} "
        f"attempts (their lock was not granted within {SWAP_LOCK_TIMEOUT}, or the log's reader "
        "lagged behind what was committed)",
        "a long transaction holds a lock on the projection's tables (pg_locks names it), or "
        "the log's reader is held back; end it and run the rebuild again",
    )


def index_renames(
    live: Sequence[tuple[str, str]], made: Sequence[tuple[str, str]]
) -> list[tuple[str, str]]:
    """``(made name, live name)`` for each index ``CREATE TABLE (LIKE …)`` made whose name
    differs from the live index of the same shape (LIKE names its copies by its own rules; after
    the swap the tables must carry the names the migrations gave, which later migrations use).
    Indexes are ``(name, shape)``; a shape is the definition without the index's name and
    table."""
    free = list(made)
    renames = []
    for name, shape in live:
        twin = next((index for index in free if index[1] == shape), None)
        if twin is None:
            raise StoreError(
                f"the copy of index {name} was not made ({shape})",
                "this is a bug in Dispach's rebuild; the live tables are unchanged",
            )
        free.remove(twin)
        if twin[0] != name:
            renames.append((twin[0], name))
    return renames


def _claim(conn: psycopg.Connection[Any], schema: str, projection: Projection) -> None:
    """One rebuild of a projection at a time: a session lock, released when the connection
    closes, however the rebuild ends."""
    row = conn.execute(
        "SELECT pg_try_advisory_lock(hashtext(%s))",
        [f"dispach.rebuild.{schema}.{projection.name}"],
    ).fetchone()
    if row is None or not row[0]:
        raise StoreError(
            f"another rebuild of {projection.name} is running",
            "wait for it to finish; the live tables are unchanged",
        )


def _prepare(
    conn: psycopg.Connection[Any], schemas: _Schemas, projection: Projection, *, inline: bool
) -> None:
    """Empty copies of the projection's tables: columns, defaults (an identity column gets a
    sequence of its own), constraints and indexes, with the live indexes' names. What an
    interrupted rebuild left (copies, or replaced tables it had not dropped yet) is dropped
    first. The schemas are made in the same transaction as the tables, so a rebuild of another
    projection ending meanwhile cannot drop them in between."""
    with conn.transaction():
        for schema in (schemas.copies, schemas.retired):
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
        for table in projection.tables:
            copy, live = sql.Identifier(schemas.copies, table), sql.Identifier(schemas.live, table)
            conn.execute(
                sql.SQL("DROP TABLE IF EXISTS {}, {}").format(
                    copy, sql.Identifier(schemas.retired, table)
                )
            )
            conn.execute(sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING ALL)").format(copy, live))
            for made, name in index_renames(
                _indexes(conn, schemas.live, table), _indexes(conn, schemas.copies, table)
            ):
                conn.execute(
                    sql.SQL("ALTER INDEX {} RENAME TO {}").format(
                        sql.Identifier(schemas.copies, made), sql.Identifier(name)
                    )
                )
        if not inline:
            # A row to lock at the swap (a runner that never ran has none; START is its value).
            conn.execute(
                """INSERT INTO projection_checkpoints (name, txid, position) VALUES (%s, 0, 0)
                   ON CONFLICT (name) DO NOTHING""",
                [projection.name],
            )


def _indexes(conn: psycopg.Connection[Any], schema: str, table: str) -> list[tuple[str, str]]:
    rows = conn.execute(
        """SELECT c.relname,
                  concat_ws(' ', i.indisprimary, i.indisunique,
                            substring(pg_get_indexdef(i.indexrelid) FROM ' USING .*$'))
             FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
            WHERE i.indrelid = format('%%I.%%I', %s::text, %s::text)::regclass
            ORDER BY c.relname""",
        [schema, table],
    ).fetchall()
    return [(name, shape) for name, shape in rows]


def _catch_up(
    store: EventStore,
    conn: psycopg.Connection[Any],
    schemas: _Schemas,
    projection: Projection,
    after: Checkpoint,
    page: int,
    applied: int,
    progress: Callable[[int], None] | None,
) -> tuple[Checkpoint, int]:
    """Replay into the copies from ``after`` up to what is committed now, a page per
    transaction, until a page is small (:data:`SWAP_TAIL`); returns the checkpoint reached and
    the events applied so far."""
    small = min(page, SWAP_TAIL)
    while True:
        events = store.read_all(after, page)
        if not events:
            return after, applied
        with conn.transaction():
            applied += _apply_to_copies(conn, schemas, projection, events)
        after = events[-1].checkpoint
        if progress is not None:
            progress(applied)
        if len(events) < small:
            return after, applied


def _apply_to_copies(
    conn: psycopg.Connection[Any],
    schemas: _Schemas,
    projection: Projection,
    events: Sequence[RecordedEvent],
) -> int:
    """Run the projection's statements for ``events`` against the copies, in the current
    transaction. Tables it does not own (none today) resolve to the live ones."""
    relevant = [e for e in events if e.type in projection.types]
    conn.execute(
        sql.SQL("SET LOCAL search_path TO {}, {}").format(
            sql.Identifier(schemas.copies), sql.Identifier(schemas.live)
        )
    )
    with conn.pipeline(), conn.cursor() as cur:
        run_statements(cur, statements_for([projection], relevant))
    return len(relevant)


def _swap(
    store: EventStore,
    conn: psycopg.Connection[Any],
    schemas: _Schemas,
    projection: Projection,
    after: Checkpoint,
    *,
    inline: bool,
) -> tuple[int, float] | None:
    """Apply the tail and move the copies in, in one transaction; ``(tail events, lock ms)``,
    or None when it must be tried again (the lock was not granted in time, or the log's reader
    has not shown every committed event yet).

    Locks, in this order: an asynchronous projection's checkpoint row (a runner takes it before
    its tables, and one in flight finishes first), then the views on the tables and the tables
    (a reader of a view locks the view before its tables). Once they are held, no statement
    changes the live tables: a writer's transaction that holds them has committed, and its
    events are in the tail; one that comes later waits, and applies its events to the new
    tables after the commit. The views are redefined in place (``CREATE OR REPLACE``, which
    keeps their grants) over the tables moved in.
    """
    live = schemas.live
    try:
        with conn.transaction():
            conn.execute(
                sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(SWAP_LOCK_TIMEOUT))
            )
            if not inline:
                conn.execute(
                    "SELECT 1 FROM projection_checkpoints WHERE name = %s FOR UPDATE",
                    [projection.name],
                )
            views = _views_on(conn, live, projection.tables)
            started = time.perf_counter()
            locked = [*(v for v, _ in views), *projection.tables]
            conn.execute(
                sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(
                    sql.SQL(", ").join(sql.Identifier(live, name) for name in locked)
                )
            )
            read = _tail(store, conn, after, projection.types if inline else frozenset())
            if read is None:
                raise _TailUnread
            tail, last = read
            applied = _apply_to_copies(conn, schemas, projection, tail)
            conn.execute(sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(live)))
            for table in projection.tables:
                for source, target in ((live, schemas.retired), (schemas.copies, live)):
                    conn.execute(
                        sql.SQL("ALTER TABLE {} SET SCHEMA {}").format(
                            sql.Identifier(source, table), sql.Identifier(target)
                        )
                    )
            for view, definition in views:
                conn.execute(
                    sql.SQL("CREATE OR REPLACE VIEW {} AS {}").format(
                        sql.Identifier(live, view), sql.SQL(definition)
                    )
                )
            if not inline:
                conn.execute(
                    """UPDATE projection_checkpoints SET txid = %s, position = %s,
                              updated_at = now()
                        WHERE name = %s""",
                    [last.txid, last.position, projection.name],
                )
    except (pgerrors.LockNotAvailable, pgerrors.DeadlockDetected, _TailUnread) as e:
        log.info("rebuild_swap_retry", projection=projection.name, reason=type(e).__name__)
        return None
    return applied, (time.perf_counter() - started) * 1000


def _views_on(
    conn: psycopg.Connection[Any], schema: str, tables: Sequence[str]
) -> list[tuple[str, str]]:
    """``(name, definition)`` of the views that read the tables. The definitions are taken with
    only the live schema on the path, so they name the tables as the copies will be named."""
    rows = conn.execute(
        """SELECT DISTINCT v.relname, pg_get_viewdef(v.oid)
             FROM pg_depend d
             JOIN pg_rewrite r ON r.oid = d.objid AND d.classid = 'pg_rewrite'::regclass
             JOIN pg_class v ON v.oid = r.ev_class AND v.relkind = 'v'
            WHERE d.refclassid = 'pg_class'::regclass
              AND d.refobjid = ANY(ARRAY(SELECT format('%%I.%%I', %s::text, t)::regclass
                                           FROM unnest(%s::text[]) AS t))
              AND v.oid <> d.refobjid
            ORDER BY v.relname""",
        [schema, list(tables)],
    ).fetchall()
    return [(name, definition) for name, definition in rows]


def _tail(
    store: EventStore, conn: psycopg.Connection[Any], after: Checkpoint, types: frozenset[str]
) -> tuple[list[RecordedEvent], Checkpoint] | None:
    """Every event the log's reader shows after ``after``, and the checkpoint of the last; None
    while an event of ``types`` (an inline projection's: the live tables hold its effects) is
    committed but not shown yet. The reader shows a prefix of what is committed, and it can lag
    (one that stops below the oldest running transaction does): the swap then tries again later
    rather than lose a row. An event of those types that commits during the swap without
    touching the tables (its statements were none) is simply read too."""
    tail: list[RecordedEvent] = []
    lagging = 0
    while True:
        page = store.read_all(after, REBUILD_PAGE)
        tail += page
        after = page[-1].checkpoint if page else after
        if len(page) == REBUILD_PAGE:
            continue
        if not types or not _unread(conn, after, types):
            return tail, after
        lagging += 1
        if lagging == _TAIL_READS:
            return None


def _unread(conn: psycopg.Connection[Any], last: Checkpoint, types: frozenset[str]) -> bool:
    """Whether an event of ``types`` is committed after ``last``."""
    row = conn.execute(
        """SELECT EXISTS (SELECT 1 FROM events
                           WHERE (transaction_id, global_position) > (%s::text::xid8, %s::bigint)
                             AND type = ANY(%s))""",
        [str(last.txid), last.position, sorted(types)],
    ).fetchone()
    return bool(row and row[0])


def _drop_retired(conn: psycopg.Connection[Any], schemas: _Schemas, projection: Projection) -> None:
    """After the swap: drop the replaced tables (nobody reads them: every statement that waited
    on them found the new ones), then the rebuild's schemas once no other rebuild uses them."""
    conn.execute(
        sql.SQL("DROP TABLE {}").format(
            sql.SQL(", ").join(sql.Identifier(schemas.retired, t) for t in projection.tables)
        )
    )
    for schema in (schemas.copies, schemas.retired):
        with contextlib.suppress(pgerrors.DependentObjectsStillExist):
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {}").format(sql.Identifier(schema)))


class _TailUnread(Exception):
    pass

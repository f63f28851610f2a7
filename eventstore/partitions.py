"""The log's partitions: ranges of ``global_position`` (migration 0014), created ahead of the
sequence, because an insert whose position no partition holds fails.

Partition ``k`` holds positions ``[k * size, (k + 1) * size)`` and is named ``events_<lower>``
after the first position it may hold (the first partition, the log as it was before 0014, holds
everything below its end and is ``events_0``). ``size`` and ``ahead`` live in the one row of
``log_partitioning``, so every node cuts the log alike.

Who creates them: the group-commit writer (eventstore/writer.py), on its own connection and in
its own thread, between two batches: once when it starts (after the migrations), whenever the
positions it has seen come within ``ahead`` partitions of the last bound, and at once when an
insert found no partition (a burst of another node's may have used the margin up). Creating one
takes a session advisory lock, so two nodes never race; the loser finds the partition there.
Each step is an autocommit statement that takes no lock the appends wait for: the new table is
built standalone, given its local unique indexes, and attached (``ATTACH PARTITION`` takes a
SHARE UPDATE EXCLUSIVE lock on the log, which inserts and reads do not conflict with).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import psycopg
from psycopg import sql

from eventstore._sql import check_schema_name


class Partitioning(NamedTuple):
    size: int
    ahead: int


class Range(NamedTuple):
    """A partition's bounds: ``lower`` (None: everything below ``upper``) to ``upper``,
    exclusive."""

    lower: int | None
    upper: int

    @property
    def name(self) -> str:
        return f"events_{self.lower or 0}"


def plan(last_upper: int, next_position: int, partitioning: Partitioning) -> list[Range]:
    """The partitions to create after the one ending at ``last_upper`` so that the partition of
    ``next_position`` and ``ahead`` more exist: aligned on multiples of ``size`` (the first one
    after an unaligned bound ends at the next multiple)."""
    size, ahead = partitioning
    target = (next_position // size + 1 + ahead) * size
    ranges = []
    lower = last_upper
    while lower < target:
        upper = (lower // size + 1) * size
        ranges.append(Range(lower, upper))
        lower = upper
    return ranges


def needs_more(last_upper: int, next_position: int, partitioning: Partitioning) -> bool:
    """Whether :func:`plan` would create anything: the writer's check after each batch, with no
    round trip."""
    size, ahead = partitioning
    return (next_position // size + 1 + ahead) * size > last_upper


Connection = psycopg.Connection[Any]


def ensure(conn: Connection, schema: str, pending: int = 0) -> tuple[int, Partitioning]:
    """Create the partitions the log needs now, plus room for ``pending`` positions about to be
    taken; returns the last bound and the partitioning. ``conn`` is in autocommit mode and its
    ``search_path`` is ``schema``."""
    key = f"dispach.partitions.{check_schema_name(schema)}"
    conn.execute("SELECT pg_advisory_lock(hashtext(%s))", [key])
    try:
        partitioning = _partitioning(conn)
        last_upper = _last_upper(conn)
        next_position = _next_position(conn) + pending
        for created in plan(last_upper, next_position, partitioning):
            _create(conn, created)
            last_upper = created.upper
        return last_upper, partitioning
    finally:
        if not conn.broken:
            conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", [key])


def ranges(conn: Connection) -> list[tuple[str, Range]]:
    """Every attached partition of the log, ``(table name, bounds)``, in position order."""
    rows = conn.execute(_BOUNDS).fetchall()
    return [(name, Range(lower, upper)) for name, lower, upper in rows]


def _partitioning(conn: Connection) -> Partitioning:
    row = conn.execute("SELECT size, ahead FROM log_partitioning").fetchone()
    assert row is not None, "migration 0014 inserts the row"
    return Partitioning(int(row[0]), int(row[1]))


def _last_upper(conn: Connection) -> int:
    found = ranges(conn)
    return max((r.upper for _, r in found), default=1)


def _next_position(conn: Connection) -> int:
    """The position the sequence hands out next (another transaction may hold some below it)."""
    row = conn.execute(
        "SELECT coalesce(pg_sequence_last_value("
        "pg_get_serial_sequence('events', 'global_position')::regclass), 0) + 1"
    ).fetchone()
    assert row is not None
    return int(row[0])


def _create(conn: Connection, bounds: Range) -> None:
    """One partition, standalone first (its local unique indexes, its append-only trigger),
    then attached: the partitioned indexes get their (empty) partitions on attach."""
    table = sql.Identifier(bounds.name)
    conn.execute(
        sql.SQL("CREATE TABLE IF NOT EXISTS {} (LIKE events INCLUDING CONSTRAINTS)").format(table)
    )
    create_local_indexes(conn, bounds.name)
    lower = sql.SQL("MINVALUE") if bounds.lower is None else sql.Literal(bounds.lower)
    conn.execute(
        sql.SQL("ALTER TABLE events ATTACH PARTITION {} FOR VALUES FROM ({}) TO ({})").format(
            table, lower, sql.Literal(bounds.upper)
        )
    )


def create_local_indexes(conn: Connection, name: str) -> None:
    """What every partition carries that the parent cannot: (stream_id, stream_version) and
    event_id unique within it (migration 0014), and the append-only trigger for statements
    naming the partition itself. Idempotent, so a creation cut short is finished by the next."""
    table = sql.Identifier(name)
    for suffix, columns in (("stream_version_key", "stream_id, stream_version"),
                            ("event_id_key", "event_id")):  # fmt: skip
        conn.execute(
            sql.SQL("CREATE UNIQUE INDEX IF NOT EXISTS {} ON {} ({})").format(
                sql.Identifier(f"{name}_{suffix}"), table, sql.SQL(columns)
            )
        )
    conn.execute(
        sql.SQL(
            "CREATE OR REPLACE TRIGGER {} BEFORE UPDATE OR DELETE OR TRUNCATE ON {}"
            " FOR EACH STATEMENT EXECUTE FUNCTION events_refuse_change()"
        ).format(sql.Identifier(f"{name}_append_only"), table)
    )


_BOUNDS = b"""
SELECT c.relname,
       (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \\(''?(-?\\d+)'))[1]::bigint,
       (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \\(''?(-?\\d+)'))[1]::bigint
  FROM pg_inherits i
  JOIN pg_class c ON c.oid = i.inhrelid
 WHERE i.inhparent = 'events'::regclass
 ORDER BY 3
"""

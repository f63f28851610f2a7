"""What a second round trip costs an idle commit: the writer's pipeline against one sync.

    .venv/bin/python bench/commit_trips.py [--rounds 300] [--idle-ms 10]

The group-commit writer's transaction with inline projections is two round trips in one
pipeline: ``BEGIN`` and the append, wait for its ``RETURNING`` (the projections' statements need
the events' positions), then the statements and ``COMMIT``. Folding it into one round trip
would mean finding the positions in SQL instead. This measures the idea on the embedded Postgres
before building it: a table with an identity key, one insert, three statements that depend on
its position, ``COMMIT``; ``two`` as the writer does it, ``one`` in a single pipeline sync with
the position looked up by id. Each commit follows ``--idle-ms`` of idleness, as a turn's accept
does at low load; the two ways alternate, and the medians (and the ratio one / two) are printed.
"""

from __future__ import annotations

# First: it takes this directory off the front of the import path (see its docstring).
from _report import pct, raw_connect, servers

# isort: split
import argparse
import secrets
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg

_SETUP = [
    "CREATE TABLE trips_events (position bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
    " event_id uuid UNIQUE NOT NULL, data jsonb NOT NULL)",
    "CREATE TABLE trips_rows (event_id uuid PRIMARY KEY, position bigint NOT NULL, n int)",
]
_INSERT = b"INSERT INTO trips_events (event_id, data) VALUES (%s, '{}') RETURNING position"
_KNOWN = (b"INSERT INTO trips_rows VALUES (%s, %s, %s) ON CONFLICT (event_id) DO UPDATE"
          b" SET n = trips_rows.n + 1")  # fmt: skip
_LOOKED_UP = (b"INSERT INTO trips_rows VALUES (%s, (SELECT position FROM trips_events"
              b" WHERE event_id = %s), %s) ON CONFLICT (event_id) DO UPDATE"
              b" SET n = trips_rows.n + 1")  # fmt: skip


def two(conn: psycopg.Connection[Any]) -> None:
    """As the writer: the insert's answer first, then the statements and COMMIT."""
    event_id = uuid.uuid4()
    with conn.cursor() as cur, conn.pipeline():
        cur.execute(b"BEGIN")
        cur.execute(_INSERT, [event_id])
        row = cur.fetchone()
        assert row is not None
        for n in range(3):
            cur.execute(_KNOWN, [event_id, row[0], n])
        cur.execute(b"COMMIT")


def one(conn: psycopg.Connection[Any]) -> None:
    """Everything in one sync; the statements find the position by the event's id."""
    event_id = uuid.uuid4()
    inserted = conn.cursor()
    with conn.cursor() as cur, conn.pipeline():
        cur.execute(b"BEGIN")
        inserted.execute(_INSERT, [event_id])
        for n in range(3):
            cur.execute(_LOOKED_UP, [event_id, event_id, n])
        cur.execute(b"COMMIT")
    assert inserted.fetchone() is not None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--idle-ms", type=float, default=10.0)
    args = parser.parse_args()
    ways: dict[str, Callable[[psycopg.Connection[Any]], None]] = {"two": two, "one": one}
    taken: dict[str, list[float]] = {name: [] for name in ways}
    with servers() as found:
        schema = f"trips_{secrets.token_hex(4)}"
        with psycopg.connect(found.database_url, autocommit=True) as admin:
            admin.execute(f"CREATE SCHEMA {schema}".encode())
        try:
            with raw_connect(found.database_url, schema, autocommit=True) as conn:
                for statement in _SETUP:
                    conn.execute(statement.encode())
                for way in ways.values():  # warm: plans cached, pages in memory
                    for _ in range(20):
                        way(conn)
                for _ in range(args.rounds):
                    for name, way in ways.items():
                        time.sleep(args.idle_ms / 1000)
                        began = time.perf_counter()
                        way(conn)
                        taken[name].append((time.perf_counter() - began) * 1000)
        finally:
            with psycopg.connect(found.database_url, autocommit=True) as admin:
                admin.execute(f"DROP SCHEMA {schema} CASCADE".encode())
    for name, samples in taken.items():
        print(f"{name}: p50 {statistics.median(samples):.3f} ms, p90 {pct(samples, 90):.3f} ms"
              f" ({len(samples)} commits, each after {args.idle_ms:g} ms idle)")  # fmt: skip
    ratio = statistics.median(taken["one"]) / statistics.median(taken["two"])
    print(f"one round trip / two: {ratio:.2f}x")


if __name__ == "__main__":
    main()

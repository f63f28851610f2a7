"""The migration runner: numbered files once each under a lock, and migrations that run outside
a transaction (concurrent index builds) that a rerun finishes after a crash or a cancel."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from typing import Any

import psycopg
import pytest
from psycopg import sql

from eventstore import START, EventStore, Metadata, NewEvent, migrate
from eventstore._sql import load
from eventstore.catalogue import ModelChunk
from eventstore.errors import MigrationError
from eventstore.migrations import Migration, available, outside_transaction, statements
from tests.conftest import ConnectFactory, Servers
from tests.storeops import append

SCOPED = "0013_scoped_reads"
AGENT_INDEX = "events_agent_checkpoint_idx"
SESSION_INDEX = "events_session_checkpoint_idx"


def upto(version: int) -> list[Migration]:
    return [m for m in available() if m.version <= version]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("SELECT 1;", ["SELECT 1;"]),
        ("-- why\nDROP INDEX a;\nCREATE INDEX a\n    ON t (x);\n",
         ["-- why\nDROP INDEX a;", "CREATE INDEX a\n    ON t (x);"]),
        ("SELECT 1;  \n\n-- a comment ending in a semicolon;\n", ["SELECT 1;"]),
        ("SELECT 1; -- trailing\nSELECT 2;", ["SELECT 1; -- trailing\nSELECT 2;"]),
        ("SELECT 1;\nSELECT 2", ["SELECT 1;", "SELECT 2"]),
        ("-- only a comment\n", []),
    ],
)  # fmt: skip
def test_a_statement_ends_at_a_line_ending_in_a_semicolon(text: str, expected: list[str]) -> None:
    assert statements(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("-- dispach:no-transaction\nCREATE INDEX CONCURRENTLY a ON t (x);", True),
        ("-- dispach:no-transaction  \r\nSELECT 1;", True),
        ("-- why\n-- dispach:no-transaction\nSELECT 1;", False),
        ("CREATE TABLE t (x int);", False),
    ],
)
def test_only_a_first_line_marker_takes_a_migration_out_of_its_transaction(
    text: str, expected: bool
) -> None:
    assert outside_transaction(text) is expected


def test_the_scoped_reads_migration_runs_outside_a_transaction() -> None:
    [scoped] = [m for m in available() if m.label == SCOPED]
    assert outside_transaction(scoped.text)
    assert [s.split()[:4] for s in statements(scoped.text)][1:] == [
        ["CREATE", "INDEX", "CONCURRENTLY", AGENT_INDEX],
        ["DROP", "INDEX", "CONCURRENTLY", "IF"],
        ["CREATE", "INDEX", "CONCURRENTLY", SESSION_INDEX],
    ]


def test_two_runners_at_once_apply_each_migration_once(servers: Servers, schema: str) -> None:
    # A runner waiting for the lock inside pg_advisory_lock would hold a snapshot the other's
    # concurrent index build waits for: Postgres would end one of them as a deadlock.
    start = threading.Barrier(2)
    results: list[list[str] | BaseException] = []

    def run() -> None:
        start.wait()
        try:
            results.append(migrate(servers.database_url, schema))
        except BaseException as e:  # reported by the assertion below
            results.append(e)

    runners = [threading.Thread(target=run) for _ in range(2)]
    for runner in runners:
        runner.start()
    for runner in runners:
        runner.join(60)
    labels = [m.label for m in available()]
    assert all(isinstance(r, list) for r in results), results
    assert sorted(results, key=lambda r: len(r) if isinstance(r, list) else -1) == [[], labels]
    with psycopg.connect(servers.database_url, options=f"-c search_path={schema}") as conn:
        rows = conn.execute("SELECT version FROM schema_migrations ORDER BY version").fetchall()
        assert [v for (v,) in rows] == [m.version for m in available()]
        assert valid(conn, schema, AGENT_INDEX) and valid(conn, schema, SESSION_INDEX)


def test_a_cancelled_index_build_is_finished_by_a_rerun(
    servers: Servers, schema: str, connect: ConnectFactory
) -> None:
    migrate(servers.database_url, schema, upto(12))
    # A snapshot older than the build keeps it waiting in its last phase, its index already in
    # the catalogue but not valid: there it is cancelled, as a crash or an operator would.
    holder = connect(autocommit=True)
    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT 1")
    failure: list[BaseException] = []

    def run() -> None:
        try:
            migrate(servers.database_url, schema, upto(13))
        except BaseException as e:  # asserted below
            failure.append(e)

    runner = threading.Thread(target=run)
    runner.start()
    watcher = connect(autocommit=True)
    pid = wait_for_build(watcher, AGENT_INDEX)
    watcher.execute("SELECT pg_cancel_backend(%s)", [pid])
    runner.join(30)
    holder.execute("ROLLBACK")

    [error] = failure
    assert isinstance(error, MigrationError) and error.code == "migration_failed"
    assert error.message == (
        f"migration {SCOPED} failed at statement 2 of 4: canceling statement due to user request"
    )
    assert "statements before it stay applied" in error.hint
    assert valid(watcher, schema, AGENT_INDEX) is False  # left behind, as after a crash
    assert recorded(watcher) == list(range(1, 13))

    assert migrate(servers.database_url, schema, upto(13)) == [SCOPED]
    assert valid(watcher, schema, AGENT_INDEX) and valid(watcher, schema, SESSION_INDEX)
    assert definition(watcher, AGENT_INDEX).endswith(
        "USING btree (((metadata ->> 'agentId'::text)), transaction_id, global_position)"
    )
    assert recorded(watcher) == list(range(1, 14))


def test_a_failing_statement_outside_a_transaction_records_nothing(
    servers: Servers, schema: str, connect: ConnectFactory
) -> None:
    first = "CREATE INDEX CONCURRENTLY probe_idx ON events (type);"
    broken = Migration(
        9001, "probe", f"-- dispach:no-transaction\n{first}\nCREATE INDEX CONCURRENTLY broken_idx\n"
        "    ON no_such_table (x);\n",
    )  # fmt: skip
    with pytest.raises(MigrationError) as raised:
        migrate(servers.database_url, schema, [*upto(13), broken])
    assert raised.value.message == (
        'migration 9001_probe failed at statement 2 of 2: relation "no_such_table" does not exist'
    )
    assert raised.value.hint == (
        "it runs outside a transaction, so the statements before it stay applied; fix the cause "
        "and start again: it is run again from its first statement"
    )
    conn = connect(autocommit=True)
    assert recorded(conn) == list(range(1, 14))
    assert valid(conn, schema, "probe_idx")  # the first statement stays, as the hint says
    # The lock was released: the fixed migration, safe to repeat, is applied by the next run.
    fixed = Migration(
        9001, "probe", f"-- dispach:no-transaction\nDROP INDEX CONCURRENTLY IF EXISTS probe_idx;\n"
        f"{first}\n",
    )  # fmt: skip
    assert migrate(servers.database_url, schema, [*upto(13), fixed]) == ["9001_probe"]
    assert recorded(conn)[-1] == 9001


def test_a_failing_migration_in_a_transaction_applies_nothing(
    servers: Servers, schema: str, connect: ConnectFactory
) -> None:
    broken = Migration(9002, "probe", "CREATE TABLE probe (x int);\nSELECT nope FROM probe;\n")
    with pytest.raises(MigrationError) as raised:
        migrate(servers.database_url, schema, [*upto(13), broken])
    assert raised.value.message == 'migration 9002_probe failed: column "nope" does not exist'
    assert raised.value.hint == "nothing of it was applied; fix the cause and start again"
    conn = connect(autocommit=True)
    assert conn.execute("SELECT to_regclass('probe')").fetchone() == (None,)
    assert recorded(conn) == list(range(1, 14))


def test_scoped_reads_use_their_indexes(store: EventStore, connect: ConnectFactory) -> None:
    # 20,000 events of 200 agents (100 each), 10 sessions per agent, 1,000 per append.
    for batch in range(20):
        append(
            store,
            f"seed-{batch}",
            [
                NewEvent(
                    event=ModelChunk(delta="x"),
                    metadata=Metadata(
                        agent_id=f"agent-{i % 200}", session_key=f"s-{i // 200 % 10}"
                    ),
                )
                for i in range(batch * 1000, (batch + 1) * 1000)
            ],
        )
    conn = connect(autocommit=True)
    conn.execute("ANALYZE events")
    page = {"txid": "0", "position": 0, "limit": 500, "types": None}
    agent = {**page, "agent_id": "agent-7", "session_key": None}
    session = {**page, "agent_id": "agent-7", "session_key": "s-3"}
    assert AGENT_INDEX in indexes_used(conn, "read_agent", agent)
    assert SESSION_INDEX in indexes_used(conn, "read_session", session)
    # Each scope's shape has its own statement (EventStore.aread_scoped), so the generic plan a
    # prepared statement may settle on uses the index too; one statement for every shape, whose
    # agent filter may be NULL, cannot.
    conn.execute("SET plan_cache_mode = force_generic_plan")
    assert AGENT_INDEX in indexes_used(conn, "read_agent", agent, prepared=True)
    assert SESSION_INDEX in indexes_used(conn, "read_session", session, prepared=True)
    assert AGENT_INDEX not in indexes_used(conn, "read_scoped", agent, prepared=True)
    assert len(conn.execute(load("read_agent").encode(), agent).fetchall()) == 100
    assert len(conn.execute(load("read_session").encode(), session).fetchall()) == 10
    assert asyncio.run(scoped_counts(store)) == (100, 10)


async def scoped_counts(store: EventStore) -> tuple[int, int]:
    """How many events the store's scoped read finds for agent-7, and for its session s-3."""
    await store.apool.open()
    try:
        agent = await store.aread_scoped(START, 500, agent_id="agent-7")
        session = await store.aread_scoped(START, 500, agent_id="agent-7", session_key="s-3")
        return len(agent), len(session)
    finally:
        await store.apool.close()


PARAMETER_TYPES = {"txid": "text", "position": "bigint", "limit": "bigint", "types": "text[]",
                   "agent_id": "text", "session_key": "text"}  # fmt: skip


def indexes_used(
    conn: psycopg.Connection[Any], query: str, params: dict[str, object], *, prepared: bool = False
) -> set[str]:
    """The indexes a plan of a scoped read scans, by the name they were created with (an index
    of a partition counts as the partitioned index it belongs to). ``prepared``: of the plan of
    a prepared statement (PREPARE, then EXECUTE), which ``plan_cache_mode`` applies to."""
    text = load(query)
    if prepared:
        order = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", text)))
        for number, name in enumerate(order, 1):
            text = text.replace(f"%({name})s", f"${number}")
        types = ", ".join(PARAMETER_TYPES[name] for name in order)
        conn.execute(f"PREPARE probe ({types}) AS {text}".encode())
        args = sql.SQL(", ").join(sql.Literal(params[name]) for name in order)
        explain = sql.SQL("EXPLAIN (FORMAT JSON) EXECUTE probe({})").format(args)
        row = conn.execute(explain).fetchone()
        conn.execute("DEALLOCATE probe")
    else:
        row = conn.execute(b"EXPLAIN (FORMAT JSON) " + text.encode(), params).fetchone()
    assert row is not None
    names: set[str] = set()
    nodes = [row[0][0]["Plan"]]
    while nodes:
        node = nodes.pop()
        nodes.extend(node.get("Plans", []))
        if "Index Name" in node:
            [(root,)] = conn.execute(
                "SELECT coalesce(pg_partition_root(%s::regclass), %s::regclass)::text",
                [node["Index Name"], node["Index Name"]],
            ).fetchall()
            names.add(root)
    return names


def wait_for_build(conn: psycopg.Connection[Any], index: str) -> int:
    """The pid of the session building ``index`` once it waits on a lock."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        row = conn.execute(
            """SELECT pid FROM pg_stat_activity
                WHERE datname = current_database() AND wait_event_type = 'Lock'
                  AND query LIKE %s""",
            [f"CREATE INDEX CONCURRENTLY {index}%"],
        ).fetchone()
        if row is not None:
            return int(row[0])
        time.sleep(0.05)
    raise AssertionError(f"no build of {index} waiting")


def valid(conn: psycopg.Connection[Any], schema: str, index: str) -> bool | None:
    """Whether ``index`` of ``schema`` is valid; None if there is none of that name."""
    row = conn.execute(
        """SELECT i.indisvalid FROM pg_index i
             JOIN pg_class c ON c.oid = i.indexrelid
             JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname = %s AND c.relname = %s""",
        [schema, index],
    ).fetchone()
    return None if row is None else bool(row[0])


def definition(conn: psycopg.Connection[Any], index: str) -> str:
    row = conn.execute("SELECT pg_get_indexdef(%s::regclass)", [index]).fetchone()
    assert row is not None
    return str(row[0])


def recorded(conn: psycopg.Connection[Any]) -> list[int]:
    return [v for (v,) in conn.execute("SELECT version FROM schema_migrations ORDER BY version")]

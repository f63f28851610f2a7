"""The partitioned log (migration 0014, eventstore/partitions.py): an existing log keeps every
position and cursor, partitions are made ahead of the positions, and optimistic concurrency and
idempotent retries hold across partitions as they did in one table."""

from __future__ import annotations

import itertools
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

import psycopg
import pytest

from eventstore import (
    ANY,
    START,
    AppendResult,
    EventStore,
    NewEvent,
    RecordedEvent,
    WrongExpectedVersion,
)
from eventstore._sql import load
from eventstore.catalogue import SessionNote, TurnStart
from eventstore.envelope import Checkpoint, Metadata
from eventstore.migrations import available, migrate
from eventstore.partitions import Partitioning, Range, needs_more, plan, ranges
from tests.conftest import ConnectFactory, Servers
from tests.storeops import append


@pytest.mark.parametrize(
    ("last_upper", "next_position", "size", "ahead", "expected"),
    [
        # A fresh log: the first partition ends at 1; the next ones align on the size.
        (1, 1, 10, 2, [(1, 10), (10, 20), (20, 30)]),
        # Enough ahead already: nothing.
        (30, 5, 10, 2, []),
        # The positions reached the last partition but one: one more.
        (30, 12, 10, 2, [(30, 40)]),
        # A migrated log ends unaligned (its last position + 1): filled up to the next multiple.
        (1235, 1235, 1000, 1, [(1235, 2000), (2000, 3000)]),
        # A burst far past the last bound: every partition up to it.
        (10, 45, 10, 1, [(10, 20), (20, 30), (30, 40), (40, 50), (50, 60)]),
    ],
)
def test_plan(
    last_upper: int, next_position: int, size: int, ahead: int, expected: list[tuple[int, int]]
) -> None:
    partitioning = Partitioning(size, ahead)
    assert plan(last_upper, next_position, partitioning) == [Range(a, b) for a, b in expected]
    assert needs_more(last_upper, next_position, partitioning) == bool(expected)


def test_partitions_are_named_by_their_first_position() -> None:
    assert Range(None, 6).name == "events_0"
    assert Range(1000, 2000).name == "events_1000"


def _append_some(store: EventStore, streams: int, each: int) -> list[RecordedEvent]:
    futures: list[Future[AppendResult]] = []
    for round_ in range(each):
        for s in range(streams):
            meta = Metadata(agent_id="a", session_key=f"k{s}", turn_id=f"t{s}")
            futures += [store.submit(f"turn-t{s}", [NewEvent(event=TurnStart(source=f"r{round_}"),
                                                             metadata=meta)], ANY)]  # fmt: skip
    return [e for f in futures for e in f.result(30).events]


def _read_everything(store: EventStore, after: Checkpoint = START) -> list[RecordedEvent]:
    found: list[RecordedEvent] = []
    while page := store.read_all(after, 100):
        found += page
        after = page[-1].checkpoint
    return found


_OLD_ROWS = """INSERT INTO events (stream_id, stream_version, event_id, type, data, metadata)
               SELECT 'turn-t' || s, %s, gen_random_uuid(), 'turn.start',
                      jsonb_build_object('source', 'r' || %s),
                      jsonb_build_object('agentId', 'a', 'sessionKey', 'k' || s, 'turnId', 't' || s)
                 FROM generate_series(0, 6) AS s"""
_OLD_READ = """SELECT event_id, global_position, transaction_id::text::bigint, stream_version
                 FROM events WHERE (transaction_id, global_position) > (%s::text::xid8, %s)
                ORDER BY transaction_id, global_position"""

Row = tuple[uuid.UUID, int, int, int]


def test_migrating_a_populated_log_keeps_positions_and_cursors(
    servers: Servers, schema: str, connect: ConnectFactory
) -> None:
    # The log as migration 0013 left it: one table, written by nine transactions.
    migrate(servers.database_url, schema, [m for m in available() if m.version <= 13])
    conn = connect(autocommit=True)
    for version in range(9):
        conn.execute(_OLD_ROWS, [version, version])
    before: list[Row] = conn.execute(_OLD_READ, ["0", 0]).fetchall()
    by_cursor = {(txid, position): conn.execute(_OLD_READ, [str(txid), position]).fetchall()
                 for _, position, txid, _ in before[::4]}  # fmt: skip
    assert len(before) == 63

    assert "0014_partitioned_log" in migrate(servers.database_url, schema)
    store = EventStore(servers.database_url, schema=schema)
    store.open()
    try:

        def rows(after: Checkpoint) -> list[Row]:
            return [(e.event_id, e.position, e.txid, e.version)
                    for e in _read_everything(store, after)]  # fmt: skip

        assert rows(START) == before
        for (txid, position), expected in by_cursor.items():
            cursor = Checkpoint(txid, position).cursor()  # as a client holds it
            assert rows(Checkpoint.from_cursor(cursor)) == expected
        # Positions continue after the old ones, versions after the old heads.
        more = _append_some(store, streams=2, each=1)
        assert min(e.position for e in more) > before[-1][1]
        assert [e.version for e in more] == [9, 9]
    finally:
        store.close()
    found = ranges(conn)
    assert found[0] == ("events_0", Range(None, before[-1][1] + 1))
    assert len(found) > 1  # the writer made the next ones at start


def _small_partitions(servers: Servers, schema: str, size: int, ahead: int) -> None:
    migrate(servers.database_url, schema)
    with psycopg.connect(servers.database_url, autocommit=True,
                         options=f"-c search_path={schema}") as conn:  # fmt: skip
        conn.execute("UPDATE log_partitioning SET size = %s, ahead = %s", [size, ahead])


def test_a_burst_across_many_partition_bounds_never_fails(
    servers: Servers, schema: str, connect: ConnectFactory
) -> None:
    # 10 positions a partition, 1 ahead: one batch of the burst crosses many bounds at once.
    _small_partitions(servers, schema, size=10, ahead=1)
    store = EventStore(servers.database_url, schema=schema)
    store.open()
    try:
        written = _append_some(store, streams=50, each=6)
        assert len(written) == 300
        assert len({e.position for e in written}) == 300
        # A batch that found no partition was inserted again (its first positions are lost to
        # the sequence, as after any failed insert); versions stay dense.
        assert sorted(e.version for e in written) == sorted(list(range(6)) * 50)
        assert len(_read_everything(store)) == 300
    finally:
        store.close()
    found = ranges(connect(autocommit=True))
    assert len(found) >= 31
    assert all(a.upper == b.lower for (_, a), (_, b) in itertools.pairwise(found))


def test_versions_and_ids_are_unique_across_partitions(
    servers: Servers, schema: str, connect: ConnectFactory
) -> None:
    _small_partitions(servers, schema, size=5, ahead=1)
    store = EventStore(servers.database_url, schema=schema)
    store.open()
    try:
        first = NewEvent(event=SessionNote(action="append", text="one"))
        original = append(store, "session-a-k", [first], -1)
        _append_some(store, streams=3, each=4)  # the log moves on, into later partitions
        # A stale expected version is refused although the stream's head is in an older one.
        with pytest.raises(WrongExpectedVersion):
            append(store, "session-a-k", [NewEvent(event=SessionNote(action="append", text="x"))],
                         -1)  # fmt: skip
        # A retry of the stored event (even with ANY) answers the original, not a copy.
        again = append(store, "session-a-k", [first], ANY)
        assert again.duplicate
        assert again.events[0].position == original.events[0].position
        nxt = append(store, "session-a-k", [NewEvent(event=SessionNote(action="append", text="2"))],
                           0)  # fmt: skip
        assert nxt.version == 1
        assert store.stream_version("session-a-k") == 1
    finally:
        store.close()
    conn = connect(autocommit=True)
    stored = conn.execute(
        "SELECT count(*), count(DISTINCT event_id) FROM events WHERE stream_id = 'session-a-k'"
    ).fetchone()
    assert stored == (2, 2)
    assert len({name for name, _ in ranges(conn)}) > 3


def test_explain_reads_no_partition_sequentially(
    servers: Servers, schema: str, connect: ConnectFactory
) -> None:
    _small_partitions(servers, schema, size=20, ahead=1)
    store = EventStore(servers.database_url, schema=schema)
    store.open()
    try:
        _append_some(store, streams=10, each=8)
    finally:
        store.close()
    conn = connect(autocommit=True)
    conn.execute("ANALYZE events")
    conn.execute("SET enable_seqscan = off")  # tiny tables: ask which plans exist at all
    page: dict[str, object] = {"txid": "0", "position": 0, "limit": 10}
    reads: list[tuple[str, dict[str, object]]] = [
        ("heads", {"streams": ["turn-t1", "turn-t2"]}),
        ("existing", {"ids": [uuid.uuid4()]}),
        ("read_all", page),
        ("read_turn", {**page, "turn_id": "t1"}),
        ("read_scoped", {**page, "agent_id": "a", "session_key": "k1", "types": None}),
        ("read_stream", {"stream": "turn-t1", "from_version": 0, "limit": 10}),
    ]
    for name, params in reads:
        assert "Seq Scan on events_" not in _plan(conn, load(name), params), name
    # What the VOLATILE functions of append.sql and heads.sql run (EXPLAIN does not show it).
    heads = "SELECT * FROM events_heads(%(streams)s::text[])"
    body = _function_body(conn, "events_heads")
    stored = _function_body(conn, "events_stored")
    probes: list[tuple[str, dict[str, object]]] = [
        (body.replace("streams", "%(streams)s::text[]"), {"streams": ["turn-t1"]}),
        (stored.replace("ids", "%(ids)s::uuid[]"), {"ids": [uuid.uuid4()]}),
        (heads, {"streams": ["turn-t1"]}),
        (load("append"), {"rows": "[]", "parts": []}),
    ]
    for query, params in probes:
        assert "Seq Scan on events_" not in _plan(conn, query, params), query


def _plan(
    conn: psycopg.Connection[tuple[object, ...]], query: str, params: dict[str, object]
) -> str:
    rows = conn.execute(("EXPLAIN " + query).encode(), params).fetchall()
    return "\n".join(str(r[0]) for r in rows)


def _function_body(conn: psycopg.Connection[tuple[object, ...]], name: str) -> str:
    """The one query a plpgsql function of migration 0014 returns."""
    row = conn.execute("SELECT prosrc FROM pg_proc WHERE proname = %s", [name]).fetchone()
    assert row is not None
    source = str(row[0])
    return source[source.index("SELECT") : source.rindex(";")]


def test_two_nodes_racing_on_one_stream_across_partitions_never_share_a_version(
    servers: Servers, schema: str, connect: ConnectFactory
) -> None:
    """Two stores (two nodes' writers) append to one stream, each deciding from the head it read,
    while the log crosses a partition bound every few events: only the unique index of one
    partition would catch a collision, the append statement's own checks catch all of them."""
    _small_partitions(servers, schema, size=3, ahead=1)
    stores = [EventStore(servers.database_url, schema=schema) for _ in range(2)]
    for store in stores:
        store.open()
    try:

        def race(store: EventStore) -> int:
            won = 0
            for _ in range(60):
                head = store.stream_version("session-a-race")
                note = NewEvent(event=SessionNote(action="append", text="x"))
                try:
                    append(store, "session-a-race", [note], head)
                    won += 1
                except WrongExpectedVersion:
                    pass
            return won

        with ThreadPoolExecutor(2) as pool:
            wins = sum(pool.map(race, stores))
    finally:
        for store in stores:
            store.close()
    versions = [
        int(str(v))
        for (v,) in connect(autocommit=True).execute(
            "SELECT stream_version FROM events WHERE stream_id = 'session-a-race' ORDER BY 1"
        )
    ]
    assert versions == list(range(wins))
    assert len(ranges(connect(autocommit=True))) > wins // 3

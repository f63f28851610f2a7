"""Archiving a partition of the log and restoring it (eventstore/archive.py), and what readers
see meanwhile (eventstore/archive_ranges.py: 410 cursor_archived, never a silent skip)."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from eventstore import INLINE, START, NewEvent, rebuild
from eventstore.archive import (
    EVENTS_FILE,
    ArchiveError,
    Facts,
    Retention,
    archive,
    connect,
    eligible,
    restore,
    verify,
)
from eventstore.catalogue import Tokens, TurnEnd, TurnStart
from eventstore.envelope import Checkpoint, Metadata
from eventstore.errors import CursorArchived
from eventstore.migrations import migrate
from eventstore.partitions import Range, ranges
from eventstore.retention import archive_eligible
from tests.conftest import ApiFactory
from tests.test_api_http import accept, client_of, ended, error_of
from tests.test_log_stats import log_cli

TURNS = 10_000
SIZE = 10_000
_ALL_COLUMNS = """SELECT global_position, stream_id, stream_version, event_id::text, type,
                         data::text, metadata::text, recorded_at::text, transaction_id::text
                    FROM {} ORDER BY global_position"""


def _facts(**changes: Any) -> Facts:
    old = datetime(2026, 1, 1, tzinfo=UTC)
    base = Facts("events_10", Range(10, 20), newest_partition=False, committed_until=50,
                 events=7, last_recorded=old, running_turns=0, active_sessions=0)  # fmt: skip
    return base._replace(**changes)


NOW = datetime(2026, 3, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("facts", "retention", "refused"),
    [
        (_facts(), None, None),
        (_facts(newest_partition=True), None, "may still receive positions"),
        (_facts(committed_until=15), None, "may still receive positions"),
        (_facts(events=0), None, "holds no events"),
        (_facts(running_turns=2), None, "2 turns not ended"),
        (_facts(), Retention(30), None),
        (_facts(last_recorded=NOW - timedelta(days=3)), Retention(30), "retention keeps 30 days"),
        (_facts(active_sessions=4), Retention(30), "4 active sessions"),
        (_facts(active_sessions=4), Retention(30, keep_sessions_active=False), None),
    ],
)
def test_which_partitions_may_be_archived(
    facts: Facts, retention: Retention | None, refused: str | None
) -> None:
    from eventstore.archive import refusal

    why = refusal(facts, retention, NOW)
    assert (why is None) if refused is None else (why is not None and refused in why), why


def _rows(conn: psycopg.Connection[Any], table: str) -> list[tuple[Any, ...]]:
    return conn.execute(_ALL_COLUMNS.replace("{}", f'"{table}"').encode()).fetchall()


@pytest.mark.asyncio
async def test_archive_and_restore_a_partition_of_ten_thousand_turns(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    nodes = api_factory.nodes
    url, schema = nodes.servers.database_url, nodes.schema
    migrate(url, schema)
    with connect(url, schema) as conn:
        conn.execute("UPDATE log_partitioning SET size = %s", [SIZE])
    api = await api_factory.start()
    store = api.node.store
    assert store is not None

    # 10,000 turns of two events each, appended through the store (many per writer batch).
    async def one(i: int) -> None:
        meta = Metadata(agent_id="assistant", session_key=f"old-{i % 50}", turn_id=f"old{i}")
        await store.aappend(f"turn-old{i}", [
            NewEvent(event=TurnStart(source="api", input=f"question {i}"), metadata=meta),
            NewEvent(event=TurnEnd(reason="final", steps=1, tokens=Tokens(prompt=3), duration_ms=5,
                                   text=f"answer {i} \\ \" \u00e9"), metadata=meta),
        ], -1)  # fmt: skip

    for chunk in range(0, TURNS, 50):  # small steps: the loop also serves the node
        await asyncio.gather(*(one(i) for i in range(chunk, chunk + 50)))
    async with client_of(api) as http:
        live = [(await accept(http, f"live {n}"))["turnId"] for n in range(3)]
        for turn_id in live:
            await ended(http, turn_id)

    with connect(url, schema) as conn:
        found = dict(ranges(conn))
        name = next(n for n, r in found.items() if r.lower == 1)  # events_1: [1, 10000)
        before = await asyncio.to_thread(_rows, conn, name)
        assert len(before) == SIZE - 1
        with pytest.raises(ArchiveError, match="may still receive positions"):
            await asyncio.to_thread(archive, conn, max(found, key=lambda n: found[n].upper),
                                    tmp_path)  # fmt: skip
        manifest = await asyncio.to_thread(archive, conn, name, tmp_path)
        assert name not in dict(ranges(conn))
    target = tmp_path / manifest["archiveId"]

    # Every archived event is in the archive, with matching checksums.
    assert verify(target) == manifest
    raw = (target / EVENTS_FILE).read_bytes()
    assert hashlib.sha256(raw).hexdigest() == manifest["files"][EVENTS_FILE]["sha256"]
    lines = gzip.decompress(raw).splitlines()
    assert hashlib.sha256(gzip.decompress(raw)).hexdigest() == manifest["rowsSha256"]
    archived = [json.loads(line) for line in lines]
    assert [e["global_position"] for e in archived] == [row[0] for row in before]
    assert manifest["events"] == len(before)
    assert manifest["positions"] == {"first": before[0][0], "last": before[-1][0]}

    first_archived = archived[0]
    inside = Checkpoint(int(archived[100]["transaction_id"]), archived[100]["global_position"])
    old_turn = first_archived["metadata"]["turnId"]
    store.archived.forget()
    async with client_of(api) as http:
        # The turn resource still answers, from the projection, and says where its events are.
        turn = (await http.get(f"/v1/turns/{old_turn}")).json()
        assert turn["status"] == "final"
        assert turn["archived"] is True and turn["archiveId"] == manifest["archiveId"]
        # Its events, from the start or from a cursor inside the archived range: 410.
        for query in ("", f"?after={inside.cursor()}"):
            response = await http.get(f"/v1/agents/assistant/turns/{old_turn}/events{query}")
            error = error_of(response, 410, "cursor_archived")
            assert manifest["archiveId"] in error["hint"] and "dispach log restore" in error["hint"]
        response = await http.get(f"/v1/agents/assistant/turns/{old_turn}/stream")
        error_of(response, 410, "cursor_archived")
        response = await http.get(f"/v1/events?after={inside.cursor()}")
        error_of(response, 410, "cursor_archived")
        # Live turns are unaffected: their resource and their events.
        for turn_id in live:
            resource = (await http.get(f"/v1/turns/{turn_id}")).json()
            assert "archived" not in resource and resource["status"] == "final"
            events = await http.get(f"/v1/agents/assistant/turns/{turn_id}/events")
            assert events.status_code == 200
            assert events.json()["events"][0]["type"] == "turn.start"
        again = await accept(http, "after the archive")
        assert (await ended(http, again["turnId"]))["status"] == "final"
    # The store refuses to pass over the range, from the start or from inside it; after it, fine.
    for after in (START, inside):
        with pytest.raises(CursorArchived):
            await store.aread_all(after, 10)
    last = manifest["lastCheckpoint"]
    assert await store.aread_all(Checkpoint(int(last["txid"]), last["position"]), 10)
    # A projection rebuilt from the log would miss the archived events: it is refused.
    with pytest.raises(CursorArchived):
        await asyncio.to_thread(rebuild, store, INLINE[0], inline=True)

    # Restore: byte-identical rows, every column.
    with connect(url, schema) as conn:
        await asyncio.to_thread(restore, conn, target)
        assert await asyncio.to_thread(_rows, conn, name) == before
        with pytest.raises(ArchiveError, match="part of the log already"):
            restore(conn, target)
    store.archived.forget()
    assert len(await store.aread_all(START, 20_000)) >= 2 * TURNS
    async with client_of(api) as http:
        response = await http.get(f"/v1/agents/assistant/turns/{old_turn}/events")
        assert response.status_code == 200
        assert [e["type"] for e in response.json()["events"]] == ["turn.start", "turn.end"]
        assert "archived" not in (await http.get(f"/v1/turns/{old_turn}")).json()


@pytest.mark.asyncio
async def test_the_cli_archives_and_restores_and_refuses_a_damaged_archive(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    nodes = api_factory.nodes
    url, schema = nodes.servers.database_url, nodes.schema
    migrate(url, schema)
    with connect(url, schema) as conn:
        conn.execute("UPDATE log_partitioning SET size = 20")
    api = await api_factory.start()
    store = api.node.store
    assert store is not None
    for i in range(30):
        meta = Metadata(agent_id="assistant", session_key="s", turn_id=f"t{i}")
        await store.aappend(f"turn-t{i}", [NewEvent(event=TurnStart(source="api"), metadata=meta),
                            NewEvent(event=TurnEnd(reason="final", steps=0, tokens=Tokens(),
                                                   duration_ms=1), metadata=meta)], -1)  # fmt: skip
    with connect(url, schema) as conn:
        # Retention: nothing is 30 days old; with 0 days every full partition behind the head.
        assert eligible(conn, Retention(30)) == []
        now_eligible = eligible(conn, Retention(0))
        assert now_eligible[0] == "events_1"
        assert ranges(conn)[-1][0] not in now_eligible  # the newest, where positions go on
        newest = ranges(conn)[-1][0]
        before = await asyncio.to_thread(_rows, conn, "events_1")

    home, out = tmp_path / "home", tmp_path / "archives"
    code, _, err = await log_cli(api, home, "archive", "--partition", newest, "--to", str(out))
    assert code == 1 and "archive_refused" in err and "hint:" in err
    code, text, err = await log_cli(api, home, "archive", "--partition", "events_1",
                                    "--to", str(out), "--json")  # fmt: skip
    assert code == 0, err
    [manifest] = json.loads(text)
    target = out / manifest["archiveId"]
    code, text, err = await log_cli(api, home, "restore", str(target / "manifest.json"))
    assert code == 0, err
    assert "restored events_1" in text
    with connect(url, schema) as conn:
        assert await asyncio.to_thread(_rows, conn, "events_1") == before

        manifest = await asyncio.to_thread(archive, conn, "events_1", tmp_path)
        target = tmp_path / manifest["archiveId"]
        data = bytearray((target / EVENTS_FILE).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (target / EVENTS_FILE).write_bytes(bytes(data))
        with pytest.raises(ArchiveError, match="does not match its manifest"):
            restore(conn, target)
        assert "events_1" not in dict(ranges(conn))
    code, _, err = await log_cli(api, home, "restore", str(target))
    assert code == 1 and "archive_refused" in err and "damaged" in err
    # Retention, as the node holding its lease runs it: every eligible partition, not the newest.
    done = await asyncio.to_thread(archive_eligible, url, schema, Retention(0), tmp_path)
    assert done and all(not a.startswith(f"{newest}-") for a in done)
    with connect(url, schema) as conn:
        assert [name for name, _ in ranges(conn)][-1] == newest

"""``dispach log stats`` against a real node's database: the CLI runs as a subprocess (as a person
runs it), reading the log the node wrote; its figures are checked against the log as the store
reads it."""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from eventstore import START, RecordedEvent
from tests.conftest import ApiServer
from tests.test_api_http import accept, client_of, eventually
from tests.test_client import DISPACH


async def log_cli(api: ApiServer, home: Path, *args: str, schema: str | None = None
                  ) -> tuple[int, str, str]:  # fmt: skip
    """``dispach log ...`` on the node's database and schema (or ``schema``)."""
    settings = api.node.settings
    assert settings.database_url is not None
    env = os.environ | {
        "DATABASE_URL": settings.database_url,
        "DISPACH_DB_SCHEMA": schema or settings.schema,
        "DISPACH_HOME": str(home),
    }
    process = await asyncio.create_subprocess_exec(
        DISPACH, "log", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def whole_log(api: ApiServer) -> list[RecordedEvent]:
    store = api.node.store
    assert store is not None
    found: list[RecordedEvent] = []
    while page := await store.aread_all(found[-1].checkpoint if found else START):
        found += page
    return found


@pytest.mark.asyncio
async def test_log_stats_counts_every_event_by_agent_and_type_and_every_table(
    api: ApiServer, tmp_path: Path
) -> None:
    async with client_of(api) as http:
        for session, text in (("s1", "hello"), ("s1", "calculate 6*7"), ("s2", "hello")):
            await accept(http, text, sessionKey=session)

    async def ends() -> list[RecordedEvent] | None:
        found = await whole_log(api)
        return found if sum(e.type == "turn.end" for e in found) == 3 else None

    log = await eventually(ends, "the three turns to end", 30.0)

    code, out, err = await log_cli(api, tmp_path, "stats", "--json")
    assert code == 0, err
    body: dict[str, Any] = json.loads(out)

    assert body["log"]["events"] == len(log)
    assert body["log"]["oldest"] == log[0].recorded_at.isoformat().replace("+00:00", "Z")
    assert body["log"]["newest"] == max(e.recorded_at for e in log).isoformat().replace(
        "+00:00", "Z"
    )
    tables = {t["table"]: t for t in body["tables"]}
    assert {"events", "turns", "messages", "sessions", "outbox"} <= set(tables)
    assert tables["events"]["rows"] == len(log)
    assert tables["turns"]["rows"] == 3 and tables["sessions"]["rows"] == 2
    assert body["log"]["bytes"] == tables["events"]["bytes"] > body["log"]["rowBytes"] > 0

    (agent,) = body["agents"]
    assert agent["agentId"] == "assistant" and agent["turns"] == 3
    by_type = {t["type"]: t for t in agent["types"]}
    assert {k: t["events"] for k, t in by_type.items()} == Counter(e.type for e in log)
    assert agent["events"] == len(log)
    assert agent["bytes"] == sum(t["bytes"] for t in agent["types"]) == body["log"]["rowBytes"]
    assert agent["bytesPerTurn"] == pytest.approx(agent["bytes"] / 3)
    assert agent["eventsPerTurn"] == pytest.approx(len(log) / 3)
    # The log's own figures per turn: its events, every table's rows, the events' row bytes.
    assert body["log"]["turns"] == 3
    assert body["log"]["eventsPerTurn"] == pytest.approx(len(log) / 3)
    written = ("events", "turns", "messages", "sessions", "outbox", "approvals", "session_context",
               "schedules", "usage_calls")  # fmt: skip
    assert body["log"]["rowsPerTurn"] == pytest.approx(sum(tables[t]["rows"] for t in written) / 3)
    assert body["log"]["bytesPerTurn"] == pytest.approx(body["log"]["rowBytes"] / 3)
    for t in agent["types"]:
        assert t["bytes"] > t["dataBytes"] > 0
        assert t["bytesPerTurn"] == pytest.approx(t["bytes"] / 3)
    assert [t["bytes"] for t in agent["types"]] == sorted(
        (t["bytes"] for t in agent["types"]), reverse=True
    )

    code, text, err = await log_cli(api, tmp_path, "stats")
    assert code == 0, err
    lines = text.splitlines()
    assert lines[0].startswith(f"log: {len(log):,} events, ")
    assert lines[1].startswith(f"per turn (3 turns): {len(log) / 3:,.1f} events, ")
    assert any(line.split()[:2] == ["turns", "3"] for line in lines)
    assert any(line.startswith("agent assistant: 3 turns, ") for line in lines)
    assert any(line.split()[:2] == ["model.chunk", str(by_type["model.chunk"]["events"])]
               for line in lines)  # fmt: skip
    assert len(await whole_log(api)) == len(log)  # it only read


@pytest.mark.asyncio
async def test_log_stats_on_a_schema_without_a_log_fails_with_a_hint(
    api: ApiServer, tmp_path: Path
) -> None:
    code, out, err = await log_cli(api, tmp_path, "stats", schema="no_such_schema")
    assert code == 1 and out == ""
    assert "Error: log_unreadable: " in err and "\n  hint: " in err and "DISPACH_DB_SCHEMA" in err

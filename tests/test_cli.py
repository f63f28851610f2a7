"""The ``dispach`` CLI against a real log (external-URL mode: the test's Postgres and NATS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from eventstore import EventStore, Metadata, NewEvent
from eventstore.catalogue import ModelChunk, Tokens, ToolCall, TurnEnd, TurnStart
from tests.conftest import ConnectFactory, Servers
from tests.storeops import append

DISPACH = str(Path(sys.executable).parent / "dispach")


@pytest.fixture
def env(servers: Servers, schema: str, tmp_path: Path) -> dict[str, str]:
    return os.environ | {
        "DATABASE_URL": servers.database_url,
        "NATS_URL": servers.nats_url,
        "DISPACH_DB_SCHEMA": schema,
        "DISPACH_CLUSTER": schema,
        "DISPACH_HOME": str(tmp_path / "home"),
    }


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [DISPACH, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def a_turn(store: EventStore, turn_id: str) -> None:
    meta = Metadata(agent_id="demo", session_key="api:default", turn_id=turn_id)
    events = [
        TurnStart(source="api", input="what is 6*7?"),
        ToolCall(slug="calc", call_id="c1", args_hash="1f", mutating=False, args={"expr": "6*7"}),
        TurnEnd(
            reason="final", steps=2, tokens=Tokens(prompt=9, output=3), duration_ms=4, text="42"
        ),
    ]
    append(store, f"turn-{turn_id}", [NewEvent(event=e, metadata=meta) for e in events])


def test_events_show_prints_a_stream_readably_and_as_public_json(
    store: EventStore, env: dict[str, str]
) -> None:
    a_turn(store, "t_1")
    shown = run(env, "events", "show", "turn-t_1")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert len(lines) == 3
    assert "turn-t_1@0" in lines[0] and "turn.start" in lines[0] and "what is 6*7?" in lines[0]
    assert "expr" not in shown.stdout  # tool arguments are private unless --full
    assert "expr" in run(env, "events", "show", "turn-t_1", "--full").stdout
    envelopes = [
        json.loads(line)
        for line in run(env, "events", "show", "turn-t_1", "--json").stdout.splitlines()
    ]
    assert [e["type"] for e in envelopes] == ["turn.start", "tool.call", "turn.end"]
    assert envelopes[2]["data"]["reason"] == "final" and envelopes[0]["turnId"] == "t_1"
    assert "args" not in envelopes[1]["data"]


def test_events_show_of_an_unknown_stream_says_so(store: EventStore, env: dict[str, str]) -> None:
    missing = run(env, "events", "show", "turn-nope")
    assert missing.returncode == 1
    assert "turn-nope has no events" in missing.stderr


def test_events_tail_refuses_an_unknown_type_with_a_suggestion(env: dict[str, str]) -> None:
    wrong = run(env, "events", "tail", "--type", "turn.ends")
    assert wrong.returncode == 1
    assert "did you mean 'turn.end'" in wrong.stderr


def test_a_tail_killed_and_resumed_after_its_last_cursor_misses_and_repeats_nothing(
    store: EventStore, env: dict[str, str]
) -> None:
    written: list[str] = []
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set() and i < 400:
            result = append(store, f"turn-w{i % 5}", [NewEvent(event=ModelChunk(delta=str(i)))])
            written.append(str(result.events[0].event_id))
            i += 1
            time.sleep(0.002)

    def tail(*extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [DISPACH, "events", "tail", "--json", *extra],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    first = tail("--from-start")
    thread = threading.Thread(target=writer)
    thread.start()
    seen: list[dict[str, Any]] = []
    assert first.stdout is not None
    while len(seen) < 60:
        seen.append(json.loads(first.stdout.readline()))
    first.kill()  # kill -9: whatever it had not printed is simply not seen
    first.wait()
    first.stdout.close()
    assert first.stderr is not None
    first.stderr.close()
    thread.join()
    second = tail("--after", seen[-1]["cursor"])
    assert second.stdout is not None
    while len(seen) < len(written):
        seen.append(json.loads(second.stdout.readline()))
    second.kill()
    second.wait()
    second.stdout.close()
    assert second.stderr is not None
    second.stderr.close()
    ids = [e["id"] for e in seen]
    assert len(ids) == len(set(ids))
    assert set(ids) == set(written)


def test_projections_rebuild_reproduces_the_live_rows(
    store: EventStore, env: dict[str, str], connect: ConnectFactory
) -> None:
    for n in range(5):
        a_turn(store, f"t_{n}")
    with connect() as conn:
        live = conn.execute("SELECT * FROM turns ORDER BY turn_id").fetchall()
    rebuilt = run(env, "projections", "rebuild")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "turns: rebuilt from 10 events" in rebuilt.stdout
    assert "sessions: rebuilt from 10 events" in rebuilt.stdout
    with connect() as conn:
        assert conn.execute("SELECT * FROM turns ORDER BY turn_id").fetchall() == live
        sessions = conn.execute("SELECT agent_id, session_key, turns FROM sessions").fetchall()
    assert sessions == [("demo", "api:default", 5)]
    unknown = run(env, "projections", "rebuild", "turnz")
    known = "known: approvals, messages, outbox, schedules, session_context, sessions, turns"
    assert unknown.returncode == 1 and known in unknown.stderr

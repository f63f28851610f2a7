"""Schedules end to end: the API (CRUD, run now, write-time validation), manifest schedules,
firing as inbound messages, two nodes on one tick, and downtime that is skipped, not replayed.

The schedule core (occurrences, DST, catch-up arithmetic) is tested without I/O in
tests/test_schedule_plan.py; these tests run real nodes on Postgres and NATS with the offline
scripted model, and read what the scheduler did from the log.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import httpx
import pytest

from actors import ids
from actors.cluster.partitions import partition_of
from actors.messages import Accepted, Submit
from actors.schedule import plan
from actors.schedule.plan import ScheduleSpec
from eventstore import EventStore, RecordedEvent, streams
from eventstore.catalogue import ScheduleFired, ScheduleSkipped, TurnStart
from runtime.config import Settings, from_env
from runtime.manifest import ManifestError
from runtime.node import Node
from tests.conftest import ApiFactory, ApiServer, NodeFactory
from tests.fakes.webhook_receiver import WebhookReceiver

T = TypeVar("T")

AGENT = "clock"


def manifest(schedules: str = "", channels: str = "") -> str:
    """The test agent: the offline scripted model, optionally channels and schedules."""
    return f"""
id: {AGENT}
model: {{provider: scripted}}
{channels}
{f"schedules:{chr(10)}{schedules}" if schedules else ""}
"""


HOOKS = '  - {id: hooks, type: webhook, url: "http://127.0.0.1:9/never"}'
"""A channel a schedule may deliver to (nothing in these tests fires a schedule that uses it)."""


SECRET = "test-webhook-secret"


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISPACH_WEBHOOK_SECRET", SECRET)


def body(sid: str = "digest", **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"id": sid, "kind": "cron", "expr": "0 9 * * 1-5",
                            "timezone": "Europe/Berlin", "task": "Sum up the day",
                            "deliver": "none"}  # fmt: skip
    return {k: v for k, v in {**base, **fields}.items() if v is not ...}


async def call(api: ApiServer, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=api.url, headers=api.headers, timeout=20) as client:
        return await client.request(method, f"/v1/agents/{AGENT}{path}", **kwargs)


async def wait_for(check: Callable[[], Awaitable[T | None]], what: str, timeout: float = 10.0) -> T:
    """Poll ``check`` until it returns something other than None."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        found = await check()
        if found is not None:
            return found
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def store_of(node: Node) -> EventStore:
    assert node.store is not None
    return node.store


async def schedule_events(node: Node, sid: str) -> list[RecordedEvent]:
    return await store_of(node).aread_stream(streams.schedule(AGENT, sid))


async def fired(node: Node, sid: str, *, manual: bool = False) -> list[ScheduleFired]:
    return [
        e.data
        for e in await schedule_events(node, sid)
        if isinstance(e.data, ScheduleFired) and e.data.manual == manual
    ]


async def skipped(node: Node, sid: str) -> list[ScheduleSkipped]:
    return [e.data for e in await schedule_events(node, sid) if isinstance(e.data, ScheduleSkipped)]


async def fired_at_least(
    node: Node, sid: str, n: int, timeout: float = 10.0
) -> list[ScheduleFired]:
    async def enough() -> list[ScheduleFired] | None:
        got = await fired(node, sid)
        return got if len(got) >= n else None

    return await wait_for(enough, f"{n} firings of {sid}", timeout)


async def schedule_turns(node: Node) -> list[tuple[str, str, str]]:
    """``(turn id, session key, status)`` of every turn a schedule started."""
    rows = await store_of(node).afetch(
        b"SELECT turn_id, session_key, status FROM turns WHERE agent_id = %s AND source = %s",
        [AGENT, "schedule"],
    )
    return [(r[0], r[1], r[2]) for r in rows]


async def turn_ended(api: ApiServer, turn_id: str) -> dict[str, Any]:
    async def ended() -> dict[str, Any] | None:
        async with httpx.AsyncClient(base_url=api.url, headers=api.headers) as client:
            r = await client.get(f"/v1/turns/{turn_id}")
        if r.status_code != 200:
            return None
        turn: dict[str, Any] = r.json()
        return turn if turn["status"] != "running" else None

    return await wait_for(ended, f"the end of turn {turn_id}")


def due_of(event: ScheduleFired) -> datetime:
    return datetime.fromisoformat(event.due)


def keyed_turn(spec: ScheduleSpec, due: datetime) -> str:
    """The turn id a firing of ``spec`` at ``due`` derives, on whichever node fires it."""
    return ids.keyed_turn_id(AGENT, plan.idempotency_key(spec, due))


def spec_of(**fields: Any) -> ScheduleSpec:
    return ScheduleSpec(**{"task": "ping", "deliver": "none", **fields})


def error(r: httpx.Response) -> dict[str, Any]:
    found: dict[str, Any] = r.json()["error"]
    return found


# --- the API ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_create_read_replace_delete(api_factory: ApiFactory) -> None:
    api_factory.write_agent(AGENT, manifest(channels=f"channels:\n{HOOKS}"))
    api = await api_factory.start()

    r = await call(api, "POST", "/schedules", json=body())
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["id"] == "digest" and created["owner"] == "api"
    assert created["kind"] == "cron" and created["timezone"] == "Europe/Berlin"
    assert created["fired"] == 0 and created["lastDue"] is None
    next_due = datetime.fromisoformat(created["nextDue"])
    local = next_due.astimezone(plan.zone(ScheduleSpec(**body())))
    assert (local.hour, local.minute) == (9, 0) and local.weekday() < 5
    assert next_due > datetime.now(UTC)

    r = await call(api, "POST", "/schedules", json=body())
    assert r.status_code == 409 and error(r)["code"] == "schedule_exists"

    r = await call(api, "POST", "/schedules",
                   json=body("alerts", kind="every", expr="15m", timezone=...,
                             deliver={"channel": "hooks", "to": "ops"}))  # fmt: skip
    assert r.status_code == 201, r.text
    assert r.json()["deliver"] == {"channel": "hooks", "to": "ops"}

    r = await call(api, "GET", "/schedules")
    assert r.status_code == 200
    assert [s["id"] for s in r.json()["schedules"]] == ["alerts", "digest"]
    r = await call(api, "GET", "/schedules/digest")
    assert r.status_code == 200 and r.json() == created

    r = await call(api, "PUT", "/schedules/digest",
                   json=body(expr="30 7 * * *", task="Morning brief", enabled=False))  # fmt: skip
    assert r.status_code == 200, r.text
    replaced = r.json()
    assert replaced["expr"] == "30 7 * * *" and replaced["task"] == "Morning brief"
    assert replaced["enabled"] is False and replaced["nextDue"] is None
    assert replaced["createdAt"] == created["createdAt"]
    r = await call(api, "GET", "/schedules", params={"enabled": "true"})
    assert [s["id"] for s in r.json()["schedules"]] == ["alerts"]

    r = await call(api, "PUT", "/schedules/digest", json=body("other"))
    assert r.status_code == 400 and error(r)["field"] == "id"

    r = await call(api, "DELETE", "/schedules/digest")
    assert r.status_code == 200 and r.json() == {"deleted": "digest"}
    gone = [("GET", ""), ("DELETE", ""), ("PUT", ""), ("POST", "/run")]
    for method, tail in gone:
        r = await call(api, method, f"/schedules/digest{tail}", json=body())
        assert r.status_code == 404, (method, r.text)
        assert error(r)["code"] == "schedule_not_found" and error(r)["hint"]
    r = await call(api, "GET", "/schedules")
    assert [s["id"] for s in r.json()["schedules"]] == ["alerts"]


@pytest.mark.asyncio
async def test_a_deleted_schedule_can_be_created_again(api_factory: ApiFactory) -> None:
    api_factory.write_agent(AGENT, manifest())
    api = await api_factory.start()
    assert (await call(api, "POST", "/schedules", json=body())).status_code == 201
    assert (await call(api, "DELETE", "/schedules/digest")).status_code == 200
    r = await call(api, "POST", "/schedules", json=body(expr="0 10 * * *"))
    assert r.status_code == 201, r.text
    assert r.json()["expr"] == "0 10 * * *"
    r = await call(api, "PUT", "/schedules/digest", json=body(expr="0 11 * * *"))
    assert r.status_code == 200 and r.json()["expr"] == "0 11 * * *"


INVALID = [
    # (what is wrong, the body, error code, error field, words the message or hint must hold)
    ("no deliver", body(deliver=...), "schedule_missing_delivery", "deliver", 'deliver: "none"'),
    ("deliver null", body(deliver=None), "schedule_missing_delivery", "deliver", "deliver"),
    ("bad cron", body(expr="61 * * * *"), "schedule_invalid", "expr", "minute hour"),
    ("too few fields", body(expr="every day"), "schedule_invalid", "expr", "*/15 * * * *"),
    ("bad every", body(kind="every", expr="5 minutes"), "schedule_invalid", "expr", '"15m"'),
    ("every too short", body(kind="every", expr="0s"), "schedule_invalid", "expr", "second"),
    ("bad at", body(kind="at", expr="tomorrow"), "schedule_invalid", "expr", "ISO 8601"),
    ("unknown zone", body(timezone="Mars/Olympus"), "schedule_invalid", "timezone", "IANA"),
    ("bad session", body(session="mine"), "schedule_invalid", "session", "shared:<key>"),
    ("blank task", body(task="  "), "schedule_invalid", "task", "prompt"),
    ("unknown channel", body(deliver={"channel": "telegram", "to": "1"}), "deliver_invalid",
     "deliver.channel", "telegram"),
]  # fmt: skip


@pytest.mark.asyncio
async def test_definitions_are_checked_when_written(api_factory: ApiFactory) -> None:
    api_factory.write_agent(AGENT, manifest())
    api = await api_factory.start()
    assert (await call(api, "POST", "/schedules", json=body("kept"))).status_code == 201
    for what, sent, code, field, words in INVALID:
        for method, path in [("POST", "/schedules"), ("PUT", "/schedules/kept")]:
            payload = {**sent, "id": "kept"} if method == "PUT" else sent
            r = await call(api, method, path, json=payload)
            assert r.status_code == 400, (what, method, r.text)
            found = error(r)
            assert (found["code"], found["field"]) == (code, field), (what, method, found)
            assert found["message"] and found["hint"], (what, found)
            assert words in found["message"] + found["hint"], (what, found)
    r = await call(api, "POST", "/schedules", json={**body(), "cron": "* * * * *"})
    assert r.status_code == 400, r.text  # unknown fields are refused, not ignored
    r = await call(api, "GET", "/schedules")
    assert [s["id"] for s in r.json()["schedules"]] == ["kept"]
    assert r.json()["schedules"][0]["expr"] == "0 9 * * 1-5"


@pytest.mark.asyncio
async def test_run_now_starts_a_turn_in_its_own_or_the_shared_session(
    api_factory: ApiFactory,
) -> None:
    api_factory.write_agent(AGENT, manifest())
    api = await api_factory.start()
    for sid, session in [("isolated-one", "isolated"), ("shared-one", "shared:daily")]:
        r = await call(api, "POST", "/schedules", json=body(sid, task="hello", session=session))
        assert r.status_code == 201, r.text

    before = datetime.now(UTC).replace(microsecond=0)
    r = await call(api, "POST", "/schedules/isolated-one/run")
    assert r.status_code == 202, r.text
    accepted = r.json()
    prefix, stamp = accepted["sessionKey"].rsplit(":", 1)
    assert prefix == "schedule:isolated-one"
    assert datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC) >= before
    turn = await turn_ended(api, accepted["turnId"])
    assert turn["source"] == "schedule" and turn["status"] == "final", turn
    assert turn["sessionKey"] == accepted["sessionKey"] and "hello" in turn["text"]

    r = await call(api, "POST", "/schedules/shared-one/run")
    assert r.status_code == 202, r.text
    shared = r.json()
    assert shared["sessionKey"] == "daily"
    assert (await turn_ended(api, shared["turnId"]))["source"] == "schedule"

    # A manual run is recorded, and leaves the schedule's clock alone.
    runs = await fired(api.node, "isolated-one", manual=True)
    assert [f.turn_id for f in runs] == [accepted["turnId"]]
    assert runs[0].session_key == accepted["sessionKey"]
    r = await call(api, "GET", "/schedules/isolated-one")
    resource = r.json()
    assert resource["fired"] == 1 and resource["lastTurnId"] == accepted["turnId"]
    assert resource["lastDue"] is None


# --- manifest schedules -----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_manifest_schedules_are_listed_and_owned_by_the_manifest(
    api_factory: ApiFactory,
) -> None:
    api_factory.write_agent(AGENT, manifest(
        '  - {id: nightly, kind: cron, expr: "0 3 * * *", timezone: Asia/Tokyo, task: tidy, '
        "deliver: none}\n"
        '  - {id: reminder, kind: at, expr: "2030-01-31T09:00", timezone: Europe/Paris, '
        "task: remind me, deliver: none}"
    ))  # fmt: skip
    api = await api_factory.start()

    async def listed() -> list[dict[str, Any]] | None:
        r = await call(api, "GET", "/schedules")
        found: list[dict[str, Any]] = r.json()["schedules"]
        return found if len(found) == 2 else None

    nightly, reminder = await wait_for(listed, "the manifest's schedules")
    assert (nightly["id"], nightly["owner"], nightly["timezone"]) == ("nightly", "manifest",
                                                                      "Asia/Tokyo")  # fmt: skip
    due = datetime.fromisoformat(nightly["nextDue"]).astimezone(plan.zone(spec_of(
        id="x", kind="cron", expr="* * * * *", timezone="Asia/Tokyo")))  # fmt: skip
    assert (due.hour, due.minute) == (3, 0)
    assert reminder["owner"] == "manifest"
    assert datetime.fromisoformat(reminder["nextDue"]) == datetime(2030, 1, 31, 8, tzinfo=UTC)

    for method in ("PUT", "DELETE"):
        r = await call(api, method, "/schedules/nightly", json=body("nightly"))
        assert r.status_code == 409, r.text
        assert error(r)["code"] == "schedule_manifest_owned" and "clock.yaml" in error(r)["hint"]
    r = await call(api, "POST", "/schedules", json=body("nightly"))
    assert r.status_code == 409 and error(r)["code"] == "schedule_exists"
    # Running one by hand is allowed: it does not change the definition.
    assert (await call(api, "POST", "/schedules/nightly/run")).status_code == 202


@pytest.mark.asyncio
async def test_a_manifest_change_is_reconciled_at_start(node_factory: NodeFactory) -> None:
    nightly = '  - {id: nightly, kind: cron, expr: "0 3 * * *", task: tidy, deliver: none}\n'
    weekly = '  - {id: weekly, kind: cron, expr: "0 3 * * 1", task: sum up, deliver: none}'
    node_factory.write_agent(AGENT, manifest(nightly + weekly))
    node = await node_factory.start()
    await wait_for(lambda: _rows(node, 2), "two schedules")
    await node.stop()
    node_factory.started.remove(node)

    # weekly changes, nightly goes; then nightly comes back.
    node_factory.write_agent(AGENT, manifest(weekly.replace("0 3 * * 1", "0 4 * * 1")))
    node = await node_factory.start()
    rows = await wait_for(lambda: _rows(node, 1, "0 4 * * 1"), "the manifest's change")
    assert [r[0] for r in rows] == ["weekly"]
    await node.stop()
    node_factory.started.remove(node)

    node_factory.write_agent(AGENT, manifest(nightly + weekly))
    node = await node_factory.start()
    rows = await wait_for(lambda: _rows(node, 2, "0 3 * * 1"), "nightly declared again")
    assert [(r[0], r[1]) for r in rows] == [("nightly", "manifest"), ("weekly", "manifest")]


async def _rows(node: Node, n: int, contains: str = "") -> list[tuple[Any, ...]] | None:
    rows = await store_of(node).afetch(
        b"SELECT schedule_id, owner, spec::text FROM schedules WHERE agent_id = %s "
        b"ORDER BY schedule_id",
        [AGENT],
    )
    return rows if len(rows) == n and contains in "".join(r[2] for r in rows) else None


BAD_MANIFESTS = [
    # (schedule entry, field named in the error, words in the message)
    ("{id: s, kind: cron, expr: '0 9 * * *', task: t}", "schedules[0].deliver",
     "does not say where"),
    ("{id: s, kind: cron, expr: '0 25 * * *', task: t, deliver: none}", "schedules[0].expr",
     "invalid"),
    ("{id: s, kind: every, expr: soon, task: t, deliver: none}", "schedules[0].expr", "soon"),
    ("{id: s, kind: cron, expr: '0 9 * * *', timezone: Nowhere/Else, task: t, deliver: none}",
     "schedules[0].timezone", "Nowhere/Else"),
    ("{id: s, kind: cron, expr: '0 9 * * *', task: t, deliver: {channel: tg, to: '1'}}",
     "schedules[0].deliver.channel", "'tg'"),
]  # fmt: skip


@pytest.mark.asyncio
@pytest.mark.parametrize(("entry", "field", "words"), BAD_MANIFESTS)
async def test_an_invalid_manifest_schedule_stops_the_node_from_starting(
    node_factory: NodeFactory, entry: str, field: str, words: str
) -> None:
    node_factory.write_agent(AGENT, manifest(f"  - {entry}"))
    # Started by hand (not by the factory, which keeps only nodes that started): stop() cleans up
    # whatever start() reached.
    node = Node(settings_of(node_factory))
    try:
        with pytest.raises(ManifestError) as raised:
            await node.start()
    finally:
        await node.stop()
    assert raised.value.field == field
    assert "schedule 's'" in raised.value.message and words in raised.value.message
    assert raised.value.hint


def settings_of(node_factory: NodeFactory) -> Settings:
    """The settings NodeFactory.start uses."""
    root = node_factory.root
    return from_env({
        "DATABASE_URL": node_factory.servers.database_url,
        "NATS_URL": node_factory.servers.nats_url,
        "DISPACH_DB_SCHEMA": node_factory.schema,
        "DISPACH_CLUSTER": node_factory.schema,
        "DISPACH_HOME": str(root / "home"),
        "DISPACH_AGENTS": str(root / "agents"),
        "DISPACH_DRAIN_SECONDS": "5",
    })  # fmt: skip


# --- firing -----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_due_schedule_fires_turns_from_the_schedule(api_factory: ApiFactory) -> None:
    api_factory.write_agent(AGENT, manifest())
    api = await api_factory.start()
    tick = body("tick", kind="every", expr="1s", timezone=..., task="ping")
    r = await call(api, "POST", "/schedules", json=tick)
    assert r.status_code == 201, r.text
    anchor = datetime.fromisoformat(r.json()["createdAt"])
    firings = await fired_at_least(api.node, "tick", 2)
    spec = spec_of(id="tick", kind="every", expr="1s")
    for f in firings:
        due = due_of(f)
        assert (due - anchor) % timedelta(seconds=1) == timedelta(0) and due > anchor
        assert f.turn_id == keyed_turn(spec, due), "the turn id derives from schedule + due"
        assert f.session_key == plan.session_key(spec, due)
        assert f.kind == "every" and not f.manual and f.drift_ms < 5000
        turn = await turn_ended(api, f.turn_id)
        assert turn["source"] == "schedule" and turn["sessionKey"] == f.session_key
        assert turn["input"] == "ping" and turn["status"] == "final"
        start = (await store_of(api.node).aread_stream(streams.turn(f.turn_id), 0, 1))[0]
        assert isinstance(start.data, TurnStart) and start.data.source == "schedule"
        assert start.data.idempotency_key == plan.idempotency_key(spec, due)
    assert len({due_of(f) for f in firings}) == len(firings)
    r = await call(api, "GET", "/schedules/tick")
    assert r.json()["fired"] >= 2 and r.json()["skipped"] == 0


@pytest.mark.asyncio
async def test_a_firing_delivers_its_reply_where_the_schedule_says(
    api_factory: ApiFactory,
) -> None:
    with WebhookReceiver(SECRET) as receiver:
        hooks = f'  - {{id: hooks, type: webhook, url: "{receiver.url}", backoff_s: [0.05]}}'
        api_factory.write_agent(AGENT, manifest(channels=f"channels:\n{hooks}"))
        api = await api_factory.start()
        tick = body("report", kind="every", expr="1s", timezone=..., task="status report",
                    deliver={"channel": "hooks", "to": "ops"})  # fmt: skip
        r = await call(api, "POST", "/schedules", json=tick)
        assert r.status_code == 201, r.text
        (first, *_) = await fired_at_least(api.node, "report", 1)
        kept = await asyncio.to_thread(receiver.wait_for, 1, 10.0)
        sent = next(b for b in kept.values() if b["turnId"] == first.turn_id)
        assert sent["to"] == "ops" and "status report" in sent["text"]
        assert (await call(api, "DELETE", "/schedules/report")).status_code == 200


@pytest.mark.asyncio
async def test_a_cron_with_seconds_fires_on_its_seconds(node_factory: NodeFactory) -> None:
    node_factory.write_agent(AGENT, manifest(
        '  - {id: even, kind: cron, expr: "*/2 * * * * *", task: ping, deliver: none}'
    ))  # fmt: skip
    node = await node_factory.start()
    firings = await fired_at_least(node, "even", 2, timeout=8)
    dues = [due_of(f) for f in firings]
    assert all(d.second % 2 == 0 and d.microsecond == 0 for d in dues), dues
    assert all(b - a == timedelta(seconds=2) for a, b in itertools.pairwise(dues))


@pytest.mark.asyncio
async def test_an_at_schedule_fires_once(node_factory: NodeFactory) -> None:
    at = (datetime.now(UTC) + timedelta(seconds=1)).replace(microsecond=0) + timedelta(seconds=1)
    node_factory.write_agent(AGENT, manifest(
        f'  - {{id: once, kind: at, expr: "{at.isoformat()}", task: ping, deliver: none}}'
    ))  # fmt: skip
    node = await node_factory.start()
    (first,) = await fired_at_least(node, "once", 1)
    assert due_of(first) == at
    await asyncio.sleep(1.5)  # a second firing would come at the next tick: there is none
    assert len(await fired(node, "once")) == 1
    assert len(await schedule_turns(node)) == 1


# --- one turn per tick --------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_cron_schedule_on_two_nodes_makes_one_turn_per_tick(
    node_factory: NodeFactory,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.INFO)
    node_factory.write_agent(AGENT, manifest(
        '  - {id: every-second, kind: cron, expr: "* * * * * *", task: ping, deliver: none}'
    ))  # fmt: skip
    first, second = await asyncio.gather(node_factory.start(), node_factory.start())
    both = datetime.now(UTC)
    output: list[str] = []

    async def ticked() -> list[ScheduleFired] | None:
        """Four ticks with both nodes up."""
        return await _fired_after(first, "every-second", both, 4)

    await wait_for(ticked, "four ticks with both nodes up")
    # One clock in the cluster: the node holding the scheduler's lease fires every tick (a
    # tick submitted twice anyway is one turn: the test below).
    status = first.cluster_status()
    assert status is not None
    clocks = [lease.node for lease in status.leases if lease.lease == "s.scheduler"]
    assert len(clocks) == 1 and clocks[0] in (first.node_id, second.node_id), status.leases
    spec = spec_of(id="every-second", kind="cron", expr="* * * * * *")
    firings = await fired(second, "every-second")
    dues = Counter(due_of(f) for f in firings)
    assert all(n == 1 for n in dues.values()), dues
    turns = await wait_for(lambda: _turns_at_least(first, len(dues)), "the turns")
    # One turn per tick (an isolated session is named after its tick), and it is the turn the
    # tick's key derives: no tick was accepted twice.
    by_session = Counter(session for _, session, _ in turns)
    assert all(n == 1 for n in by_session.values()), by_session
    for turn_id, session, _ in turns:
        due = datetime.strptime(session.rsplit(":", 1)[1], "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
        assert turn_id == keyed_turn(spec, due), session
    assert {f.turn_id for f in firings} <= {t for t, _, _ in turns}
    assert len(turns) <= len(dues) + 1  # at most the tick being recorded right now is unrecorded
    output.extend(capfd.readouterr())
    logged = "\n".join(r.getMessage() + repr(r.__dict__) for r in caplog.records)
    for text in (logged, "".join(output)):
        assert "replayed=True" not in text  # no tick was fired by two clocks
        assert "WrongExpectedVersion" not in text and "Traceback" not in text
        assert "scheduler_tick_failed" not in text and "schedule_not_accepted" not in text


async def _fired_after(node: Node, sid: str, since: datetime, n: int) -> list[ScheduleFired] | None:
    got = [f for f in await fired(node, sid) if due_of(f) > since]
    return got if len(got) >= n else None


async def _turns_at_least(node: Node, n: int) -> list[tuple[str, str, str]] | None:
    got = await schedule_turns(node)
    return got if len(got) >= n else None


@pytest.mark.asyncio
async def test_the_same_tick_submitted_on_two_nodes_is_one_turn(node_factory: NodeFactory) -> None:
    """What the scheduler does for a tick, done by two nodes at once, and again later (as a node
    that fired, crashed before recording ``schedule.fired`` and restarted would): one turn."""
    node_factory.write_agent(AGENT, manifest())
    first, second = await asyncio.gather(node_factory.start(), node_factory.start())
    spec = spec_of(id="twice", kind="cron", expr="0 9 * * *")
    due = datetime(2030, 1, 31, 9, tzinfo=UTC)

    def submit() -> Submit:
        key = plan.idempotency_key(spec, due)
        return Submit(agent_id=AGENT, session_key=plan.session_key(spec, due), text=spec.task,
                      source="schedule", idempotency_key=key)  # fmt: skip

    # Each node hands it to the session's owner (one of them), as the scheduler does.
    assert first.commands is not None and second.commands is not None
    answers = await asyncio.gather(
        first.commands.submit(submit()), second.commands.submit(submit())
    )
    again = await first.commands.submit(submit())
    for answer in [*answers, again]:
        assert isinstance(answer, Accepted), answer
        assert answer.turn_id == keyed_turn(spec, due)
        assert answer.session_key == "schedule:twice:20300131T090000Z"
    assert again.replayed  # type: ignore[union-attr]
    turns = await schedule_turns(first)
    assert [t for t, _, _ in turns] == [keyed_turn(spec, due)]


@pytest.mark.asyncio
async def test_a_tick_whose_turn_exists_but_was_not_recorded_fires_no_second_turn(
    node_factory: NodeFactory,
) -> None:
    """A node that submitted a tick's turn and died before appending ``schedule.fired``: the
    next scheduler to see the tick submits it again and the key answers with the same turn."""
    at = (datetime.now(UTC) + timedelta(seconds=1)).replace(microsecond=0) + timedelta(seconds=1)
    node_factory.write_agent(AGENT, manifest(
        f'  - {{id: once, kind: at, expr: "{at.isoformat()}", task: ping, deliver: none}}'
    ))  # fmt: skip
    node = await node_factory.start()
    spec = spec_of(id="once", kind="at", expr=at.isoformat())
    assert node.engine is not None and node.ownership is not None
    # The engine is called directly, as the node's command path calls it once the session's
    # partition is open here: wait for that, as the command path waits.
    ownership = node.ownership
    partition = partition_of(AGENT, plan.session_key(spec, at), node.settings.partitions)

    async def opened() -> bool | None:
        return ownership.owns(partition) or None

    await wait_for(opened, f"partition {partition} opened")
    early = await node.engine.submit(
        Submit(agent_id=AGENT, session_key=plan.session_key(spec, at), text=spec.task,
               source="schedule", idempotency_key=plan.idempotency_key(spec, at))
    )  # fmt: skip
    assert isinstance(early, Accepted) and not early.replayed
    (recorded,) = await fired_at_least(node, "once", 1)
    assert recorded.turn_id == early.turn_id and due_of(recorded) == at
    assert [t for t, _, _ in await schedule_turns(node)] == [early.turn_id]


# --- downtime -----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_ticks_missed_while_down_are_skipped_not_replayed(node_factory: NodeFactory) -> None:
    node_factory.write_agent(AGENT, manifest(
        "  - {id: tick, kind: every, expr: 1s, task: ping, deliver: none}"
    ))  # fmt: skip
    node = await node_factory.start()
    before = await fired_at_least(node, "tick", 1)
    await node.stop()
    node_factory.started.remove(node)
    last_before = max(due_of(f) for f in await fired_from_db(node_factory, before))

    # The downtime under test: three or four ticks nobody fires, counted from the last one fired
    # (the stop above took part of it already).
    down_until = last_before + timedelta(seconds=3.5)
    await asyncio.sleep(max(0.0, (down_until - datetime.now(UTC)).total_seconds()))
    node = await node_factory.start()
    # The clock starts once the node holds the scheduler's lease, near the end of its start:
    # the latest missed tick is due before this.
    restart = datetime.now(UTC)

    async def skip() -> list[ScheduleSkipped] | None:
        return await skipped(node, "tick") or None

    (skip_event,) = await wait_for(skip, "schedule.skipped")
    assert skip_event.reason == "downtime" and skip_event.kind == "every"
    assert skip_event.missed >= 2 and not skip_event.missed_at_least
    await fired_at_least(node, "tick", len(before) + 3)  # it goes on ticking after the restart
    after = [f for f in await fired(node, "tick") if due_of(f) > last_before]
    # The latest missed tick is inside the grace window: it fires, once, right after what the
    # skip counted; the rest are counted. (Told apart by the skip's bound, not by the test's
    # clock: a restart can land a few ms before that tick's due time.)
    counted_to = datetime.fromisoformat(skip_event.up_to)
    at_start = [f for f in after if due_of(f) <= counted_to + timedelta(milliseconds=1)]
    assert len(at_start) == 1, (str(restart), [f.due for f in after], skip_event.up_to)
    assert counted_to < due_of(at_start[0]) <= restart + timedelta(seconds=1)
    downtime_ticks = (due_of(at_start[0]) - last_before) // timedelta(seconds=1)
    assert skip_event.missed + 1 == downtime_ticks
    assert len({due_of(f) for f in after}) == len(after)
    turns = await schedule_turns(node)
    assert len(turns) == len(await fired(node, "tick"))
    r = await store_of(node).afetch(
        b"SELECT skipped FROM schedules WHERE agent_id = %s AND schedule_id = 'tick'", [AGENT]
    )
    assert r == [(skip_event.missed,)]


async def fired_from_db(
    node_factory: NodeFactory, seen: list[ScheduleFired]
) -> list[ScheduleFired]:
    """All firings recorded before the stop (the node's store is closed: read with a fresh one)."""
    store = EventStore(node_factory.servers.database_url, schema=node_factory.schema)
    await store.aopen()
    try:
        events = await store.aread_stream(streams.schedule(AGENT, "tick"))
    finally:
        await store.aclose()
    found = [e.data for e in events if isinstance(e.data, ScheduleFired)]
    assert len(found) >= len(seen)
    return found


@pytest.mark.asyncio
async def test_a_refused_tick_is_skipped_on_the_record_with_the_refusal(
    api_factory: ApiFactory,
) -> None:
    """A tick the session refuses (a shared session still busy, with the `reject` policy) is a
    `schedule.skipped` with the refusal's code at once, not a `downtime` miss counted later."""
    api_factory.write_agent(AGENT, f"""
id: {AGENT}
model:
  provider: scripted
  script:
    - {{match: "^nap$", tool: nap, input: {{seconds: 60}}}}
tools:
  - name: nap
    module: tests.test_api_http:nap
    description: Sleeps.
    input_schema: {{type: object}}
session: {{concurrency: reject}}
""")  # fmt: skip
    api = await api_factory.start()
    tick = body("busy", kind="every", expr="1s", timezone=..., task="nap", session="shared:nap")
    r = await call(api, "POST", "/schedules", json=tick)
    assert r.status_code == 201, r.text

    async def refused() -> list[ScheduleSkipped] | None:
        got = [s for s in await skipped(api.node, "busy") if s.reason == "session_busy"]
        return got or None

    (first, *_) = await wait_for(refused, "a tick refused by the busy session")
    assert first.missed == 1 and first.up_to
    assert len(await fired(api.node, "busy")) == 1  # the napping turn holds the session
    assert not [s for s in await skipped(api.node, "busy") if s.reason == "downtime"]

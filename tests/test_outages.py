"""A node's answers while it starts and while Postgres or NATS is down: real ``dispach serve``
processes, a Postgres and a NATS of each test's own that the test stops and starts again.

A request the node cannot serve is refused at once with ``503`` and ``Retry-After`` (never a
``404`` or an empty list, never a 30 s wait), a refused message never runs later, and a message
whose acceptance timed out is answered with what the node can know of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import pytest_asyncio
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from actors.ids import keyed_turn_id
from gateways.client import Client
from runtime.embedded import EmbeddedNats, EmbeddedPostgres
from tests.conftest import Servers
from tests.test_node import Serve

pytestmark = pytest.mark.slow

FAST = 1.5  # "at once": the 1 s the node promises, with room for a loaded 2-core machine
MESSAGES = "/v1/agents/assistant/messages"


class Relay:
    """A TCP relay to a server on ``host:port``. Until :meth:`open` it holds every connection,
    as a dependency that does not answer yet (the node's start waits on it); a connection the
    server refuses is closed. ``port`` may change: a restarted Postgres may not get its old port
    back (the old one lingers in TIME_WAIT), the relay's stays the node's."""

    def __init__(self, host: str, port: int, *, held: bool = False) -> None:
        self.host, self.port = host, port
        self._open = asyncio.Event()
        if not held:
            self._open.set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def open(self) -> None:
        self._open.set()

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._open.wait()
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return
        pumps = {
            asyncio.create_task(_pump(reader, up_writer)),
            asyncio.create_task(_pump(up_reader, writer)),
        }
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._tasks.difference_update(pumps)
            writer.close()
            up_writer.close()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()


class Node:
    """A ``dispach serve`` process (tests/test_node.py's Serve) and an HTTP client for it."""

    def __init__(self, home: Path, **env: str) -> None:
        self.serve = Serve(home, DISPACH_LOG_FORMAT="json", DISPACH_DRAIN_SECONDS="2", **env)
        self.http = httpx.AsyncClient(base_url=self.serve.url, timeout=60)

    async def ready(self) -> None:
        await asyncio.to_thread(self.serve.wait_ready)

    async def timed(self, method: str, path: str, **kwargs: Any) -> tuple[httpx.Response, float]:
        started = time.monotonic()
        response = await self.http.request(method, path, **kwargs)
        return response, time.monotonic() - started

    async def send(self, text: str, key: str | None = None, session: str = "outage") -> Any:
        headers = {"Idempotency-Key": key} if key else {}
        body = {"text": text, "sessionKey": session}
        return await self.http.post(MESSAGES, json=body, headers=headers)

    async def until(self, check: Callable[[], Awaitable[bool]], what: str, within: float) -> None:
        deadline = time.monotonic() + within
        while not await check():
            assert self.serve.proc.poll() is None, self.serve.output()
            assert time.monotonic() < deadline, f"not {what} within {within} s"
            await asyncio.sleep(0.05)

    def refused(self, path: str) -> int:
        """How many ``POST path`` the node has answered 503 so far (its JSON access lines)."""
        count = 0
        for line in self.serve.log.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if (isinstance(entry, dict) and entry.get("event") == "request"
                    and entry.get("method") == "POST" and entry.get("path") == path
                    and entry.get("status") == 503):  # fmt: skip
                count += 1
        return count

    async def ended(self, turn_id: str) -> None:
        async def done() -> bool:
            turn = await self.http.get(f"/v1/turns/{turn_id}")
            return turn.status_code == 200 and turn.json()["status"] != "running"

        await self.until(done, f"turn {turn_id} ended", 30)

    async def waiting_on(self, dependency: str) -> None:
        """Until /v1/ready answers 503 naming ``dependency``."""

        async def named() -> bool:
            ready = await self.http.get("/v1/ready")
            return ready.status_code == 503 and dependency in ready.json()["error"]["message"]

        await self.until(named, f"ready=503 naming {dependency}", 10)

    async def close(self) -> None:
        await self.http.aclose()
        if self.serve.proc.poll() is None:
            self.serve.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.serve.proc.wait, 30)
            except Exception:
                self.serve.proc.kill()
                raise


@pytest_asyncio.fixture
async def nodes() -> AsyncIterator[list[Node]]:
    started: list[Node] = []
    yield started
    for node in started:
        await node.close()


def refused_at_once(response: httpx.Response, elapsed: float, code: str) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == code, response.text
    assert response.headers["retry-after"] == "1"
    assert elapsed < FAST, f"{code} took {elapsed:.2f} s"


@pytest.mark.asyncio
async def test_a_starting_node_answers_503_not_ready_until_it_is_ready(
    servers: Servers, schema: str, tmp_path: Path, nodes: list[Node]
) -> None:
    pg = conninfo_to_dict(servers.database_url)
    gate = Relay(str(pg.get("host") or "127.0.0.1"), int(str(pg.get("port") or 5432)), held=True)
    gated = make_conninfo(servers.database_url, host="127.0.0.1", port=str(await gate.start()))
    node = Node(tmp_path / "home", DATABASE_URL=gated, NATS_URL=servers.nats_url,
                DISPACH_DB_SCHEMA=schema)  # fmt: skip
    nodes.append(node)
    try:

        async def bound() -> bool:
            with contextlib.suppress(httpx.TransportError):
                return (await node.http.get("/v1/health")).status_code == 200
            return False

        await node.until(bound, "listening", 30)  # its start now waits on Postgres
        assert (await node.http.get("/v1/ready")).status_code == 503
        engine_routes = [
            ("POST", MESSAGES),
            ("GET", "/v1/agents"),
            ("GET", "/v1/agents/assistant"),
            ("GET", "/v1/turns/t_1"),
        ]
        for method, path in engine_routes:
            body = {"text": "hi"} if method == "POST" else None
            response, elapsed = await node.timed(method, path, json=body)
            refused_at_once(response, elapsed, "not_ready")
        assert (await node.http.get("/v1/openapi.json")).status_code == 200
        assert (await node.http.get("/v1/nowhere")).status_code == 404

        # The Python client waits out the start (Retry-After) and its message is taken once.
        def send() -> Any:
            with Client(node.serve.url) as client:
                return client.send("assistant", "sent while starting", session_key="starting")

        refused_before = node.refused(MESSAGES)
        sending = asyncio.create_task(asyncio.to_thread(send))

        async def retried() -> bool:  # refused, waited its Retry-After, and asked again
            return sending.done() or node.refused(MESSAGES) >= refused_before + 2

        await node.until(retried, "the client refused twice while the node starts", 30)
        assert not sending.done()
        gate.open()
        accepted = await asyncio.wait_for(sending, 60)
        await node.ended(accepted.turn_id)
        listed = await node.http.get(
            "/v1/agents/assistant/turns", params={"sessionKey": "starting"}
        )
        assert [t["turnId"] for t in listed.json()["turns"]] == [accepted.turn_id]
    finally:
        gate.open()
        await node.close()
        await gate.stop()


@pytest.mark.asyncio
async def test_with_postgres_down_the_node_says_so_and_refuses_at_once(
    servers: Servers, tmp_path: Path, nodes: list[Node]
) -> None:
    postgres = EmbeddedPostgres(tmp_path / "pg")
    url = await asyncio.to_thread(postgres.start, None)
    relay = Relay("127.0.0.1", postgres.port)
    relayed = make_conninfo(url, port=str(await relay.start()))
    try:
        node = Node(tmp_path / "home", DATABASE_URL=relayed, NATS_URL=servers.nats_url)
        nodes.append(node)
        await node.ready()
        before = (await node.send("before the outage")).json()["turnId"]
        await node.ended(before)

        await asyncio.to_thread(postgres.stop)
        await node.waiting_on("postgres")
        turn = f"/v1/agents/assistant/turns/{before}"
        for method, path in [("POST", MESSAGES), ("GET", turn), ("POST", f"{turn}/stop"),
                             ("GET", f"/v1/turns/{before}")]:  # fmt: skip
            headers = {"Idempotency-Key": "during-outage"}
            body = {"text": "during the outage", "sessionKey": "outage"}
            sent = {"json": body, "headers": headers} if method == "POST" else {}
            response, elapsed = await node.timed(method, path, **sent)
            refused_at_once(response, elapsed, "store_unavailable")

        await asyncio.to_thread(postgres.start, postgres.port)
        relay.port = postgres.port
        await node.ready()
        after = await node.send("after the outage")
        assert after.status_code == 202, after.text
        await node.ended(after.json()["turnId"])
        # The refused message never ran: no turn holds its key, the session has the other two.
        refused = keyed_turn_id("assistant", "during-outage")
        assert (await node.http.get(f"/v1/turns/{refused}")).status_code == 404
        listed = await node.http.get("/v1/agents/assistant/turns", params={"sessionKey": "outage"})
        inputs = [t["input"] for t in listed.json()["turns"]]
        assert inputs == ["after the outage", "before the outage"]
        assert "postgres_down" in node.serve.output() or "postgres_up" in node.serve.output()
    finally:
        await asyncio.to_thread(postgres.stop)
        await relay.stop()


@pytest.mark.asyncio
async def test_with_nats_down_writes_are_refused_at_once_and_reads_go_on(
    servers: Servers, schema: str, tmp_path: Path, nodes: list[Node]
) -> None:
    nats_server = EmbeddedNats(tmp_path / "nats")
    await asyncio.to_thread(nats_server.start, None, None)
    relay = Relay("127.0.0.1", nats_server.port)
    relayed = f"nats://127.0.0.1:{await relay.start()}"
    try:
        node = Node(tmp_path / "home", DATABASE_URL=servers.database_url, NATS_URL=relayed,
                    DISPACH_DB_SCHEMA=schema)  # fmt: skip
        nodes.append(node)
        await node.ready()
        before = (await node.send("before the outage")).json()["turnId"]
        await node.ended(before)

        await asyncio.to_thread(nats_server.stop)
        await node.waiting_on("nats")
        headers = {"Idempotency-Key": "during-outage"}
        body = {"text": "during the outage", "sessionKey": "outage"}
        response, elapsed = await node.timed("POST", MESSAGES, json=body, headers=headers)
        refused_at_once(response, elapsed, "nats_unavailable")
        read, elapsed = await node.timed("GET", f"/v1/turns/{before}")
        assert read.status_code == 200 and elapsed < FAST

        await asyncio.to_thread(nats_server.start, nats_server.port, None)
        relay.port = nats_server.port
        await node.ready()
        refused = keyed_turn_id("assistant", "during-outage")
        assert (await node.http.get(f"/v1/turns/{refused}")).status_code == 404
    finally:
        await asyncio.to_thread(nats_server.stop)
        await relay.stop()


@contextlib.asynccontextmanager
async def appends_held(database_url: str, schema: str) -> AsyncIterator[Callable[[], Any]]:
    """Postgres takes no append while the block runs (a lock that still lets reads through):
    a slow database, not a down one. Yields a wait for the node's writer to be held by it."""
    conn = await psycopg.AsyncConnection.connect(database_url, options=f"-c search_path={schema}")
    try:
        await conn.execute("LOCK TABLE events IN SHARE MODE")

        async def writer_held() -> None:
            query = """SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
                        WHERE NOT l.granted AND c.relname = 'events'
                          AND c.relnamespace = %s::regnamespace"""
            deadline = time.monotonic() + 10
            while True:
                async with await psycopg.AsyncConnection.connect(database_url) as probe:
                    row = await (await probe.execute(query, [schema])).fetchone()
                if row is not None and row[0] > 0:
                    return
                assert time.monotonic() < deadline, "the writer never waited on the lock"
                await asyncio.sleep(0.05)

        yield writer_held
    finally:
        await conn.rollback()
        await conn.close()


@pytest.mark.asyncio
async def test_an_accept_that_times_out_says_it_is_unknown_and_a_retry_makes_one_turn(
    servers: Servers, schema: str, tmp_path: Path, nodes: list[Node]
) -> None:
    node = Node(tmp_path / "home", DATABASE_URL=servers.database_url, NATS_URL=servers.nats_url,
                DISPACH_DB_SCHEMA=schema, DISPACH_ACCEPT_TIMEOUT_SECONDS="3")  # fmt: skip
    nodes.append(node)
    await node.ready()
    async with appends_held(servers.database_url, schema) as writer_held:
        keyed = {"json": {"text": "slow"}, "headers": {"Idempotency-Key": "slow-1"}}
        sending = asyncio.create_task(node.timed("POST", MESSAGES, **keyed))
        await writer_held()
        timed_out, elapsed = await sending
    assert timed_out.status_code == 504, timed_out.text
    error = timed_out.json()["error"]
    assert (error["code"], error["accepted"]) == ("accept_timeout", "unknown")
    assert "same Idempotency-Key" in error["hint"] and 3 <= elapsed < 3 + FAST
    # It was in fact accepted once the database took the append: the retry the hint advises
    # replays that turn, and nothing runs twice.
    turn_id = keyed_turn_id("assistant", "slow-1")
    await node.ended(turn_id)
    again = await node.http.post(MESSAGES, json={"text": "slow"},
                                 headers={"Idempotency-Key": "slow-1"})  # fmt: skip
    assert again.status_code == 200 and again.json()["turnId"] == turn_id
    assert again.json()["replayed"] is True
    listed = await node.http.get("/v1/agents/assistant/turns")
    assert [t["turnId"] for t in listed.json()["turns"]] == [turn_id]


@pytest.mark.asyncio
async def test_an_accept_on_the_sessions_owner_needs_no_nats_for_its_answer(
    servers: Servers, schema: str, tmp_path: Path, nodes: list[Node]
) -> None:
    nats_server = EmbeddedNats(tmp_path / "nats")
    url = await asyncio.to_thread(nats_server.start, None, None)
    try:
        node = Node(tmp_path / "home", DATABASE_URL=servers.database_url, NATS_URL=url,
                    DISPACH_DB_SCHEMA=schema, DISPACH_ACCEPT_TIMEOUT_SECONDS="5")  # fmt: skip
        nodes.append(node)
        await node.ready()
        async with appends_held(servers.database_url, schema) as writer_held:
            keyed = {"json": {"text": "lost"}, "headers": {"Idempotency-Key": "lost-1"}}
            sending = asyncio.create_task(node.timed("POST", MESSAGES, **keyed))
            await writer_held()
            # The session took the message and waits for its append. This node owns the
            # session: the answer comes back in process, NATS or not (when the owner is another
            # node and its answer is lost, the key finds the turn, as the test above shows).
            await asyncio.to_thread(nats_server.stop)
        answered, _ = await sending
        assert answered.status_code == 202, answered.text
        assert answered.json()["turnId"] == keyed_turn_id("assistant", "lost-1")
        turn = await node.http.get(f"/v1/turns/{answered.json()['turnId']}")
        assert turn.status_code == 200 and turn.json()["input"] == "lost"
    finally:
        await asyncio.to_thread(nats_server.stop)

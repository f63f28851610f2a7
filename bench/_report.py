# ruff: noqa: E402 - the imports below must follow the sys.path fix
"""What the benchmarks share: percentiles, the results table, machine facts, the raw psycopg
single-row baseline each figure is set beside, and a node under test as a subprocess.

A benchmark imports this module first, for the import path it leaves behind: Python puts the
script's directory first on ``sys.path``, where bench/eventstore.py and bench/http.py would stand
in for the ``eventstore`` package and the standard library's ``http``. Found there, this module
takes bench/ off the front (it keeps it last, for itself) and puts the repository first.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))

import asyncio
import contextlib
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import (
    AsyncIterator,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from importlib import metadata
from typing import Any, TypeVar

import psycopg
from psycopg import sql

from eventstore import Checkpoint, EventStore
from eventstore.catalogue import TurnEnd
from runtime.config import Settings, from_env

perf = time.perf_counter

T = TypeVar("T")


def pct(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (nan when there are no samples)."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    rank = math.ceil(q / 100 * len(ordered))
    return ordered[max(0, min(len(ordered) - 1, rank - 1))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def rate(per_second: float) -> str:
    return f"{per_second:,.0f}/s"


def section(title: str) -> None:
    print(f"\n== {title}", flush=True)


@dataclass(frozen=True)
class Goal:
    text: str
    met: Callable[[float, float], bool]
    """Called with (ours, baseline)."""


@dataclass(frozen=True)
class Line:
    figure: str
    ours: str
    baseline: str
    ratio: str
    goal: str
    met: str


def line(
    figure: str,
    ours: float,
    baseline: float | None,
    show: Callable[[float], str],
    goal: Goal | None = None,
) -> Line:
    ratio = "-" if not baseline else f"{ours / baseline:.2f}x"
    met = "-" if goal is None else ("yes" if goal.met(ours, baseline or 0.0) else "NO")
    return Line(
        figure,
        show(ours),
        "-" if baseline is None else show(baseline),
        ratio,
        "-" if goal is None else goal.text,
        met,
    )


def print_rows(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> None:
    cells = [list(header), *[list(r) for r in rows]]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]

    def fmt(c: list[str]) -> str:
        parts = [c[i].rjust(w) if i in right else c[i].ljust(w) for i, w in enumerate(widths)]
        return "| " + " | ".join(parts) + " |"

    print(fmt(cells[0]))
    print("|" + "|".join(("-" * (w + 1) + ":") if i in right else "-" * (w + 2)
                         for i, w in enumerate(widths)) + "|")  # fmt: skip
    for c in cells[1:]:
        print(fmt(c))


def print_table(lines: Sequence[Line]) -> None:
    print_rows(
        ("figure", "ours", "baseline", "ratio", "goal", "met?"),
        [(x.figure, x.ours, x.baseline, x.ratio, x.goal, x.met) for x in lines],
        {1, 2, 3},
    )


def machine_facts(url: str, nats_version: str, data_dir: Path | None) -> None:
    section("machine")
    print(f"cpus: {os.cpu_count()}  platform: {platform.platform()}")
    loop = type(asyncio.get_running_loop())
    print(f"python: {platform.python_version()}  event loop: {loop.__module__}.{loop.__name__}")
    names = ("psycopg", "psycopg-pool", "nats-py", "msgspec", "pykka", "uvloop")
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    print("packages: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    settings = ("shared_buffers", "synchronous_commit", "wal_sync_method", "commit_delay", "fsync")
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT version()").fetchone()
        print(f"postgres: {row[0] if row else '?'}")
        shown = []
        for name in settings:
            value = conn.execute(f"SHOW {name}").fetchone()
            shown.append(f"{name}={value[0] if value else '?'}")
        print("settings: " + " ".join(shown))
    print(f"nats-server: {nats_version}")
    print(f"library: {library_state()}")
    if data_dir is not None:
        fs = subprocess.run(
            ["df", "--output=fstype,source", str(data_dir)],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split()
        print(f"embedded data dir: {data_dir} ({' '.join(fs[2:]) or 'unknown fs'})")


async def nats_version(url: str) -> str:
    """The version the NATS server at ``url`` says it runs."""
    import nats

    nc = await nats.connect(url)
    try:
        return str(nc.connected_server_version)
    finally:
        await nc.close()


def library_state() -> str:
    """The commit the library is at, and its uncommitted files (read-only git queries)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "-C",
                str(root),
                "status",
                "--porcelain",
                "--",
                "actors",
                "eventstore",
                "gateways",
                "runtime",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    changed = [d[3:] for d in dirty if d.strip()]
    return head + (f" + uncommitted changes to {', '.join(changed)}" if changed else "")


INSERT = b"INSERT INTO scratch (id, type, data) VALUES (%s, %s, %s::jsonb)"
PAYLOAD = '{"delta": "The quick brown fox jumps over the lazy dog.", "kind": "text"}'


@dataclass(frozen=True)
class RawSingle:
    rate: float
    p50: float
    p99: float
    commits: int

    @staticmethod
    def mean(before: RawSingle, after: RawSingle) -> RawSingle:
        """The baseline of a run: the mean of the measurements before and after it."""
        return RawSingle((before.rate + after.rate) / 2, (before.p50 + after.p50) / 2,
                         (before.p99 + after.p99) / 2, before.commits + after.commits)  # fmt: skip


def raw_setup(url: str, schema: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
        conn.execute(
            sql.SQL(
                "CREATE TABLE {}.scratch ("
                " seq bigint GENERATED ALWAYS AS IDENTITY UNIQUE,"
                " id uuid PRIMARY KEY, type text NOT NULL, data jsonb NOT NULL)"
            ).format(sql.Identifier(schema))
        )


def raw_single(
    url: str, schema: str, seconds: float, when: str, payload: str = PAYLOAD
) -> RawSingle:
    """Single-row INSERT + COMMIT, sequential, from one connection."""
    with raw_connect(url, schema) as conn:
        latencies: list[float] = []
        start = perf()
        end = start + seconds
        while (t0 := perf()) < end:
            conn.execute(INSERT, (uuid.uuid4(), "model.chunk", payload))
            conn.commit()
            latencies.append(perf() - t0)
        result = RawSingle(
            len(latencies) / (perf() - start), pct(latencies, 50), pct(latencies, 99),
            len(latencies),
        )  # fmt: skip
    print(
        f"raw single-row INSERT+COMMIT ({when}): {rate(result.rate)} ({result.commits} commits), "
        f"p50 {ms(result.p50)}, p99 {ms(result.p99)}"
    )
    return result


def raw_connect(url: str, schema: str, *, autocommit: bool = False) -> psycopg.Connection[Any]:
    return psycopg.connect(url, autocommit=autocommit, options=f"-c search_path={schema}")


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run the benchmark on uvloop, as a node does (plain asyncio if it is missing)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


@dataclass(frozen=True)
class Servers:
    database_url: str
    nats_url: str
    data_dir: Path | None
    """The embedded Postgres's data directory (None when Postgres is external)."""
    nats_pid: int | None
    """The embedded nats-server's process (None when NATS is external)."""


@contextlib.contextmanager
def servers() -> Iterator[Servers]:
    """DATABASE_URL / NATS_URL when set, else embedded Postgres and NATS in a temporary
    directory, removed afterwards."""
    from runtime.embedded import EmbeddedServices

    database_url = os.environ.get("DATABASE_URL")
    nats_url = os.environ.get("NATS_URL")
    home: Path | None = None
    services: EmbeddedServices | None = None
    if database_url is None or nats_url is None:
        home = Path(tempfile.mkdtemp(prefix="dispach-bench-"))
        services = EmbeddedServices(home, database_url, nats_url)
        services.start()
    try:
        url = database_url or (services.database_url if services else None)
        nurl = nats_url or (services.nats_url if services else None)
        assert url is not None and nurl is not None
        yield Servers(
            url,
            nurl,
            home if database_url is None else None,
            services.nats_pid if services is not None else None,
        )
    finally:
        if services is not None:
            services.stop()
        if home is not None:
            shutil.rmtree(home, ignore_errors=True)


# --- a node under test, as a subprocess ----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def get_status(url: str) -> int:
    """The HTTP status of a GET (0 when nothing answers)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            status: int = answer.status
            return status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def drop_schemas(url: str, schemas: Iterable[str]) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for schema in schemas:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


async def wait_ready(
    server: asyncio.subprocess.Process, base: str, log: Path, path: str = "/v1/ready"
) -> float:
    """Seconds from now until GET ``path`` answers 200 (polled every 20 ms)."""
    started = perf()
    while perf() - started < 120:
        if server.returncode is not None:
            raise SystemExit(f"the server exited with {server.returncode}:\n{tail(log)}")
        if await asyncio.to_thread(get_status, base + path) == 200:
            return perf() - started
        await asyncio.sleep(0.02)
    raise SystemExit(f"the server was not ready after 120 s:\n{tail(log)}")


@contextlib.asynccontextmanager
async def serving(
    database_url: str,
    nats_url: str,
    work: Path,
    agent: str,
    *,
    argv: Sequence[str] = ("-m", "runtime", "serve"),
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    name: str = "dispach serve",
) -> AsyncIterator[tuple[int, str]]:
    """A node under test: ``python argv`` with a schema, home and agents directory of its own
    (the one agent ``agent``, in YAML), on the given Postgres and NATS, on a free loopback port
    with no token, logging at ``warning`` (``env`` is added to that). Yields its pid and base
    URL once it is ready; then stops it (SIGTERM: its drain), fails the benchmark if it did not
    exit 0, and drops its schema."""
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    root = work / schema
    (root / "agents").mkdir(parents=True)
    (root / "agents" / "bench.yaml").write_text(agent)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    variables = {
        **os.environ,
        "DATABASE_URL": database_url, "NATS_URL": nats_url, "DISPACH_DB_SCHEMA": schema,
        "DISPACH_HOME": str(root / "home"), "DISPACH_AGENTS": str(root / "agents"),
        "DISPACH_HOST": "127.0.0.1", "DISPACH_PORT": str(port), "DISPACH_API_TOKEN": "",
        "DISPACH_LOG_LEVEL": "warning", **(env or {}),
    }  # fmt: skip
    log = root / "serve.log"
    try:
        with log.open("wb") as sink:
            server = await asyncio.create_subprocess_exec(
                sys.executable, *argv, env=variables, cwd=cwd or root, stdout=sink,
                stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
        try:
            await wait_ready(server, base, log)
            yield server.pid, base
        finally:
            status = await stop_server(server)
        if status != 0:
            raise SystemExit(f"{name} exited with {status}:\n{tail(log)}")
    finally:
        drop_schemas(database_url, [schema])


async def stop_server(server: asyncio.subprocess.Process, timeout: float = 60.0) -> int:
    """SIGTERM, then wait for the drain (SIGKILL after ``timeout`` s, reported as -9)."""
    if server.returncode is not None:
        return server.returncode
    server.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(server.wait(), timeout)
    except TimeoutError:
        server.kill()
        await server.wait()
        return -9


# --- waiting for turn ends ---------------------------------------------------------------------


@dataclass(frozen=True)
class Ended:
    """A turn.end as the bench's one subscription saw it, and when (perf counter, wall clock)."""

    end: TurnEnd
    at: float
    wall: float


def node_settings(
    url: str, nats_url: str, schema: str, agent: str, manifest: str, **env: str
) -> tuple[Settings, Path]:
    """Settings for an in-process node serving one agent from ``manifest``, with its home and
    agents directory in a new temporary directory (returned, for the caller to remove); ``env``
    adds or overrides DISPACH_* settings."""
    root = Path(tempfile.mkdtemp(prefix="dispach-bench-node-"))
    (root / "agents").mkdir()
    (root / "agents" / f"{agent}.yaml").write_text(manifest)
    settings = from_env({
        "DATABASE_URL": url, "NATS_URL": nats_url, "DISPACH_DB_SCHEMA": schema,
        "DISPACH_CLUSTER": schema,
        "DISPACH_HOME": str(root / "home"), "DISPACH_AGENTS": str(root / "agents"),
        "DISPACH_DRAIN_SECONDS": "10", **env,
    })  # fmt: skip
    return settings, root


class FullCollections:
    """The collector's full (generation 2) collections, from gc.callbacks: the pause of each
    (wall and thread CPU seconds) and the unreachable objects it found (and freed), also filed
    by what the bench says it was doing (``where``)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float, int]] = []
        self.where = "start"
        self.by_where: dict[str, list[float]] = {}
        """CPU seconds of each collection, by ``where``."""
        self._started = (0.0, 0.0)

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = (perf(), time.thread_time())
        else:
            wall, cpu = self._started
            self.pauses.append((perf() - wall, time.thread_time() - cpu, info.get("collected", 0)))
            self.by_where.setdefault(self.where, []).append(self.pauses[-1][1])


class Ends:
    """turn.end sightings, from one subscription, resolving the future of the waiting turn."""

    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future[Ended]] = {}
        self._early: dict[str, Ended] = {}

    def seen(self, turn_id: str, end: TurnEnd) -> None:
        ended = Ended(end, perf(), time.time())
        future = self._waiting.pop(turn_id, None)
        if future is None:
            self._early[turn_id] = ended  # ended before its waiter had the acceptance back
        elif not future.done():
            future.set_result(ended)

    async def wait(self, turn_id: str, timeout: float) -> Ended:
        early = self._early.pop(turn_id, None)
        if early is not None:
            return early
        future: asyncio.Future[Ended] = asyncio.get_running_loop().create_future()
        self._waiting[turn_id] = future
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._waiting.pop(turn_id, None)


async def watch_ends(store: EventStore, after: Checkpoint, ends: Ends) -> None:
    # Only turn.end rows leave Postgres: the client shares the node's event loop, and reading
    # every event of every turn to find the ends cost it a third of the loop's time per turn.
    async for event in store.subscribe(after, types=("turn.end",)):
        if event.metadata.turn_id is not None and isinstance(event.data, TurnEnd):
            ends.seen(event.metadata.turn_id, event.data)

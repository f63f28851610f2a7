"""Benchmark of issue 14: 1 and 2 node processes on one log, and failover, in one run.

    .venv/bin/python bench/cluster.py [--quick] [--baseline <rev>] [--rounds 4] [--kills 5]

Uses DATABASE_URL / NATS_URL when set, else starts the embedded Postgres and NATS in a fresh
temporary directory (removed afterwards). Every node sees them as external services, so
``dispach serve --workers 2`` starts no service of its own: both workers share them.

Throughput. Configurations, alternated round by round (A B B A ..., the order reversed every
round, so a drift of the shared machine falls on all alike), each round a fresh
``python -m runtime serve`` with a fresh schema (``DISPACH_DB_SCHEMA``) and deployment name
(``DISPACH_CLUSTER``), on a free loopback port, its tree first on ``PYTHONPATH``:

  - ``1 process``: this tree, ``serve --workers 1`` (one node owns every partition);
  - ``2 processes``: this tree, ``serve --workers 2`` (a supervisor and two nodes on one port);
  - with ``--baseline <rev>``: that commit, plain ``serve``, from a git worktree (bench/ab.py's
    approach), e.g. ``1c14767``, main before issue 14: what ownership costs one node.

The round waits for ``GET /v1/ready`` and, for this tree, until ``GET /v1/cluster`` shows every
partition leased by exactly N nodes. Then bench/http.py's loadgen runs, with its agents (scripted
model ``bench``: one step; ``bench-tool``: calculator, then the answer) and its driver: ``seq``
(accept p50/p99, one keep-alive connection, so with 2 processes one worker answers every POST
and forwards the sessions the other owns) and ``burst`` over 16 sessions, then bursts over 128
sessions and one-tool bursts over 16 and 128. Node CPU is read from /proc for the whole process
tree (supervisor and workers), and the machine's busy share during the 128-session plain burst
says whether the 2 cores were saturated. The raw psycopg single-row INSERT + COMMIT is measured
before the rounds and after them (mean): the rate beside turns/s, as in bench/http.py. Nodes log
JSON at info (no line per turn): the round prints what its log said about ownership and every
warning. The round ends with SIGTERM; a server still running 30 s later is killed (-9, its
workers too) and reported, and its figures stand (they were measured before the stop).

Failover. Two separate nodes (``serve``, DISPACH_NODE_ID n1 and n2, DISPACH_LEASE_TTL_SECONDS
``--ttl``) on a fresh schema and deployment, serving agent ``slow`` whose model is the fake
Anthropic (tests/fakes) in a process of its own: it holds the first request of each turn (the
turn is in flight on its owner), and answers a request it has seen before at once, so a resumed
turn ends as soon as its new owner runs it and the figure is the cluster's, not the model's.
Per kill: ``--failover-turns`` turns on sessions whose partitions the victim holds
(``partition_of`` over GET /v1/cluster's leases), posted to the victim; once the fake holds all
of them, kill -9 of the victim; the time from the kill to the first ``turn.end`` of those turns
in the log (its ``recorded_at``) is the failover time; every turn must end exactly once, resumed
on the survivor. The victim is restarted (same id) and the bench waits until both nodes hold
partitions again before the next kill; the victims alternate. p50 and max over the kills are set
against TTL + 2 s.

Goals (issue 14, "Performance"): 2 processes >= 1.3x the throughput of 1; ownership costs no more
than 5 % of single-node throughput and adds <= 0.1 ms to accept p50 (1 process against
``--baseline``); failover <= TTL + 2 s.

``--quick``: 60 turns a burst, 1 round per configuration, 2 kills of 10 turns: a smoke run.
"""

from __future__ import annotations

# First: it takes this directory off the front of the import path (see its docstring).
from _report import (
    RawSingle,
    Servers,
    busy_share,
    drop_schemas,
    free_port,
    machine_facts,
    machine_ticks,
    ms,
    nats_version,
    perf,
    print_rows,
    rate,
    raw_setup,
    raw_single,
    run_loop,
    section,
    servers,
    stop_server,
    tail,
    tree_cpu,
    wait_ready,
)

# isort: split
import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import multiprocessing
import os
import re
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from types import ModuleType
from typing import Any

import ab
import psycopg

from actors.cluster.partitions import partition_of
from eventstore import streams


def _load_http() -> ModuleType:
    """bench/http.py, whose agents, runs and driver call this bench shares. Its name is the
    standard library's ``http`` (which _report leaves first on the path), so it is loaded from
    its file, under ``bench_http``."""
    spec = importlib.util.spec_from_file_location("bench_http", Path(__file__).with_name("http.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building classes
    spec.loader.exec_module(module)
    return module


_http = _load_http()
ROOT = Path(__file__).resolve().parent.parent
LOADGEN: Path = _http.LOADGEN
RUNS: tuple[Any, ...] = tuple(
    dataclasses.replace(r, phases="seq,burst") if r.key == "main" else r for r in _http.RUNS
)
"""bench/http.py's four loadgen runs; the first without its closed-loop and reattach phases."""
STOP_SECONDS = 30.0
"""SIGTERM to exit, at most (DISPACH_DRAIN_SECONDS is 10); then kill -9, reported as -9."""
SLOW_AGENT = """\
id: slow
name: Failover agent (the fake Anthropic holds each turn's first model call)
model:
  provider: anthropic
  id: claude-sonnet-5
  base_url: {url}
  api_key_env: DISPACH_BENCH_ANTHROPIC_KEY
tools: []
"""


@dataclass(frozen=True)
class Plan:
    base: Any
    """bench/http.py's Plan: turns a loadgen phase, seconds of each raw-commit measurement."""
    rounds: int
    kills: int
    failover_turns: int


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    tree: ab.Tree
    workers: int | None
    """``--workers`` (None: the baseline, which has no such flag)."""


@dataclass(frozen=True)
class Figure:
    key: str
    label: str
    show: Callable[[float], str]
    read: Callable[[dict[str, dict[str, Any]]], float | None]


def _wall(run: str) -> Callable[[dict[str, dict[str, Any]]], float | None]:
    return lambda r: r[run]["burst"]["turns_per_s_wall"]


def _accept(q: str) -> Callable[[dict[str, dict[str, Any]]], float | None]:
    return lambda r: r["main"]["seq_e2e"]["accept_ms"][q]


def _ms(x: float) -> str:
    return f"{x:.2f} ms"


THROUGHPUT = (
    Figure("plain16", "plain burst turns/s, 16 sessions", rate, _wall("main")),
    Figure("plain128", "plain burst turns/s, 128 sessions", rate, _wall("burst128")),
    Figure("tool16", "one-tool burst turns/s, 16 sessions", rate, _wall("tool16")),
    Figure("tool128", "one-tool burst turns/s, 128 sessions", rate, _wall("tool128")),
)
LATENCY = (
    Figure("accept50", "accept p50 (seq, idle)", _ms, _accept("p50")),
    Figure("accept99", "accept p99 (seq, idle)", _ms, _accept("p99")),
)


# --- decisions (pure) ----------------------------------------------------------------------------


def order(configs: int, rounds: int) -> list[int]:
    """Config indexes, round after round, each round reversed from the one before (A B B A for
    two configs, A B C C B A for three), so a drift in time favours none."""
    forward = list(range(configs))
    return [i for r in range(rounds) for i in (forward if r % 2 == 0 else forward[::-1])]


def lease_owners(view: dict[str, Any]) -> Counter[str]:
    """Partitions held per node in a GET /v1/cluster answer."""
    return Counter(
        str(lease["node"]) for lease in view.get("leases") or []
        if isinstance(lease.get("partition"), int)
    )  # fmt: skip


def unsettled(view: dict[str, Any], nodes: int | set[str]) -> str | None:
    """Why the cluster in ``view`` is not settled (None: it is): every partition leased, by
    exactly ``nodes`` (a count, or the ids), each of them holding some."""
    leases = [x for x in view.get("leases") or [] if isinstance(x.get("partition"), int)]
    covered = {x["partition"] for x in leases}
    owners = set(lease_owners(view))
    total = int(view.get("partitions", -1))
    if len(covered) != total:
        return f"{len(covered)} of {total} partitions leased"
    if isinstance(nodes, int) and len(owners) != nodes:
        return f"held by {len(owners)} nodes, not {nodes}"
    if isinstance(nodes, set) and owners != nodes:
        return f"held by {sorted(owners)}, not {sorted(nodes)}"
    return None


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


# --- HTTP (blocking; called in threads) ----------------------------------------------------------


def call(url: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    """GET (or POST ``body`` as JSON): the status and the decoded answer (0, {} when nothing
    answers)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {} if body is None else {"content-type": "application/json"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=10) as r:
            status: int = r.status
            raw = r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except OSError:
        return 0, {}
    try:
        found = json.loads(raw) if raw else {}
    except ValueError:
        found = {"raw": raw.decode(errors="replace")}
    return status, found if isinstance(found, dict) else {"value": found}


async def wait_settled(base: str, nodes: int | set[str], timeout: float = 60) -> dict[str, Any]:
    """Until ``base``'s GET /v1/cluster is settled (see ``unsettled``); the view. SystemExit
    with the last answer when it is not within ``timeout``."""
    last: tuple[int, dict[str, Any]] = (0, {})

    async def settled() -> bool:
        nonlocal last
        last = await asyncio.to_thread(call, base + "/v1/cluster")
        return last[0] == 200 and unsettled(last[1], nodes) is None

    if await until(settled, timeout):
        return last[1]
    status, view = last
    why = unsettled(view, nodes) if status == 200 else f"GET /v1/cluster answered {status}"
    raise SystemExit(f"the cluster did not settle in {timeout:g} s: {why}; leases by node"
                     f" {dict(lease_owners(view))}, nodes {view.get('nodes')}")  # fmt: skip


async def until(check: Callable[[], Awaitable[bool]], timeout: float, every: float = 0.05) -> bool:
    """Poll ``check`` until it is true (True) or ``timeout`` s have passed (False)."""
    deadline = perf() + timeout
    while not await check():
        if perf() > deadline:
            return False
        await asyncio.sleep(every)
    return True


# --- processes -----------------------------------------------------------------------------------


def base_env(
    servers_: Servers, schema: str, cluster: str, home: Path, agents: Path
) -> dict[str, str]:
    """A node's environment: the bench's, without its own DISPACH_*/ANTHROPIC_* settings."""
    inherited = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("DISPACH_", "ANTHROPIC_")) and k not in ("DATABASE_URL", "NATS_URL")
    }  # fmt: skip
    return inherited | {
        "DATABASE_URL": servers_.database_url, "NATS_URL": servers_.nats_url,
        "DISPACH_DB_SCHEMA": schema, "DISPACH_CLUSTER": cluster,
        "DISPACH_HOME": str(home), "DISPACH_AGENTS": str(agents),
        "DISPACH_HOST": "127.0.0.1", "DISPACH_API_TOKEN": "", "DISPACH_DRAIN_SECONDS": "10",
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
    }  # fmt: skip


async def spawn(
    tree: Path, args: Sequence[str], env: dict[str, str], cwd: Path, log: Path
) -> asyncio.subprocess.Process:
    """``python -m runtime serve`` of ``tree`` (first on PYTHONPATH, run from ``cwd`` so the
    current directory adds nothing), in its own session: kill -9 reaches all of it."""
    with log.open("ab") as sink:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "runtime", "serve", *args,
            env=env | {"PYTHONPATH": str(tree)}, cwd=cwd, stdout=sink,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (a supervisor's workers, in sessions of their own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


async def kill(proc: asyncio.subprocess.Process, workers: Sequence[int] = ()) -> None:
    """kill -9 of a server and of ``workers``, its children as they were before it stopped (a
    worker whose drain hangs outlives its parent and the SIGTERM of PR_SET_PDEATHSIG)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # a pid reused within the round is not likely


def problems(log: Path, lines: int = 12) -> str:
    """The log's last warning and error lines (what a failed configuration said)."""
    found = [
        row for row in tail(log, 100_000).splitlines()
        if re.search(r"warn|error|exception|traceback|session_moving|drain", row, re.IGNORECASE)
    ]  # fmt: skip
    return "\n".join(found[-lines:]) or "(no warning or error lines)"


def log_summary(log: Path) -> str:
    """What a node's JSON log said about ownership, and every warning or error, counted by
    logger and event: a move of partitions in the middle of a run, or a refusal, shows here."""
    said: Counter[str] = Counter()
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no log)"
    for row in text.splitlines():
        with contextlib.suppress(ValueError):
            line = json.loads(row)
            if isinstance(line, dict) and (
                line.get("logger") == "dispach.cluster" or line.get("level") in ("warning", "error")
            ):
                said[f"{line.get('level')} {line.get('logger')} {line.get('event')}"] += 1
    return "; ".join(f"{k} x{n}" for k, n in sorted(said.items())) or "(nothing)"


async def drop_streams(nats_url: str, cluster: str) -> None:
    """The deployment's JetStream streams (its key-value buckets), so that an external NATS
    does not keep one bucket per round."""
    import nats

    with contextlib.suppress(Exception):
        nc = await nats.connect(nats_url, connect_timeout=2, max_reconnect_attempts=1)
        try:
            js = nc.jetstream()
            for info in await js.streams_info():
                name = info.config.name
                if name is not None and cluster in name:
                    await js.delete_stream(name)
        finally:
            await nc.close()


# --- throughput ----------------------------------------------------------------------------------


async def one_round(
    config: Config, found: Servers, plan: Plan, work: Path, keep: bool
) -> dict[str, dict[str, Any]] | None:
    """One fresh server of ``config`` under the four loadgen runs: their results (and
    ``node``: CPU and busy share), or None when the configuration failed (said why)."""
    suffix = secrets.token_hex(4)
    schema, cluster = f"bench_{suffix}", f"bench-{suffix}"
    root = work / schema
    (root / "agents").mkdir(parents=True)
    for agent, manifest in _http.AGENTS.items():
        (root / "agents" / f"{agent}.yaml").write_text(manifest)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = base_env(found, schema, cluster, root / "home", root / "agents") | {
        "DISPACH_PORT": str(port), "DISPACH_LOG_FORMAT": "json",
    }  # fmt: skip
    log = root / "serve.log"
    args = [] if config.workers is None else ["--workers", str(config.workers)]
    section(f"{config.label}: serve {' '.join(args)} (schema {schema}, cluster {cluster})")
    results: dict[str, dict[str, Any]] = {}
    workers: list[int] = []
    server = await spawn(config.tree.path, args, env, root, log)
    try:
        took = await wait_ready(server, base, log)
        if config.workers is not None:
            settling = perf()
            view = await wait_settled(base, config.workers)
            owners = ", ".join(f"{n} {c}" for n, c in sorted(lease_owners(view).items()))
            print(f"ready in {took:.2f} s; every partition leased {perf() - settling:.2f} s"
                  f" later: {owners}")  # fmt: skip
        else:
            print(f"ready in {took:.2f} s")
        for run in RUNS:
            print(f"{run.key} starts at {time.strftime('%H:%M:%S', time.gmtime())} UTC")
            cpu, ticks = tree_cpu(server.pid), machine_ticks()
            result: dict[str, Any] = await _http.loadgen(base, server.pid, run, plan.base)
            turns = result["burst"]["completed"] + result.get("seq_e2e", {}).get("n", 0)
            spent = tree_cpu(server.pid) - cpu
            result["node"] = {"cpu_ms_per_turn": spent * 1000 / max(1, turns),
                              "busy": busy_share(ticks, machine_ticks())}  # fmt: skip
            _http.print_phases(run, result)
            print(f"node CPU, every process of it (the 'server CPU' above is pid {server.pid}"
                  f" alone): {result['node']['cpu_ms_per_turn']:.2f} ms/turn;"
                  f" machine busy {result['node']['busy']:.0%}")  # fmt: skip
            results[run.key] = result
        print(f"its log, ownership events and warnings: {log_summary(log)}")
        section(f"{config.label}: stop (SIGTERM)")
        workers = children(server.pid)
        started = perf()
        status = await stop_server(server, STOP_SECONDS)
        results["stop"] = {"status": status, "seconds": perf() - started}
        print(f"exited with {status} after {ms(perf() - started)}")
        if status != 0:  # the figures above stand; the stop is reported on its own
            print(f"{config.label}: SIGTERM did not stop it cleanly (-9: still running after"
                  f" {STOP_SECONDS:g} s, then killed); the end of its log:")  # fmt: skip
            print(tail(log, 12))
    except SystemExit as e:
        print(f"{config.label} FAILED: {e}\nits log says:\n{problems(log)}\n--- end of its log:"
              f"\n{tail(log, 15)}")  # fmt: skip
        return None
    finally:
        await kill(server, workers or children(server.pid))
        if not keep:
            await asyncio.to_thread(drop_schemas, found.database_url, [schema])
            await drop_streams(found.nats_url, cluster)
    return results


async def throughput(
    configs: list[Config], found: Servers, plan: Plan, work: Path, keep: bool
) -> dict[str, list[dict[str, dict[str, Any]]]]:
    measured: dict[str, list[dict[str, dict[str, Any]]]] = {c.key: [] for c in configs}
    sequence = order(len(configs), plan.rounds)
    print("order: " + " ".join(configs[i].key for i in sequence))
    for n, which in enumerate(sequence, 1):
        config = configs[which]
        print(f"\n-- round {n} of {len(sequence)}: {config.label}", flush=True)
        result = await one_round(config, found, plan, work, keep)
        if result is not None:
            measured[config.key].append(result)
            shown = (f"{f.key} {f.show(v)}" for f in THROUGHPUT + LATENCY
                     if (v := f.read(result)) is not None)  # fmt: skip
            print(f"round {n} {config.key}: " + ", ".join(shown), flush=True)
    return measured


# --- the fake model, in a process of its own -----------------------------------------------------

MARKER = re.compile(r"failover turn (k\d+t\d+)")


def _serve_fake(conn: Connection, hold: float) -> None:
    """The child: a FakeAnthropic that holds the first request of each turn (by the marker in
    its message) for ``hold`` s and answers a repeated one at once; ``("seen", prefix)`` asks
    how many markers with that prefix it has received."""
    from tests.fakes.anthropic_server import FakeAnthropic, Item, Reply

    halt = threading.Event()
    seen: set[str] = set()
    lock = threading.Lock()

    def answer(body: dict[str, Any]) -> Item:
        markers = MARKER.findall(json.dumps(body.get("messages")))
        if markers:
            with lock:
                first = markers[-1] not in seen
                seen.add(markers[-1])
            if first:
                halt.wait(hold)
        return Reply(text="done")

    with FakeAnthropic() as fake:
        fake.responder = answer
        conn.send(fake.url)
        while (asked := conn.recv()) != "stop":
            with lock:
                conn.send(sum(1 for m in seen if m.startswith(asked[1])))
        halt.set()


class Fake:
    def __init__(self, hold: float) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve_fake, args=(child, hold),
                                        name="fake-anthropic", daemon=True)  # fmt: skip
        self._process.start()
        child.close()
        self.url: str = self._conn.recv()

    def seen(self, prefix: str) -> int:
        self._conn.send(("seen", prefix))
        count: int = self._conn.recv()
        return count

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send("stop")
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()


# --- failover ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kill:
    victim: str
    turns: int
    first_s: float | None
    """kill -9 to the first turn.end of the victim's turns (None: none ended)."""
    last_s: float | None
    ends: Counter[str]
    """turn.end events per turn."""
    resumed_on: Counter[str]
    """The node of each turn's last turn.attempt."""
    reasons: Counter[str]


class Nodes:
    """The two failover nodes: their processes, ports and logs."""

    def __init__(self, tree: Path, env: dict[str, str], root: Path) -> None:
        self.tree, self.env, self.root = tree, env, root
        self.ports = {n: free_port() for n in ("n1", "n2")}
        self.procs: dict[str, asyncio.subprocess.Process] = {}

    def base(self, node: str) -> str:
        return f"http://127.0.0.1:{self.ports[node]}"

    def log(self, node: str) -> Path:
        return self.root / f"serve-{node}.log"

    async def start(self, node: str) -> None:
        env = self.env | {"DISPACH_NODE_ID": node, "DISPACH_PORT": str(self.ports[node]),
                          "DISPACH_HOME": str(self.root / f"home-{node}")}  # fmt: skip
        self.procs[node] = await spawn(self.tree, [], env, self.root, self.log(node))
        await wait_ready(self.procs[node], self.base(node), self.log(node))

    def said(self) -> str:
        return "\n".join(f"--- {n}:\n{problems(self.log(n))}" for n in self.procs)


async def ended_rows(conn: psycopg.AsyncConnection[Any], turn_ids: list[str]) -> list[Any]:
    """(turn id, recorded_at, reason) of every turn.end of ``turn_ids``."""
    cursor = await conn.execute(
        "SELECT substr(stream_id, 6), recorded_at, data->>'reason' FROM events"
        " WHERE type = 'turn.end' AND stream_id = ANY(%s)",
        [[streams.turn(t) for t in turn_ids]],
    )
    return list(await cursor.fetchall())


async def last_attempts(conn: psycopg.AsyncConnection[Any], turn_ids: list[str]) -> Counter[str]:
    cursor = await conn.execute(
        "SELECT DISTINCT ON (stream_id) data->>'node' FROM events"
        " WHERE (type = 'turn.attempt' OR (type = 'turn.start' AND data->>'attempt' = '1'))"
        " AND stream_id = ANY(%s)"
        " ORDER BY stream_id, global_position DESC",
        [[streams.turn(t) for t in turn_ids]],
    )
    return Counter(str(row[0]) for row in await cursor.fetchall())


async def one_kill(
    k: int, nodes: Nodes, fake: Fake, conn: psycopg.AsyncConnection[Any], turns: int, ttl: float
) -> Kill:
    victim, survivor = ("n2", "n1") if k % 2 == 0 else ("n1", "n2")
    view = await wait_settled(nodes.base(survivor), {"n1", "n2"})
    count = int(view["partitions"])
    held = {x["partition"] for x in view["leases"] if x.get("node") == victim}
    keys = (f"fo{k}-{i}" for i in range(100_000))
    sessions = [s for s in keys if partition_of("slow", s, count) in held][:turns]
    turn_ids: list[str] = []
    for i, session in enumerate(sessions):
        body = {"text": f"failover turn k{k}t{i}", "sessionKey": session, "deliver": "none"}
        status, answer = await asyncio.to_thread(
            call, nodes.base(victim) + "/v1/agents/slow/messages", body
        )
        if status != 202:
            raise SystemExit(f"POST to {victim} answered {status}: {answer}\n{nodes.said()}")
        turn_ids.append(str(answer["turnId"]))

    async def all_held() -> bool:
        return await asyncio.to_thread(fake.seen, f"k{k}t") >= len(turn_ids)

    if not await until(all_held, 30):
        held_now = await asyncio.to_thread(fake.seen, f"k{k}t")
        raise SystemExit(f"the fake holds {held_now} of {len(turn_ids)} turns after 30 s")
    proc = nodes.procs[victim]
    os.killpg(proc.pid, signal.SIGKILL)
    killed_at = time.time()
    await proc.wait()
    rows: list[Any] = []

    async def all_ended() -> bool:
        rows[:] = await ended_rows(conn, turn_ids)
        return len(rows) >= len(turn_ids)

    await until(all_ended, ttl + 60)
    at = sorted(row[1].timestamp() - killed_at for row in rows)
    result = Kill(
        victim, len(turn_ids), at[0] if at else None, at[-1] if at else None,
        Counter(str(row[0]) for row in rows), await last_attempts(conn, turn_ids),
        Counter(str(row[2]) for row in rows),
    )  # fmt: skip
    shown = "-" if result.first_s is None else f"{result.first_s:.2f} s"
    print(f"kill {k + 1}: kill -9 {victim} with {len(turn_ids)} turns in flight; first resumed"
          f" turn.end after {shown}, last {result.last_s or 0:.2f} s; ended {len(result.ends)}"
          f" of {len(turn_ids)} (twice: {sum(1 for c in result.ends.values() if c > 1)});"
          f" reasons {dict(result.reasons)}; last attempt on {dict(result.resumed_on)}",
          flush=True)  # fmt: skip
    if len(result.ends) < len(turn_ids):
        print(f"not every turn ended within TTL + 60 s; the nodes say:\n{nodes.said()}")
    await nodes.start(victim)  # again, same id: it rejoins and takes its share back
    return result


async def failover(
    tree: Path, found: Servers, plan: Plan, ttl: float, work: Path, keep: bool
) -> list[Kill]:
    suffix = secrets.token_hex(4)
    schema, cluster = f"bench_{suffix}", f"bench-{suffix}"
    root = work / schema
    (root / "agents").mkdir(parents=True)
    fake = Fake(hold=300)
    (root / "agents" / "slow.yaml").write_text(SLOW_AGENT.format(url=fake.url))
    env = base_env(found, schema, cluster, root / "home", root / "agents") | {
        "DISPACH_LEASE_TTL_SECONDS": f"{ttl:g}", "DISPACH_LOG_FORMAT": "json",
        "DISPACH_BENCH_ANTHROPIC_KEY": "test",
    }  # fmt: skip
    nodes = Nodes(tree, env, root)
    kills: list[Kill] = []
    section(f"failover: nodes n1, n2 (serve, TTL {ttl:g} s; schema {schema}, cluster {cluster})")
    try:
        await asyncio.gather(nodes.start("n1"), nodes.start("n2"))
        async with await psycopg.AsyncConnection.connect(
            found.database_url, autocommit=True, options=f"-c search_path={schema}"
        ) as conn:
            for k in range(plan.kills):
                kills.append(await one_kill(k, nodes, fake, conn, plan.failover_turns, ttl))
            await wait_settled(nodes.base("n1"), {"n1", "n2"})
        section("failover: stop (SIGTERM to both)")
        statuses = await asyncio.gather(*(stop_server(p) for p in nodes.procs.values()))
        print(f"exit statuses: {dict(zip(nodes.procs, statuses, strict=True))}")
        for node in nodes.procs:
            print(f"{node}'s log, ownership events and warnings: {log_summary(nodes.log(node))}")
        if any(statuses):
            print(nodes.said())
    except SystemExit as e:
        print(f"failover FAILED: {e}\nthe nodes say:\n{nodes.said()}")
    finally:
        for proc in nodes.procs.values():
            await kill(proc)
        fake.stop()
        if not keep:
            await asyncio.to_thread(drop_schemas, found.database_url, [schema])
            await drop_streams(found.nats_url, cluster)
    return kills


# --- the tables ----------------------------------------------------------------------------------


def figures(runs: list[dict[str, dict[str, Any]]], figure: Figure) -> list[float]:
    return [v for r in runs if (v := figure.read(r)) is not None]


def node_figures(runs: list[dict[str, dict[str, Any]]], run: str, key: str) -> list[float]:
    return [float(r[run]["node"][key]) for r in runs]


def print_results(
    configs: list[Config], measured: dict[str, list[dict[str, dict[str, Any]]]], raw: RawSingle
) -> list[tuple[str, str, str]]:
    """The medians table; returns the goal lines it can judge: (goal, measured, met?)."""
    one, two = measured.get("w1", []), measured.get("w2", [])
    base = measured.get("base", [])
    baseline = next((c for c in configs if c.key == "base"), None)
    goals: list[tuple[str, str, str]] = []
    table = []

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or not b else f"{a / b:.2f}x"

    def spread(values: list[float]) -> str:
        return "/".join(f"{v:.0f}" if v >= 100 else f"{v:.2f}" for v in values) or "-"

    for f in THROUGHPUT + LATENCY:
        a, b = median(figures(one, f)), median(figures(two, f))
        rows = [f.label, "-" if a is None else f.show(a), "-" if b is None else f.show(b),
                ratio(b, a)]  # fmt: skip
        if baseline is not None:
            c = median(figures(base, f))
            rows += ["-" if c is None else f.show(c), ratio(a, c)]
        against = raw.rate if f in THROUGHPUT else raw.p50 * 1000
        rows += [f.show(against), ratio(a, against), ratio(b, against),
                 f"{spread(figures(one, f))} | {spread(figures(two, f))}"]  # fmt: skip
        table.append(rows)
        if f in THROUGHPUT:
            met = "-" if a is None or b is None else ("yes" if b >= 1.3 * a else "NO")
            goals.append((f"2 processes >= 1.3x 1 process: {f.label}", ratio(b, a), met))
    for label, run, key, show in (
        ("node CPU per plain turn (128-session burst)", "burst128", "cpu_ms_per_turn", _ms),
        ("node CPU per one-tool turn (128-session burst)", "tool128", "cpu_ms_per_turn", _ms),
        ("machine busy during the plain 128-session burst", "burst128", "busy",
         lambda x: f"{x:.0%}"),
    ):  # fmt: skip
        a, b = median(node_figures(one, run, key)), median(node_figures(two, run, key))
        rows = [label, "-" if a is None else show(a), "-" if b is None else show(b), ratio(b, a)]
        if baseline is not None:
            c = median(node_figures(base, run, key))
            rows += ["-" if c is None else show(c), ratio(a, c)]
        rows += ["-", "-", "-", ""]
        table.append(rows)

    def stops(runs: list[dict[str, dict[str, Any]]]) -> str:
        done = [r["stop"] for r in runs if "stop" in r]
        return ", ".join(f"{x['status']} in {x['seconds']:.1f} s" for x in done) or "-"

    rows = ["SIGTERM -> exit status, per round", stops(one), stops(two), "-"]
    if baseline is not None:
        rows += [stops(base), "-"]
    table.append([*rows, "-", "-", "-", ""])
    header = ["figure", "1 process", "2 processes", "2 / 1"]
    if baseline is not None:
        header += [baseline.tree.name, "1 / baseline"]
    header += ["raw baseline", "1 / raw", "2 / raw", "rounds (1 | 2)"]
    print_rows(header, table, set(range(1, len(header) - 1)))
    if baseline is not None:
        plain = THROUGHPUT[0]
        a, c = median(figures(one, plain)), median(figures(base, plain))
        met = "-" if a is None or c is None else ("yes" if a >= 0.95 * c else "NO")
        goals.append((f"ownership costs <= 5 % (1 process / {baseline.tree.name}, plain 16)",
                      ratio(a, c), met))  # fmt: skip
        accept = LATENCY[0]
        a, c = median(figures(one, accept)), median(figures(base, accept))
        added = "-" if a is None or c is None else f"{a - c:+.2f} ms"
        met = "-" if a is None or c is None else ("yes" if a - c <= 0.1 else "NO")
        goals.append((f"ownership adds <= 0.1 ms to accept p50 (vs {baseline.tree.name})",
                      added, met))  # fmt: skip
        print(
            f"baseline rounds ({baseline.tree.name}): "
            + "; ".join(f"{f.key} {spread(figures(base, f))}" for f in THROUGHPUT + LATENCY)
        )
    return goals


def failover_goals(kills: list[Kill], ttl: float) -> list[tuple[str, str, str]]:
    times = [k.first_s for k in kills if k.first_s is not None]
    bound = ttl + 2
    if not kills:
        return []
    lost = sum(k.turns - len(k.ends) for k in kills)
    twice = sum(1 for k in kills for c in k.ends.values() if c > 1)
    p50, top = median(times), max(times, default=None)
    shown = ("-" if p50 is None or top is None else
             f"p50 {p50:.2f} s, max {top:.2f} s over {len(times)} kills")  # fmt: skip
    met = "yes" if top is not None and top <= bound and len(times) == len(kills) else "NO"
    return [
        (f"failover (kill -9 -> first resumed turn.end) <= TTL + 2 s = {bound:g} s", shown, met),
        (
            "every turn of a killed node ends exactly once",
            f"{lost} not ended, {twice} twice",
            "yes" if lost == 0 and twice == 0 else "NO",
        ),
    ]


# --- the run -------------------------------------------------------------------------------------


async def bench(
    configs: list[Config], found: Servers, plan: Plan, ttl: float, work: Path, keep: bool
) -> None:
    machine_facts(found.database_url, await nats_version(found.nats_url), found.data_dir)
    print(f"mode: {'quick' if plan.base is _http.QUICK else 'full'}; turns a phase:"
          f" {plan.base.turns}; rounds per configuration: {plan.rounds}; kills: {plan.kills} of"
          f" {plan.failover_turns} turns; lease TTL (failover) {ttl:g} s")  # fmt: skip
    print(f"driver: {sys.executable} {LOADGEN}")
    for c in configs:
        print(f"{c.key}: {c.label} ({c.tree.name}, {c.tree.path})")
    raw_schema = f"bench_{secrets.token_hex(4)}_raw"
    await asyncio.to_thread(raw_setup, found.database_url, raw_schema)
    section("baseline: raw psycopg single-row INSERT + COMMIT")
    raw1 = await asyncio.to_thread(raw_single, found.database_url, raw_schema,
                                   plan.base.raw_seconds, "before")  # fmt: skip
    measured = await throughput(configs, found, plan, work, keep) if plan.rounds else {}
    section("baseline again, after the rounds: the machine is shared")
    raw2 = await asyncio.to_thread(raw_single, found.database_url, raw_schema,
                                   plan.base.raw_seconds, "after")  # fmt: skip
    raw = RawSingle.mean(raw1, raw2)
    if not keep:
        await asyncio.to_thread(drop_schemas, found.database_url, [raw_schema])
    this = next(c for c in configs if c.key == "w1").tree.path
    kills = await failover(this, found, plan, ttl, work, keep) if plan.kills else []

    section("results")
    print(f"medians of the rounds; raw baseline: single-row INSERT+COMMIT on the same database,"
          f" mean of before and after ({rate(raw.rate)}, p50 {ms(raw.p50)}): beside turns/s"
          f" rows as a rate, beside latency rows as its p50.")  # fmt: skip
    goals = print_results(configs, measured, raw) if measured else []
    if kills:
        print()
        print_rows(
            ("kill", "victim", "turns", "first turn.end", "last turn.end", "ended", "resumed on"),
            [(str(i + 1), k.victim, str(k.turns),
              "-" if k.first_s is None else f"{k.first_s:.2f} s",
              "-" if k.last_s is None else f"{k.last_s:.2f} s",
              f"{len(k.ends)} ({sum(k.ends.values())} ends)",
              ", ".join(f"{n} {c}" for n, c in sorted(k.resumed_on.items())))
             for i, k in enumerate(kills)],
            {2, 3, 4},
        )  # fmt: skip
    goals += failover_goals(kills, ttl)
    if goals:
        print()
        print_rows(("goal (issue 14)", "measured", "met?"), goals, set())


@contextlib.contextmanager
def worktree(rev: str | None, work: Path) -> Iterator[ab.Tree | None]:
    """A detached git worktree of ``rev`` (bench/ab.py's baseline), removed afterwards."""
    if rev is None:
        yield None
        return
    short = ab.git("rev-parse", "--short", rev)
    path = work / "baseline"
    ab.git("worktree", "add", "--detach", str(path), short)
    try:
        yield ab.Tree(f"baseline {short}", path)
    finally:
        ab.git("worktree", "remove", "--force", str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true",
                        help="60 turns a phase, 1 round, 2 kills of 10 turns")  # fmt: skip
    parser.add_argument("--baseline", help="a commit to run as the 1-process baseline")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per configuration")
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--failover-turns", type=int, default=20, help="turns in flight a kill")
    parser.add_argument("--ttl", type=float, default=3.0, help="lease TTL of the failover nodes")
    parser.add_argument("--keep", action="store_true", help="keep the schemas, buckets and logs")
    args = parser.parse_args()
    if not LOADGEN.is_file():
        raise SystemExit(f"the load driver is missing: {LOADGEN} (see docs/benchmarks.md)")
    plan = (Plan(_http.QUICK, 1, 2, 10) if args.quick else
            Plan(_http.FULL, args.rounds, args.kills, args.failover_turns))  # fmt: skip
    head = ab.git("rev-parse", "--short", "HEAD")
    dirty = "+changes" if ab.git("status", "--porcelain", "--", "*.py") else ""
    this = ab.Tree(f"this tree {head}{dirty}", ROOT)
    started = perf()
    work = Path(tempfile.mkdtemp(prefix="dispach-bench-cluster-"))
    try:
        with worktree(args.baseline, work) as old, servers() as found:
            configs = [Config("w1", "1 process", this, 1), Config("w2", "2 processes", this, 2)]
            if old is not None:
                configs.insert(0, Config("base", old.name, old, None))
            run_loop(bench(configs, found, plan, args.ttl, work, args.keep))
    finally:
        if args.keep:
            print(f"\nthe nodes' logs are kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\ntotal time {perf() - started:.1f} s")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()

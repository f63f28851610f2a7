"""Benchmark of the outbox: drain rate to a local webhook receiver, and recovery after a restart.

    .venv/bin/python bench/outbox.py [--quick] [--keep] [--items N] [--concurrency C] [--profile]
                                     [--node-script SCRIPT]

Uses DATABASE_URL / NATS_URL when set, else starts the embedded Postgres and NATS in a fresh
temporary directory (removed afterwards). The node is a subprocess, ``.venv/bin/dispach serve``,
on a free loopback port, with its own DISPACH_HOME and schema ``bench_<hex>`` (the baseline's
scratch table is in ``bench_<hex>_raw``); one agent, ``bench``, has a webhook channel ``hooks``
(concurrency 64, or --concurrency) pointed at the test suite's WebhookReceiver
(tests/fakes/webhook_receiver.py), which runs in a process of its own so that it shares no GIL
with the node or the bench.

The bench writes the items itself, as a turn would: ``delivery.enqueued`` events (one ~200 char
chunk each, ten items per fake turn stream, one append per item) through an EventStore of its own
on the node's schema with the inline projections, so the ``outbox`` rows appear in the same
commits. The node is not woken by another process's commits: it finds them by its poll
(DISPACH_OUTBOX_POLL_MS, 1 s), then keeps draining without waiting while there is work.

  1. drain: the node is up and idle; N items are appended (10,000; --quick 2,000). Rate = N over
     the first item's commit to the last ``sent`` (both from the outbox rows: created_at, and
     updated_at of the sent row); latency = created_at -> updated_at per item.
  2. recovery: SIGTERM the node, append N items while it is down, and give 1 % of them a
     ``delivery.attempted`` by the stopped node (a send in doubt, left by a node that is gone:
     recovery flags it uncertain and resends it), then start a node: process start -> /v1/ready,
     and process start -> the last item sent.
  3. --profile: a third node under cProfile (event-loop thread only, enabled by SIGUSR1 just
     before the items are appended) drains N more items; prints where the loop's time went.

CPU is read from /proc: the node's main thread (the event loop) and its other threads apart, the
receiver, the embedded Postgres (postmaster and backends) and nats-server, the bench itself, and
the machine's busy share (the rest is other work on a shared machine). The table sets each rate
beside the raw psycopg single-row INSERT + COMMIT rate on the same database, measured before and
after (the machine is shared: ratios travel, absolutes do not). --node-script runs the node as
``python SCRIPT`` (a script ending in runtime.cli's ``dispach serve``), to measure a change
without editing the library.
"""

from __future__ import annotations

# First: it takes this directory off the front of the import path (see its docstring).
from _report import (
    Goal,
    Line,
    RawSingle,
    Servers,
    busy_share,
    cpu_seconds,
    drop_schemas,
    free_port,
    line,
    machine_facts,
    machine_ticks,
    ms,
    nats_version,
    perf,
    print_table,
    proc_status,
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
import json
import math
import multiprocessing
import os
import pstats
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import Counter, defaultdict, deque
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psycopg

DISPACH = Path(sys.executable).parent / "dispach"
SECRET = "bench-webhook-secret-0123456789"
AGENT = "bench"
PER_TURN = 10
UNCERTAIN_SHARE = 0.01
IN_FLIGHT = 2_000
"""Appends the bench keeps queued in its writer (its queue holds 10,000)."""
TEXT = ("The outbox drains replies to their channels; this is one chunk of one of them. " * 3)[:200]
PROFILED = """\
import cProfile, runpy, signal, sys
profile, out, script = cProfile.Profile(), sys.argv[1], sys.argv[2:]
def on(*_):
    profile.enable()
def off(*_):
    profile.disable()
    profile.dump_stats(out)
signal.signal(signal.SIGUSR1, on)
signal.signal(signal.SIGUSR2, off)
sys.argv = ["dispach", "serve"]
if script:
    runpy.run_path(script[0], run_name="__main__")
else:
    from runtime.cli import main
    main()
"""
"""The node under cProfile, switched on by SIGUSR1 and dumped by SIGUSR2 (the event-loop thread
only: it is the one that runs the signal handlers)."""


@dataclass(frozen=True)
class Plan:
    items: int
    raw_seconds: float
    keep: bool = False
    concurrency: int = 64
    profile: bool = False
    node_script: Path | None = None
    """Run the node as ``python <script>`` instead of ``dispach serve`` (an experiment)."""


FULL = Plan(10_000, 3.0)
QUICK = Plan(2_000, 0.5)


# --- the receiver, in a process of its own -------------------------------------------------------


def _serve_receiver(conn: Connection, secret: str) -> None:
    """The child: a WebhookReceiver, answering "tally" on the pipe until "stop"."""
    from tests.fakes.webhook_receiver import WebhookReceiver

    with WebhookReceiver(secret) as receiver:
        conn.send(receiver.url)
        while conn.recv() != "stop":
            got = receiver.received
            conn.send({
                "requests": len(got),
                "kept": len(receiver.kept),
                "duplicates": sum(r.duplicate for r in got),
                "uncertain": sum(r.headers.get("x-dispach-uncertain") == "1" for r in got),
                "not_200": sum(r.status != 200 for r in got),
                "errors": len(receiver.errors),
            })  # fmt: skip


class Receiver:
    def __init__(self, secret: str) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_serve_receiver, args=(child, secret), name="webhook-receiver", daemon=True
        )
        self._process.start()
        child.close()
        self.url: str = self._conn.recv()

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    def tally(self) -> dict[str, int]:
        self._conn.send("tally")
        found: dict[str, int] = self._conn.recv()
        return found

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send("stop")
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()


# --- the items -----------------------------------------------------------------------------------


def seed(store: Any, batch: str, items: int, in_doubt: int = 0, dead_node: str = "") -> None:
    """Append ``items`` outbox items in fake turns of session ``batch`` (one append each,
    interleaved across turn streams so the writer can group them), then a ``delivery.attempted``
    by ``dead_node`` for the first ``in_doubt`` of them: sends a node left without an answer when
    it died (recovery resends an attempt at once only when its node is surely gone)."""
    from actors.ids import turn_id
    from actors.outbox.plan import item_key
    from eventstore import NO_STREAM, Metadata, NewEvent, streams
    from eventstore.catalogue import Deliver, DeliveryAttempted, DeliveryEnqueued

    turns = [turn_id() for _ in range(math.ceil(items / PER_TURN))]
    queued: deque[Future[Any]] = deque()
    doubtful: list[tuple[str, Metadata]] = []
    for index in range(items):
        turn = turns[index % len(turns)]
        meta = Metadata(agent_id=AGENT, session_key=batch, turn_id=turn)
        deliver = Deliver(channel="hooks", to=f"r{index // len(turns)}")
        key = item_key(AGENT, batch, turn, deliver, 0)
        event = DeliveryEnqueued(channel_id="hooks", to=deliver.to, key=key, chunk_index=0,
                                 chunk_total=1, text=TEXT)  # fmt: skip
        queued.append(store.submit(streams.turn(turn), [NewEvent(event=event, metadata=meta)]))
        if len(doubtful) < in_doubt:
            doubtful.append((key, meta))
        while len(queued) >= IN_FLIGHT:
            queued.popleft().result(60)
    while queued:
        queued.popleft().result(60)
    for key, meta in doubtful:
        claim = DeliveryAttempted(channel_id="hooks", chunk_index=0, chunk_total=1, attempt=1,
                                  node=dead_node)  # fmt: skip
        queued.append(
            store.submit(streams.outbox(key), [NewEvent(event=claim, metadata=meta)], NO_STREAM)
        )
    while queued:
        queued.popleft().result(60)


@dataclass(frozen=True)
class Settled:
    """One batch's outbox rows once every item is settled (DB clock, epoch seconds)."""

    sent: int
    unsent: int
    uncertain: int
    first_enqueued: float
    last_enqueued: float
    first_sent: float
    last_sent: float
    latency_p50: float
    latency_p99: float


_SETTLED = """
SELECT count(*) FILTER (WHERE status = 'sent'), count(*) FILTER (WHERE status <> 'sent'),
       count(*) FILTER (WHERE uncertain),
       extract(epoch FROM min(created_at))::float8, extract(epoch FROM max(created_at))::float8,
       extract(epoch FROM min(updated_at) FILTER (WHERE status = 'sent'))::float8,
       extract(epoch FROM max(updated_at) FILTER (WHERE status = 'sent'))::float8,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM updated_at - created_at))
           FILTER (WHERE status = 'sent'),
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM updated_at - created_at))
           FILTER (WHERE status = 'sent')
  FROM outbox WHERE session_key = %s
"""
# The partial index outbox_due_idx holds exactly the unsettled rows: cheap to poll every 20 ms.
_UNSETTLED = "SELECT count(*) FROM outbox WHERE status IN ('pending', 'inflight')"


async def wait_settled(
    url: str, schema: str, limit: float, seeding: asyncio.Future[None] | None = None
) -> float:
    """Poll every 20 ms until the seeding (if any) is done and no item is unsettled; returns the
    perf() time it was seen."""
    async with await psycopg.AsyncConnection.connect(
        url, autocommit=True, options=f"-c search_path={schema}"
    ) as conn:
        started = perf()
        while perf() - started < limit:
            row = await (await conn.execute(_UNSETTLED)).fetchone()
            if seeding is None or seeding.done():
                if seeding is not None:
                    seeding.result()  # raise what the seeding raised
                if row is not None and row[0] == 0:
                    return perf()
            await asyncio.sleep(0.02)
    raise SystemExit(f"the outbox did not settle in {limit:.0f} s")


def settled(url: str, schema: str, batch: str) -> Settled:
    with psycopg.connect(url, autocommit=True, options=f"-c search_path={schema}") as conn:
        row = conn.execute(_SETTLED.encode(), (batch,)).fetchone()
    assert row is not None
    sent, unsent, uncertain, *times = row
    return Settled(sent, unsent, uncertain, *(math.nan if v is None else float(v) for v in times))


# --- the node ------------------------------------------------------------------------------------


@dataclass
class Node:
    env: dict[str, str]
    base: str
    log: Path
    script: Path | None = None
    process: asyncio.subprocess.Process | None = None
    started_wall: float = 0.0
    started: float = 0.0

    async def start(self, profile_to: Path | None = None) -> float:
        """Start a ``dispach serve``; returns seconds from the process start to ready."""
        argv = [str(DISPACH), "serve"]
        if self.script is not None:
            argv = [sys.executable, str(self.script)]
        if profile_to is not None:
            script = [] if self.script is None else [str(self.script)]
            argv = [sys.executable, "-c", PROFILED, str(profile_to), *script]
        self.started_wall, self.started = time.time(), perf()
        with self.log.open("ab") as sink:
            self.process = await asyncio.create_subprocess_exec(
                *argv, env=self.env, stdout=sink, stderr=asyncio.subprocess.STDOUT
            )
        await wait_ready(self.process, self.base, self.log)
        return perf() - self.started

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    async def stop(self) -> None:
        assert self.process is not None
        began = perf()
        status = await stop_server(self.process)
        print(f"dispach serve exited with {status} after {ms(perf() - began)} (SIGTERM)")
        if status != 0:
            print(tail(self.log))

    def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()


def log_summary(log: Path) -> str:
    """Lines in the node's log, and its most frequent events (a line per item costs CPU)."""
    events: Counter[str] = Counter()
    with log.open(errors="replace") as f:
        for row in f:
            try:
                events[str(json.loads(row).get("event", "?"))[:60]] += 1
            except ValueError:
                events["(not JSON)"] += 1
    top = ", ".join(f"{n} x {event!r}" for event, n in events.most_common(4))
    return f"node log: {sum(events.values())} lines; most frequent: {top}"


def thread_cpu(pid: int) -> tuple[float, float]:
    """(main thread, all other threads) CPU seconds: the main thread runs the event loop."""
    tick = os.sysconf("SC_CLK_TCK")
    main = other = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            used = (int(fields[11]) + int(fields[12])) / tick
            if int(task.name) == pid:
                main += used
            else:
                other += used
    return main, other


@dataclass(frozen=True)
class Usage:
    """What a window cost: node CPU (loop thread, other threads), the other processes' CPU
    (receiver, Postgres with its backends, nats-server, the bench), and the machine's busy share
    (1.0: both cores; what we do not account for is other work on the machine)."""

    loop: float
    threads: float
    others: dict[str, float]
    busy: float
    seconds: float

    @property
    def node(self) -> float:
        return self.loop + self.threads

    def show(self, items: int) -> str:
        def per(x: float) -> str:
            return f"{x * 1000 / max(1, items):.2f} s"

        others = ", ".join(f"{name} {per(cpu)}" for name, cpu in self.others.items())
        cores = (os.cpu_count() or 1) * self.seconds
        ours = (self.node + sum(self.others.values())) / cores if cores else math.nan
        return (
            f"CPU per 1,000 items: node {per(self.node)} (loop thread {per(self.loop)}, other"
            f" threads {per(self.threads)}), {others}; machine busy {self.busy:.0%}, these"
            f" processes {ours:.0%} of its cores"
        )


class Meter:
    def __init__(self, node: int, others: dict[str, int]) -> None:
        self._node, self._others = node, others
        self._at = (thread_cpu(node), self._cpu(), machine_ticks(), perf())

    def _cpu(self) -> dict[str, float]:
        found = {name: tree_cpu(pid) for name, pid in self._others.items()}
        found["bench"] = time.process_time()
        return found

    def read(self) -> Usage:
        (loop0, threads0), others0, ticks0, began = self._at
        loop1, threads1 = thread_cpu(self._node)
        others = {name: cpu - others0[name] for name, cpu in self._cpu().items()}
        return Usage(loop1 - loop0, threads1 - threads0, others,
                     busy_share(ticks0, machine_ticks()), perf() - began)  # fmt: skip


# --- the phases ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Drain:
    rows: Settled
    usage: Usage
    seen: float
    """Seconds from the start of the seeding to the poll that saw the outbox empty."""

    @property
    def rate(self) -> float:
        return self.rows.sent / (self.rows.last_sent - self.rows.first_enqueued)

    @property
    def steady(self) -> float:
        return self.rows.sent / (self.rows.last_sent - self.rows.first_sent)


@dataclass(frozen=True)
class Rig:
    """What a phase works with: the node, the bench's store on its schema, and the pids of the
    other processes whose CPU is counted."""

    node: Node
    store: Any
    url: str
    schema: str
    others: dict[str, int]


async def drain(rig: Rig, batch: str, items: int) -> Drain:
    meter = Meter(rig.node.pid, rig.others)
    began = perf()
    seeding = asyncio.ensure_future(asyncio.to_thread(seed, rig.store, batch, items))
    seen = await wait_settled(rig.url, rig.schema, 120 + items / 50, seeding)
    usage = meter.read()
    rows = await asyncio.to_thread(settled, rig.url, rig.schema, batch)
    result = Drain(rows, usage, seen - began)
    print(
        f"{rows.sent} sent, {rows.unsent} not sent; appended in"
        f" {rows.last_enqueued - rows.first_enqueued:.2f} s"
        f" ({rate(items / max(1e-9, rows.last_enqueued - rows.first_enqueued))}); first sent"
        f" {rows.first_sent - rows.first_enqueued:.2f} s after the first append (the node's poll);"
        f" last sent {rows.last_sent - rows.first_enqueued:.2f} s after it (the bench's 20 ms poll"
        f" saw it at {result.seen:.2f} s)\n"
        f"drain {rate(result.rate)} (first append -> last sent), {rate(result.steady)} (first sent"
        f" -> last sent); append -> sent p50 {ms(rows.latency_p50)}, p99 {ms(rows.latency_p99)}\n"
        f"{usage.show(items)}"
    )
    return result


@dataclass(frozen=True)
class Recovery:
    ready: float
    settled: float
    rows: Settled
    usage: Usage
    ready_cpu: float
    ready_kb: int

    @property
    def rate(self) -> float:
        return self.rows.sent / (self.rows.last_sent - self.rows.first_sent)


async def recovery(rig: Rig, batch: str, items: int) -> Recovery:
    node = rig.node
    dead = f"{socket.gethostname()}-{node.pid}"  # the node id it ran under (DISPACH_NODE_ID unset)
    await node.stop()
    in_doubt = max(1, round(items * UNCERTAIN_SHARE))
    took = perf()
    await asyncio.to_thread(seed, rig.store, batch, items, in_doubt, dead)
    print(f"appended {items} items ({in_doubt} with a delivery.attempted by the stopped node"
          f" {dead}) while the node was down in {perf() - took:.2f} s")  # fmt: skip
    ready = await node.start()
    meter = Meter(node.pid, rig.others)
    ready_cpu, ready_kb = cpu_seconds(node.pid), proc_status(node.pid)["VmRSS"]
    seen = await wait_settled(rig.url, rig.schema, 120 + items / 50) - node.started
    usage = meter.read()
    rows = await asyncio.to_thread(settled, rig.url, rig.schema, batch)
    result = Recovery(ready, rows.last_sent - node.started_wall, rows, usage, ready_cpu, ready_kb)
    print(
        f"process start -> ready {result.ready:.2f} s (CPU {ready_cpu:.2f} s); first sent"
        f" {rows.first_sent - node.started_wall:.2f} s, last sent {result.settled:.2f} s after"
        f" the process start (the bench's 20 ms poll saw it at {seen:.2f} s); {rows.sent} sent,"
        f" {rows.unsent} not sent, {rows.uncertain} flagged uncertain (expected {in_doubt})\n"
        f"drain after recovery {rate(result.rate)} (first sent -> last sent)\n"
        f"{usage.show(items)} (from ready)"
    )
    return result


async def profiled(rig: Rig, items: int, out: Path) -> None:
    await rig.node.stop()
    await rig.node.start(profile_to=out)
    os.kill(rig.node.pid, signal.SIGUSR1)
    result = await drain(rig, "bench-profile", items)
    os.kill(rig.node.pid, signal.SIGUSR2)
    await rig.node.stop()  # the handler has run (and dumped the profile) by the time it exits
    print_profile(pstats.Stats(str(out)), result.rows.sent)


def print_profile(stats: pstats.Stats, items: int) -> None:
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in raw.values())
    print(f"event-loop thread: {total:.2f} s of profiled function time, "
          f"{total / max(1, items) * 1000:.3f} ms per item (cProfile inflates it)")  # fmt: skip
    by_area: dict[str, float] = defaultdict(float)
    for (filename, _, _), (_, _, tt, _, _) in raw.items():
        by_area[area(filename)] += tt
    print("own time by area:")
    for name, tt in sorted(by_area.items(), key=lambda kv: -kv[1])[:14]:
        print(f"  {name:<30} {tt / total:6.1%}  {tt / max(1, items) * 1000:7.3f} ms/item")
    for key, title, count in ((2, "own time", 22), (3, "cumulative time", 22)):
        print(f"top {count} by {title}:")
        print(f"  {'calls/item':>10} {'own ms/item':>11} {'cum ms/item':>11}  function")
        ranked = sorted(raw.items(), key=lambda kv: -kv[1][key])[:count]
        for (filename, lineno, func), (_, nc, tt, ct, _) in ranked:
            where = f"{short(filename)}:{lineno}({func})" if filename != "~" else func
            print(f"  {nc / max(1, items):>10.2f} {tt / max(1, items) * 1000:>11.4f}"
                  f" {ct / max(1, items) * 1000:>11.4f}  {where}")  # fmt: skip


def short(filename: str) -> str:
    for marker in ("site-packages/", "/work/main/", "/lib/python3.11/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def area(filename: str) -> str:
    """A package (or our top-level directory) for a profiled function's file."""
    if filename == "~":
        return "builtins (C)"
    name = short(filename)
    if name == filename:
        return "other"
    parts = name.split("/")
    if parts[0] in ("actors", "gateways") and len(parts) > 2:
        return f"{parts[0]}/{parts[1]}"  # actors/outbox, gateways/channels: the outbox's own
    return parts[0].removesuffix(".py")


# --- the run -------------------------------------------------------------------------------------


def table(items: int, raw: RawSingle, first: Drain, second: Recovery, peak_kb: int) -> list[Line]:
    def seconds(x: float) -> str:
        return f"{x:.2f} s"

    def mb(x: float) -> str:
        return f"{x / 1024:.0f} MB"

    def cpu(x: float) -> str:
        return f"{x:.2f} s"

    full = items >= FULL.items
    per_k = 1000 / items
    return [
        line("drain items/s (first append -> last sent)", first.rate, raw.rate, rate,
             Goal(">= 1,000/s", lambda ours, _: ours >= 1000)),
        line("drain items/s (first sent -> last sent)", first.steady, raw.rate, rate),
        line("append -> sent p50", first.rows.latency_p50, raw.p50, ms),
        line("append -> sent p99", first.rows.latency_p99, raw.p99, ms),
        line("recovery: process start -> ready", second.ready, None, seconds),
        line(f"recovery: process start -> {items:,} sent", second.settled, None, seconds,
             Goal("<= 15 s", lambda ours, _: ours <= 15) if full else None),
        line("recovery: drain items/s (first sent -> last sent)", second.rate, raw.rate, rate),
        line("node CPU per 1,000 items (drain)",
             first.usage.node * per_k, None, cpu),
        line("node CPU per 1,000 items (after recovery)",
             second.usage.node * per_k, None, cpu),
        line("node RSS at ready (recovery node)", second.ready_kb, None, mb),
        line("node RSS peak (VmHWM, recovery node)", peak_kb, None, mb),
    ]  # fmt: skip


def others(receiver: Receiver, found: Servers) -> dict[str, int]:
    """The processes whose CPU is counted beside the node's: the receiver, and the embedded
    Postgres (its postmaster, with every backend) and nats-server when the bench started them."""
    pids = {"receiver": receiver.pid}
    if found.data_dir is not None:
        postmaster = found.data_dir / "postgres" / "postmaster.pid"
        with contextlib.suppress(OSError, ValueError, IndexError):
            pids["postgres"] = int(postmaster.read_text().split()[0])
    if found.nats_pid is not None:
        pids["nats"] = found.nats_pid
    return pids


async def bench(found: Servers, plan: Plan) -> None:
    from eventstore import INLINE, EventStore

    url, nats_url, data_dir = found.database_url, found.nats_url, found.data_dir
    schema = f"bench_{secrets.token_hex(4)}"
    raw_schema = f"{schema}_raw"
    root = Path(tempfile.mkdtemp(prefix="dispach-bench-outbox-"))
    machine_facts(url, await nats_version(nats_url), data_dir)
    print(f"schema: {schema}  items: {plan.items}  channel concurrency: {plan.concurrency}"
          f"  raw baseline: {plan.raw_seconds:g} s"
          + (f"  node: python {plan.node_script}" if plan.node_script else ""))  # fmt: skip

    await asyncio.to_thread(raw_setup, url, raw_schema)
    section("baseline: raw psycopg single-row INSERT + COMMIT")
    raw1 = await asyncio.to_thread(raw_single, url, raw_schema, plan.raw_seconds, "before")

    receiver = Receiver(SECRET)
    (root / "agents").mkdir()
    (root / "agents" / f"{AGENT}.yaml").write_text(
        f"id: {AGENT}\nmodel: {{provider: scripted}}\nchannels:\n"
        f'  - {{id: hooks, type: webhook, url: "{receiver.url}",'
        f" concurrency: {plan.concurrency}}}\n"
    )
    port = free_port()
    node = Node(
        {
            **{k: v for k, v in os.environ.items() if k != "DISPACH_NODE_ID"},
            "DATABASE_URL": url,
            "NATS_URL": nats_url,
            "DISPACH_DB_SCHEMA": schema,
            "DISPACH_CLUSTER": schema,
            "DISPACH_HOME": str(root / "home"),
            "DISPACH_AGENTS": str(root / "agents"),
            "DISPACH_HOST": "127.0.0.1",
            "DISPACH_PORT": str(port),
            "DISPACH_API_TOKEN": "",
            "DISPACH_WEBHOOK_SECRET": SECRET,
        },
        f"http://127.0.0.1:{port}",
        root / "serve.log",
        plan.node_script,
    )
    store = EventStore(url, schema=schema, inline=INLINE)
    rig = Rig(node, store, url, schema, others(receiver, found))
    try:
        section(f"node: dispach serve on {node.base}; receiver (pid {receiver.pid}) {receiver.url}")
        ready = await node.start()
        print(f"ready in {ready:.2f} s; RSS {proc_status(node.pid)['VmRSS'] / 1024:.0f} MB")
        await asyncio.to_thread(store.open)

        section(f"1. drain: {plan.items:,} items appended by the bench to an idle node")
        first = await drain(rig, "bench-drain", plan.items)

        section(f"2. recovery: stop, {plan.items:,} items appended meanwhile, start")
        second = await recovery(rig, "bench-recovery", plan.items)
        status = proc_status(node.pid)
        print(f"node now: RSS {status['VmRSS'] / 1024:.0f} MB, peak {status['VmHWM'] / 1024:.0f}"
              f" MB, {status['Threads']} threads")  # fmt: skip

        if plan.profile:
            section(f"3. profile: a node under cProfile drains {plan.items:,} more items")
            await profiled(rig, plan.items, root / "node.prof")
        tally = receiver.tally()
        expected = plan.items * (3 if plan.profile else 2)
        print(f"\nreceiver: {tally} (expected {expected} kept, 0 duplicates, 0 not 200)")
        if not plan.profile:
            section("stop")
            await node.stop()
        print(log_summary(node.log))
    finally:
        node.kill()
        receiver.stop()
        await asyncio.to_thread(store.close)

    section("baseline again, right after: the machine is shared")
    raw2 = await asyncio.to_thread(raw_single, url, raw_schema, plan.raw_seconds, "after")
    raw = RawSingle.mean(raw1, raw2)
    if plan.keep:
        print(f"kept: schemas {schema}, {raw_schema}; node log and profile in {root}")
    else:
        await asyncio.to_thread(drop_schemas, url, (schema, raw_schema))
        shutil.rmtree(root, ignore_errors=True)

    section("results")
    print(
        f"raw baseline: single-row INSERT+COMMIT on the same database, mean of before and after"
        f" ({rate(raw.rate)}, p50 {ms(raw.p50)}, p99 {ms(raw.p99)}): the rate beside items/s"
        f" (ratio = items sent per raw commit), p50/p99 beside latencies. {plan.items:,} items a"
        f" phase; each item is 2 appends by the node (attempted, sent) and one POST."
    )
    print_table(table(plan.items, raw, first, second, status["VmHWM"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK.items:,} items a phase")
    parser.add_argument("--items", type=int, help="items a phase (default 10,000)")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the bench schemas, the node's log and profile afterwards",
    )
    parser.add_argument("--concurrency", type=int, default=64, help="the channel's (64)")
    parser.add_argument("--profile", action="store_true", help="a third drain under cProfile")
    parser.add_argument(
        "--node-script",
        type=Path,
        help="run the node as `python SCRIPT` (a "
        "script ending in runtime.cli's `dispach serve`: to try a change)",
    )
    args = parser.parse_args()  # fmt: skip
    if not DISPACH.is_file():
        raise SystemExit(f"{DISPACH} is missing: install the project (pip install -e '.[dev]')")
    base = QUICK if args.quick else FULL
    plan = Plan(args.items or base.items, base.raw_seconds, args.keep, args.concurrency,
                args.profile, args.node_script)  # fmt: skip
    started = perf()
    with servers() as found:
        run_loop(bench(found, plan))
    print(f"\ntotal time {perf() - started:.1f} s")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()

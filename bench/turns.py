"""Benchmark of the turn engine: turns per second through the actors, in one run, on one database.

    .venv/bin/python bench/turns.py [--quick] [--keep] [--no-profile] [--adapters-only] [--tracing]

Uses DATABASE_URL / NATS_URL when set, else starts the embedded Postgres and NATS in a fresh
temporary directory (removed afterwards). Every run works in its own schemas ``bench_<hex>`` (the
node's) and ``bench_<hex>_raw`` (the baseline's scratch table).

An in-process ``runtime.node.Node`` (uvloop when installed) serves one agent, ``bench``, with the
offline scripted model (``model: {provider: scripted}``, instant) and the calculator tool. The
bench is a client on the node's own NATS connection and event loop, like the tests:
``gateways.ingress.request`` sends each message (the NATS door); one subscription to the store
(``where type == "turn.end"``) resolves the per-turn futures.

  - baseline: raw psycopg single-row INSERT + COMMIT from one connection, before and after;
  - phase A: single-step turns ("hello": the model answers without tools);
  - phase B: one tool step per turn ("calculate 6*7": calculator, then the answer; 2 model calls);
  - for 1, 16 and 128 concurrent sessions, each a closed loop (the next message only once the
    previous turn's ``turn.end`` is seen), warm-up then a fixed window;
  - per turn, from its own events: per-step runtime overhead, and where the time goes between its
    appends (``recorded_at`` is the inserting transaction's ``now()``);
  - per window: commits, events, NATS messages, threads started and CPU per turn;
  - a cProfile of the event-loop thread at 16 sessions, phase A;
  - the model adapters (bench/_adapters.py): loop CPU per model call against each provider's
    fake, our parsing apart from the SDK's share, against a bare HTTP read of the same body.
``--tracing`` measures what tracing (actors/tracing.py) costs instead: phases A and B at 16
sessions, in windows that alternate tracing off and on in the same node (a shared machine's load
drifts over minutes; each "on" window is compared with the "off" window just before it). Spans
go by the real BatchSpanProcessor and OTLP/HTTP exporter to a sink in this process that reads
each export and discards it (:class:`OtlpSink`). Goal: at most 5 % of the turn rate.
Goals: issue "turn engine": per-step overhead p50 <= 2 ms; >= 500 single-step turns/s.
Anchor: the original Dispach (Bun + SQLite, not durable per event) on this machine: ~1,300
single-step and ~750 one-tool turns/s, ~1 ms of server CPU per turn.
"""

from __future__ import annotations

# First: it takes this directory off the front of the import path (see its docstring).
from _report import (
    Ends,
    Goal,
    Line,
    RawSingle,
    drop_schemas,
    line,
    machine_facts,
    ms,
    node_settings,
    pct,
    perf,
    print_rows,
    print_table,
    rate,
    raw_setup,
    raw_single,
    run_loop,
    section,
    servers,
    watch_ends,
)

# isort: split
from _adapters import all_figures, print_figures

# isort: split
import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import gc
import itertools
import logging
import math
import os
import pstats
import re
import resource
import secrets
import shutil
import statistics
import threading
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import structlog
from nats.aio.client import Client

from actors import tracing
from actors.messages import Refused
from actors.model import ModelEvent, ModelRequest
from eventstore import Checkpoint, EventStore, RecordedEvent
from eventstore.catalogue import ModelResult, ToolResult, TurnEnd
from gateways.ingress import IngressMessage, request
from runtime.node import Node

AGENT = "bench"
MANIFEST = """\
id: bench
name: Benchmark agent
model:
  provider: scripted
tools: [calculator]
"""
CONCURRENCY = (1, 16, 128)
STEP_OVERHEAD_AT = (1, 16)
PACED_SESSIONS = 16
PACED_AT = (0.25, 0.5)
"""The open-loop runs: these shares of the phase's best closed-loop rate, over 16 sessions."""
PROFILE_AT = 16


@dataclass(frozen=True)
class Phase:
    key: str
    title: str
    text: str
    steps: int
    anchor: float
    """The original Dispach's turns/s on this machine, against an instant mock model."""


PHASES = (
    Phase("A", "single-step turns (no tools)", "hello", 1, 1300.0),
    Phase("B", "one tool step per turn (calculator, then the answer)", "calculate 6*7", 2, 750.0),
)


@dataclass(frozen=True)
class Plan:
    raw_seconds: float
    warmup: float
    window: float
    profile_seconds: float
    turns_per_session: int
    """A worker starts a new session after this many turns: a session's history grows by every
    turn and is read (and sent to the model) by the next, so one endless session per worker would
    make every turn slower than the one before."""


FULL = Plan(3.0, 1.0, 8.0, 4.0, 16)
QUICK = Plan(0.5, 0.3, 2.0, 1.0, 16)


class OtlpSink:
    """An OTLP/HTTP endpoint that takes every export and discards it, counting requests and
    bytes (a collector's cost is not the node's; the exporter's is)."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, HTTPServer

        sink = self
        self.requests = 0
        self.bytes = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                size = int(self.headers.get("Content-Length", "0"))
                self.rfile.read(size)
                sink.requests += 1
                sink.bytes += size
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        # One thread: the exporter sends one batch at a time, and the counts need no lock.
        self._server = HTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}/v1/traces"
        threading.Thread(target=self._server.serve_forever, name="otlp-sink", daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


TRACING_PAIRS = 5
TRACING_SESSIONS = 16


async def tracing_ab(node: Node, ends: Ends, monitor: Monitor, plan: Plan) -> None:
    """Tracing off, then on, window after window; per phase, the on/off ratios of turns/s and
    of the process's CPU per turn (the exporter's thread included), pair by pair and their
    medians."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    sink = OtlpSink()
    try:
        for phase in PHASES:
            section(f"tracing off vs on: phase {phase.key}, {TRACING_SESSIONS} sessions")
            rates: list[float] = []
            cpus: list[float] = []
            for pair in range(TRACING_PAIRS):
                off = await run_load(node, ends, monitor, phase, TRACING_SESSIONS, plan,
                                     f"{phase.key}off{pair}")  # fmt: skip
                handle = tracing.configure("bench", environ={},
                                           exporter=OTLPSpanExporter(sink.endpoint))  # fmt: skip
                assert handle is not None, "tracing was on already (OTEL_* set in the environment?)"
                try:
                    on = await run_load(node, ends, monitor, phase, TRACING_SESSIONS, plan,
                                        f"{phase.key}on{pair}")  # fmt: skip
                finally:
                    await asyncio.to_thread(handle.shutdown)
                rates.append(on.rate / off.rate)
                cpus.append(on.usage.process_cpu / off.usage.process_cpu)
                cpu_off, cpu_on = ms(off.usage.process_cpu), ms(on.usage.process_cpu)
                print(f"pair {pair + 1}: off {rate(off.rate)}, {cpu_off} CPU/turn; "
                      f"on {rate(on.rate)}, {cpu_on} CPU/turn")  # fmt: skip
            print(f"median on/off: turns/s {statistics.median(rates):.3f}x, process CPU per turn "
                  f"{statistics.median(cpus):.3f}x")  # fmt: skip
        print(f"\nexported: {sink.requests} OTLP requests, {sink.bytes / 1e6:.1f} MB")
    finally:
        sink.close()


# --- instrumentation (bench side only: no library code is changed) -------------------------------

_thread_starts: Counter[str] = Counter()
_THREAD_KIND = re.compile(r"[-_]?\d+(?: \(.*\))?$")


def thread_kind(name: str) -> str:
    """A thread's family: ``TurnActor-17`` -> ``TurnActor``, ``asyncio_3`` -> ``asyncio``."""
    return _THREAD_KIND.sub("", name) or name


def count_thread_starts() -> None:
    """Count every thread started from now on, by family (a wrapper around Thread.start)."""
    original = threading.Thread.start

    def start(self: threading.Thread) -> None:
        _thread_starts[thread_kind(self.name)] += 1
        original(self)

    threading.Thread.start = start  # type: ignore[method-assign]


class TimedModel:
    """Wraps the agent's model to measure the time spent inside the model's own code per call
    (from the first request for an event to ``Completed``, without the runner's work between
    the events). For the scripted model this is the "model latency" of a step."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.label = inner.label
        self.samples: list[float] = []

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        busy = 0.0
        t0 = perf()
        async for event in self.inner.stream(request):
            busy += perf() - t0
            yield event
            t0 = perf()
        busy += perf() - t0
        self.samples.append(busy)


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu(pid: int, tid: int | None = None, *, children: bool = False) -> float | None:
    """CPU seconds (user + system) of a process or of one of its threads, from /proc."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    if children:
        ticks += int(fields[13]) + int(fields[14])  # cutime, cstime (reaped children)
    return ticks / _CLK_TCK


def proc_ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Snapshot:
    at: float
    process_cpu: float
    threads: dict[int, tuple[str, float]]
    """native thread id -> (family, CPU seconds), live threads only."""
    pg_cpu: dict[int, float]
    nats_cpu: float | None
    next_xid: int
    wal_bytes: int
    xacts: int
    batches: int
    commands: int
    nats_in: int
    nats_out: int
    thread_starts: dict[str, int]


class Monitor:
    """Takes before/after snapshots of a window: this process, Postgres, NATS and the writer."""

    def __init__(self, url: str, node: Node, nats_pid: int | None, local_pg: bool) -> None:
        self.conn = psycopg.connect(url, autocommit=True)
        self.node = node
        self.nats_pid = nats_pid
        self.local_pg = local_pg
        row = self.conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid() LIMIT 1"
        ).fetchone()
        self.postmaster = proc_ppid(int(row[0])) if row and local_pg else None

    def close(self) -> None:
        self.conn.close()

    def snapshot(self) -> Snapshot:
        row = self.conn.execute(
            "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint,"
            " (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint,"
            " (SELECT xact_commit + xact_rollback FROM pg_stat_database"
            "   WHERE datname = current_database())"
        ).fetchone()
        assert row is not None
        pg_cpu: dict[int, float] = {}
        if self.local_pg:
            pids = [r[0] for r in self.conn.execute("SELECT pid FROM pg_stat_activity")]
            for pid in pids:
                cpu = proc_cpu(int(pid))
                if cpu is not None:
                    pg_cpu[int(pid)] = cpu
            if self.postmaster is not None:
                cpu = proc_cpu(self.postmaster, children=True)
                if cpu is not None:
                    pg_cpu[self.postmaster] = cpu
        threads: dict[int, tuple[str, float]] = {}
        me = os.getpid()
        for t in threading.enumerate():
            if t.native_id is None:
                continue
            cpu = proc_cpu(me, t.native_id)
            if cpu is not None:
                threads[t.native_id] = (thread_kind(t.name), cpu)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        store = self.node.store
        assert store is not None and self.node.nc is not None
        writer = store._writer
        stats = self.node.nc.stats
        return Snapshot(
            at=perf(),
            process_cpu=usage.ru_utime + usage.ru_stime,
            threads=threads,
            pg_cpu=pg_cpu,
            nats_cpu=None if self.nats_pid is None else proc_cpu(self.nats_pid),
            next_xid=int(row[0]),
            wal_bytes=int(row[1]),
            xacts=int(row[2] or 0),
            batches=writer.batches,
            commands=writer.commands,
            nats_in=int(stats["in_msgs"]),
            nats_out=int(stats["out_msgs"]),
            thread_starts=dict(_thread_starts),
        )


@dataclass(frozen=True)
class Usage:
    """What one window cost, per turn that ended in it."""

    turns: int
    seconds: float
    process_cpu: float
    threads: dict[str, float]
    pg_cpu: float | None
    nats_cpu: float | None
    write_xacts: float
    wal_bytes: float
    statements: float
    writer_batches: float
    writer_appends: float
    nats_in: float
    nats_out: float
    thread_starts: dict[str, float]


def usage(a: Snapshot, b: Snapshot, turns: int) -> Usage:
    n = max(1, turns)
    threads: dict[str, float] = defaultdict(float)
    live = 0.0
    for tid, (kind, cpu) in b.threads.items():
        before = a.threads.get(tid, (kind, 0.0))[1]
        threads[kind] += cpu - before
        live += cpu - before
    process = b.process_cpu - a.process_cpu
    threads["(exited threads)"] = max(0.0, process - live)
    pg = sum(cpu - a.pg_cpu[pid] for pid, cpu in b.pg_cpu.items() if pid in a.pg_cpu)
    starts = {k: (v - a.thread_starts.get(k, 0)) / n for k, v in b.thread_starts.items()}
    return Usage(
        turns=turns,
        seconds=b.at - a.at,
        process_cpu=process / n,
        threads={k: v / n for k, v in threads.items()},
        pg_cpu=pg / n if b.pg_cpu else None,
        nats_cpu=None
        if a.nats_cpu is None or b.nats_cpu is None
        else (b.nats_cpu - a.nats_cpu) / n,
        write_xacts=(b.next_xid - a.next_xid) / n,
        wal_bytes=(b.wal_bytes - a.wal_bytes) / n,
        statements=(b.xacts - a.xacts) / n,
        writer_batches=(b.batches - a.batches) / n,
        writer_appends=(b.commands - a.commands) / n,
        nats_in=(b.nats_in - a.nats_in) / n,
        nats_out=(b.nats_out - a.nats_out) / n,
        thread_starts={k: v for k, v in starts.items() if v > 0},
    )


def paced_key(phase: Phase, share: float) -> str:
    return f"{phase.key} paced {share:.0%}"


# --- the client: closed-loop sessions ------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    turn_id: str
    submitted: float
    accepted: float
    ended: float
    submitted_wall: float
    ended_wall: float

    @property
    def latency(self) -> float:
        return self.ended - self.submitted


async def one_turn(nc: Client, ends: Ends, phase: Phase, session: str) -> Sample:
    """Submit one message over NATS and wait until its turn.end is seen."""
    wall, t0 = time.time(), perf()
    result = await request(nc, AGENT, IngressMessage(text=phase.text, session_key=session))
    t1 = perf()
    match result:
        case Refused(code=code, message=message):
            raise RuntimeError(f"the node refused a bench message: {code}: {message}")
    seen = await ends.wait(result.turn_id, 60.0)
    return Sample(result.turn_id, t0, t1, seen.at, wall, seen.wall)


async def worker(
    node: Node, ends: Ends, phase: Phase, label: str, index: int, plan: Plan,
    stop: asyncio.Event, samples: list[Sample], warm: Callable[[], None],
) -> None:  # fmt: skip
    assert node.nc is not None
    n = 0
    while not stop.is_set():
        session = f"bench:{label}:{index}:{n // plan.turns_per_session}"
        samples.append(await one_turn(node.nc, ends, phase, session))
        if n == 0:
            warm()
        n += 1


@dataclass(frozen=True)
class Run:
    phase: Phase
    sessions: int
    samples: list[Sample]
    """Turns that ended inside the window."""
    window: float
    usage: Usage
    after: Checkpoint
    paced: str = ""
    """For an open-loop run (run_paced), not a closed loop: its pace."""

    @property
    def name(self) -> str:
        return f"{self.phase.key} x{self.sessions}" + (f", {self.paced}" if self.paced else "")

    @property
    def rate(self) -> float:
        return len(self.samples) / self.window


async def run_load(
    node: Node, ends: Ends, monitor: Monitor, phase: Phase, sessions: int, plan: Plan,
    label: str, profile: cProfile.Profile | None = None,
) -> Run:  # fmt: skip
    store = node.store
    assert store is not None
    after = await asyncio.to_thread(store.head)
    stop = asyncio.Event()
    samples: list[Sample] = []
    warmed = asyncio.Event()
    cold = [sessions]

    def warm() -> None:
        cold[0] -= 1
        if cold[0] == 0:
            warmed.set()

    tasks = [
        asyncio.create_task(worker(node, ends, phase, label, i, plan, stop, samples, warm))
        for i in range(sessions)
    ]
    try:
        # Warm-up: at least plan.warmup, and until every session has finished one turn.
        started = perf()
        while not warmed.is_set() or perf() - started < plan.warmup:
            await asyncio.sleep(0.05)
            for task in tasks:
                if task.done():
                    task.result()  # a worker failed: raise its error
        before = await asyncio.to_thread(monitor.snapshot)
        if profile is not None:
            profile.enable()
        await asyncio.sleep(plan.profile_seconds if profile is not None else plan.window)
        if profile is not None:
            profile.disable()
        end = await asyncio.to_thread(monitor.snapshot)
        start_at, end_at = before.at, end.at
        inside = [s for s in samples if start_at <= s.ended < end_at]
    finally:
        stop.set()
        done = await asyncio.gather(*tasks, return_exceptions=True)
    for outcome in done:
        if isinstance(outcome, BaseException):
            raise outcome
    return Run(phase, sessions, inside, end_at - start_at, usage(before, end, len(inside)), after)


async def run_paced(
    node: Node, ends: Ends, monitor: Monitor, phase: Phase, sessions: int, per_second: float,
    plan: Plan, label: str,
) -> Run:  # fmt: skip
    """Open loop: messages arrive at ``per_second`` whatever the node does, round robin over
    ``sessions`` session keys. A closed loop at saturation measures the queue the bench itself
    builds (each worker's next submit waits for its previous end: latency = sessions / rate);
    paced below saturation, the figures are the node's own latency under that load."""
    store = node.store
    assert store is not None and node.nc is not None
    nc = node.nc
    after = await asyncio.to_thread(store.head)
    samples: list[Sample] = []
    inflight: set[asyncio.Task[None]] = set()
    failures: list[BaseException] = []

    async def one(i: int) -> None:
        cycle = i // (sessions * plan.turns_per_session)
        samples.append(await one_turn(nc, ends, phase, f"bench:{label}:{i % sessions}:{cycle}"))

    def done(task: asyncio.Task[None]) -> None:
        inflight.discard(task)
        if not task.cancelled() and task.exception() is not None:
            failures.append(task.exception())  # type: ignore[arg-type]

    marks: list[Snapshot] = []

    async def measure() -> None:
        await asyncio.sleep(plan.warmup)
        marks.append(await asyncio.to_thread(monitor.snapshot))
        await asyncio.sleep(plan.window)
        marks.append(await asyncio.to_thread(monitor.snapshot))

    measuring = asyncio.create_task(measure())
    started, i = perf(), 0
    while not measuring.done() and not failures:
        delay = started + i / per_second - perf()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(i))
        inflight.add(task)
        task.add_done_callback(done)
        i += 1
    await measuring
    if inflight:
        await asyncio.wait(inflight)
    if failures:
        raise failures[0]
    before, end = marks
    inside = [s for s in samples if before.at <= s.ended < end.at]
    return Run(phase, sessions, inside, end.at - before.at, usage(before, end, len(inside)), after,
               paced=f"paced {per_second:.0f}/s")  # fmt: skip


# --- per-turn analysis, from the turns' own events -----------------------------------------------


@dataclass
class TurnFacts:
    events: int = 0
    appends: list[tuple[datetime, str]] = field(default_factory=list)
    """One entry per append (transaction): its recorded_at and the types it carried."""
    steps: int = 0
    model_ms: int = 0
    tool_ms: int = 0
    start_at: datetime | None = None
    attempt_at: datetime | None = None
    end_at: datetime | None = None


@dataclass(frozen=True)
class LogFacts:
    turns: dict[str, TurnFacts]
    starts_per_transaction: float
    """turn.start events per transaction that holds any, over the window's turns: 1.0 means no
    two acceptances ever shared a group commit."""
    appends_per_transaction: float
    """Appends (of any turn in the window) per writer transaction."""


async def turn_facts(store: EventStore, after: Checkpoint, wanted: set[str]) -> LogFacts:
    facts: dict[str, TurnFacts] = defaultdict(TurnFacts)
    checkpoint = after
    last_txid: dict[str, int] = {}
    starts: Counter[int] = Counter()
    appends: Counter[int] = Counter()
    while page := await store.aread_all(checkpoint, 5000):
        checkpoint = page[-1].checkpoint
        for event in page:
            turn = event.metadata.turn_id
            if turn is None or turn not in wanted:
                continue
            if event.type == "turn.start":
                starts[event.txid] += 1
            if last_txid.get(turn) != event.txid:
                appends[event.txid] += 1
            add_event(facts[turn], event, last_txid.get(turn))
            last_txid[turn] = event.txid
    return LogFacts(
        facts,
        sum(starts.values()) / max(1, len(starts)),
        sum(appends.values()) / max(1, len(appends)),
    )


def add_event(f: TurnFacts, event: RecordedEvent, last_txid: int | None) -> None:
    f.events += 1
    if event.txid != last_txid:
        f.appends.append((event.recorded_at, event.type))
    else:
        at, types = f.appends[-1]
        f.appends[-1] = (at, f"{types}+{event.type}")
    match event.type:
        case "turn.start":
            f.start_at = event.recorded_at
        case "turn.attempt":
            f.attempt_at = event.recorded_at
        case "turn.end":
            f.end_at = event.recorded_at
            assert isinstance(event.data, TurnEnd)
            f.steps = event.data.steps
        case "model.result":
            assert isinstance(event.data, ModelResult)
            f.model_ms += event.data.latency_ms
        case "tool.result":
            assert isinstance(event.data, ToolResult)
            f.tool_ms += event.data.latency_ms


@dataclass(frozen=True)
class Analysis:
    events: float
    appends: float
    steps: float
    overhead: list[float]
    """Per turn: (turn.start -> turn.end) / steps - the model's own time per step (TimedModel)."""
    overhead_minus_latency: list[float]
    """Per turn: (turn.start -> turn.end - sum of model.result latency_ms) / steps."""
    server: list[float]
    """Per turn: turn.start -> turn.end (recorded_at)."""
    tool_ms: float
    segments: list[tuple[str, list[float]]]
    log: LogFacts


def analyse(run: Run, log: LogFacts, model_time: float) -> Analysis:
    facts = log.turns
    overhead: list[float] = []
    minus_latency: list[float] = []
    server: list[float] = []
    segments: dict[str, list[float]] = defaultdict(list)
    order: list[str] = []
    complete = [
        (s, facts[s.turn_id])
        for s in run.samples
        if s.turn_id in facts and facts[s.turn_id].end_at is not None
    ]
    for sample, f in complete:
        assert f.end_at is not None and f.start_at is not None
        # From the acceptance, not from turn.attempt: the writer chains a stream's queued
        # appends into one commit, so turn.attempt often shares turn.end's transaction (and its
        # recorded_at); turn.start is always a commit of its own (202 waits for it). The span
        # therefore also holds the hand-off from acceptance to the runner: stricter, not looser.
        span = (f.end_at - f.start_at).total_seconds()
        steps = max(1, f.steps)
        overhead.append(span / steps - model_time)
        minus_latency.append((span - f.model_ms / 1000) / steps)
        server.append((f.end_at - f.start_at).total_seconds())
        points = [("client submits", sample.submitted_wall)]
        points += [(types, at.timestamp()) for at, types in f.appends]
        points.append(("client sees turn.end", sample.ended_wall))
        for i, ((a, ta), (b, tb)) in enumerate(itertools.pairwise(points)):
            key = f"{i + 1}. {a} -> {b}"
            if key not in segments:
                order.append(key)
            segments[key].append(tb - ta)
    n = max(1, len(complete))
    return Analysis(
        events=sum(f.events for _, f in complete) / n,
        appends=sum(len(f.appends) for _, f in complete) / n,
        steps=sum(f.steps for _, f in complete) / n,
        overhead=overhead,
        overhead_minus_latency=minus_latency,
        server=server,
        tool_ms=sum(f.tool_ms for _, f in complete) / n,
        segments=[(k, segments[k]) for k in order],
        log=log,
    )


# --- the profile ---------------------------------------------------------------------------------

_AREAS = (
    ("psycopg", ("/psycopg/", "/psycopg_pool/", "/psycopg_binary/")),
    ("nats-py", ("/nats/",)),
    ("eventstore", ("/eventstore/",)),
    ("actors", ("/actors/",)),
    ("gateways", ("/gateways/",)),
    ("runtime", ("/runtime/",)),
    ("msgspec", ("/msgspec/",)),
    ("structlog", ("/structlog/",)),
    ("pykka", ("/pykka/",)),
    ("bench client", ("/bench/",)),
    ("asyncio / uvloop", ("/asyncio/", "/uvloop/")),
    ("concurrent.futures / threading", ("/concurrent/", "threading.py", "queue.py")),
)


def area(filename: str) -> str:
    for name, needles in _AREAS:
        if any(n in filename for n in needles):
            return name
    if filename == "~":
        return "builtins (C functions)"
    return "other"


def short(filename: str) -> str:
    for marker in ("site-packages/", "/work/main/", "lib/python3.11/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def print_profile(profile: cProfile.Profile, turns: int, seconds: float) -> None:
    stats = pstats.Stats(profile)
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in raw.values())
    print(
        f"event-loop thread, {seconds:.1f} s, {turns} turns ended: {total:.2f} s of profiled "
        f"function time = {total / max(1, turns) * 1000:.2f} ms per turn (cProfile inflates it)"
    )
    by_area: dict[str, float] = defaultdict(float)
    for (filename, _, _), (_, _, tt, _, _) in raw.items():
        by_area[area(filename)] += tt
    print("\nown time by area (share of the loop thread's profiled time):")
    for name, tt in sorted(by_area.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<34} {tt / total * 100:5.1f} %  {tt / max(1, turns) * 1000:6.3f} ms/turn")

    def show(key: int, title: str, count: int) -> None:
        print(f"\ntop {count} by {title}:")
        print(f"  {'calls/turn':>10} {'own ms/turn':>11} {'cum ms/turn':>11}  function")
        ranked = sorted(raw.items(), key=lambda kv: -kv[1][key])
        shown = 0
        for (filename, lineno, func), (_, nc, tt, ct, _) in ranked:
            if filename.endswith("turns.py") and "/bench/" in filename and key == 3:
                continue  # the bench's own coroutines wrap everything
            where = f"{short(filename)}:{lineno}({func})" if filename != "~" else func
            print(
                f"  {nc / max(1, turns):>10.2f} {tt / max(1, turns) * 1000:>11.3f} "
                f"{ct / max(1, turns) * 1000:>11.3f}  {where}"
            )
            shown += 1
            if shown == count:
                break

    client = sum(
        ct
        for (filename, _, func), (_, _, _, ct, _) in raw.items()
        if "/bench/" in filename and func in ("watch_ends", "worker")
    )
    print(
        f"  the bench client (its subscriber and submits, cumulative): "
        f"{client / total * 100:.1f} % = {client / max(1, turns) * 1000:.3f} ms/turn"
    )
    show(2, "own time (tottime)", 25)
    show(3, "cumulative time (coroutines count each resumption)", 20)


# --- reports -------------------------------------------------------------------------------------


def print_run(run: Run) -> None:
    lat = [s.latency for s in run.samples]
    acc = [s.accepted - s.submitted for s in run.samples]
    print(
        f"{run.sessions:>3} sessions: {rate(run.rate)} turns ({len(run.samples)} in "
        f"{run.window:.1f} s); submit -> turn.end seen p50 {ms(pct(lat, 50))} "
        f"p99 {ms(pct(lat, 99))}; submit -> accepted p50 {ms(pct(acc, 50))}"
    )


FAMILIES = {
    "MainThread": "MainThread (the event loop)",
    "dispach-writer": "dispach-writer (group commit)",
    "uvloop": "uvloop (default executor: Portal.wait, to_thread)",
    "asyncio": "asyncio (default executor: Portal.wait, to_thread)",
    "dispach-worker": "dispach-worker (psycopg pool)",
    "dispach-scheduler": "dispach-scheduler (psycopg pool)",
    "(exited threads)": "exited during the window (TurnActor threads)",
}


def starts_of(kind: str) -> Callable[[Usage], float]:
    return lambda u: u.thread_starts.get(kind, 0.0)


def cpu_of(family: str) -> Callable[[Usage], float]:
    return lambda u: u.threads.get(family, 0.0) * 1000


def print_usage(runs: Sequence[Run]) -> None:
    header = ["per turn", *[r.name for r in runs]]

    def row(name: str, get: Callable[[Usage], float | None], fmt: str = "{:.2f}") -> list[str]:
        values = [get(r.usage) for r in runs]
        return [name, *["n/a" if v is None else fmt.format(v) for v in values]]

    rows = [
        row("python process CPU, ms (node + bench client)", lambda u: u.process_cpu * 1000),
        row("postgres CPU, ms (all its processes)",
            lambda u: None if u.pg_cpu is None else u.pg_cpu * 1000),
        row("nats-server CPU, ms",
            lambda u: None if u.nats_cpu is None else u.nats_cpu * 1000),
        row("appends committed by the writer", lambda u: u.writer_appends),
        row("writer transactions (group commits)", lambda u: u.writer_batches),
        row("write transactions in Postgres (xids)", lambda u: u.write_xacts),
        row("Postgres transactions incl. reads (approx.)", lambda u: u.statements, "{:.1f}"),
        row("WAL bytes", lambda u: u.wal_bytes, "{:,.0f}"),
        row("NATS messages out (node connection)", lambda u: u.nats_out, "{:.1f}"),
        row("NATS messages in (node connection)", lambda u: u.nats_in, "{:.1f}"),
    ]  # fmt: skip
    for kind in sorted({k for r in runs for k in r.usage.thread_starts}):
        rows.append(row(f"threads started: {kind}", starts_of(kind)))
    for family in sorted({k for r in runs for k in r.usage.threads}):
        if any(r.usage.threads.get(family, 0.0) >= 0.00005 for r in runs):
            rows.append(row(f"CPU ms, thread {FAMILIES.get(family, family)}", cpu_of(family)))
    print_rows(header, rows, set(range(1, len(header))))


def print_segments(title: str, analysis: Analysis) -> None:
    print(f"\n{title}")
    rows = []
    total = 0.0
    for key, values in analysis.segments:
        p50 = pct(values, 50)
        mean = statistics.fmean(values) if values else math.nan
        total += mean
        rows.append((key, ms(p50), ms(mean)))
    rows.append(("sum of the means", "", ms(total)))
    print_rows(("from -> to (each append is one transaction)", "p50", "mean"), rows, {1, 2})


def print_analyses(analyses: dict[tuple[str, int], Analysis]) -> None:
    print(
        "per-step runtime overhead = (turn.start recorded_at -> turn.end recorded_at) / "
        "steps - the model's own time per call.\n"
        "recorded_at is now() of the inserting transaction, so the span runs from the start of "
        "the transaction that accepts the turn to the start of the one that stores turn.end.\n"
        "Also shown: the same span minus model.result latency_ms (the runner's own clock around "
        "the model stream), and turn.start -> turn.end."
    )
    rows = []
    for (pk, sessions), a in analyses.items():
        rows.append((
            f"{pk} x{sessions}", f"{a.events:.1f}", f"{a.appends:.1f}", f"{a.steps:.1f}",
            ms(pct(a.overhead, 50)), ms(pct(a.overhead, 99)),
            ms(pct(a.overhead_minus_latency, 50)), ms(pct(a.overhead_minus_latency, 99)),
            ms(pct(a.server, 50)), f"{a.tool_ms:.1f}",
            f"{a.log.starts_per_transaction:.2f}", f"{a.log.appends_per_transaction:.2f}",
        ))  # fmt: skip
    print_rows(
        ("run", "events/turn", "appends/turn", "steps", "overhead/step p50", "p99",
         "minus latency_ms p50", "p99", "turn.start->end p50", "tool ms/turn",
         "turn.starts/txn", "appends/txn"),
        rows, set(range(1, 12)),
    )  # fmt: skip
    print(
        "turn.starts/txn: turn.start events per transaction holding one (1.00 = no two "
        "acceptances ever shared a group commit);\n"
        "appends/txn: appends of the window's turns per writer transaction (group commit at "
        "work); tool ms/turn: tool.result latency_ms."
    )
    for phase in PHASES:
        for sessions in STEP_OVERHEAD_AT:
            print_segments(
                f"phase {phase.key}, {sessions} session(s): where a turn's time goes "
                "(wall clock; Postgres and this process share the host's clock)",
                analyses[(phase.key, sessions)],
            )


def result_lines(
    runs: dict[tuple[str, int], Run], analyses: dict[tuple[str, int], Analysis],
    raw1: RawSingle, raw2: RawSingle,
) -> list[Line]:  # fmt: skip
    base = RawSingle.mean(raw1, raw2)
    base_rate, base_p50, base_p99 = base.rate, base.p50, base.p99
    lines: list[Line] = []
    for phase in PHASES:
        best = max(runs[(phase.key, s)].rate for s in CONCURRENCY)
        for sessions in CONCURRENCY:
            run = runs[(phase.key, sessions)]
            lines.append(line(f"{phase.key}: {phase.steps}-step turns/s, {sessions} sessions",
                              run.rate, base_rate, rate))  # fmt: skip
        goal = Goal(">= 500/s", lambda o, b: o >= 500) if phase.key == "A" else None
        lines.append(line(f"{phase.key}: best turns/s (Dispach ~{phase.anchor:,.0f}/s)",
                          best, base_rate, rate, goal))  # fmt: skip
        for sessions in CONCURRENCY:
            lat = [s.latency for s in runs[(phase.key, sessions)].samples]
            lines.append(line(f"{phase.key}: turn latency p50, {sessions} sessions",
                              pct(lat, 50), base_p50, ms))  # fmt: skip
            lines.append(line(f"{phase.key}: turn latency p99, {sessions} sessions",
                              pct(lat, 99), base_p99, ms))  # fmt: skip
        step_goal = Goal("<= 2.00 ms", lambda o, b: o <= 0.002)
        rows = [
            (1, analyses[(phase.key, 1)], ""),
            (16, analyses[(phase.key, 16)], " (closed loop, saturated: queueing)"),
        ]
        for share in PACED_AT:
            paced = runs[(paced_key(phase, share), PACED_SESSIONS)]
            rows.append((PACED_SESSIONS, analyses[(paced_key(phase, share), PACED_SESSIONS)],
                         f", paced at {rate(paced.rate)} (open loop, {share:.0%})"))  # fmt: skip
        for sessions, a, how in rows:
            goal = None if "saturated" in how else step_goal
            lines.append(line(f"{phase.key}: per-step overhead p50, {sessions} sessions{how}",
                              pct(a.overhead, 50), base_p50, ms, goal))  # fmt: skip
            lines.append(line(f"{phase.key}: per-step overhead p99, {sessions} sessions{how}",
                              pct(a.overhead, 99), base_p99, ms))  # fmt: skip
        for share in PACED_AT:
            paced = runs[(paced_key(phase, share), PACED_SESSIONS)]
            lat = [s.latency for s in paced.samples]
            for q in (50, 99):
                lines.append(line(f"{phase.key}: turn latency p{q}, {PACED_SESSIONS} sessions, "
                                  f"paced at {rate(paced.rate)} (open loop, {share:.0%})",
                                  pct(lat, q), base_p50 if q == 50 else base_p99, ms))  # fmt: skip
        for sessions in CONCURRENCY:
            u = runs[(phase.key, sessions)].usage
            server = u.process_cpu + (u.pg_cpu or 0.0) + (u.nats_cpu or 0.0)
            lines.append(line(
                f"{phase.key}: CPU per turn, all processes, {sessions} sessions "
                "(Dispach ~1 ms)", server, None, ms,
            ))  # fmt: skip
    return lines


# --- the run -------------------------------------------------------------------------------------


async def bench(
    url: str, nats_url: str, plan: Plan, data_dir: Path | None, nats_pid: int | None,
    keep: bool, with_profile: bool, traced: bool = False,
) -> None:  # fmt: skip
    schema = f"bench_{secrets.token_hex(4)}"
    raw_schema = f"{schema}_raw"
    settings, root = node_settings(url, nats_url, schema, AGENT, MANIFEST)
    count_thread_starts()
    node = Node(settings)
    monitor: Monitor | None = None
    watcher: asyncio.Task[None] | None = None
    lines: list[Line] = []
    try:
        await node.start()
        # As runtime/node.py serve does once the node is up: what start-up loaded (the SDKs,
        # the agents) is frozen out of the collector's sight. Without it each full collection
        # walks it all: 110-140 ms pauses of the loop, the turn latency p99 at 16 sessions.
        gc.collect()
        gc.freeze()
        assert node.store is not None and node.nc is not None
        store = node.store
        machine_facts(url, str(node.nc.connected_server_version), data_dir)
        print(f"schema: {schema}  mode: {'quick' if plan is QUICK else 'full'}")
        print(
            f"window {plan.window:g} s after {plan.warmup:g} s of warm-up per setting; a worker "
            f"starts a new session every {plan.turns_per_session} turns"
        )
        # The bench measures the model's own time; the agent is otherwise the manifest's.
        agent = node.agents[AGENT]
        timed = TimedModel(agent.model)
        node.agents[AGENT] = dataclasses.replace(agent, model=timed)
        monitor = await asyncio.to_thread(Monitor, url, node, nats_pid, data_dir is not None)
        if traced:
            ends = Ends()
            head = await asyncio.to_thread(store.head)
            watcher = asyncio.create_task(watch_ends(store, head, ends), name="bench-ends")
            await tracing_ab(node, ends, monitor, plan)
            return

        await asyncio.to_thread(raw_setup, url, raw_schema)
        section("baseline: raw psycopg single-row INSERT + COMMIT")
        raw1 = await asyncio.to_thread(raw_single, url, raw_schema, plan.raw_seconds, "before")

        ends = Ends()
        head = await asyncio.to_thread(store.head)
        watcher = asyncio.create_task(watch_ends(store, head, ends), name="bench-ends")

        runs: dict[tuple[str, int], Run] = {}
        model_time: dict[str, float] = {}
        for phase in PHASES:
            section(f"phase {phase.key}: {phase.title}, text {phase.text!r}")
            timed.samples.clear()
            for sessions in CONCURRENCY:
                run = await run_load(node, ends, monitor, phase, sessions, plan,
                                     f"{phase.key}{sessions}")  # fmt: skip
                runs[(phase.key, sessions)] = run
                print_run(run)
            best = max(runs[(phase.key, n)].rate for n in CONCURRENCY)
            for share in PACED_AT:
                paced = await run_paced(node, ends, monitor, phase, PACED_SESSIONS, best * share,
                                        plan, f"{phase.key}paced{share * 100:.0f}")  # fmt: skip
                runs[(paced_key(phase, share), PACED_SESSIONS)] = paced
                print(f"open loop, paced at {share:.0%} of the best closed-loop rate "
                      f"({rate(best * share)}):")  # fmt: skip
                print_run(paced)
            model_time[phase.key] = statistics.median(timed.samples) if timed.samples else 0.0
            print(
                f"model's own time per call (TimedModel, {len(timed.samples)} calls): p50 "
                f"{ms(model_time[phase.key])}, p99 {ms(pct(timed.samples, 99))}"
            )

        section("baseline again, right after: the machine is shared")
        raw2 = await asyncio.to_thread(raw_single, url, raw_schema, plan.raw_seconds, "after")
        base = RawSingle.mean(raw1, raw2)
        print(f"baseline: mean of before and after = {rate(base.rate)}, "
              f"p50 {ms(base.p50)}, p99 {ms(base.p99)}")  # fmt: skip

        section("per turn, from the turns' own events")
        analyses: dict[tuple[str, int], Analysis] = {}
        for key, run in runs.items():
            log = await turn_facts(store, run.after, {s.turn_id for s in run.samples})
            analyses[key] = analyse(run, log, model_time[run.phase.key])
        print_analyses(analyses)

        section("cost per turn (deltas over each window / turns that ended in it)")
        print_usage(list(runs.values()))

        if with_profile:
            section(f"profile: phase A, {PROFILE_AT} sessions, cProfile on the event-loop thread")
            profile = cProfile.Profile()
            prun = await run_load(node, ends, monitor, PHASES[0], PROFILE_AT, plan,
                                  "profile", profile)  # fmt: skip
            print_profile(profile, len(prun.samples), prun.window)
            print(f"\nturns/s while profiled: {rate(prun.rate)}")

        lines = result_lines(runs, analyses, raw1, raw2)
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        if monitor is not None:
            monitor.close()
        await node.stop()
        if not keep:
            await asyncio.to_thread(drop_schemas, url, (schema, raw_schema))
        shutil.rmtree(root, ignore_errors=True)

    section("results (ratio = ours / baseline)")
    print(
        "baseline: raw single-row INSERT+COMMIT on the same database, mean of before and after:"
        " rate for turns/s rows (ratio = turns per raw commit), p50/p99 for latency rows.\n"
        "turn latency = submit over NATS -> the client's store subscription yields turn.end."
    )
    print_table(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="short windows, a smoke run")
    parser.add_argument("--keep", action="store_true", help="keep the bench schemas afterwards")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile window")
    parser.add_argument("--adapters-only", action="store_true",
                        help="only the CPU per model call of each provider's adapter")  # fmt: skip
    parser.add_argument(
        "--tracing", action="store_true", help="only tracing's cost: windows off and on, paired"
    )
    args = parser.parse_args()
    if args.adapters_only:
        print_figures(run_loop(all_figures()))
        return
    plan = QUICK if args.quick else FULL
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    started = perf()

    with servers() as found:
        run_loop(bench(found.database_url, found.nats_url, plan, found.data_dir, found.nats_pid,
                       args.keep, not args.no_profile, args.tracing))  # fmt: skip
    if args.tracing:
        return
    # The model adapters against their fakes (no database): CPU per call, ours and the SDK's.
    print_figures(run_loop(all_figures(40 if args.quick else 200)))
    print(f"\ntotal time {perf() - started:.1f} s")


if __name__ == "__main__":
    main()

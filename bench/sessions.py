"""Benchmark of what many live sessions cost the garbage collector and the event loop.

    .venv/bin/python bench/sessions.py [--quick] [--keep] [--sessions S] [--turns T]

Uses DATABASE_URL / NATS_URL when set, else starts the embedded Postgres and NATS in a fresh
temporary directory (removed afterwards). The node works in its own schema ``bench_<hex>``.

A node keeps one SessionActor per live session, and each holds its session's history between
turns. Python's full (generation 2) collections walk every object the collector tracks, on the
one event loop thread: while one runs, no turn, HTTP request or NATS message moves.

An in-process ``runtime.node.Node`` (uvloop when installed) serves one agent, ``bench``, with the
offline scripted model (instant) and the calculator tool; sessions are never passivated during
the run (``DISPACH_SESSION_IDLE_SECONDS`` 3600, ``DISPACH_MAX_SESSIONS`` above what the bench
opens). Once the node is up the bench calls ``gc.collect(); gc.freeze()``, as a serving node
does (runtime/node.py ``serve``). Messages go in over NATS (``gateways.ingress.request``); one
subscription to the store (``turn.end``) tells each turn's waiter that it ended. In order:

  1. load before the sessions: W closed-loop workers (16) send plain turns for a few seconds
     (5; --quick 2), each to a session of its own that it replaces every 16 turns, while a task
     sleeps 1 ms in a loop and records each oversleep (the loop's lag) and ``gc.callbacks``
     times the full collections (and counts what each freed). Turn latency is submit ->
     turn.end seen;
  2. the idle node, measured (``measure`` below): objects the collector tracks
     (``len(gc.get_objects())``, frozen ones excluded) and the references they hold
     (``gc.get_referents``: a collection follows each, and reads the object it points to),
     ``gc.collect()`` timed 5 times (wall, and the loop thread's CPU: ``time.thread_time``), the
     tracked types, VmRSS;
  3. S sessions (1,024; --quick 128) driven to T turns each (24; --quick 8), 32 sessions in
     flight, each one turn after the other; even turns call the calculator ("calculate a*b":
     tool_use, tool_result, answer), odd ones are plain text. Any turn refused or not ending
     ``final`` stops the bench;
  4. with the S sessions live and idle: measured as in 2;
  5. the same load as 1 with the S sessions live (on new session keys: the S stay);
  6. baseline: every message row of the S sessions read from the ``messages`` table and decoded
     (msgspec) into one list per session, all held: the same messages as plain decoded JSON.
     Everything tracked until then (the node, the S sessions) is frozen first, so the
     collections walk the JSON and what little is new; measured as in 2 before and after.

"Ours" is 4 (the node with the S sessions live), "baseline" is 6 (the messages alone, as
decoded JSON); the floor under each (2, and 6 before the JSON) is printed beside them. The
figures use only the node's public behaviour and the gc module: they hold whatever the node keeps
for a live session (its history, its actor, and anything else that holds on after a turn),
however it keeps it.
"""

from __future__ import annotations

# First: it takes this directory off the front of the import path (see its docstring).
from _report import (
    Ends,
    FullCollections,
    Goal,
    Line,
    drop_schemas,
    line,
    machine_facts,
    ms,
    node_settings,
    pct,
    perf,
    print_rows,
    print_table,
    run_loop,
    section,
    servers,
    watch_ends,
)

# isort: split
from _procstat import proc_status

# isort: split
import argparse
import asyncio
import contextlib
import gc
import logging
import os
import secrets
import shlex
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import structlog

from actors.messages import Refused
from gateways.ingress import IngressMessage, request
from runtime.node import Node

AGENT = "bench"
MANIFEST = """\
id: bench
name: Sessions benchmark agent
model:
  provider: scripted
tools: [calculator]
"""
LIVE = "bench:live:"
"""Session keys of the S sessions start with this."""
LOAD_TURNS_PER_SESSION = 16
"""A load worker opens a new session after this many turns (as bench/turns.py does)."""
LOAD_SESSIONS_ROOM = 8192
"""DISPACH_MAX_SESSIONS is S plus this: the load's sessions never crowd the S out."""
LAG_SLEEP = 0.001

_JSON = msgspec.json.Decoder(Any)
LIVE_MESSAGES_SQL = b"""
SELECT session_key, content::text
  FROM messages
 WHERE agent_id = %(agent_id)s AND session_key LIKE %(prefix)s
 ORDER BY session_key, position
"""


@dataclass(frozen=True)
class Plan:
    sessions: int
    turns: int
    in_flight: int
    """Sessions driven at once in step 3 (each one turn after the other)."""
    workers: int
    """Closed-loop workers of the load."""
    seconds: float
    """Length of each load."""
    collects: int
    """Timed ``gc.collect()`` calls per measured state."""
    quick: bool = False


FULL = Plan(1024, 24, 32, 16, 5.0, 5)
QUICK = Plan(128, 8, 32, 16, 2.0, 5, quick=True)


# --- turns ---------------------------------------------------------------------------------------


@dataclass
class Driven:
    latencies: list[float] = field(default_factory=list)
    """Submit -> turn.end seen, per turn."""
    reasons: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)

    def refuse_unless_final(self, what: str) -> None:
        if set(self.reasons) - {"final"}:
            raise SystemExit(f"{what}: not every turn ended final: {dict(self.reasons)}; "
                             f"errors: {dict(self.errors) or 'none'}")  # fmt: skip


async def one_turn(node: Node, ends: Ends, text: str, session_key: str, driven: Driven) -> None:
    assert node.nc is not None
    t0 = perf()
    result = await request(node.nc, AGENT, IngressMessage(text=text, session_key=session_key))
    match result:
        case Refused(code=code, message=message):
            raise RuntimeError(f"the node refused a bench message: {code}: {message}")
    end = (await ends.wait(result.turn_id, 120.0)).end
    driven.latencies.append(perf() - t0)
    driven.reasons[end.reason] += 1
    if end.error is not None:
        driven.errors[end.error.code] += 1


def live_text(session: int, n: int) -> str:
    """Turn ``n`` of live session ``session``: a calculator call on even turns, else plain."""
    if n % 2 == 0:
        return f"calculate {session % 97 + 2}*{n + 3}"
    return f"hello, this is turn {n + 1} of session {session}"


async def drive(node: Node, ends: Ends, plan: Plan) -> Driven:
    """Step 3: every live session to ``plan.turns`` turns, ``plan.in_flight`` sessions at once."""
    driven = Driven()
    pending = iter(range(plan.sessions))
    done = 0
    started = perf()
    every = max(1, plan.sessions // 8)

    async def worker() -> None:
        nonlocal done
        for session in pending:  # one iterator shared by the workers: each session once
            for n in range(plan.turns):
                await one_turn(node, ends, live_text(session, n), f"{LIVE}{session}", driven)
            done += 1
            if done % every == 0:
                recent = driven.latencies[-every * plan.turns :]
                print(f"  {done:>5} sessions, {len(driven.latencies):,} turns in "
                      f"{perf() - started:.1f} s; the last {len(recent):,}: p50 "
                      f"{ms(pct(recent, 50))}, p99 {ms(pct(recent, 99))}", flush=True)  # fmt: skip

    await asyncio.gather(*(worker() for _ in range(plan.in_flight)))
    return driven


# --- measuring a state ---------------------------------------------------------------------------


def rss_kb() -> int:
    return proc_status(os.getpid())["VmRSS"]


@dataclass(frozen=True)
class State:
    """The process at rest, as a full collection sees it."""

    name: str
    tracked: int
    """Objects the collector tracks (frozen ones excluded): what a full collection walks."""
    references: int
    """The references those objects hold (``gc.get_referents``): what it follows, each twice."""
    wall: list[float]
    cpu: list[float]
    """The loop thread's CPU seconds of each timed ``gc.collect()``."""
    rss_kb: int
    types: Counter[str]


def measure(name: str, collects: int) -> State:
    """On the loop thread, with nothing running: the collections stall the loop, as in a node."""
    gc.collect()  # untimed: the garbage of what ran before is not what is measured
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(collects):
        t0, c0 = perf(), time.thread_time()
        gc.collect()
        wall.append(perf() - t0)
        cpu.append(time.thread_time() - c0)
    objects = gc.get_objects()
    types = Counter(type(o).__name__ for o in objects)
    tracked = len(objects)
    references = sum(len(gc.get_referents(o)) for o in objects)
    del objects
    return State(name, tracked, references, wall, cpu, rss_kb(), types)


def show_state(state: State) -> None:
    print(f"{state.name}: {state.tracked:,} tracked objects holding {state.references:,} "
          f"references; full collection wall p50 "
          f"{ms(pct(state.wall, 50))} max {ms(max(state.wall))}, CPU p50 "
          f"{ms(pct(state.cpu, 50))} max {ms(max(state.cpu))}; VmRSS "
          f"{state.rss_kb / 1024:,.1f} MB", flush=True)  # fmt: skip


def show_growth(before: State, after: State, top: int = 10) -> None:
    most = ", ".join(f"{k} {v:,}" for k, v in after.types.most_common(top))
    grown = ", ".join(f"{k} +{v:,}" for k, v in (after.types - before.types).most_common(top))
    print(f"  tracked types, most: {most}")
    print(f"  grown most since {before.name!r}: {grown or 'nothing'}")


# --- load with the loop's lag --------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    name: str
    driven: Driven
    seconds: float
    lags: list[float]
    """How much longer than 1 ms each 1 ms sleep of the sampler took."""
    pauses: list[tuple[float, float, int]]
    live_before: int
    live_after: int

    @property
    def rate(self) -> float:
        return len(self.driven.latencies) / self.seconds


async def load(node: Node, ends: Ends, plan: Plan, label: str, name: str) -> Load:
    """Closed-loop plain turns on new sessions for ``plan.seconds``, the loop's lag sampled."""
    assert node.engine is not None
    driven = Driven()
    stop = asyncio.Event()
    sampling = True
    lags: list[float] = []

    async def sampler() -> None:
        while sampling:
            t0 = perf()
            await asyncio.sleep(LAG_SLEEP)
            lags.append(perf() - t0 - LAG_SLEEP)

    async def worker(index: int) -> None:
        n = 0
        while not stop.is_set():
            key = f"bench:{label}:{index}:{n // LOAD_TURNS_PER_SESSION}"
            await one_turn(node, ends, f"hello from worker {index}, turn {n}", key, driven)
            n += 1

    live_before = len(node.engine.live_sessions())
    collections = FullCollections()
    gc.callbacks.append(collections)
    lagging = asyncio.create_task(sampler(), name="bench-lag")
    started = perf()
    try:
        workers = [asyncio.create_task(worker(i)) for i in range(plan.workers)]
        await asyncio.sleep(plan.seconds)
        stop.set()
        await asyncio.gather(*workers)  # each finishes the turn it is in
    finally:
        seconds = perf() - started
        sampling = False
        await lagging
        gc.callbacks.remove(collections)
    driven.refuse_unless_final(name)
    live_after = len(node.engine.live_sessions())
    return Load(name, driven, seconds, lags, collections.pauses, live_before, live_after)


def show_load(run: Load) -> None:
    lat, lags = run.driven.latencies, run.lags
    walls = [w for w, _, _ in run.pauses]
    cpus = [c for _, c, _ in run.pauses]
    freed = [f for _, _, f in run.pauses]
    print(f"{run.name}: {len(lat):,} turns in {run.seconds:.1f} s ({run.rate:,.0f}/s); latency "
          f"p50 {ms(pct(lat, 50))} p99 {ms(pct(lat, 99))} max {ms(max(lat))}")  # fmt: skip
    print(f"  loop lag over {len(lags):,} 1 ms sleeps: p50 {ms(pct(lags, 50))} p99 "
          f"{ms(pct(lags, 99))} max {ms(max(lags))}")  # fmt: skip
    if run.pauses:
        print(f"  full collections: {len(run.pauses)}, wall max {ms(max(walls))}, CPU max "
              f"{ms(max(cpus))}; unreachable objects each freed: "
              f"{', '.join(f'{f:,}' for f in freed)}")  # fmt: skip
    else:
        print("  full collections: none")
    print(f"  live sessions {run.live_before:,} -> {run.live_after:,}", flush=True)


def pause_max(run: Load) -> float:
    return max((w for w, _, _ in run.pauses), default=0.0)


# --- the baseline --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Baseline:
    floor: State
    """Everything until then frozen, before the JSON."""
    held: State
    """...with the JSON held."""
    rows: int
    sessions: int


async def baseline(node: Node, plan: Plan) -> Baseline:
    store = node.store
    assert store is not None
    # Out of the collector's sight from here on: the node and the S sessions (the bench ends
    # after this; what is frozen stays so until the process exits).
    gc.collect()
    gc.freeze()
    floor = measure("baseline floor (node and sessions frozen)", plan.collects)
    rows = await store.afetch(LIVE_MESSAGES_SQL, {"agent_id": AGENT, "prefix": f"{LIVE}%"})
    held: dict[str, list[Any]] = {}
    for session_key, content in rows:
        held.setdefault(session_key, []).append(_JSON.decode(content))
    count = len(rows)
    del rows
    with_json = measure("baseline (the same messages as decoded JSON)", plan.collects)
    sessions = len(held)
    del held
    return Baseline(floor, with_json, count, sessions)


# --- reports -------------------------------------------------------------------------------------


def result_lines(idle: State, live: State, base: Baseline, before: Load, during: Load,
                 plan: Plan) -> list[Line]:  # fmt: skip
    count: Callable[[float], str] = lambda v: f"{v:,.0f}"  # noqa: E731
    per: Callable[[float], str] = lambda v: f"{v:,.2f}"  # noqa: E731
    mb: Callable[[float], str] = lambda v: f"{v / 1024:,.1f} MB"  # noqa: E731
    no_worse = Goal("<= 1x (no worse than plain JSON)", lambda o, b: o <= b)
    calm = Goal("<= 1.5x (before the sessions)", lambda o, b: b > 0 and o / b <= 1.5)
    held, floor = base.held, base.floor
    added, json = live.tracked - idle.tracked, held.tracked - floor.tracked
    return [
        line(f"tracked objects, {plan.sessions:,} sessions live", live.tracked, held.tracked,
             count),
        line("  added over the floor", added, json, count, no_worse),
        line("  added per message row", added / base.rows, json / base.rows, per, no_worse),
        line("  added per session", added / plan.sessions, json / plan.sessions, per),
        line("full collection p50, wall", pct(live.wall, 50), pct(held.wall, 50), ms),
        line("  added over the floor", pct(live.wall, 50) - pct(idle.wall, 50),
             pct(held.wall, 50) - pct(floor.wall, 50), ms, no_worse),
        line("full collection max, wall", max(live.wall), max(held.wall), ms),
        line("full collection p50, loop-thread CPU", pct(live.cpu, 50), pct(held.cpu, 50), ms),
        line("  added over the floor", pct(live.cpu, 50) - pct(idle.cpu, 50),
             pct(held.cpu, 50) - pct(floor.cpu, 50), ms, no_worse),
        line("VmRSS added over the floor", live.rss_kb - idle.rss_kb,
             held.rss_kb - floor.rss_kb, mb),
        line("load: loop lag p99, vs before the sessions", pct(during.lags, 99),
             pct(before.lags, 99), ms, calm),
        line("load: loop lag max", max(during.lags), max(before.lags), ms, calm),
        line("load: turn latency p99", pct(during.driven.latencies, 99),
             pct(before.driven.latencies, 99), ms, calm),
        line("load: full collections in the window", len(during.pauses), len(before.pauses),
             count),
        line("load: their pause max, wall", pause_max(during), pause_max(before), ms),
    ]  # fmt: skip


def print_states(states: list[State]) -> None:
    def per_object(s: State) -> str:
        cpu = pct(s.cpu, 50) * 1e9
        return f"{cpu / s.tracked:,.0f} / {cpu / s.references:,.0f}" if s.references else "-"

    rows = [(s.name, f"{s.tracked:,}", f"{s.references:,}",
             f"{pct(s.wall, 50) * 1000:.2f} / {max(s.wall) * 1000:.2f}",
             f"{pct(s.cpu, 50) * 1000:.2f} / {max(s.cpu) * 1000:.2f}", per_object(s),
             f"{s.rss_kb / 1024:,.1f}") for s in states]  # fmt: skip
    header = ("state", "tracked objects", "their references",
              "full collection wall p50 / max, ms", "CPU p50 / max, ms",
              "CPU p50 per object / reference, ns", "VmRSS, MB")  # fmt: skip
    print_rows(header, rows, set(range(1, len(header))))


# --- the run -------------------------------------------------------------------------------------


async def bench(url: str, nats_url: str, plan: Plan, data_dir: Path | None, keep: bool) -> None:
    schema = f"bench_{secrets.token_hex(4)}"
    settings, root = node_settings(
        url, nats_url, schema, AGENT, MANIFEST, DISPACH_SESSION_IDLE_SECONDS="3600",
        DISPACH_MAX_SESSIONS=str(plan.sessions + LOAD_SESSIONS_ROOM),
    )  # fmt: skip
    node = Node(settings)
    watcher: asyncio.Task[None] | None = None
    try:
        await node.start()
        # As runtime/node.py serve does once the node is up.
        gc.collect()
        gc.freeze()
        assert node.store is not None and node.nc is not None and node.engine is not None
        store, engine = node.store, node.engine
        started_rss = rss_kb()
        machine_facts(url, str(node.nc.connected_server_version), data_dir)
        print(
            f"schema: {schema}  mode: {'quick' if plan.quick else 'full'}; {plan.sessions:,} "
            f"sessions x {plan.turns} turns ({plan.in_flight} in flight); load: "
            f"{plan.workers} workers x {plan.seconds:g} s; {plan.collects} timed collections "
            f"per state; gc thresholds {gc.get_threshold()}, frozen at start "
            f"{gc.get_freeze_count():,}; VmRSS after start {started_rss / 1024:,.1f} MB"
        )
        ends = Ends()
        head = await asyncio.to_thread(store.head)
        watcher = asyncio.create_task(watch_ends(store, head, ends), name="bench-ends")

        section("1. load before the sessions")
        before = await load(node, ends, plan, "before", "load before the sessions")
        show_load(before)

        section("2. the idle node")
        await asyncio.sleep(0.5)  # the last turns' actors settle
        idle = measure("idle node", plan.collects)
        show_state(idle)

        section(f"3. {plan.sessions:,} sessions driven to {plan.turns} turns each")
        started = perf()
        driven = await drive(node, ends, plan)
        took = perf() - started
        driven.refuse_unless_final("the live sessions")
        lat, ended = driven.latencies, dict(driven.reasons)
        print(f"{len(lat):,} turns in {took:.1f} s ({len(lat) / took:,.0f}/s); latency p50 "
              f"{ms(pct(lat, 50))} p99 {ms(pct(lat, 99))}; ends {ended}")  # fmt: skip

        section(f"4. {plan.sessions:,} sessions live and idle")
        await asyncio.sleep(0.5)
        live_keys = engine.live_sessions()
        ours = sum(1 for _, key in live_keys if key.startswith(LIVE))
        live = measure(f"{plan.sessions:,} sessions live", plan.collects)
        show_state(live)
        show_growth(idle, live)
        print(f"  live SessionActors (the engine's registry): {len(live_keys):,}, of them the "
              f"bench's {ours:,} (of {plan.sessions:,}); VmRSS since start "
              f"{(live.rss_kb - started_rss) / 1024:+,.1f} MB")  # fmt: skip
        if ours != plan.sessions:
            raise SystemExit(f"only {ours} of the {plan.sessions} sessions are live")

        section(f"5. load with the {plan.sessions:,} sessions live")
        during = await load(node, ends, plan, "during", f"load, {plan.sessions:,} sessions live")
        show_load(during)

        section("6. baseline: the same messages as decoded JSON")
        base = await baseline(node, plan)
        show_state(base.floor)
        show_state(base.held)
        show_growth(base.floor, base.held)
        print(f"  {base.rows:,} message rows of {base.sessions:,} sessions")
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        await node.stop()
        if not keep:
            await asyncio.to_thread(drop_schemas, url, (schema,))
        shutil.rmtree(root, ignore_errors=True)

    section("states (full collections timed on the loop thread, nothing else running)")
    print_states([idle, live, base.floor, base.held])
    print(f"message rows (history entries) of the {plan.sessions:,} sessions: {base.rows:,} "
          f"({base.rows / plan.sessions:.1f} per session); tracked objects per row: ours "
          f"{(live.tracked - idle.tracked) / base.rows:.2f}, as decoded JSON "
          f"{(base.held.tracked - base.floor.tracked) / base.rows:.2f}")  # fmt: skip
    section("results (ours: the node with the sessions live; baseline: the same messages as "
            "decoded JSON, or the load before the sessions; the floors: the idle node, and "
            "everything frozen)")  # fmt: skip
    print_table(result_lines(idle, live, base, before, during, plan))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="128 sessions x 8 turns, 2 s loads")
    parser.add_argument("--keep", action="store_true", help="keep the bench schema afterwards")
    parser.add_argument("--sessions", type=int, help="live sessions (default 1024)")
    parser.add_argument("--turns", type=int, help="turns per live session (default 24)")
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    plan = Plan(args.sessions or plan.sessions, args.turns or plan.turns, plan.in_flight,
                plan.workers, plan.seconds, plan.collects, plan.quick)  # fmt: skip
    print("$ " + shlex.join(sys.orig_argv), flush=True)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    started = perf()
    with servers() as found:
        run_loop(bench(found.database_url, found.nats_url, plan, found.data_dir, args.keep))
    print(f"\ntotal time {perf() - started:.1f} s")


if __name__ == "__main__":
    main()

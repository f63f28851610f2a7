"""Benchmark of context assembly for long sessions: time and memory against the number of turns.

    .venv/bin/python bench/context.py [--quick] [--keep] [--turns 100,1000,2000]

Uses DATABASE_URL / NATS_URL when set, else starts the embedded Postgres and NATS in a fresh
temporary directory (removed afterwards). The node works in its own schema ``bench_<hex>``.

An in-process ``runtime.node.Node`` (uvloop when installed) serves one agent, ``bench``: the
offline scripted model (instant) answers ``read <path>`` with a call of ``read_report``, a custom
tool of this script that returns ~5 KB, then with a one-line summary. ``model.context_window`` is
16,000 tokens, so the compaction ladder (excerpt, dedupe, stub, digest with the mechanical
digester, reset) runs for real as the session grows. One session gets its turns one after the
other (submit over NATS, wait for ``turn.end``) up to each checkpoint N (100, 1,000 and 2,000;
--quick 20 and 100).

What a session reads swings with the compaction cycle (few turns right after a digest, many just
before the next), so each figure is sampled after every turn of the last ``window`` turns before
a checkpoint (100; --quick 20), with the session idle:

  - rehydration: ``actors.context.load.load`` (the snapshot row, the rows after the digest, the
    last turn's end, the notes); beside it, at the checkpoint, a read of every message row of the
    session (what a full replay would read: O(history));
  - memory: tracemalloc, the bytes the loaded ``History`` keeps and the peak while loading;
  - assembly: ``actors.context.compact.prepare`` on a copy of that History with a fresh input, as
    a turn's first model call does it in a session just rehydrated (a fresh copy each time: no
    memo, and the ladder runs when the previous turn pushed the pressure over a threshold); on a
    copy of the history the session's actor holds, as a warm session's next turn does it (the
    memo of the last turn's rendering: only the entries added since are rendered); again on one
    copy (the memo hit of a turn's later steps); ``assemble`` alone. Wall time and the loop
    thread's CPU time
    (``time.thread_time``): on a shared machine the wall time also holds the time the OS gave
    other processes, the CPU time only ours;
  - at the checkpoint: one model round trip of the assembled request to the test suite's
    FakeAnthropic (tests/fakes/anthropic_server.py, a real HTTP server, in a process of its own
    so that it shares no GIL with the bench) through ``gateways.model.AnthropicModel`` (the
    official SDK), p50, with the loop thread's CPU for it.
Once the node is up the bench calls ``gc.collect(); gc.freeze()``, as a serving node does
(runtime/node.py ``serve``); the full collections of the garbage collector (generation 2) after
that are timed with ``gc.callbacks``.
Goal (issue 6): assembly p99 <= 5 ms and O(window), not O(history), in time and memory. The
ratio column sets each figure at N beside the same figure at the first checkpoint (1.00x: flat).
"""

from __future__ import annotations

# First: it takes this directory off the front of the import path (see its docstring).
from _report import (
    Ends,
    FullCollections,
    drop_schemas,
    machine_facts,
    ms,
    node_settings,
    pct,
    perf,
    print_table,
    run_loop,
    section,
    servers,
    watch_ends,
)

# isort: split
from _child import Child
from _context_points import Clock, Point, Sampled, print_points, result_lines
from _procstat import busy_share, machine_ticks

# isort: split
import argparse
import asyncio
import contextlib
import gc
import itertools
import logging
import os
import secrets
import shutil
import tracemalloc
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
import structlog

from actors.context.assemble import assemble
from actors.context.compact import prepare
from actors.context.history import History, entry
from actors.context.load import load
from actors.messages import Refused
from actors.model import Completed, ModelRequest
from eventstore import EventStore
from gateways.ingress import IngressMessage, request
from gateways.model import AnthropicModel
from runtime.node import Node

AGENT = "bench"
SESSION = "bench:long"
WINDOW = 16_000
PATHS = 6
"""The tool reads one of this many paths in turn: the same call comes back within the window, so
the dedupe stage has something to do."""
MANIFEST = f"""\
id: bench
name: Context benchmark agent
instructions:
  - You read reports for the person and tell them what is in them.
reminders:
  - Quote numbers exactly as the report gives them.
model:
  provider: scripted
  context_window: {WINDOW}
  script:
    - match: '^read (\\S+)$'
      tool: read_report
      input: {{path: "{{1}}"}}
tools:
  - name: read_report
    module: "__main__:read_report"
    description: Read a report by its path.
    input_schema:
      type: object
      properties: {{path: {{type: string}}}}
      required: [path]
"""
_calls = itertools.count(1)


def read_report(args: dict[str, Any], ctx: object) -> str:
    """The custom tool: a ~5 KB report, different at every call (``__main__:read_report``)."""
    call = next(_calls)
    rows = [f"{args['path']} call {call}: the reports of this benchmark are long on purpose"]
    rows += [f"line {i:03d}: value {(call * 7919 + i * 104729) % 100_000:>6} units, status ok, "
             f"checked against the previous reading" for i in range(64)]  # fmt: skip
    return "\n".join(rows)


def request_text(i: int) -> str:
    return f"read src/module_{i % PATHS}.py"


@dataclass(frozen=True)
class Plan:
    checkpoints: tuple[int, ...]
    window: int
    """Turns before each checkpoint after which the session is sampled."""
    repeats: int
    """prepare / assemble calls per sampled turn, for each variant."""
    loads: int
    """load() calls per sampled turn."""
    round_trips: int
    quick: bool = False


FULL = Plan((100, 1000, 2000), 100, 20, 2, 30)
QUICK = Plan((20, 100), 20, 20, 2, 10, quick=True)


# --- the fake Anthropic server, in a process of its own ------------------------------------------


def _serve_fake(conn: Connection) -> None:
    """The child: a FakeAnthropic answering "ok" to everything until "stop"."""
    from tests.fakes.anthropic_server import FakeAnthropic

    with FakeAnthropic() as fake:
        conn.send(fake.url)
        while conn.recv() != "stop":
            fake.reset()  # it keeps every request it answered
            conn.send(len(fake.errors))


class Fake(Child):
    def __init__(self) -> None:
        super().__init__(_serve_fake, name="fake-anthropic")

    def reset(self) -> int:
        """Forget the requests answered so far; the count of the fake's own internal errors."""
        errors: int = self.ask("reset")
        return errors


# --- driving the session -------------------------------------------------------------------------


@dataclass
class Driven:
    latencies: list[float] = field(default_factory=list)
    """Submit -> turn.end seen, per turn, in order."""
    reasons: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    first_error: int | None = None
    """The number of the first turn that did not end ``final``."""


async def turn(node: Node, ends: Ends, i: int, driven: Driven) -> None:
    """Turn ``i`` of the session (0-based), once the one before has ended."""
    assert node.nc is not None
    t0 = perf()
    result = await request(node.nc, AGENT, IngressMessage(text=request_text(i),
                                                          session_key=SESSION))  # fmt: skip
    match result:
        case Refused(code=code, message=message):
            raise RuntimeError(f"the node refused a bench message: {code}: {message}")
    end = (await ends.wait(result.turn_id, 60.0)).end
    driven.latencies.append(perf() - t0)
    driven.reasons[end.reason] += 1
    if end.error is not None:
        driven.errors[end.error.code] += 1
    if end.reason != "final" and driven.first_error is None:
        driven.first_error = i + 1
        print(f"  turn {i + 1} ended {end.reason}: {end.error}", flush=True)
    if (i + 1) % 250 == 0:
        recent = driven.latencies[-250:]
        print(f"  {i + 1:>5} turns; the last 250: p50 {ms(pct(recent, 50))}, "
              f"p99 {ms(pct(recent, 99))}; ends {dict(driven.reasons)}", flush=True)  # fmt: skip


COLLECTIONS = FullCollections()


# --- sampling after each turn of a window --------------------------------------------------------

_JSON = msgspec.json.Decoder(Any)
_ENCODE = msgspec.json.Encoder().encode
STAGES_SQL = b"""
SELECT data->>'stage', count(*),
       count(*) FILTER (WHERE coalesce((data->>'changed')::boolean, true))
  FROM events
 WHERE type = 'compaction.stage' AND metadata->>'sessionKey' = %(session_key)s
 GROUP BY 1 ORDER BY 1
"""
ALL_MESSAGES_SQL = b"""
SELECT turn_id, position, role, content::text
  FROM messages
 WHERE agent_id = %(agent_id)s AND session_key = %(session_key)s
 ORDER BY position
"""


async def traced_load(store: EventStore) -> tuple[History, int, int]:
    """A load under tracemalloc: the History, the bytes it keeps, the peak while loading (the
    node is idle between turns, so little else allocates meanwhile; no gc.collect() here: its
    full collections would stand out among those the bench counts)."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        history = await load(store, AGENT, SESSION)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return history, current - base, peak - base


async def sample(node: Node, plan: Plan, i: int, into: Sampled) -> History:
    """Measure the session as the turn after turn ``i`` would read it."""
    store, agent = node.store, node.agents[AGENT]
    assert store is not None
    policy, pinned, digester = agent.context, agent.pinned, agent.digester
    text = request_text(i + 1)
    for _ in range(plan.loads):
        await into.load.time(load, store, AGENT, SESSION)
    history, kept, peak = await traced_load(store)
    into.kept.append(kept)
    into.peak.append(peak)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        rendered = history.copy()
        assemble(pinned, rendered, text, [], policy.excerpt_keep)
        into.memo.append(tracemalloc.get_traced_memory()[0] - base)
    finally:
        tracemalloc.stop()
    del rendered
    into.entries.append(len(history.entries))
    into.view_turns.append(len({e.start for e in history.entries}))
    marks = history.view.marks
    into.marked_bytes.append(sum(len(_ENCODE(e.content)) for e in history.entries
                                 if e.obs_id is not None and e.obs_id in marks))  # fmt: skip
    into.tokens.append(assemble(pinned, history.copy(), text, [], policy.excerpt_keep).total)
    for n in range(plan.repeats):
        copy = history.copy()
        prepared = await into.prepare.time(prepare, pinned, copy, text, [], policy, digester)
        if n == 0:
            into.after.append(prepared.assembly.total)
            into.stages.update(getattr(e, "stage", "?") for e in prepared.events[:-1])
    assert node.engine is not None
    # The copy the engine's context read gets: the session actor's own when it holds one.
    held = await node.engine._history(AGENT, SESSION)
    if held._memo is not None:
        into.held_count += 1
        for _ in range(plan.repeats):
            await into.held.time(prepare, pinned, held.copy(), text, [], policy, digester)
    warm = history.copy()
    await prepare(pinned, warm, text, [], policy, digester)
    for _ in range(plan.repeats):
        await into.warm.time(prepare, pinned, warm, text, [], policy, digester)
    for _ in range(plan.repeats):
        copy = history.copy()
        await into.assemble.time(assemble, pinned, copy, text, [], policy.excerpt_keep)
    return history


# --- at a checkpoint -----------------------------------------------------------------------------


async def checkpoint(node: Node, fake: Fake, plan: Plan, turns: int, history: History,
                     sampled: Sampled, samples: int, driven: Driven, busy: float, own: float,
                     collections: list[tuple[float, float, int]]) -> Point:  # fmt: skip
    store, agent = node.store, node.agents[AGENT]
    assert store is not None
    policy, pinned = agent.context, agent.pinned
    key = {"agent_id": AGENT, "session_key": SESSION}

    async def read_all() -> list[Any]:
        rows = await store.afetch(ALL_MESSAGES_SQL, key)
        return [entry(t, p, r, _JSON.decode(c)) for t, p, r, c in rows]

    full = Clock()
    COLLECTIONS.where = "checkpoint: reads of every row"
    for _ in range(20):
        await full.time(read_all)
    full_rows = len(await read_all())
    COLLECTIONS.where = "checkpoint: round trips"

    prepared = await prepare(pinned, history.copy(), request_text(turns), [], policy,
                             agent.digester)  # fmt: skip
    request = ModelRequest(model=agent.model_id, system=prepared.assembly.system,
                           messages=prepared.assembly.messages, tools=pinned.tools,
                           max_tokens=256)  # fmt: skip
    model = AnthropicModel(agent.model_id, api_key="test", base_url=fake.url, max_retries=0)
    trips = Clock()
    reported = 0
    try:
        for n in range(plan.round_trips + 2):

            async def trip() -> int:
                prompt = 0
                async for event in model.stream(request):
                    if isinstance(event, Completed):
                        prompt = event.usage.prompt_tokens
                return prompt

            reported = await (trips.time(trip) if n >= 2 else trip())  # 2 to warm up
    finally:
        await model.aclose()
    if errors := fake.reset():
        print(f"the fake Anthropic server failed internally {errors} times")

    rows = await store.afetch(STAGES_SQL, {"session_key": SESSION})
    digest = history.view.digest
    requests = digest.requests if digest is not None else ()
    return Point(
        turns=turns, sampled=sampled, samples=samples,
        turn_latency=driven.latencies[-samples:], busy=busy, own=own,
        full_read=full, full_rows=full_rows,
        digest_turns=digest.turns if digest else 0, requests=len(requests),
        archived=digest.archived if digest is not None else 0,
        requests_tokens=len("\n".join(f"{i}. {r}" for i, r in enumerate(requests, 1))) // 4,
        marks=Counter(history.view.marks.values()),
        slots={s.label: s.tokens for s in prepared.assembly.slots}, budget=policy.budget,
        round_trip=trips, reported_tokens=reported,
        compactions={stage: (int(n), int(changed)) for stage, n, changed in rows},
        collections=collections, first_error=driven.first_error,
        tracked=Counter(type(o).__name__ for o in gc.get_objects()),
    )  # fmt: skip


# --- the run -------------------------------------------------------------------------------------


async def bench(url: str, nats_url: str, plan: Plan, data_dir: Path | None, keep: bool) -> None:
    schema = f"bench_{secrets.token_hex(4)}"
    settings, root = node_settings(url, nats_url, schema, AGENT, MANIFEST)
    # The SDK talks to the fake on loopback, never through a proxy from the environment.
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    fake = Fake()
    node = Node(settings)
    collections = COLLECTIONS
    watcher: asyncio.Task[None] | None = None
    points: list[Point] = []
    driven = Driven()
    try:
        await node.start()
        # As runtime/node.py serve does once the node is up: what start-up loaded (the SDKs'
        # models, the agents) is frozen out of the collector's sight. Collections are counted
        # from here on.
        gc.collect()
        gc.freeze()
        gc.callbacks.append(collections)
        assert node.store is not None and node.nc is not None
        store = node.store
        machine_facts(url, str(node.nc.connected_server_version), data_dir)
        policy = node.agents[AGENT].context
        print(f"schema: {schema}  mode: {'quick' if plan.quick else 'full'}; checkpoints "
              f"{', '.join(f'{n:,}' for n in plan.checkpoints)}, each sampled over its last "
              f"{plan.window} turns")  # fmt: skip
        print(f"agent: scripted model, window {policy.window:,}, budget {policy.budget:,}, "
              f"thresholds {policy.thresholds}, keep_turns {policy.keep_turns}, excerpt over "
              f"{policy.excerpt_over} keep {policy.excerpt_keep}; tool output "
              f"{len(read_report({'path': 'src/module_0.py'}, None)):,} chars; requests like "
              f"{request_text(1)!r}")  # fmt: skip
        ends = Ends()
        head = await asyncio.to_thread(store.head)
        watcher = asyncio.create_task(watch_ends(store, head, ends), name="bench-ends")
        done = 0
        for n in plan.checkpoints:
            section(f"the session, turns {done + 1:,} to {n:,}")
            started = perf()
            window = min(plan.window, n - done)
            collections.where = "turns"
            for i in range(done, n - window):
                await turn(node, ends, i, driven)
            sampled = Sampled()
            ticks, cpu = machine_ticks(), sum(os.times()[:4])
            history = History()
            for i in range(n - window, n):
                collections.where = "turns"
                await turn(node, ends, i, driven)
                collections.where = "sampling"
                history = await sample(node, plan, i, sampled)
            busy, after = busy_share(ticks, machine_ticks()), sum(os.times()[:4])
            span = (machine_ticks()[1] - ticks[1]) / (os.sysconf("SC_CLK_TCK") or 100)
            own = (after - cpu) / span if span else 0.0
            print(f"{n - done:,} turns, the last {window} sampled, in {perf() - started:.1f} s")
            started = perf()
            points.append(await checkpoint(node, fake, plan, n, history, sampled, window, driven,
                                           busy, own, list(collections.pauses)))  # fmt: skip
            print(f"checkpoint measured in {perf() - started:.1f} s")
            done = n
    finally:
        if collections in gc.callbacks:
            gc.callbacks.remove(collections)
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        await node.stop()
        fake.stop()
        if not keep:
            await asyncio.to_thread(drop_schemas, url, (schema,))
        shutil.rmtree(root, ignore_errors=True)

    section("per checkpoint (times p50 / p99 over the sampled turns, in ms)")
    print(
        f"turn ends: {dict(driven.reasons)}; errors: {dict(driven.errors) or 'none'}"
        + (f"; first turn not final: {driven.first_error:,}" if driven.first_error else "")
    )
    print_points(points)
    print("full collections by what the bench was doing: " + "; ".join(
        f"{where} {len(cpu)} (CPU median {pct(cpu, 50) * 1000:.0f} ms, max {max(cpu) * 1000:.0f})"
        for where, cpu in COLLECTIONS.by_where.items()))  # fmt: skip
    for older, newer in itertools.pairwise(points):
        grown = newer.tracked - older.tracked
        print(f"tracked objects, turn {older.turns:,} -> {newer.turns:,}: "
              f"{newer.tracked.total() - older.tracked.total():+,}; grown most: "
              + ", ".join(f"{k} +{v:,}" for k, v in grown.most_common(8)))  # fmt: skip
    section(f"results (ratio = at N / at N={points[0].turns:,}; last rows: / round trip p50)")
    print_table(result_lines(points))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="20 and 100 turns, fewer samples")
    parser.add_argument("--keep", action="store_true", help="keep the bench schema afterwards")
    parser.add_argument("--turns", help="checkpoints, comma-separated (default 100,1000,2000)")
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    if args.turns:
        checkpoints = tuple(sorted({int(t) for t in args.turns.split(",")}))
        plan = Plan(checkpoints, plan.window, plan.repeats, plan.loads, plan.round_trips,
                    plan.quick)  # fmt: skip
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    started = perf()
    with servers() as found:
        run_loop(bench(found.database_url, found.nats_url, plan, found.data_dir, args.keep))
    print(f"\ntotal time {perf() - started:.1f} s")


if __name__ == "__main__":
    main()

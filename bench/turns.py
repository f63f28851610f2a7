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
each export and discards it (bench/_turn_tracing.py's ``OtlpSink``). Goal: at most 5 % of the
turn rate.
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
from _procstat import count_thread_starts
from _profile import library_area, print_areas, print_top, raw_stats, total_time
from _turn_cost import Monitor, print_usage
from _turn_load import AGENT, Phase, Plan, Run, paced_key, run_load, run_paced
from _turn_log import Analysis, analyse, print_segments, turn_facts
from _turn_tracing import tracing_ab

# isort: split
import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import gc
import logging
import pstats
import secrets
import shutil
import statistics
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import structlog

from actors.model import ModelEvent, ModelRequest
from runtime.node import Node

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


PHASES = (
    Phase("A", "single-step turns (no tools)", "hello", 1, 1300.0),
    Phase("B", "one tool step per turn (calculator, then the answer)", "calculate 6*7", 2, 750.0),
)


FULL = Plan(3.0, 1.0, 8.0, 4.0, 16)
QUICK = Plan(0.5, 0.3, 2.0, 1.0, 16)


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


# --- reports -------------------------------------------------------------------------------------


def print_run(run: Run) -> None:
    lat = [s.latency for s in run.samples]
    acc = [s.accepted - s.submitted for s in run.samples]
    print(
        f"{run.sessions:>3} sessions: {rate(run.rate)} turns ({len(run.samples)} in "
        f"{run.window:.1f} s); submit -> turn.end seen p50 {ms(pct(lat, 50))} "
        f"p99 {ms(pct(lat, 99))}; submit -> accepted p50 {ms(pct(acc, 50))}"
    )


def _wraps_all(filename: str) -> bool:
    """The bench's own coroutines (the workers, the load, the run): they wrap everything."""
    return "/bench/" in filename and Path(filename).name in ("turns.py", "_turn_load.py")


def print_profile(profile: cProfile.Profile, turns: int, seconds: float) -> None:
    raw = raw_stats(pstats.Stats(profile))
    total = total_time(raw)
    print(
        f"event-loop thread, {seconds:.1f} s, {turns} turns ended: {total:.2f} s of profiled "
        f"function time = {total / max(1, turns) * 1000:.2f} ms per turn (cProfile inflates it)"
    )
    print_areas(raw, library_area, "own time by area (share of the loop thread's profiled time):",
                turns, "turn")  # fmt: skip
    client = sum(
        ct
        for (filename, _, func), (_, _, _, ct, _) in raw.items()
        if "/bench/" in filename and func in ("watch_ends", "worker")
    )
    print(
        f"  the bench client (its subscriber and submits, cumulative): "
        f"{client / total * 100:.1f} % = {client / max(1, turns) * 1000:.3f} ms/turn"
    )
    print_top(raw, 2, "own time (tottime)", 25, turns, "turn")
    print_top(raw, 3, "cumulative time (coroutines count each resumption)", 20, turns, "turn",
              skip=_wraps_all)  # fmt: skip


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
            await tracing_ab(node, ends, monitor, plan, PHASES)
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
        print_usage([(r.name, r.usage) for r in runs.values()])

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

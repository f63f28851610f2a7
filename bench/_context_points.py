"""What bench/context.py measures of the session: the timings and sizes sampled after each turn
of a window, everything measured at a checkpoint, and the tables of them (a column a
checkpoint; then each figure at N beside the same at the first checkpoint)."""

from __future__ import annotations

from _report import Goal, Line, line, ms, pct, perf, print_rows

# isort: split
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Clock:
    """Wall and loop-thread CPU seconds of repeated calls."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    async def time(self, call: Callable[..., Awaitable[Any] | Any], *args: Any) -> Any:
        t0, c0 = perf(), time.thread_time()
        result = call(*args)
        if isinstance(result, Awaitable):
            result = await result
        self.wall.append(perf() - t0)
        self.cpu.append(time.thread_time() - c0)
        return result


@dataclass
class Sampled:
    """What the sampled turns before one checkpoint showed."""

    prepare: Clock = field(default_factory=Clock)
    held: Clock = field(default_factory=Clock)
    """prepare() on a copy of the history the session's actor holds (a warm session)."""
    held_count: int = 0
    """Sampled turns after which the actor held a history (else the held clock is empty)."""
    warm: Clock = field(default_factory=Clock)
    assemble: Clock = field(default_factory=Clock)
    load: Clock = field(default_factory=Clock)
    stages: Counter[str] = field(default_factory=Counter)
    kept: list[int] = field(default_factory=list)
    """Bytes the loaded History keeps (tracemalloc), per sampled turn."""
    memo: list[int] = field(default_factory=list)
    """Bytes one assemble() adds to a copy of it: the memo of its rendered messages, which a
    warm session's History keeps too."""
    peak: list[int] = field(default_factory=list)
    entries: list[int] = field(default_factory=list)
    view_turns: list[int] = field(default_factory=list)
    marked_bytes: list[int] = field(default_factory=list)
    """Bytes (as JSON) of the whole bodies of the marked tool results the History holds."""
    tokens: list[int] = field(default_factory=list)
    """The assembled request's estimate, before prepare's ladder."""
    after: list[int] = field(default_factory=list)
    """...and after it."""


@dataclass(frozen=True)
class Point:
    """Everything measured for one checkpoint."""

    turns: int
    sampled: Sampled
    samples: int
    turn_latency: list[float]
    busy: float
    """The machine's busy share while sampling (1.0: both cores busy)."""
    own: float
    """...and this process's share of the machine's CPU time in that span."""
    full_read: Clock
    full_rows: int
    digest_turns: int
    requests: int
    archived: int
    requests_tokens: int
    marks: Counter[str]
    slots: dict[str, int]
    budget: int
    round_trip: Clock
    reported_tokens: int
    compactions: dict[str, tuple[int, int]]
    collections: list[tuple[float, float, int]]
    first_error: int | None
    tracked: Counter[str]
    """Objects the collector tracks at N (frozen ones aside), by type: what a full collection
    walks."""


def p50_p99(values: list[float]) -> str:
    return f"{pct(values, 50) * 1000:.3f} / {pct(values, 99) * 1000:.3f}"


def med_max(values: list[int], scale: float = 1.0, fmt: str = "{:,.0f}") -> str:
    return f"{fmt.format(pct(values, 50) / scale)} / {fmt.format(max(values) / scale)}"


def gc_pauses(point: Point, which: int) -> str:
    pauses = [p[which] for p in point.collections]
    return f"{pct(pauses, 50) * 1000:.0f} / {max(pauses) * 1000:.0f}" if pauses else "-"


def slot(label: str) -> Callable[[Point], str]:
    return lambda p: f"{p.slots.get(label, 0):,}"


def print_points(points: list[Point]) -> None:
    header = ["figure", *[f"N = {p.turns:,}" for p in points]]

    def row(name: str, get: Callable[[Point], str]) -> list[str]:
        return [name, *[get(p) for p in points]]

    kb = 1024.0
    labels = list(dict.fromkeys(k for p in points for k in p.slots))
    rows = [
        row("turns sampled (the last ones before N)",
            lambda p: f"{p.turns - p.samples + 1:,}-{p.turns:,}"),
        row("machine busy / this process, while sampling",
            lambda p: f"{p.busy * 100:.0f} % / {p.own * 100:.0f} %"),
        row("turn latency (submit -> turn.end), ms", lambda p: p50_p99(p.turn_latency)),
        row("load(), wall, ms", lambda p: p50_p99(p.sampled.load.wall)),
        row("load(), loop-thread CPU, ms", lambda p: p50_p99(p.sampled.load.cpu)),
        row("read of every message row (at N), ms", lambda p: p50_p99(p.full_read.wall)),
        row("message rows of the session (at N)", lambda p: f"{p.full_rows:,}"),
        row("entries in the History, median / max", lambda p: med_max(p.sampled.entries)),
        row("turns in the view, median / max", lambda p: med_max(p.sampled.view_turns)),
        row("History kept after load(), KB, median / max",
            lambda p: med_max(p.sampled.kept, kb, "{:,.1f}")),
        row("  of which whole bodies of marked results (JSON), KB",
            lambda p: med_max(p.sampled.marked_bytes, kb, "{:,.1f}")),
        row("peak while loading, KB, median / max",
            lambda p: med_max(p.sampled.peak, kb, "{:,.1f}")),
        row("memo of the rendered messages (one assemble), KB, median / max",
            lambda p: med_max(p.sampled.memo, kb, "{:,.1f}")),
        row("prepare(), fresh copy (a turn's 1st call), wall, ms",
            lambda p: p50_p99(p.sampled.prepare.wall)),
        row("prepare(), fresh copy, loop-thread CPU, ms", lambda p: p50_p99(p.sampled.prepare.cpu)),
        row("  max wall / max CPU, ms", lambda p: f"{max(p.sampled.prepare.wall) * 1000:.1f} / "
            f"{max(p.sampled.prepare.cpu) * 1000:.1f}"),
        row("  stages per call (by stage)",
            lambda p: f"{sum(p.sampled.stages.values()) / len(p.sampled.after):.2f} ("
            + (", ".join(f"{k} {v / len(p.sampled.after):.2f}"
                         for k, v in sorted(p.sampled.stages.items())) or "none") + ")"),
        row("prepare(), the actor's copy (warm next turn), wall, ms",
            lambda p: p50_p99(p.sampled.held.wall) if p.sampled.held.wall else "-"),
        row("prepare(), the actor's copy, loop-thread CPU, ms",
            lambda p: p50_p99(p.sampled.held.cpu) if p.sampled.held.cpu else "-"),
        row("  sampled turns after which the actor held a history",
            lambda p: f"{p.sampled.held_count} of {p.samples}"),
        row("prepare(), same copy (later calls), wall, ms", lambda p: p50_p99(p.sampled.warm.wall)),
        row("assemble(), fresh copy, wall, ms", lambda p: p50_p99(p.sampled.assemble.wall)),
        row("assemble(), fresh copy, loop-thread CPU, ms",
            lambda p: p50_p99(p.sampled.assemble.cpu)),
        row("tokens before prepare, median / max", lambda p: med_max(p.sampled.tokens)),
        row("tokens after prepare, median / max", lambda p: med_max(p.sampled.after)),
        row("prompt budget (window 16,000 less reserve)", lambda p: f"{p.budget:,}"),
        *[row(f"  slot {label} (at N, after prepare)", slot(label)) for label in labels],
        row("turns the digest covers (at N)", lambda p: f"{p.digest_turns:,}"),
        row("requests kept verbatim in it / their tokens",
            lambda p: f"{p.requests:,} / ~{p.requests_tokens:,}"),
        row("earlier requests archived (summarised, not listed)", lambda p: f"{p.archived:,}"),
        row("marks in the view (at N)",
            lambda p: ", ".join(f"{k} {v}" for k, v in sorted(p.marks.items())) or "none"),
        row("prompt tokens the fake counted (at N)", lambda p: f"{p.reported_tokens:,}"),
        row("model round trip to FakeAnthropic, wall, ms", lambda p: p50_p99(p.round_trip.wall)),
        row("  loop-thread CPU of it (the SDK), ms", lambda p: p50_p99(p.round_trip.cpu)),
        row("compaction.stage events so far (changed)",
            lambda p: ", ".join(f"{k} {n} ({c})" for k, (n, c) in p.compactions.items())),
        row("first turn that did not end final", lambda p: f"{p.first_error or '-'}"),
        row("objects the GC tracks (not frozen), at N", lambda p: f"{p.tracked.total():,}"),
        row("full GC collections so far", lambda p: f"{len(p.collections)}"),
        row("  their pause, wall median / max, ms", lambda p: gc_pauses(p, 0)),
        row("  their pause, CPU median / max, ms", lambda p: gc_pauses(p, 1)),
        row("  unreachable objects each freed, median / max",
            lambda p: med_max([int(c[2]) for c in p.collections]) if p.collections else "-"),
    ]  # fmt: skip
    print_rows(header, rows, set(range(1, len(header))))


def result_lines(points: list[Point]) -> list[Line]:
    first = points[0]
    flat = Goal("<= 1.5x (O(window))", lambda o, b: b > 0 and o / b <= 1.5)
    kb: Callable[[float], str] = lambda v: f"{v / 1024:,.1f} KB"  # noqa: E731
    count: Callable[[float], str] = lambda v: f"{v:,.0f}"  # noqa: E731
    lines: list[Line] = []
    for p in points[1:]:
        at = f"N={p.turns:,} vs N={first.turns:,}"

        def add(name: str, get: Callable[[Point], float], show: Callable[[float], str],
                goal: Goal | None = flat, p: Point = p, at: str = at) -> None:  # fmt: skip
            lines.append(line(f"{name}, {at}", get(p), get(first), show, goal))

        add("prepare() p50, turn's 1st call, CPU", lambda x: pct(x.sampled.prepare.cpu, 50), ms)
        add("prepare() p99, turn's 1st call, CPU", lambda x: pct(x.sampled.prepare.cpu, 99), ms)
        add("prepare() p99, turn's 1st call, wall", lambda x: pct(x.sampled.prepare.wall, 99), ms)
        if p.sampled.held.cpu and first.sampled.held.cpu:
            add("prepare() p50, warm next turn, CPU", lambda x: pct(x.sampled.held.cpu, 50), ms)
            add("prepare() p99, warm next turn, CPU", lambda x: pct(x.sampled.held.cpu, 99), ms)
        add("prepare() p50, later calls, wall", lambda x: pct(x.sampled.warm.wall, 50), ms)
        add("assemble() p99, fresh copy, CPU", lambda x: pct(x.sampled.assemble.cpu, 99), ms)
        add("load() p50, wall", lambda x: pct(x.sampled.load.wall, 50), ms)
        add("load() p99, wall", lambda x: pct(x.sampled.load.wall, 99), ms)
        add("History kept after load(), max", lambda x: max(x.sampled.kept), kb)
        add("peak while loading, max", lambda x: max(x.sampled.peak), kb)
        add("entries in the History, max", lambda x: max(x.sampled.entries), count)
        add("tokens before prepare, max", lambda x: max(x.sampled.tokens), count)
        add("digest slot tokens (at N)", lambda x: x.slots.get("digest", 0), count, None)
        add(
            "full read of the messages p50 (O(history))",
            lambda x: pct(x.full_read.wall, 50),
            ms,
            None,
        )
    five = Goal("p99 <= 5 ms", lambda o, b: o <= 0.005)
    for p in points:
        rt = pct(p.round_trip.wall, 50)
        lines.append(line(f"prepare() p99 wall vs model round trip p50, N={p.turns:,}",
                          pct(p.sampled.prepare.wall, 99), rt, ms, five))  # fmt: skip
        lines.append(line(f"prepare() p99 CPU vs model round trip p50, N={p.turns:,}",
                          pct(p.sampled.prepare.cpu, 99), rt, ms, five))  # fmt: skip
        if p.sampled.held.cpu:
            lines.append(line(f"prepare() p99 CPU, warm, vs model round trip p50, N={p.turns:,}",
                              pct(p.sampled.held.cpu, 99), rt, ms, five))  # fmt: skip
    return lines

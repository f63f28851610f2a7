"""Per-turn facts read back from the log (bench/turns.py): each turn's appends and their
``recorded_at``, steps, model and tool time; and what they say: per-step runtime overhead and
where a turn's time goes between its appends."""

from __future__ import annotations

from _report import ms, pct, print_rows

# isort: split
from _turn_load import Run

# isort: split
import itertools
import math
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from eventstore import Checkpoint, EventStore, RecordedEvent
from eventstore.catalogue import ModelResult, ToolResult, TurnEnd


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

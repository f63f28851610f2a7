"""The client of bench/turns.py: sessions that each send a message and wait for its turn.end,
in a closed loop (the next once the last has ended) or paced (an open loop); a window of them,
its turns and what it cost."""

from __future__ import annotations

from _report import Ends, perf

# isort: split
from _turn_cost import Monitor, Snapshot, Usage, usage

# isort: split
import asyncio
import cProfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client

from actors.messages import Refused
from eventstore import Checkpoint
from gateways.ingress import IngressMessage, request
from runtime.node import Node

AGENT = "bench"
"""The agent every turn goes to (bench/turns.py's manifest)."""


@dataclass(frozen=True)
class Phase:
    key: str
    title: str
    text: str
    steps: int
    anchor: float
    """The original Dispach's turns/s on this machine, against an instant mock model."""


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


def paced_key(phase: Phase, share: float) -> str:
    return f"{phase.key} paced {share:.0%}"


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

"""What the outbox bench (bench/outbox.py) works with: the node under test (``dispach serve`` as a
subprocess, or under cProfile), the webhook receiver in a process of its own, the CPU meter of
a window, and the rig of a phase that holds them."""

from __future__ import annotations

from _report import ms, perf, stop_server, tail, wait_ready

# isort: split
from _child import Child
from _procstat import busy_share, machine_ticks, thread_cpu, tree_cpu

# isort: split
import asyncio
import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

DISPACH = Path(sys.executable).parent / "dispach"
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


class Receiver(Child):
    def __init__(self, secret: str) -> None:
        super().__init__(_serve_receiver, secret, name="webhook-receiver")

    def tally(self) -> dict[str, int]:
        found: dict[str, int] = self.ask("tally")
        return found


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


@dataclass(frozen=True)
class Rig:
    """What a phase works with: the node, the bench's store on its schema, and the pids of the
    other processes whose CPU is counted."""

    node: Node
    store: Any
    url: str
    schema: str
    others: dict[str, int]

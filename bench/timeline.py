"""Where an idle turn's wall-clock time goes: the median timeline of sequential turns.

    .venv/bin/python bench/timeline.py [--turns 200] [--skip 20]

A ``dispach serve`` on the embedded Postgres and NATS (a fresh schema), started by this script
in a child interpreter that wraps a few of the node's functions with clock marks before the node
builds its routes (``--child``: the HTTP handlers, the session actor's receive, the writer's
submit, commit and hand-over, the turn runner's run, history load, model call and end; the
writer's insert and its inline projections' statements). The shared load driver then sends
``--turns`` turns one at a time, each in a new session, each polled every millisecond until it
ends (its ``seq`` phase: what ``accept p50`` and ``e2e p50`` in bench/ab.py and the side-by-side
tool measure). At exit the child writes its marks; this script cuts them into turns at each
``POST …/messages``, drops the first ``--skip`` turns (warm-up) and prints, per mark, the median
time since the POST reached the handler, and in which thread. A wrapper costs about a
microsecond a call, so the figures are the path's own, give or take a few per cent.
"""

from __future__ import annotations

# First: it takes this directory off the front of the import path (see its docstring).
from _report import servers, serving

# isort: split
from ab import AGENT, LOADGEN  # the same agent and driver as the A/B runs

# isort: split
import argparse
import asyncio
import collections
import functools
import inspect
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
Mark = tuple[float, str, str]


# --- in the child: the node, with marks ----------------------------------------------------------


def _marked(marks: list[Mark], label: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def mark(edge: str) -> None:
        marks.append((time.perf_counter(), threading.current_thread().name, label + edge))

    if inspect.iscoroutinefunction(f):

        @functools.wraps(f)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            mark(">")
            try:
                return await f(*args, **kwargs)
            finally:
                mark("<")

        return timed_async

    @functools.wraps(f)
    def timed(*args: Any, **kwargs: Any) -> Any:
        mark(">")
        try:
            return f(*args, **kwargs)
        finally:
            mark("<")

    return timed


def child(out: str) -> None:
    """Serve as ``dispach serve`` does, with marks; write them to ``out`` at exit."""
    import atexit

    from actors.session import actor as session
    from actors.turn import modelcall, runner
    from eventstore import writer
    from gateways.api import turns as api
    from runtime.cli import main

    marks: list[Mark] = []
    wrapped: list[tuple[Any, str, str]] = [
        (api, "post_message", "POST messages"), (api, "get_turn", "GET turn"),
        (session.SessionActor, "on_receive", "session actor"),
        (writer.GroupCommitWriter, "submit", "writer submit"),
        (writer.GroupCommitWriter, "_commit", "commit"),
        (writer.GroupCommitWriter, "_insert", "commit: insert"),
        (writer, "run_statements", "commit: projections sent"),
        (writer.GroupCommitWriter, "_delivered", "hand-over on the loop"),
        (runner.TurnRunner, "run", "turn runner"),
        (runner.TurnRunner, "_earlier", "history"),
        (modelcall.Caller, "call", "model call"),
        (runner.TurnRunner, "_finish", "turn end"),
    ]  # fmt: skip
    for owner, name, label in wrapped:
        setattr(owner, name, _marked(marks, label, getattr(owner, name)))

    def dump() -> None:
        Path(out).write_text(json.dumps(marks))

    atexit.register(dump)
    sys.argv = ["dispach", "serve"]
    main()


# --- in the parent ------------------------------------------------------------------------------


async def run(turns: int, work: Path) -> list[Mark]:
    out = work / "marks.json"
    with servers() as found:
        async with serving(
            found.database_url, found.nats_url, work, AGENT,
            argv=(__file__, "--child", str(out)), cwd=ROOT,
        ) as (pid, base):  # fmt: skip
            driver = await asyncio.create_subprocess_exec(
                sys.executable, str(LOADGEN), "--base", base, "--agent", "bench",
                "--pid", str(pid), "--phases", "seq", "--turns", str(turns),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            printed, errors = await driver.communicate()
            if driver.returncode != 0:
                raise SystemExit(f"loadgen failed: {errors.decode()[-2000:]}")
            seq = json.loads(printed)["seq_e2e"]
            print(f"accept p50 {seq['accept_ms']['p50']:.2f} ms, end-to-end p50 "
                  f"{seq['e2e_ms']['p50']:.2f} ms, {seq['polls_per_turn']:.1f} polls per"
                  " turn (marks included)")  # fmt: skip
        return [(float(at), str(thread), str(label)) for at, thread, label in
                json.loads(out.read_text())]  # fmt: skip


def timeline(marks: list[Mark], skip: int) -> list[tuple[float, str, str, int]]:
    """Per mark (its label, its nth time within a turn), the median ms after the turn's POST
    reached its handler; only marks seen in at least four fifths of the turns."""
    turns: list[list[Mark]] = []
    for mark in marks:
        if mark[2] == "POST messages>":
            turns.append([mark])
        elif turns:
            turns[-1].append(mark)
    turns = turns[skip:]
    offsets: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for turn in turns:
        began, seen = turn[0][0], collections.Counter[str]()
        for at, thread, label in turn:
            seen[label] += 1
            offsets[(f"{label} #{seen[label]}", thread)].append((at - began) * 1000)
    return sorted(
        (statistics.median(found), label, thread, len(found))
        for (label, thread), found in offsets.items()
        if len(found) >= 0.8 * len(turns)
    )


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--skip", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dispach-bench-timeline-") as work:
        marks = asyncio.run(run(args.turns, Path(work)))
    print("\n  ms after the POST | mark (> entered, < left; #n: its nth time in the turn)")
    for at, label, thread, _ in timeline(marks, args.skip):
        print(f"  {at:8.3f}          | {label} [{thread}]")


if __name__ == "__main__":
    main()

"""A/B of the HTTP path: this tree against an older commit, alternated in one run.

    .venv/bin/python bench/ab.py --baseline <rev> [--rounds 6] [--turns 300] [--quick]
                                 [--phases seq,burst,closed,reattach]

What a change to the edge costs (the Origin and content-type checks, stream tokens, read
timeouts...) is smaller than the drift of a shared 2-core machine between two runs minutes apart.
So both trees are measured in the same run, alternated A B B A A B ..., each round a fresh
``dispach serve`` (its own schema and home, the same Postgres and NATS) under the shared load
driver: ``seq`` (one turn at a time: accept p50/p99, end-to-end p50), ``burst`` (16
submitters, 16 sessions: turns/s, accept p50, the server process's CPU per turn), ``closed``
(16 streamed turns in flight, ``POST {stream: true}`` read to ``turn.end``: turns/s, the first
frame, CPU per turn) and ``reattach`` (POST, then the turn's stream: its first event and its
``turn.end``, from the POST), or those ``--phases`` names; every round also reports the
server's peak RSS. The baseline
tree is a detached ``git worktree`` of ``--baseline`` in a temporary directory, run by this
interpreter with its packages first on ``PYTHONPATH`` (the same dependencies; only our code
differs). Prints each round, then per tree the median of its rounds and the ratio this tree /
baseline. The servers log at ``warning``: an access line per request is not measured here.
"""

from __future__ import annotations

# First: it takes this directory off the front of the import path (see its docstring).
from _report import print_rows, section, servers, serving

# isort: split
import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOADGEN = Path("/work/shared/tools/loadgen/loadgen.py")
ROOT = Path(__file__).resolve().parent.parent
AGENT = """\
id: bench
name: Benchmark agent
model:
  provider: scripted
tools: [calculator]
"""
PHASES = ("seq", "burst", "closed", "reattach")
FIGURES: tuple[tuple[str, str, str, Callable[[dict[str, Any]], float]], ...] = (
    ("seq", "accept p50 (seq)", "ms", lambda r: r["seq_e2e"]["accept_ms"]["p50"]),
    ("seq", "accept p99 (seq)", "ms", lambda r: r["seq_e2e"]["accept_ms"]["p99"]),
    ("seq", "end-to-end p50 (seq)", "ms", lambda r: r["seq_e2e"]["e2e_ms"]["p50"]),
    ("burst", "accept p50 (burst)", "ms", lambda r: r["burst"]["accept_ms"]["p50"]),
    ("burst", "burst turns/s", "/s", lambda r: r["burst"]["turns_per_s_wall"]),
    ("burst", "server CPU per turn (burst)", "ms",
     lambda r: r["burst"]["cpu_s"]["server"] * 1000 / r["burst"]["n"]),
    ("closed", "closed loop turns/s", "/s", lambda r: r["closed_loop"]["turns_per_s"]),
    ("closed", "first frame p50 (closed)", "ms",
     lambda r: r["closed_loop"]["accept_first_frame_ms"]["p50"]),
    ("closed", "server CPU per turn (closed)", "ms",
     lambda r: r["closed_loop"]["cpu_s"]["server"] * 1000 / r["closed_loop"]["n"]),
    ("reattach", "first SSE event p50 (reattach)", "ms",
     lambda r: r["stream_reattach"]["first_event_ms"]["p50"]),
    ("reattach", "turn.end via SSE p50 (reattach)", "ms",
     lambda r: r["stream_reattach"]["turn_end_ms"]["p50"]),
    ("", "server peak RSS", "MiB", lambda r: r["server_mem_kb"]["VmHWM"] / 1024),
)  # fmt: skip
"""Per figure: the phase it comes from ("": every run), its label and unit, and where the
driver's result has it."""


@dataclass(frozen=True)
class Tree:
    name: str
    path: Path


async def one_round(
    tree: Tree, url: str, nats_url: str, turns: int, phases: list[str], work: Path
) -> list[float]:
    async with serving(
        url, nats_url, work, AGENT, env={"PYTHONPATH": str(tree.path)}, name=tree.name
    ) as (pid, base):
        result = await loadgen(base, pid, turns, phases)
    if result.get("errors") or result.get("burst", {}).get("post_errors"):
        raise SystemExit(f"{tree.name}: driver errors {result.get('errors')}")
    return [figure(result) for phase, _, _, figure in FIGURES if phase in ("", *phases)]


async def loadgen(base: str, pid: int, turns: int, phases: list[str]) -> dict[str, Any]:
    argv = [
        sys.executable, str(LOADGEN), "--base", base, "--agent", "bench", "--pid", str(pid),
        "--phases", ",".join(phases), "--turns", str(turns), "--sessions", "16",
        "--submitters", "16",
    ]  # fmt: skip
    child = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await child.communicate()
    if child.returncode != 0:
        raise SystemExit(f"loadgen failed ({child.returncode}):\n{err.decode()[-3000:]}")
    found: dict[str, Any] = json.loads(out)
    return found


def order(rounds: int) -> list[int]:
    """0 = baseline, 1 = this tree, in ABBA blocks so a drift in time favours neither."""
    block = [0, 1, 1, 0]
    return [block[i % 4] for i in range(rounds)]


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip


async def bench(trees: list[Tree], rounds: int, turns: int, phases: list[str], work: Path) -> None:
    measured: dict[int, list[list[float]]] = {0: [], 1: []}
    shown = [(label, unit) for phase, label, unit, _ in FIGURES if phase in ("", *phases)]
    with servers() as found:
        print(f"rounds: {rounds} ({' '.join('AB'[i] for i in order(rounds))}, A = baseline);"
              f" phases: {','.join(phases)}; turns per phase: {turns};"
              f" driver: {LOADGEN}")  # fmt: skip
        for n, which in enumerate(order(rounds), 1):
            tree = trees[which]
            figures = await one_round(tree, found.database_url, found.nats_url, turns, phases, work)
            measured[which].append(figures)
            pairs = zip(shown, figures, strict=True)
            said = (f"{label} {v:.2f}{unit}" for (label, unit), v in pairs)
            print(f"round {n} {tree.name}: " + ", ".join(said), flush=True)
    section("medians")
    table = []
    for i, (label, unit) in enumerate(shown):
        a = statistics.median(r[i] for r in measured[0])
        b = statistics.median(r[i] for r in measured[1])
        spread = [f"{r[i]:.2f}" for r in measured[0]], [f"{r[i]:.2f}" for r in measured[1]]
        table.append((label, f"{a:.2f} {unit}", f"{b:.2f} {unit}", f"{b / a:.2f}x",
                      f"{'/'.join(spread[0])} | {'/'.join(spread[1])}"))  # fmt: skip
    print_rows(("figure", trees[0].name, trees[1].name, "this / baseline", "rounds (A | B)"),
               table, {1, 2, 3})  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="4 rounds of 60 turns")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"the driver's phases to run, of {','.join(PHASES)}")  # fmt: skip
    args = parser.parse_args()
    phases = args.phases.split(",")
    if not phases or not set(phases) <= set(PHASES):
        raise SystemExit(f"--phases takes some of {','.join(PHASES)}")
    rounds, turns = (4, 60) if args.quick else (args.rounds, args.turns)
    if not LOADGEN.exists():
        raise SystemExit(f"the load driver is missing: {LOADGEN}")
    rev, head = git("rev-parse", "--short", args.baseline), git("rev-parse", "--short", "HEAD")
    dirty = "+changes" if git("status", "--porcelain", "--", "*.py") else ""
    work = Path(tempfile.mkdtemp(prefix="dispach-bench-ab-"))
    old = work / "baseline"
    git("worktree", "add", "--detach", str(old), rev)
    try:
        trees = [Tree(f"baseline {rev}", old), Tree(f"this tree {head}{dirty}", ROOT)]
        asyncio.run(bench(trees, rounds, turns, phases, work))
    finally:
        git("worktree", "remove", "--force", str(old))
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Benchmark of the HTTP gateway: a real ``dispach serve`` under the shared load driver, in one run.

    .venv/bin/python bench/http.py [--quick] [--keep] [--original SIDEBYSIDE.json]

Uses DATABASE_URL / NATS_URL when set, else starts the embedded Postgres and NATS in a fresh
temporary directory (removed afterwards), the same code ``dispach serve`` would run. The node is a
subprocess, ``.venv/bin/dispach serve``, on a free loopback port, with its own DISPACH_HOME and
schema ``bench_<hex>`` (the baseline's scratch table is in ``bench_<hex>_raw``). It serves two
agents declared in a temporary DISPACH_AGENTS directory, both with the offline scripted model
(instant) and the calculator tool:

  - ``bench``: ``model: {provider: scripted}``; the driver's texts ("burst turn 7", ...) match
    none of its rules, so every turn is one step (the model answers without tools);
  - ``bench-tool``: the same, with ``script: [{match: ".", tool: calculator, ...}]``, so every
    turn is one tool step (calculator, then the answer: two model calls). The driver sends fixed
    texts and has no option for them; this agent turns its texts into "calculate 6*7" turns.

The driver is /work/shared/tools/loadgen (a keep-alive HTTP/1.1 client on the standard library,
cheaper per request than the server): run as a subprocess with this interpreter (uvloop), never
copied. Its phases: ``seq`` (sequential POST then poll until final: accept and end-to-end
latency), ``burst`` (N turns from 16 submitters: turns/s), ``closed`` (16 turns in flight, POST
``{stream: true}`` read to ``turn.end``), ``reattach`` (POST, then GET .../stream to ``turn.end``:
first-event latency). Runs: all four phases over 16 sessions; then a burst over 128 sessions; then
one-tool bursts over 16 and 128 sessions.

Baseline: raw psycopg single-row INSERT + COMMIT on the same database, before and after.
Anchor: the original Dispach (Bun, SQLite) under the same driver, read from the JSON that
``../shared/tools/sidebyside/sidebyside.py run --out FILE`` writes (``--original FILE``): the
median of its runs for each figure, with the date and machine of that run printed beside the
table. Its figures change with the machine, so a file from another machine or day compares
loosely; without ``--original`` the column is empty.
"""

from __future__ import annotations

# First: it takes this directory off the front of the import path (see its docstring).
from _report import (
    RawSingle,
    drop_schemas,
    free_port,
    machine_facts,
    ms,
    nats_version,
    perf,
    print_rows,
    rate,
    raw_setup,
    raw_single,
    run_loop,
    section,
    servers,
    stop_server,
    tail,
    wait_ready,
)

# isort: split
from _procstat import cpu_seconds, proc_status

# isort: split
import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOADGEN = Path("/work/shared/tools/loadgen/loadgen.py")
ROOT = Path(__file__).resolve().parent.parent
DISPACH = ROOT / ".venv" / "bin" / "dispach"
AGENTS = {
    "bench": """\
id: bench
name: Benchmark agent
model:
  provider: scripted
tools: [calculator]
""",
    "bench-tool": """\
id: bench-tool
name: Benchmark agent, one tool call per turn
model:
  provider: scripted
  script:
    - {match: ".", tool: calculator, input: {expression: "6*7"}}
tools: [calculator]
""",
}


@dataclass(frozen=True)
class Plan:
    turns: int
    raw_seconds: float


FULL = Plan(500, 3.0)
QUICK = Plan(60, 0.5)


@dataclass(frozen=True)
class Run:
    key: str
    agent: str
    phases: str
    sessions: int


RUNS = (
    Run("main", "bench", "seq,burst,closed,reattach", 16),
    Run("burst128", "bench", "burst", 128),
    Run("tool16", "bench-tool", "burst", 16),
    Run("tool128", "bench-tool", "burst", 128),
)


# --- the driver ----------------------------------------------------------------------------------


async def loadgen(base: str, pid: int, run: Run, plan: Plan) -> dict[str, Any]:
    argv = [
        sys.executable, str(LOADGEN), "--base", base, "--agent", run.agent, "--pid", str(pid),
        "--phases", run.phases, "--turns", str(plan.turns), "--sessions", str(run.sessions),
        "--submitters", "16",
    ]  # fmt: skip
    print("$ " + " ".join(argv[1:]), flush=True)
    child = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await child.communicate()
    if child.returncode != 0:
        raise SystemExit(f"loadgen failed ({child.returncode}):\n{err.decode()[-3000:]}")
    found: dict[str, Any] = json.loads(out)
    return found


def print_phases(run: Run, result: dict[str, Any]) -> None:
    """The figures of one loadgen run, phase by phase."""
    seq = result.get("seq_e2e")
    if seq:
        print(
            f"seq ({seq['n']} turns, one at a time): accept p50 {lat(seq['accept_ms'], 'p50')}"
            f" p99 {lat(seq['accept_ms'], 'p99')}; end-to-end p50 {lat(seq['e2e_ms'], 'p50')}"
            f" p99 {lat(seq['e2e_ms'], 'p99')}; server durationMs p50"
            f" {lat(seq['server_durationMs'], 'p50')}; {seq['polls_per_turn']:.1f} polls per"
            f" turn; statuses {seq['statuses']}; server CPU {per_turn(seq['cpu_s'], seq['n'])}"
        )
    burst = result.get("burst")
    if burst:
        print(
            f"burst ({burst['n']} turns, {burst['sessions']} sessions, {burst['submitters']}"
            f" submitters): {burst['completed']} completed, {burst['post_errors']} POST errors;"
            f" {rate(burst['turns_per_s_wall'])} wall, {rate(burst['turns_per_s_server'] or 0)}"
            f" server window; accept p50 {lat(burst['accept_ms'], 'p50')} p99"
            f" {lat(burst['accept_ms'], 'p99')}; POST -> endedAt p50"
            f" {lat(burst['post_to_endedAt_ms'], 'p50')} p99"
            f" {lat(burst['post_to_endedAt_ms'], 'p99')}; statuses {burst['statuses']} steps"
            f" {burst['steps']}; server CPU {per_turn(burst['cpu_s'], burst['completed'])}"
        )
    closed = result.get("closed_loop")
    if closed:
        print(
            f"closed ({closed['workers']} in flight, POST stream:true to turn.end):"
            f" {rate(closed['turns_per_s'])}; turn p50 {lat(closed['turn_ms'], 'p50')} p99"
            f" {lat(closed['turn_ms'], 'p99')}; first frame p50"
            f" {lat(closed['accept_first_frame_ms'], 'p50')}; not final at turn.end"
            f" {closed['not_final_at_turn_end']}; statuses {closed['statuses']}; server CPU"
            f" {per_turn(closed['cpu_s'], closed['n'])}"
        )
    reattach = result.get("stream_reattach")
    if reattach:
        print(
            f"reattach ({reattach['n']} turns: POST, then GET .../stream): first event p50"
            f" {lat(reattach['first_event_ms'], 'p50')} p99"
            f" {lat(reattach['first_event_ms'], 'p99')}; turn.end p50"
            f" {lat(reattach['turn_end_ms'], 'p50')}; final right after turn.end"
            f" {reattach['final_immediately_after_turn_end']}/{reattach['n']}; unavailable"
            f" {reattach['stream_unavailable']}"
        )
    print(f"server memory after the run: {result.get('server_mem_kb')}")
    errors = result.get("errors") or []
    print(f"driver errors ({run.key}): {len(errors)}" + "".join(f"\n  {e}" for e in errors))


def lat(summary: dict[str, Any], key: str) -> str:
    value = summary.get(key)
    return "-" if value is None else f"{value:.2f} ms"


def per_turn(cpu: dict[str, float], turns: int) -> str:
    if not turns:
        return "-"
    return f"{cpu['server'] * 1000 / turns:.2f} ms/turn (driver {cpu['driver'] * 1000 / turns:.2f})"


# --- the table -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    figure: str
    ours: float | None
    dispach: float | None
    baseline: float | None
    show: Callable[[float], str]


ORIGINAL_FIGURES = {
    # our row -> the sidebyside table's figure whose "original" median anchors it
    "burst16": "burst turns/s, 16 sessions, plain (wall)",
    "burst16-server": "burst turns/s, 16 sessions, plain (server window)",
    "burst128": "burst turns/s, 128 sessions, plain (wall)",
    "tool16": "burst turns/s, 16 sessions, one tool (wall)",
    "tool128": "burst turns/s, 128 sessions, one tool (wall)",
    "closed": "closed loop turns/s, 16 in flight, plain",
    "accept": "accept p50, idle (seq, plain)",
    "e2e50": "e2e p50, plain (seq: POST -> polled final)",
    "e2e99": "e2e p99, plain",
    "first-event": "first SSE event p50 (reattach, from POST), plain",
    "cpu": "server CPU per turn, burst16 plain (server process)",
    "rss-ready": "server RSS at ready (plain server)",
    "rss-peak": "server RSS peak VmHWM, plain server after all phases",
}
_KIB = {"MiB": 1024.0}
"""Units the sidebyside table gives memory in, as the kB this benchmark reads from /proc."""


@dataclass(frozen=True)
class Original:
    """The original Dispach's figures from one sidebyside run (median of its rounds)."""

    figures: dict[str, float]
    source: str

    @classmethod
    def load(cls, path: Path) -> Original:
        try:
            report = json.loads(path.read_text())
            table, meta = report["table"], report.get("meta", {})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"--original {path}: not a sidebyside --out file ({e})") from None
        by_figure = {row["figure"]: row for row in table if isinstance(row, dict)}
        figures: dict[str, float] = {}
        for key, figure in ORIGINAL_FIGURES.items():
            row = by_figure.get(figure, {})
            median = row.get("original", {}).get("median")
            if isinstance(median, int | float):
                figures[key] = median * _KIB.get(row.get("unit", ""), 1.0)
        machine = meta.get("machine", {})
        original = meta.get("original", {})
        rounds = sum(1 for run in report.get("runs", []) if run.get("system") == "original")
        source = (
            f"{path} (sidebyside {meta.get('started_utc', '?')} UTC, {machine.get('cores', '?')}"
            f" cores {machine.get('cpu', '?')}, original {original.get('version', '?')} on Bun"
            f" {original.get('bun', '?')}, {rounds} runs of it)"
        )
        return cls(figures, source)


NO_ORIGINAL = Original({}, "none: pass --original with a sidebyside --out file")


def rows(
    results: dict[str, dict[str, Any]],
    raw: RawSingle,
    ready_kb: int,
    peak_kb: int,
    original: Original,
) -> list[Row]:
    main, burst128 = results["main"], results["burst128"]
    tool16, tool128 = results["tool16"], results["tool128"]
    seq, burst, closed = main["seq_e2e"], main["burst"], main["closed_loop"]
    reattach = main["stream_reattach"]

    def ms_(x: float) -> str:
        return f"{x:.2f} ms"

    def mb(x: float) -> str:
        return f"{x / 1024:.0f} MB"

    def server_rate(b: dict[str, Any]) -> float | None:
        value: float | None = b["turns_per_s_server"]
        return value

    o = original.figures.get
    return [
        Row("burst turns/s, 16 sessions (wall)", burst["turns_per_s_wall"], o("burst16"),
            raw.rate, rate),
        Row("burst turns/s, 16 sessions (server window)", server_rate(burst),
            o("burst16-server"), raw.rate, rate),
        Row("burst turns/s, 128 sessions (wall)", burst128["burst"]["turns_per_s_wall"],
            o("burst128"), raw.rate, rate),
        Row("one-tool turns/s, 16 sessions (wall)", tool16["burst"]["turns_per_s_wall"],
            o("tool16"), raw.rate, rate),
        Row("one-tool turns/s, 128 sessions (wall)", tool128["burst"]["turns_per_s_wall"],
            o("tool128"), raw.rate, rate),
        Row("closed loop turns/s, 16 in flight (stream:true)", closed["turns_per_s"],
            o("closed"), raw.rate, rate),
        Row("accept p50 (seq, idle)", seq["accept_ms"]["p50"], o("accept"), raw.p50 * 1000, ms_),
        Row("end-to-end p50 (seq: POST -> polled final)", seq["e2e_ms"]["p50"], o("e2e50"),
            raw.p50 * 1000, ms_),
        Row("end-to-end p99 (seq)", seq["e2e_ms"]["p99"], o("e2e99"), raw.p99 * 1000, ms_),
        Row("first SSE event p50 (reattach, from the POST)",
            reattach["first_event_ms"]["p50"], o("first-event"), raw.p50 * 1000, ms_),
        Row("server CPU per turn (burst, 16 sessions)",
            burst["cpu_s"]["server"] * 1000 / max(1, burst["completed"]), o("cpu"), None, ms_),
        Row("server RSS at ready", ready_kb, o("rss-ready"), None, mb),
        Row("server RSS peak (VmHWM)", peak_kb, o("rss-peak"), None, mb),
    ]  # fmt: skip


def print_results(lines: Iterable[Row]) -> None:
    table = []
    for r in lines:
        ours = "-" if r.ours is None else r.show(r.ours)
        table.append((
            r.figure, ours,
            "-" if r.dispach is None else r.show(r.dispach),
            "-" if r.ours is None or not r.dispach else f"{r.ours / r.dispach:.2f}x",
            "-" if r.baseline is None else r.show(r.baseline),
            "-" if r.ours is None or not r.baseline else f"{r.ours / r.baseline:.2f}x",
        ))  # fmt: skip
    print_rows(
        ("figure", "ours", "Dispach", "ours / Dispach", "raw baseline", "ours / baseline"),
        table,
        {1, 2, 3, 4, 5},
    )


# --- the run -------------------------------------------------------------------------------------


async def bench(
    url: str, nats_url: str, plan: Plan, data_dir: Path | None, keep: bool, original: Original
) -> None:
    schema = f"bench_{secrets.token_hex(4)}"
    raw_schema = f"{schema}_raw"
    root = Path(tempfile.mkdtemp(prefix="dispach-bench-http-"))
    (root / "agents").mkdir()
    for agent, manifest in AGENTS.items():
        (root / "agents" / f"{agent}.yaml").write_text(manifest)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = root / "serve.log"
    env = {
        **os.environ,
        "DATABASE_URL": url, "NATS_URL": nats_url, "DISPACH_DB_SCHEMA": schema,
        "DISPACH_CLUSTER": schema,
        "DISPACH_HOME": str(root / "home"), "DISPACH_AGENTS": str(root / "agents"),
        "DISPACH_HOST": "127.0.0.1", "DISPACH_PORT": str(port), "DISPACH_API_TOKEN": "",
    }  # fmt: skip
    machine_facts(url, await nats_version(nats_url), data_dir)
    print(f"schema: {schema}  mode: {'quick' if plan is QUICK else 'full'}  turns: {plan.turns}")
    print(f"driver: {sys.executable} {LOADGEN}")

    await asyncio.to_thread(raw_setup, url, raw_schema)
    section("baseline: raw psycopg single-row INSERT + COMMIT")
    raw1 = await asyncio.to_thread(raw_single, url, raw_schema, plan.raw_seconds, "before")

    server: asyncio.subprocess.Process | None = None
    results: dict[str, dict[str, Any]] = {}
    try:
        with log.open("wb") as sink:
            server = await asyncio.create_subprocess_exec(
                str(DISPACH), "serve", env=env, stdout=sink, stderr=asyncio.subprocess.STDOUT
            )
        section(f"dispach serve (pid {server.pid}) on {base}")
        took = await wait_ready(server, base, log)
        ready = proc_status(server.pid)
        ready_cpu = cpu_seconds(server.pid)
        print(
            f"ready in {took:.2f} s; RSS {ready['VmRSS'] / 1024:.0f} MB, {ready['Threads']}"
            f" threads, CPU so far {ready_cpu:.2f} s"
        )
        for run in RUNS:
            section(f"loadgen {run.key}: agent {run.agent}, {run.phases}, {run.sessions} sessions")
            result = await loadgen(base, server.pid, run, plan)
            results[run.key] = result
            print_phases(run, result)
        peak = proc_status(server.pid)
        print(
            f"\nserver after all runs: RSS {peak['VmRSS'] / 1024:.0f} MB, peak (VmHWM)"
            f" {peak['VmHWM'] / 1024:.0f} MB, {peak['Threads']} threads, CPU"
            f" {cpu_seconds(server.pid) - ready_cpu:.1f} s since ready"
        )
        section("stop: SIGTERM")
        started = perf()
        status = await stop_server(server)
        print(f"dispach serve exited with {status} after {ms(perf() - started)}")
        if status != 0:
            print(tail(log))
    finally:
        if server is not None and server.returncode is None:
            server.kill()
            await server.wait()

    section("baseline again, right after: the machine is shared")
    raw2 = await asyncio.to_thread(raw_single, url, raw_schema, plan.raw_seconds, "after")
    raw = RawSingle.mean(raw1, raw2)
    if not keep:
        await asyncio.to_thread(drop_schemas, url, (schema, raw_schema))
    shutil.rmtree(root, ignore_errors=True)

    section("results")
    print(
        "raw baseline: single-row INSERT+COMMIT on the same database, mean of before and after"
        f" ({rate(raw.rate)}, p50 {ms(raw.p50)}, p99 {ms(raw.p99)}): the rate beside turns/s"
        " rows (ratio = turns per raw commit), p50/p99 beside latency rows.\n"
        f"Dispach: the original under the same driver, from {original.source}; compare only"
        " within one run of one machine."
    )
    print_results(rows(results, raw, ready["VmRSS"], peak["VmHWM"], original))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK.turns} turns a phase")
    parser.add_argument("--keep", action="store_true", help="keep the bench schemas afterwards")
    parser.add_argument(
        "--original", type=Path, metavar="FILE",
        help="the JSON of `sidebyside.py run --out FILE` (the original Dispach's figures)",
    )  # fmt: skip
    args = parser.parse_args()
    original = NO_ORIGINAL if args.original is None else Original.load(args.original)
    if not LOADGEN.is_file():
        raise SystemExit(f"the load driver is missing: {LOADGEN} (see docs/benchmarks.md)")
    if not DISPACH.is_file():
        raise SystemExit(f"{DISPACH} is missing: install the project (pip install -e '.[dev]')")
    plan = QUICK if args.quick else FULL
    started = perf()
    with servers() as found:
        run_loop(bench(found.database_url, found.nats_url, plan, found.data_dir, args.keep,
                       original))  # fmt: skip
    print(f"\ntotal time {perf() - started:.1f} s")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()

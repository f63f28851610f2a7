"""Benchmark of issue 14: 1 and 2 node processes on one log, and failover, in one run.

    .venv/bin/python bench/cluster.py [--quick] [--baseline <rev>] [--rounds 4] [--kills 5]

Uses DATABASE_URL / NATS_URL when set, else starts the embedded Postgres and NATS in a fresh
temporary directory (removed afterwards). Every node sees them as external services, so
``dispach serve --workers 2`` starts no service of its own: both workers share them.

Throughput. Configurations, alternated round by round (A B B A ..., the order reversed every
round, so a drift of the shared machine falls on all alike), each round a fresh
``python -m runtime serve`` with a fresh schema (``DISPACH_DB_SCHEMA``) and deployment name
(``DISPACH_CLUSTER``), on a free loopback port, its tree first on ``PYTHONPATH``:

  - ``1 process``: this tree, ``serve --workers 1`` (one node owns every partition);
  - ``2 processes``: this tree, ``serve --workers 2`` (a supervisor and two nodes on one port);
  - with ``--baseline <rev>``: that commit, plain ``serve``, from a git worktree (bench/ab.py's
    approach), e.g. ``1c14767``, main before issue 14: what ownership costs one node.

The round waits for ``GET /v1/ready`` and, for this tree, until ``GET /v1/cluster`` shows every
partition leased by exactly N nodes. Then bench/http.py's loadgen runs, with its agents (scripted
model ``bench``: one step; ``bench-tool``: calculator, then the answer) and its driver: ``seq``
(accept p50/p99, one keep-alive connection, so with 2 processes one worker answers every POST
and forwards the sessions the other owns) and ``burst`` over 16 sessions, then bursts over 128
sessions and one-tool bursts over 16 and 128. Node CPU is read from /proc for the whole process
tree (supervisor and workers), and the machine's busy share during the 128-session plain burst
says whether the 2 cores were saturated. The raw psycopg single-row INSERT + COMMIT is measured
before the rounds and after them (mean): the rate beside turns/s, as in bench/http.py. Nodes log
JSON at info (no line per turn): the round prints what its log said about ownership and every
warning. The round ends with SIGTERM; a server still running 30 s later is killed (-9, its
workers too) and reported, and its figures stand (they were measured before the stop).

Failover. Two separate nodes (``serve``, DISPACH_NODE_ID n1 and n2, DISPACH_LEASE_TTL_SECONDS
``--ttl``) on a fresh schema and deployment, serving agent ``slow`` whose model is the fake
Anthropic (tests/fakes) in a process of its own: it holds the first request of each turn (the
turn is in flight on its owner), and answers a request it has seen before at once, so a resumed
turn ends as soon as its new owner runs it and the figure is the cluster's, not the model's.
Per kill: ``--failover-turns`` turns on sessions whose partitions the victim holds
(``partition_of`` over GET /v1/cluster's leases), posted to the victim; once the fake holds all
of them, kill -9 of the victim; the time from the kill to the first ``turn.end`` of those turns
in the log (its ``recorded_at``) is the failover time; every turn must end exactly once, resumed
on the survivor. The victim is restarted (same id) and the bench waits until both nodes hold
partitions again before the next kill; the victims alternate. p50 and max over the kills are set
against TTL + 2 s.

Goals (issue 14, "Performance"): 2 processes >= 1.3x the throughput of 1; ownership costs no more
than 5 % of single-node throughput and adds <= 0.1 ms to accept p50 (1 process against
``--baseline``); failover <= TTL + 2 s.

``--quick``: 60 turns a burst, 1 round per configuration, 2 kills of 10 turns: a smoke run.
"""

from __future__ import annotations

# First: it takes this directory off the front of the import path (see its docstring).
from _report import (
    RawSingle,
    Servers,
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
from _cluster_figures import LATENCY, THROUGHPUT, print_results
from _cluster_nodes import (
    base_env,
    drop_streams,
    kill,
    lease_owners,
    log_summary,
    problems,
    spawn,
    wait_settled,
)
from _failover import failover, failover_goals
from _procstat import busy_share, children, machine_ticks, tree_cpu

# isort: split
import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import ab


def _load_http() -> ModuleType:
    """bench/http.py, whose agents, runs and driver call this bench shares. Its name is the
    standard library's ``http`` (which _report leaves first on the path), so it is loaded from
    its file, under ``bench_http``."""
    spec = importlib.util.spec_from_file_location("bench_http", Path(__file__).with_name("http.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building classes
    spec.loader.exec_module(module)
    return module


_http = _load_http()
ROOT = Path(__file__).resolve().parent.parent
LOADGEN: Path = _http.LOADGEN
RUNS: tuple[Any, ...] = tuple(
    dataclasses.replace(r, phases="seq,burst") if r.key == "main" else r for r in _http.RUNS
)
"""bench/http.py's four loadgen runs; the first without its closed-loop and reattach phases."""
STOP_SECONDS = 30.0
"""SIGTERM to exit, at most (DISPACH_DRAIN_SECONDS is 10); then kill -9, reported as -9."""


@dataclass(frozen=True)
class Plan:
    base: Any
    """bench/http.py's Plan: turns a loadgen phase, seconds of each raw-commit measurement."""
    rounds: int
    kills: int
    failover_turns: int


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    tree: ab.Tree
    workers: int | None
    """``--workers`` (None: the baseline, which has no such flag)."""


# --- decisions (pure) ----------------------------------------------------------------------------


def order(configs: int, rounds: int) -> list[int]:
    """Config indexes, round after round, each round reversed from the one before (A B B A for
    two configs, A B C C B A for three), so a drift in time favours none."""
    forward = list(range(configs))
    return [i for r in range(rounds) for i in (forward if r % 2 == 0 else forward[::-1])]


# --- throughput ----------------------------------------------------------------------------------


async def one_round(
    config: Config, found: Servers, plan: Plan, work: Path, keep: bool
) -> dict[str, dict[str, Any]] | None:
    """One fresh server of ``config`` under the four loadgen runs: their results (and
    ``node``: CPU and busy share), or None when the configuration failed (said why)."""
    suffix = secrets.token_hex(4)
    schema, cluster = f"bench_{suffix}", f"bench-{suffix}"
    root = work / schema
    (root / "agents").mkdir(parents=True)
    for agent, manifest in _http.AGENTS.items():
        (root / "agents" / f"{agent}.yaml").write_text(manifest)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = base_env(found, schema, cluster, root / "home", root / "agents") | {
        "DISPACH_PORT": str(port), "DISPACH_LOG_FORMAT": "json",
    }  # fmt: skip
    log = root / "serve.log"
    args = [] if config.workers is None else ["--workers", str(config.workers)]
    section(f"{config.label}: serve {' '.join(args)} (schema {schema}, cluster {cluster})")
    results: dict[str, dict[str, Any]] = {}
    workers: list[int] = []
    server = await spawn(config.tree.path, args, env, root, log)
    try:
        took = await wait_ready(server, base, log)
        if config.workers is not None:
            settling = perf()
            view = await wait_settled(base, config.workers)
            owners = ", ".join(f"{n} {c}" for n, c in sorted(lease_owners(view).items()))
            print(f"ready in {took:.2f} s; every partition leased {perf() - settling:.2f} s"
                  f" later: {owners}")  # fmt: skip
        else:
            print(f"ready in {took:.2f} s")
        for run in RUNS:
            print(f"{run.key} starts at {time.strftime('%H:%M:%S', time.gmtime())} UTC")
            cpu, ticks = tree_cpu(server.pid), machine_ticks()
            result: dict[str, Any] = await _http.loadgen(base, server.pid, run, plan.base)
            turns = result["burst"]["completed"] + result.get("seq_e2e", {}).get("n", 0)
            spent = tree_cpu(server.pid) - cpu
            result["node"] = {"cpu_ms_per_turn": spent * 1000 / max(1, turns),
                              "busy": busy_share(ticks, machine_ticks())}  # fmt: skip
            _http.print_phases(run, result)
            print(f"node CPU, every process of it (the 'server CPU' above is pid {server.pid}"
                  f" alone): {result['node']['cpu_ms_per_turn']:.2f} ms/turn;"
                  f" machine busy {result['node']['busy']:.0%}")  # fmt: skip
            results[run.key] = result
        print(f"its log, ownership events and warnings: {log_summary(log)}")
        section(f"{config.label}: stop (SIGTERM)")
        workers = children(server.pid)
        started = perf()
        status = await stop_server(server, STOP_SECONDS)
        results["stop"] = {"status": status, "seconds": perf() - started}
        print(f"exited with {status} after {ms(perf() - started)}")
        if status != 0:  # the figures above stand; the stop is reported on its own
            print(f"{config.label}: SIGTERM did not stop it cleanly (-9: still running after"
                  f" {STOP_SECONDS:g} s, then killed); the end of its log:")  # fmt: skip
            print(tail(log, 12))
    except SystemExit as e:
        print(f"{config.label} FAILED: {e}\nits log says:\n{problems(log)}\n--- end of its log:"
              f"\n{tail(log, 15)}")  # fmt: skip
        return None
    finally:
        await kill(server, workers or children(server.pid))
        if not keep:
            await asyncio.to_thread(drop_schemas, found.database_url, [schema])
            await drop_streams(found.nats_url, cluster)
    return results


async def throughput(
    configs: list[Config], found: Servers, plan: Plan, work: Path, keep: bool
) -> dict[str, list[dict[str, dict[str, Any]]]]:
    measured: dict[str, list[dict[str, dict[str, Any]]]] = {c.key: [] for c in configs}
    sequence = order(len(configs), plan.rounds)
    print("order: " + " ".join(configs[i].key for i in sequence))
    for n, which in enumerate(sequence, 1):
        config = configs[which]
        print(f"\n-- round {n} of {len(sequence)}: {config.label}", flush=True)
        result = await one_round(config, found, plan, work, keep)
        if result is not None:
            measured[config.key].append(result)
            shown = (f"{f.key} {f.show(v)}" for f in THROUGHPUT + LATENCY
                     if (v := f.read(result)) is not None)  # fmt: skip
            print(f"round {n} {config.key}: " + ", ".join(shown), flush=True)
    return measured


# --- the run -------------------------------------------------------------------------------------


async def bench(
    configs: list[Config], found: Servers, plan: Plan, ttl: float, work: Path, keep: bool
) -> None:
    machine_facts(found.database_url, await nats_version(found.nats_url), found.data_dir)
    print(f"mode: {'quick' if plan.base is _http.QUICK else 'full'}; turns a phase:"
          f" {plan.base.turns}; rounds per configuration: {plan.rounds}; kills: {plan.kills} of"
          f" {plan.failover_turns} turns; lease TTL (failover) {ttl:g} s")  # fmt: skip
    print(f"driver: {sys.executable} {LOADGEN}")
    for c in configs:
        print(f"{c.key}: {c.label} ({c.tree.name}, {c.tree.path})")
    raw_schema = f"bench_{secrets.token_hex(4)}_raw"
    await asyncio.to_thread(raw_setup, found.database_url, raw_schema)
    section("baseline: raw psycopg single-row INSERT + COMMIT")
    raw1 = await asyncio.to_thread(raw_single, found.database_url, raw_schema,
                                   plan.base.raw_seconds, "before")  # fmt: skip
    measured = await throughput(configs, found, plan, work, keep) if plan.rounds else {}
    section("baseline again, after the rounds: the machine is shared")
    raw2 = await asyncio.to_thread(raw_single, found.database_url, raw_schema,
                                   plan.base.raw_seconds, "after")  # fmt: skip
    raw = RawSingle.mean(raw1, raw2)
    if not keep:
        await asyncio.to_thread(drop_schemas, found.database_url, [raw_schema])
    this = next(c for c in configs if c.key == "w1").tree.path
    kills = (await failover(this, found, plan.kills, plan.failover_turns, ttl, work, keep)
             if plan.kills else [])  # fmt: skip

    section("results")
    print(f"medians of the rounds; raw baseline: single-row INSERT+COMMIT on the same database,"
          f" mean of before and after ({rate(raw.rate)}, p50 {ms(raw.p50)}): beside turns/s"
          f" rows as a rate, beside latency rows as its p50.")  # fmt: skip
    baseline = next((c.tree.name for c in configs if c.key == "base"), None)
    goals = print_results(measured, raw, baseline) if measured else []
    if kills:
        print()
        print_rows(
            ("kill", "victim", "turns", "first turn.end", "last turn.end", "ended", "resumed on"),
            [(str(i + 1), k.victim, str(k.turns),
              "-" if k.first_s is None else f"{k.first_s:.2f} s",
              "-" if k.last_s is None else f"{k.last_s:.2f} s",
              f"{len(k.ends)} ({sum(k.ends.values())} ends)",
              ", ".join(f"{n} {c}" for n, c in sorted(k.resumed_on.items())))
             for i, k in enumerate(kills)],
            {2, 3, 4},
        )  # fmt: skip
    goals += failover_goals(kills, ttl)
    if goals:
        print()
        print_rows(("goal (issue 14)", "measured", "met?"), goals, set())


@contextlib.contextmanager
def worktree(rev: str | None, work: Path) -> Iterator[ab.Tree | None]:
    """A detached git worktree of ``rev`` (bench/ab.py's baseline), removed afterwards."""
    if rev is None:
        yield None
        return
    short = ab.git("rev-parse", "--short", rev)
    path = work / "baseline"
    ab.git("worktree", "add", "--detach", str(path), short)
    try:
        yield ab.Tree(f"baseline {short}", path)
    finally:
        ab.git("worktree", "remove", "--force", str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true",
                        help="60 turns a phase, 1 round, 2 kills of 10 turns")  # fmt: skip
    parser.add_argument("--baseline", help="a commit to run as the 1-process baseline")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per configuration")
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--failover-turns", type=int, default=20, help="turns in flight a kill")
    parser.add_argument("--ttl", type=float, default=3.0, help="lease TTL of the failover nodes")
    parser.add_argument("--keep", action="store_true", help="keep the schemas, buckets and logs")
    args = parser.parse_args()
    if not LOADGEN.is_file():
        raise SystemExit(f"the load driver is missing: {LOADGEN} (see docs/benchmarks.md)")
    plan = (Plan(_http.QUICK, 1, 2, 10) if args.quick else
            Plan(_http.FULL, args.rounds, args.kills, args.failover_turns))  # fmt: skip
    head = ab.git("rev-parse", "--short", "HEAD")
    dirty = "+changes" if ab.git("status", "--porcelain", "--", "*.py") else ""
    this = ab.Tree(f"this tree {head}{dirty}", ROOT)
    started = perf()
    work = Path(tempfile.mkdtemp(prefix="dispach-bench-cluster-"))
    try:
        with worktree(args.baseline, work) as old, servers() as found:
            configs = [Config("w1", "1 process", this, 1), Config("w2", "2 processes", this, 2)]
            if old is not None:
                configs.insert(0, Config("base", old.name, old, None))
            run_loop(bench(configs, found, plan, args.ttl, work, args.keep))
    finally:
        if args.keep:
            print(f"\nthe nodes' logs are kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\ntotal time {perf() - started:.1f} s")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()

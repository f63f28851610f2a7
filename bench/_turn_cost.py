"""What a window of turns cost, per turn that ended in it (bench/turns.py): CPU of this process
by thread family, of Postgres and of nats-server, the writer's commits, WAL bytes, NATS
messages and threads started, from a snapshot before and after the window."""

from __future__ import annotations

from _report import perf, print_rows

# isort: split
from _procstat import proc_cpu, proc_ppid, thread_kind, thread_starts

# isort: split
import os
import resource
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psycopg

from runtime.node import Node


@dataclass(frozen=True)
class Snapshot:
    at: float
    process_cpu: float
    threads: dict[int, tuple[str, float]]
    """native thread id -> (family, CPU seconds), live threads only."""
    pg_cpu: dict[int, float]
    nats_cpu: float | None
    next_xid: int
    wal_bytes: int
    xacts: int
    batches: int
    commands: int
    nats_in: int
    nats_out: int
    thread_starts: dict[str, int]


class Monitor:
    """Takes before/after snapshots of a window: this process, Postgres, NATS and the writer."""

    def __init__(self, url: str, node: Node, nats_pid: int | None, local_pg: bool) -> None:
        self.conn = psycopg.connect(url, autocommit=True)
        self.node = node
        self.nats_pid = nats_pid
        self.local_pg = local_pg
        row = self.conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid() LIMIT 1"
        ).fetchone()
        self.postmaster = proc_ppid(int(row[0])) if row and local_pg else None

    def close(self) -> None:
        self.conn.close()

    def snapshot(self) -> Snapshot:
        row = self.conn.execute(
            "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint,"
            " (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint,"
            " (SELECT xact_commit + xact_rollback FROM pg_stat_database"
            "   WHERE datname = current_database())"
        ).fetchone()
        assert row is not None
        pg_cpu: dict[int, float] = {}
        if self.local_pg:
            pids = [r[0] for r in self.conn.execute("SELECT pid FROM pg_stat_activity")]
            for pid in pids:
                cpu = proc_cpu(int(pid))
                if cpu is not None:
                    pg_cpu[int(pid)] = cpu
            if self.postmaster is not None:
                cpu = proc_cpu(self.postmaster, children=True)
                if cpu is not None:
                    pg_cpu[self.postmaster] = cpu
        threads: dict[int, tuple[str, float]] = {}
        me = os.getpid()
        for t in threading.enumerate():
            if t.native_id is None:
                continue
            cpu = proc_cpu(me, t.native_id)
            if cpu is not None:
                threads[t.native_id] = (thread_kind(t.name), cpu)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        store = self.node.store
        assert store is not None and self.node.nc is not None
        writer = store._writer
        stats = self.node.nc.stats
        return Snapshot(
            at=perf(),
            process_cpu=usage.ru_utime + usage.ru_stime,
            threads=threads,
            pg_cpu=pg_cpu,
            nats_cpu=None if self.nats_pid is None else proc_cpu(self.nats_pid),
            next_xid=int(row[0]),
            wal_bytes=int(row[1]),
            xacts=int(row[2] or 0),
            batches=writer.batches,
            commands=writer.commands,
            nats_in=int(stats["in_msgs"]),
            nats_out=int(stats["out_msgs"]),
            thread_starts=dict(thread_starts),
        )


@dataclass(frozen=True)
class Usage:
    """What one window cost, per turn that ended in it."""

    turns: int
    seconds: float
    process_cpu: float
    threads: dict[str, float]
    pg_cpu: float | None
    nats_cpu: float | None
    write_xacts: float
    wal_bytes: float
    statements: float
    writer_batches: float
    writer_appends: float
    nats_in: float
    nats_out: float
    thread_starts: dict[str, float]


def usage(a: Snapshot, b: Snapshot, turns: int) -> Usage:
    n = max(1, turns)
    threads: dict[str, float] = defaultdict(float)
    live = 0.0
    for tid, (kind, cpu) in b.threads.items():
        before = a.threads.get(tid, (kind, 0.0))[1]
        threads[kind] += cpu - before
        live += cpu - before
    process = b.process_cpu - a.process_cpu
    threads["(exited threads)"] = max(0.0, process - live)
    pg = sum(cpu - a.pg_cpu[pid] for pid, cpu in b.pg_cpu.items() if pid in a.pg_cpu)
    starts = {k: (v - a.thread_starts.get(k, 0)) / n for k, v in b.thread_starts.items()}
    return Usage(
        turns=turns,
        seconds=b.at - a.at,
        process_cpu=process / n,
        threads={k: v / n for k, v in threads.items()},
        pg_cpu=pg / n if b.pg_cpu else None,
        nats_cpu=None
        if a.nats_cpu is None or b.nats_cpu is None
        else (b.nats_cpu - a.nats_cpu) / n,
        write_xacts=(b.next_xid - a.next_xid) / n,
        wal_bytes=(b.wal_bytes - a.wal_bytes) / n,
        statements=(b.xacts - a.xacts) / n,
        writer_batches=(b.batches - a.batches) / n,
        writer_appends=(b.commands - a.commands) / n,
        nats_in=(b.nats_in - a.nats_in) / n,
        nats_out=(b.nats_out - a.nats_out) / n,
        thread_starts={k: v for k, v in starts.items() if v > 0},
    )


FAMILIES = {
    "MainThread": "MainThread (the event loop)",
    "dispach-writer": "dispach-writer (group commit)",
    "uvloop": "uvloop (default executor: Portal.wait, to_thread)",
    "asyncio": "asyncio (default executor: Portal.wait, to_thread)",
    "dispach-worker": "dispach-worker (psycopg pool)",
    "dispach-scheduler": "dispach-scheduler (psycopg pool)",
    "(exited threads)": "exited during the window (TurnActor threads)",
}


def starts_of(kind: str) -> Callable[[Usage], float]:
    return lambda u: u.thread_starts.get(kind, 0.0)


def cpu_of(family: str) -> Callable[[Usage], float]:
    return lambda u: u.threads.get(family, 0.0) * 1000


def print_usage(runs: Sequence[tuple[str, Usage]]) -> None:
    """The table of what each run cost per turn, a column a run (its name, its usage)."""
    header = ["per turn", *[name for name, _ in runs]]
    usages = [u for _, u in runs]

    def row(name: str, get: Callable[[Usage], float | None], fmt: str = "{:.2f}") -> list[str]:
        values = [get(u) for u in usages]
        return [name, *["n/a" if v is None else fmt.format(v) for v in values]]

    rows = [
        row("python process CPU, ms (node + bench client)", lambda u: u.process_cpu * 1000),
        row("postgres CPU, ms (all its processes)",
            lambda u: None if u.pg_cpu is None else u.pg_cpu * 1000),
        row("nats-server CPU, ms",
            lambda u: None if u.nats_cpu is None else u.nats_cpu * 1000),
        row("appends committed by the writer", lambda u: u.writer_appends),
        row("writer transactions (group commits)", lambda u: u.writer_batches),
        row("write transactions in Postgres (xids)", lambda u: u.write_xacts),
        row("Postgres transactions incl. reads (approx.)", lambda u: u.statements, "{:.1f}"),
        row("WAL bytes", lambda u: u.wal_bytes, "{:,.0f}"),
        row("NATS messages out (node connection)", lambda u: u.nats_out, "{:.1f}"),
        row("NATS messages in (node connection)", lambda u: u.nats_in, "{:.1f}"),
    ]  # fmt: skip
    for kind in sorted({k for u in usages for k in u.thread_starts}):
        rows.append(row(f"threads started: {kind}", starts_of(kind)))
    for family in sorted({k for u in usages for k in u.threads}):
        if any(u.threads.get(family, 0.0) >= 0.00005 for u in usages):
            rows.append(row(f"CPU ms, thread {FAMILIES.get(family, family)}", cpu_of(family)))
    print_rows(header, rows, set(range(1, len(header))))

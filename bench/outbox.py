"""Benchmark of the outbox: drain rate to a local webhook receiver, and recovery after a restart.

    .venv/bin/python bench/outbox.py [--quick] [--keep] [--items N] [--concurrency C] [--profile]
                                     [--node-script SCRIPT]

Uses DATABASE_URL / NATS_URL when set, else starts the embedded Postgres and NATS in a fresh
temporary directory (removed afterwards). The node is a subprocess, ``.venv/bin/dispach serve``,
on a free loopback port, with its own DISPACH_HOME and schema ``bench_<hex>`` (the baseline's
scratch table is in ``bench_<hex>_raw``); one agent, ``bench``, has a webhook channel ``hooks``
(concurrency 64, or --concurrency) pointed at the test suite's WebhookReceiver
(tests/fakes/webhook_receiver.py), which runs in a process of its own so that it shares no GIL
with the node or the bench.

The bench writes the items itself, as a turn would: ``delivery.enqueued`` events (one ~200 char
chunk each, ten items per fake turn stream, one append per item) through an EventStore of its own
on the node's schema with the inline projections, so the ``outbox`` rows appear in the same
commits. The node is not woken by another process's commits: it finds them by its poll
(DISPACH_OUTBOX_POLL_MS, 1 s), then keeps draining without waiting while there is work.

  1. drain: the node is up and idle; N items are appended (10,000; --quick 2,000). Rate = N over
     the first item's commit to the last ``sent`` (both from the outbox rows: created_at, and
     updated_at of the sent row); latency = created_at -> updated_at per item.
  2. recovery: SIGTERM the node, append N items while it is down, and give 1 % of them a
     ``delivery.attempted`` by the stopped node (a send in doubt, left by a node that is gone:
     recovery flags it uncertain and resends it), then start a node: process start -> /v1/ready,
     and process start -> the last item sent.
  3. --profile: a third node under cProfile (event-loop thread only, enabled by SIGUSR1 just
     before the items are appended) drains N more items; prints where the loop's time went.

CPU is read from /proc: the node's main thread (the event loop) and its other threads apart, the
receiver, the embedded Postgres (postmaster and backends) and nats-server, the bench itself, and
the machine's busy share (the rest is other work on a shared machine). The table sets each rate
beside the raw psycopg single-row INSERT + COMMIT rate on the same database, measured before and
after (the machine is shared: ratios travel, absolutes do not). --node-script runs the node as
``python SCRIPT`` (a script ending in runtime.cli's ``dispach serve``), to measure a change
without editing the library.
"""

from __future__ import annotations

# First: it takes this directory off the front of the import path (see its docstring).
from _report import (
    Goal,
    Line,
    RawSingle,
    Servers,
    drop_schemas,
    free_port,
    line,
    machine_facts,
    ms,
    nats_version,
    perf,
    print_table,
    rate,
    raw_setup,
    raw_single,
    run_loop,
    section,
    servers,
)

# isort: split
from _outbox_items import AGENT, Settled, seed, settled, wait_settled
from _outbox_rig import DISPACH, Meter, Node, Receiver, Rig, Usage, log_summary
from _procstat import cpu_seconds, proc_status
from _profile import package_area, print_areas, print_top, raw_stats, total_time

# isort: split
import argparse
import asyncio
import contextlib
import os
import pstats
import secrets
import shutil
import signal
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

SECRET = "bench-webhook-secret-0123456789"
UNCERTAIN_SHARE = 0.01


@dataclass(frozen=True)
class Plan:
    items: int
    raw_seconds: float
    keep: bool = False
    concurrency: int = 64
    profile: bool = False
    node_script: Path | None = None
    """Run the node as ``python <script>`` instead of ``dispach serve`` (an experiment)."""


FULL = Plan(10_000, 3.0)
QUICK = Plan(2_000, 0.5)


# --- the phases ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Drain:
    rows: Settled
    usage: Usage
    seen: float
    """Seconds from the start of the seeding to the poll that saw the outbox empty."""

    @property
    def rate(self) -> float:
        return self.rows.sent / (self.rows.last_sent - self.rows.first_enqueued)

    @property
    def steady(self) -> float:
        return self.rows.sent / (self.rows.last_sent - self.rows.first_sent)


async def drain(rig: Rig, batch: str, items: int) -> Drain:
    meter = Meter(rig.node.pid, rig.others)
    began = perf()
    seeding = asyncio.ensure_future(asyncio.to_thread(seed, rig.store, batch, items))
    seen = await wait_settled(rig.url, rig.schema, 120 + items / 50, seeding)
    usage = meter.read()
    rows = await asyncio.to_thread(settled, rig.url, rig.schema, batch)
    result = Drain(rows, usage, seen - began)
    print(
        f"{rows.sent} sent, {rows.unsent} not sent; appended in"
        f" {rows.last_enqueued - rows.first_enqueued:.2f} s"
        f" ({rate(items / max(1e-9, rows.last_enqueued - rows.first_enqueued))}); first sent"
        f" {rows.first_sent - rows.first_enqueued:.2f} s after the first append (the node's poll);"
        f" last sent {rows.last_sent - rows.first_enqueued:.2f} s after it (the bench's 20 ms poll"
        f" saw it at {result.seen:.2f} s)\n"
        f"drain {rate(result.rate)} (first append -> last sent), {rate(result.steady)} (first sent"
        f" -> last sent); append -> sent p50 {ms(rows.latency_p50)}, p99 {ms(rows.latency_p99)}\n"
        f"{usage.show(items)}"
    )
    return result


@dataclass(frozen=True)
class Recovery:
    ready: float
    settled: float
    rows: Settled
    usage: Usage
    ready_cpu: float
    ready_kb: int

    @property
    def rate(self) -> float:
        return self.rows.sent / (self.rows.last_sent - self.rows.first_sent)


async def recovery(rig: Rig, batch: str, items: int) -> Recovery:
    node = rig.node
    dead = f"{socket.gethostname()}-{node.pid}"  # the node id it ran under (DISPACH_NODE_ID unset)
    await node.stop()
    in_doubt = max(1, round(items * UNCERTAIN_SHARE))
    took = perf()
    await asyncio.to_thread(seed, rig.store, batch, items, in_doubt, dead)
    print(f"appended {items} items ({in_doubt} with a delivery.attempted by the stopped node"
          f" {dead}) while the node was down in {perf() - took:.2f} s")  # fmt: skip
    ready = await node.start()
    meter = Meter(node.pid, rig.others)
    ready_cpu, ready_kb = cpu_seconds(node.pid), proc_status(node.pid)["VmRSS"]
    seen = await wait_settled(rig.url, rig.schema, 120 + items / 50) - node.started
    usage = meter.read()
    rows = await asyncio.to_thread(settled, rig.url, rig.schema, batch)
    result = Recovery(ready, rows.last_sent - node.started_wall, rows, usage, ready_cpu, ready_kb)
    print(
        f"process start -> ready {result.ready:.2f} s (CPU {ready_cpu:.2f} s); first sent"
        f" {rows.first_sent - node.started_wall:.2f} s, last sent {result.settled:.2f} s after"
        f" the process start (the bench's 20 ms poll saw it at {seen:.2f} s); {rows.sent} sent,"
        f" {rows.unsent} not sent, {rows.uncertain} flagged uncertain (expected {in_doubt})\n"
        f"drain after recovery {rate(result.rate)} (first sent -> last sent)\n"
        f"{usage.show(items)} (from ready)"
    )
    return result


async def profiled(rig: Rig, items: int, out: Path) -> None:
    await rig.node.stop()
    await rig.node.start(profile_to=out)
    os.kill(rig.node.pid, signal.SIGUSR1)
    result = await drain(rig, "bench-profile", items)
    os.kill(rig.node.pid, signal.SIGUSR2)
    await rig.node.stop()  # the handler has run (and dumped the profile) by the time it exits
    print_profile(pstats.Stats(str(out)), result.rows.sent)


def print_profile(stats: pstats.Stats, items: int) -> None:
    raw = raw_stats(stats)
    total = total_time(raw)
    print(f"event-loop thread: {total:.2f} s of profiled function time, "
          f"{total / max(1, items) * 1000:.3f} ms per item (cProfile inflates it)")  # fmt: skip
    print_areas(raw, package_area, "own time by area:", items, "item", most=14)
    for key, title in ((2, "own time"), (3, "cumulative time")):
        print_top(raw, key, title, 22, items, "item", digits=4)


# --- the run -------------------------------------------------------------------------------------


def table(items: int, raw: RawSingle, first: Drain, second: Recovery, peak_kb: int) -> list[Line]:
    def seconds(x: float) -> str:
        return f"{x:.2f} s"

    def mb(x: float) -> str:
        return f"{x / 1024:.0f} MB"

    def cpu(x: float) -> str:
        return f"{x:.2f} s"

    full = items >= FULL.items
    per_k = 1000 / items
    return [
        line("drain items/s (first append -> last sent)", first.rate, raw.rate, rate,
             Goal(">= 1,000/s", lambda ours, _: ours >= 1000)),
        line("drain items/s (first sent -> last sent)", first.steady, raw.rate, rate),
        line("append -> sent p50", first.rows.latency_p50, raw.p50, ms),
        line("append -> sent p99", first.rows.latency_p99, raw.p99, ms),
        line("recovery: process start -> ready", second.ready, None, seconds),
        line(f"recovery: process start -> {items:,} sent", second.settled, None, seconds,
             Goal("<= 15 s", lambda ours, _: ours <= 15) if full else None),
        line("recovery: drain items/s (first sent -> last sent)", second.rate, raw.rate, rate),
        line("node CPU per 1,000 items (drain)",
             first.usage.node * per_k, None, cpu),
        line("node CPU per 1,000 items (after recovery)",
             second.usage.node * per_k, None, cpu),
        line("node RSS at ready (recovery node)", second.ready_kb, None, mb),
        line("node RSS peak (VmHWM, recovery node)", peak_kb, None, mb),
    ]  # fmt: skip


def others(receiver: Receiver, found: Servers) -> dict[str, int]:
    """The processes whose CPU is counted beside the node's: the receiver, and the embedded
    Postgres (its postmaster, with every backend) and nats-server when the bench started them."""
    pids = {"receiver": receiver.pid}
    if found.data_dir is not None:
        postmaster = found.data_dir / "postgres" / "postmaster.pid"
        with contextlib.suppress(OSError, ValueError, IndexError):
            pids["postgres"] = int(postmaster.read_text().split()[0])
    if found.nats_pid is not None:
        pids["nats"] = found.nats_pid
    return pids


async def bench(found: Servers, plan: Plan) -> None:
    from eventstore import INLINE, EventStore

    url, nats_url, data_dir = found.database_url, found.nats_url, found.data_dir
    schema = f"bench_{secrets.token_hex(4)}"
    raw_schema = f"{schema}_raw"
    root = Path(tempfile.mkdtemp(prefix="dispach-bench-outbox-"))
    machine_facts(url, await nats_version(nats_url), data_dir)
    print(f"schema: {schema}  items: {plan.items}  channel concurrency: {plan.concurrency}"
          f"  raw baseline: {plan.raw_seconds:g} s"
          + (f"  node: python {plan.node_script}" if plan.node_script else ""))  # fmt: skip

    await asyncio.to_thread(raw_setup, url, raw_schema)
    section("baseline: raw psycopg single-row INSERT + COMMIT")
    raw1 = await asyncio.to_thread(raw_single, url, raw_schema, plan.raw_seconds, "before")

    receiver = Receiver(SECRET)
    (root / "agents").mkdir()
    (root / "agents" / f"{AGENT}.yaml").write_text(
        f"id: {AGENT}\nmodel: {{provider: scripted}}\nchannels:\n"
        f'  - {{id: hooks, type: webhook, url: "{receiver.url}",'
        f" concurrency: {plan.concurrency}}}\n"
    )
    port = free_port()
    node = Node(
        {
            **{k: v for k, v in os.environ.items() if k != "DISPACH_NODE_ID"},
            "DATABASE_URL": url,
            "NATS_URL": nats_url,
            "DISPACH_DB_SCHEMA": schema,
            "DISPACH_CLUSTER": schema,
            "DISPACH_HOME": str(root / "home"),
            "DISPACH_AGENTS": str(root / "agents"),
            "DISPACH_HOST": "127.0.0.1",
            "DISPACH_PORT": str(port),
            "DISPACH_API_TOKEN": "",
            "DISPACH_WEBHOOK_SECRET": SECRET,
        },
        f"http://127.0.0.1:{port}",
        root / "serve.log",
        plan.node_script,
    )
    store = EventStore(url, schema=schema, inline=INLINE)
    rig = Rig(node, store, url, schema, others(receiver, found))
    try:
        section(f"node: dispach serve on {node.base}; receiver (pid {receiver.pid}) {receiver.url}")
        ready = await node.start()
        print(f"ready in {ready:.2f} s; RSS {proc_status(node.pid)['VmRSS'] / 1024:.0f} MB")
        await asyncio.to_thread(store.open)

        section(f"1. drain: {plan.items:,} items appended by the bench to an idle node")
        first = await drain(rig, "bench-drain", plan.items)

        section(f"2. recovery: stop, {plan.items:,} items appended meanwhile, start")
        second = await recovery(rig, "bench-recovery", plan.items)
        status = proc_status(node.pid)
        print(f"node now: RSS {status['VmRSS'] / 1024:.0f} MB, peak {status['VmHWM'] / 1024:.0f}"
              f" MB, {status['Threads']} threads")  # fmt: skip

        if plan.profile:
            section(f"3. profile: a node under cProfile drains {plan.items:,} more items")
            await profiled(rig, plan.items, root / "node.prof")
        tally = receiver.tally()
        expected = plan.items * (3 if plan.profile else 2)
        print(f"\nreceiver: {tally} (expected {expected} kept, 0 duplicates, 0 not 200)")
        if not plan.profile:
            section("stop")
            await node.stop()
        print(log_summary(node.log))
    finally:
        node.kill()
        receiver.stop()
        await asyncio.to_thread(store.close)

    section("baseline again, right after: the machine is shared")
    raw2 = await asyncio.to_thread(raw_single, url, raw_schema, plan.raw_seconds, "after")
    raw = RawSingle.mean(raw1, raw2)
    if plan.keep:
        print(f"kept: schemas {schema}, {raw_schema}; node log and profile in {root}")
    else:
        await asyncio.to_thread(drop_schemas, url, (schema, raw_schema))
        shutil.rmtree(root, ignore_errors=True)

    section("results")
    print(
        f"raw baseline: single-row INSERT+COMMIT on the same database, mean of before and after"
        f" ({rate(raw.rate)}, p50 {ms(raw.p50)}, p99 {ms(raw.p99)}): the rate beside items/s"
        f" (ratio = items sent per raw commit), p50/p99 beside latencies. {plan.items:,} items a"
        f" phase; each item is 2 appends by the node (attempted, sent) and one POST."
    )
    print_table(table(plan.items, raw, first, second, status["VmHWM"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK.items:,} items a phase")
    parser.add_argument("--items", type=int, help="items a phase (default 10,000)")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the bench schemas, the node's log and profile afterwards",
    )
    parser.add_argument("--concurrency", type=int, default=64, help="the channel's (64)")
    parser.add_argument("--profile", action="store_true", help="a third drain under cProfile")
    parser.add_argument(
        "--node-script",
        type=Path,
        help="run the node as `python SCRIPT` (a "
        "script ending in runtime.cli's `dispach serve`: to try a change)",
    )
    args = parser.parse_args()  # fmt: skip
    if not DISPACH.is_file():
        raise SystemExit(f"{DISPACH} is missing: install the project (pip install -e '.[dev]')")
    base = QUICK if args.quick else FULL
    plan = Plan(args.items or base.items, base.raw_seconds, args.keep, args.concurrency,
                args.profile, args.node_script)  # fmt: skip
    started = perf()
    with servers() as found:
        run_loop(bench(found, plan))
    print(f"\ntotal time {perf() - started:.1f} s")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()

"""Failover, bench/cluster.py's second part: two nodes on one log and the fake Anthropic holding
each turn's first model call; kill -9 of the node that owns the turns in flight, and the time
until they end on the survivor."""

from __future__ import annotations

from _report import Servers, drop_schemas, free_port, section, stop_server, wait_ready

# isort: split
from _child import Child
from _cluster_figures import median
from _cluster_nodes import (
    base_env,
    call,
    drop_streams,
    kill,
    log_summary,
    problems,
    spawn,
    until,
    wait_settled,
)

# isort: split
import asyncio
import json
import os
import re
import secrets
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psycopg

from actors.cluster.partitions import partition_of
from eventstore import streams

SLOW_AGENT = """\
id: slow
name: Failover agent (the fake Anthropic holds each turn's first model call)
model:
  provider: anthropic
  id: claude-sonnet-5
  base_url: {url}
  api_key_env: DISPACH_BENCH_ANTHROPIC_KEY
tools: []
"""


MARKER = re.compile(r"failover turn (k\d+t\d+)")


def _serve_fake(conn: Connection, hold: float) -> None:
    """The child: a FakeAnthropic that holds the first request of each turn (by the marker in
    its message) for ``hold`` s and answers a repeated one at once; ``("seen", prefix)`` asks
    how many markers with that prefix it has received."""
    from tests.fakes.anthropic_server import FakeAnthropic, Item, Reply

    halt = threading.Event()
    seen: set[str] = set()
    lock = threading.Lock()

    def answer(body: dict[str, Any]) -> Item:
        markers = MARKER.findall(json.dumps(body.get("messages")))
        if markers:
            with lock:
                first = markers[-1] not in seen
                seen.add(markers[-1])
            if first:
                halt.wait(hold)
        return Reply(text="done")

    with FakeAnthropic() as fake:
        fake.responder = answer
        conn.send(fake.url)
        while (asked := conn.recv()) != "stop":
            with lock:
                conn.send(sum(1 for m in seen if m.startswith(asked[1])))
        halt.set()


class Fake(Child):
    def __init__(self, hold: float) -> None:
        super().__init__(_serve_fake, hold, name="fake-anthropic")

    def seen(self, prefix: str) -> int:
        count: int = self.ask(("seen", prefix))
        return count


# --- failover ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kill:
    victim: str
    turns: int
    first_s: float | None
    """kill -9 to the first turn.end of the victim's turns (None: none ended)."""
    last_s: float | None
    ends: Counter[str]
    """turn.end events per turn."""
    resumed_on: Counter[str]
    """The node of each turn's last turn.attempt."""
    reasons: Counter[str]


class Nodes:
    """The two failover nodes: their processes, ports and logs."""

    def __init__(self, tree: Path, env: dict[str, str], root: Path) -> None:
        self.tree, self.env, self.root = tree, env, root
        self.ports = {n: free_port() for n in ("n1", "n2")}
        self.procs: dict[str, asyncio.subprocess.Process] = {}

    def base(self, node: str) -> str:
        return f"http://127.0.0.1:{self.ports[node]}"

    def log(self, node: str) -> Path:
        return self.root / f"serve-{node}.log"

    async def start(self, node: str) -> None:
        env = self.env | {"DISPACH_NODE_ID": node, "DISPACH_PORT": str(self.ports[node]),
                          "DISPACH_HOME": str(self.root / f"home-{node}")}  # fmt: skip
        self.procs[node] = await spawn(self.tree, [], env, self.root, self.log(node))
        await wait_ready(self.procs[node], self.base(node), self.log(node))

    def said(self) -> str:
        return "\n".join(f"--- {n}:\n{problems(self.log(n))}" for n in self.procs)


async def ended_rows(conn: psycopg.AsyncConnection[Any], turn_ids: list[str]) -> list[Any]:
    """(turn id, recorded_at, reason) of every turn.end of ``turn_ids``."""
    cursor = await conn.execute(
        "SELECT substr(stream_id, 6), recorded_at, data->>'reason' FROM events"
        " WHERE type = 'turn.end' AND stream_id = ANY(%s)",
        [[streams.turn(t) for t in turn_ids]],
    )
    return list(await cursor.fetchall())


async def last_attempts(conn: psycopg.AsyncConnection[Any], turn_ids: list[str]) -> Counter[str]:
    cursor = await conn.execute(
        "SELECT DISTINCT ON (stream_id) data->>'node' FROM events"
        " WHERE (type = 'turn.attempt' OR (type = 'turn.start' AND data->>'attempt' = '1'))"
        " AND stream_id = ANY(%s)"
        " ORDER BY stream_id, global_position DESC",
        [[streams.turn(t) for t in turn_ids]],
    )
    return Counter(str(row[0]) for row in await cursor.fetchall())


async def one_kill(
    k: int, nodes: Nodes, fake: Fake, conn: psycopg.AsyncConnection[Any], turns: int, ttl: float
) -> Kill:
    victim, survivor = ("n2", "n1") if k % 2 == 0 else ("n1", "n2")
    view = await wait_settled(nodes.base(survivor), {"n1", "n2"})
    count = int(view["partitions"])
    held = {x["partition"] for x in view["leases"] if x.get("node") == victim}
    keys = (f"fo{k}-{i}" for i in range(100_000))
    sessions = [s for s in keys if partition_of("slow", s, count) in held][:turns]
    turn_ids: list[str] = []
    for i, session in enumerate(sessions):
        body = {"text": f"failover turn k{k}t{i}", "sessionKey": session, "deliver": "none"}
        status, answer = await asyncio.to_thread(
            call, nodes.base(victim) + "/v1/agents/slow/messages", body
        )
        if status != 202:
            raise SystemExit(f"POST to {victim} answered {status}: {answer}\n{nodes.said()}")
        turn_ids.append(str(answer["turnId"]))

    async def all_held() -> bool:
        return await asyncio.to_thread(fake.seen, f"k{k}t") >= len(turn_ids)

    if not await until(all_held, 30):
        held_now = await asyncio.to_thread(fake.seen, f"k{k}t")
        raise SystemExit(f"the fake holds {held_now} of {len(turn_ids)} turns after 30 s")
    proc = nodes.procs[victim]
    os.killpg(proc.pid, signal.SIGKILL)
    killed_at = time.time()
    await proc.wait()
    rows: list[Any] = []

    async def all_ended() -> bool:
        rows[:] = await ended_rows(conn, turn_ids)
        return len(rows) >= len(turn_ids)

    await until(all_ended, ttl + 60)
    at = sorted(row[1].timestamp() - killed_at for row in rows)
    result = Kill(
        victim, len(turn_ids), at[0] if at else None, at[-1] if at else None,
        Counter(str(row[0]) for row in rows), await last_attempts(conn, turn_ids),
        Counter(str(row[2]) for row in rows),
    )  # fmt: skip
    shown = "-" if result.first_s is None else f"{result.first_s:.2f} s"
    print(f"kill {k + 1}: kill -9 {victim} with {len(turn_ids)} turns in flight; first resumed"
          f" turn.end after {shown}, last {result.last_s or 0:.2f} s; ended {len(result.ends)}"
          f" of {len(turn_ids)} (twice: {sum(1 for c in result.ends.values() if c > 1)});"
          f" reasons {dict(result.reasons)}; last attempt on {dict(result.resumed_on)}",
          flush=True)  # fmt: skip
    if len(result.ends) < len(turn_ids):
        print(f"not every turn ended within TTL + 60 s; the nodes say:\n{nodes.said()}")
    await nodes.start(victim)  # again, same id: it rejoins and takes its share back
    return result


async def failover(
    tree: Path, found: Servers, count: int, turns: int, ttl: float, work: Path, keep: bool
) -> list[Kill]:
    """``count`` kills of a node with ``turns`` turns in flight, the victims alternating."""
    suffix = secrets.token_hex(4)
    schema, cluster = f"bench_{suffix}", f"bench-{suffix}"
    root = work / schema
    (root / "agents").mkdir(parents=True)
    fake = Fake(hold=300)
    (root / "agents" / "slow.yaml").write_text(SLOW_AGENT.format(url=fake.url))
    env = base_env(found, schema, cluster, root / "home", root / "agents") | {
        "DISPACH_LEASE_TTL_SECONDS": f"{ttl:g}", "DISPACH_LOG_FORMAT": "json",
        "DISPACH_BENCH_ANTHROPIC_KEY": "test",
    }  # fmt: skip
    nodes = Nodes(tree, env, root)
    kills: list[Kill] = []
    section(f"failover: nodes n1, n2 (serve, TTL {ttl:g} s; schema {schema}, cluster {cluster})")
    try:
        await asyncio.gather(nodes.start("n1"), nodes.start("n2"))
        async with await psycopg.AsyncConnection.connect(
            found.database_url, autocommit=True, options=f"-c search_path={schema}"
        ) as conn:
            for k in range(count):
                kills.append(await one_kill(k, nodes, fake, conn, turns, ttl))
            await wait_settled(nodes.base("n1"), {"n1", "n2"})
        section("failover: stop (SIGTERM to both)")
        statuses = await asyncio.gather(*(stop_server(p) for p in nodes.procs.values()))
        print(f"exit statuses: {dict(zip(nodes.procs, statuses, strict=True))}")
        for node in nodes.procs:
            print(f"{node}'s log, ownership events and warnings: {log_summary(nodes.log(node))}")
        if any(statuses):
            print(nodes.said())
    except SystemExit as e:
        print(f"failover FAILED: {e}\nthe nodes say:\n{nodes.said()}")
    finally:
        for proc in nodes.procs.values():
            await kill(proc)
        fake.stop()
        if not keep:
            await asyncio.to_thread(drop_schemas, found.database_url, [schema])
            await drop_streams(found.nats_url, cluster)
    return kills


def failover_goals(kills: list[Kill], ttl: float) -> list[tuple[str, str, str]]:
    times = [k.first_s for k in kills if k.first_s is not None]
    bound = ttl + 2
    if not kills:
        return []
    lost = sum(k.turns - len(k.ends) for k in kills)
    twice = sum(1 for k in kills for c in k.ends.values() if c > 1)
    p50, top = median(times), max(times, default=None)
    shown = ("-" if p50 is None or top is None else
             f"p50 {p50:.2f} s, max {top:.2f} s over {len(times)} kills")  # fmt: skip
    met = "yes" if top is not None and top <= bound and len(times) == len(kills) else "NO"
    return [
        (f"failover (kill -9 -> first resumed turn.end) <= TTL + 2 s = {bound:g} s", shown, met),
        (
            "every turn of a killed node ends exactly once",
            f"{lost} not ended, {twice} twice",
            "yes" if lost == 0 and twice == 0 else "NO",
        ),
    ]

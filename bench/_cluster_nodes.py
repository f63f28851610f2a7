"""The nodes bench/cluster.py runs, as processes: their environment, start (in a session of
their own) and kill -9, what their logs said; GET /v1/cluster and when it is settled."""

from __future__ import annotations

from _report import Servers, perf, tail

# isort: split
import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any


def lease_owners(view: dict[str, Any]) -> Counter[str]:
    """Partitions held per node in a GET /v1/cluster answer."""
    return Counter(
        str(lease["node"]) for lease in view.get("leases") or []
        if isinstance(lease.get("partition"), int)
    )  # fmt: skip


def unsettled(view: dict[str, Any], nodes: int | set[str]) -> str | None:
    """Why the cluster in ``view`` is not settled (None: it is): every partition leased, by
    exactly ``nodes`` (a count, or the ids), each of them holding some."""
    leases = [x for x in view.get("leases") or [] if isinstance(x.get("partition"), int)]
    covered = {x["partition"] for x in leases}
    owners = set(lease_owners(view))
    total = int(view.get("partitions", -1))
    if len(covered) != total:
        return f"{len(covered)} of {total} partitions leased"
    if isinstance(nodes, int) and len(owners) != nodes:
        return f"held by {len(owners)} nodes, not {nodes}"
    if isinstance(nodes, set) and owners != nodes:
        return f"held by {sorted(owners)}, not {sorted(nodes)}"
    return None


def call(url: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    """GET (or POST ``body`` as JSON): the status and the decoded answer (0, {} when nothing
    answers)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {} if body is None else {"content-type": "application/json"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=10) as r:
            status: int = r.status
            raw = r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except OSError:
        return 0, {}
    try:
        found = json.loads(raw) if raw else {}
    except ValueError:
        found = {"raw": raw.decode(errors="replace")}
    return status, found if isinstance(found, dict) else {"value": found}


async def wait_settled(base: str, nodes: int | set[str], timeout: float = 60) -> dict[str, Any]:
    """Until ``base``'s GET /v1/cluster is settled (see ``unsettled``); the view. SystemExit
    with the last answer when it is not within ``timeout``."""
    last: tuple[int, dict[str, Any]] = (0, {})

    async def settled() -> bool:
        nonlocal last
        last = await asyncio.to_thread(call, base + "/v1/cluster")
        return last[0] == 200 and unsettled(last[1], nodes) is None

    if await until(settled, timeout):
        return last[1]
    status, view = last
    why = unsettled(view, nodes) if status == 200 else f"GET /v1/cluster answered {status}"
    raise SystemExit(f"the cluster did not settle in {timeout:g} s: {why}; leases by node"
                     f" {dict(lease_owners(view))}, nodes {view.get('nodes')}")  # fmt: skip


async def until(check: Callable[[], Awaitable[bool]], timeout: float, every: float = 0.05) -> bool:
    """Poll ``check`` until it is true (True) or ``timeout`` s have passed (False)."""
    deadline = perf() + timeout
    while not await check():
        if perf() > deadline:
            return False
        await asyncio.sleep(every)
    return True


def base_env(
    servers_: Servers, schema: str, cluster: str, home: Path, agents: Path
) -> dict[str, str]:
    """A node's environment: the bench's, without its own DISPACH_*/ANTHROPIC_* settings."""
    inherited = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("DISPACH_", "ANTHROPIC_")) and k not in ("DATABASE_URL", "NATS_URL")
    }  # fmt: skip
    return inherited | {
        "DATABASE_URL": servers_.database_url, "NATS_URL": servers_.nats_url,
        "DISPACH_DB_SCHEMA": schema, "DISPACH_CLUSTER": cluster,
        "DISPACH_HOME": str(home), "DISPACH_AGENTS": str(agents),
        "DISPACH_HOST": "127.0.0.1", "DISPACH_API_TOKEN": "", "DISPACH_DRAIN_SECONDS": "10",
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
    }  # fmt: skip


async def spawn(
    tree: Path, args: Sequence[str], env: dict[str, str], cwd: Path, log: Path
) -> asyncio.subprocess.Process:
    """``python -m runtime serve`` of ``tree`` (first on PYTHONPATH, run from ``cwd`` so the
    current directory adds nothing), in its own session: kill -9 reaches all of it."""
    with log.open("ab") as sink:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "runtime", "serve", *args,
            env=env | {"PYTHONPATH": str(tree)}, cwd=cwd, stdout=sink,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


async def kill(proc: asyncio.subprocess.Process, workers: Sequence[int] = ()) -> None:
    """kill -9 of a server and of ``workers``, its children as they were before it stopped (a
    worker whose drain hangs outlives its parent and the SIGTERM of PR_SET_PDEATHSIG)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # a pid reused within the round is not likely


def problems(log: Path, lines: int = 12) -> str:
    """The log's last warning and error lines (what a failed configuration said)."""
    found = [
        row for row in tail(log, 100_000).splitlines()
        if re.search(r"warn|error|exception|traceback|session_moving|drain", row, re.IGNORECASE)
    ]  # fmt: skip
    return "\n".join(found[-lines:]) or "(no warning or error lines)"


def log_summary(log: Path) -> str:
    """What a node's JSON log said about ownership, and every warning or error, counted by
    logger and event: a move of partitions in the middle of a run, or a refusal, shows here."""
    said: Counter[str] = Counter()
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no log)"
    for row in text.splitlines():
        with contextlib.suppress(ValueError):
            line = json.loads(row)
            if isinstance(line, dict) and (
                line.get("logger") == "dispach.cluster" or line.get("level") in ("warning", "error")
            ):
                said[f"{line.get('level')} {line.get('logger')} {line.get('event')}"] += 1
    return "; ".join(f"{k} x{n}" for k, n in sorted(said.items())) or "(nothing)"


async def drop_streams(nats_url: str, cluster: str) -> None:
    """The deployment's JetStream streams (its key-value buckets), so that an external NATS
    does not keep one bucket per round."""
    import nats

    with contextlib.suppress(Exception):
        nc = await nats.connect(nats_url, connect_timeout=2, max_reconnect_attempts=1)
        try:
            js = nc.jetstream()
            for info in await js.streams_info():
                name = info.config.name
                if name is not None and cluster in name:
                    await js.delete_stream(name)
        finally:
            await nc.close()

"""What the HTTP stack costs per request: the node's, against uvicorn alone and Starlette alone.

    .venv/bin/python bench/requests.py [--seconds 6] [--rounds 3]

Needs ``wrk`` (Debian: ``apt-get install wrk``), the load driver here: a request costs the node
tens of microseconds, less than a Python client's own, and ``wrk`` in C keeps the second core
for itself. Each round starts, one after the other, on the same machine and the same embedded
Postgres and NATS:

- ``bare ASGI``: uvicorn (httptools, uvloop, as the node runs it) with an ASGI callable that
  answers a fixed 15-byte JSON body;
- ``bare Starlette``: the same under Starlette with one route;
- ``dispach serve`` (no token, logs at ``warning``), asked for ``GET /v1/health``,
  ``GET /v1/agents/bench/turns/{id}`` of an ended turn (served from memory), and the same path
  for a turn that does not exist (a query, then the 404 envelope).

Each target gets ``wrk -t1 -c4`` for ``--seconds`` after a 2 s warm-up; the figure is the
server process's CPU (utime + stime from /proc) over the requests answered. Prints every round,
then the medians and each figure's ratio to ``bare ASGI`` in the same round.
"""

from __future__ import annotations

# First: it takes this directory off the front of the import path (see its docstring).
from _report import (
    free_port,
    print_rows,
    section,
    servers,
    serving,
    stop_server,
    wait_ready,
)

# isort: split
from _procstat import cpu_seconds

# isort: split
import argparse
import asyncio
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

AGENT = "id: bench\nname: Benchmark agent\nmodel:\n  provider: scripted\n"
BARE = """\
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

BODY = b'{"status":"ok"}'


async def asgi(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"15")]})
    await send({"type": "http.response.body", "body": BODY})


async def health(request):
    return Response(BODY, media_type="application/json")


starlette = Starlette(routes=[Route("/v1/health", health)])
"""


async def wrk(url: str, seconds: int) -> int:
    """Requests answered with 2xx (or the 404 asked for) in ``seconds``."""
    child = await asyncio.create_subprocess_exec(
        "wrk", "-t1", "-c4", f"-d{seconds}s", url, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await child.communicate()
    text = out.decode()
    found = re.search(r"(\d+) requests in", text)
    if child.returncode != 0 or found is None:
        raise SystemExit(f"wrk failed on {url}:\n{text}")
    return int(found.group(1))


async def cpu_per_request(pid: int, url: str, seconds: int) -> float:
    """Microseconds of the server's CPU per request under wrk."""
    await wrk(url, 2)
    before = cpu_seconds(pid)
    answered = await wrk(url, seconds)
    return (cpu_seconds(pid) - before) / answered * 1e6


@asynccontextmanager
async def uvicorn(app: str, work: Path) -> AsyncIterator[tuple[int, str]]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = work / f"{app}.log"
    with log.open("wb") as sink:
        server = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "uvicorn", f"bare:{app}", "--port", str(port),
            "--loop", "uvloop", "--http", "httptools", "--log-level", "warning",
            "--no-access-log", cwd=work, stdout=sink, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
    try:
        await wait_ready(server, base, log, path="/v1/health")
        yield server.pid, base
    finally:
        await stop_server(server)


def ended_turn(base: str) -> str:
    """Post a message and wait for its turn's end; its id."""
    body = json.dumps({"text": "hello", "sessionKey": "requests"}).encode()
    headers = {"content-type": "application/json"}
    request = urllib.request.Request(f"{base}/v1/agents/bench/messages", body, headers)
    with urllib.request.urlopen(request, timeout=10) as answer:
        turn_id: str = json.load(answer)["turnId"]
    for _ in range(1000):
        with urllib.request.urlopen(f"{base}/v1/agents/bench/turns/{turn_id}") as answer:
            if json.load(answer)["status"] != "running":
                return turn_id
        time.sleep(0.01)
    raise SystemExit(f"turn {turn_id} did not end")


TARGETS = ("bare ASGI", "bare Starlette", "node GET /v1/health", "node GET turn (ended)",
           "node GET turn (404)")  # fmt: skip


async def one_round(url: str, nats_url: str, seconds: int, work: Path) -> list[float]:
    figures = []
    for app in ("asgi", "starlette"):
        async with uvicorn(app, work) as (pid, base):
            figures.append(await cpu_per_request(pid, f"{base}/v1/health", seconds))
    async with serving(url, nats_url, work, AGENT) as (pid, base):
        turn = f"{base}/v1/agents/bench/turns/"
        paths = [f"{base}/v1/health", turn + ended_turn(base), turn + "t_nothing"]
        for path in paths:
            figures.append(await cpu_per_request(pid, path, seconds))
    return figures


async def bench(rounds: int, seconds: int, work: Path) -> None:
    measured: list[list[float]] = []
    with servers() as found:
        for n in range(1, rounds + 1):
            figures = await one_round(found.database_url, found.nats_url, seconds, work)
            measured.append(figures)
            said = ", ".join(f"{t} {f:.1f} µs" for t, f in zip(TARGETS, figures, strict=True))
            print(f"round {n}: {said}", flush=True)
    section("server CPU per request (medians)")
    rows = []
    for i, target in enumerate(TARGETS):
        median = statistics.median(r[i] for r in measured)
        ratio = statistics.median(r[i] / r[0] for r in measured)
        spread = "/".join(f"{r[i]:.1f}" for r in measured)
        rows.append((target, f"{median:.1f} µs", f"{ratio:.2f}x", spread))
    print_rows(("target", "CPU per request", "÷ bare ASGI", "rounds"), rows, {1, 2})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=6)
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is missing: apt-get install wrk")
    work = Path(tempfile.mkdtemp(prefix="dispach-bench-requests-"))
    (work / "bare.py").write_text(BARE)
    try:
        asyncio.run(bench(args.rounds, args.seconds, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

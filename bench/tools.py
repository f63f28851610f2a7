"""Benchmark of a tool call's cost by where the tool runs: a Python function in the node, an MCP
server over stdio, an MCP server over streamable HTTP.

    .venv/bin/python bench/tools.py [--calls 2000] [--quick]

Each call goes the way a turn makes it: ``actors.tools.execute`` with the agent's deadline and
output limit, on uvloop, over the ``ToolSpec`` the manifest builder would produce:

  - direct: a coroutine function of this process that returns its argument (the baseline);
  - stdio: ``echo`` of bench/_mcp_echo.py (the official SDK's ``MCPServer``) as a child process,
    through ``gateways.mcp.client`` (a ``Connection`` of the node's ``Hub``, the SDK's ``Client``);
  - http: the same server as a process serving streamable HTTP on 127.0.0.1;
  - sdk: the SDK's ``Client.call_tool`` alone, on a stdio process of the same server, with none
    of Dispach's code around it: what the protocol and the SDK's two halves cost by themselves.

Then, unless --quick, one large result at a time (``blob``: 5 and 50 MB of text, three calls each,
the median kept) over stdio, through our transport (gateways/mcp/stdio.py) and through the
SDK's ``stdio_client``: wall time and the loop's CPU time of the call.

The four are called in turn, one call at a time (round robin, so that the machine's noise falls
on all of them alike), after a warm-up of 100 calls each. Figures: p50 and p99 of the call, what
the MCP paths add over the direct call, what ours adds over the SDK alone, and the CPU time of
the loop's thread per call (``time.thread_time``: the client's half; the server's is its own
process's). Goal (issue 18): <= 1 ms added at p50 over stdio on this machine.
"""

from __future__ import annotations

# First: it takes this directory off the front of the import path (see its docstring).
from _report import (
    Goal,
    free_port,
    line,
    ms,
    pct,
    perf,
    print_rows,
    print_table,
    run_loop,
    section,
)

# isort: split
import argparse
import contextlib
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from mcp.client import Client
from mcp.client.stdio import StdioServerParameters

from actors.tools import ToolContext, ToolSpec, execute
from gateways.mcp.client import Hub
from gateways.mcp.spec import Http, ServerSpec, Stdio

HERE = Path(__file__).resolve().parent
ECHO = ("-P", str(HERE / "_mcp_echo.py"))
"""-P: without bench/ first on its path (bench/http.py would stand in for the standard http)."""
SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


async def _direct(args: dict[str, Any], ctx: ToolContext) -> str:
    return str(args["text"])


@contextlib.contextmanager
def http_server() -> Any:
    port = free_port()
    proc = subprocess.Popen([sys.executable, *ECHO, "http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(url, timeout=1)
            except urllib.error.HTTPError:
                break  # it answers (a GET without a session is refused): it is up
            except OSError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.asynccontextmanager
async def tools(url: str) -> AsyncIterator[dict[str, ToolSpec]]:
    hub = Hub(client_version="bench")
    stdio = hub.source(ServerSpec(
        name="stdio", transport=Stdio(command=sys.executable, args=(*ECHO, "stdio"))))  # fmt: skip
    http = hub.source(ServerSpec(name="http", transport=Http(url=url)))
    await hub.start(20)
    for source in (stdio, http):
        if source.connection.state != "up":
            raise SystemExit(f"MCP server {source.name} is {source.connection.state}: "
                             f"{source.connection.error}")  # fmt: skip
    try:
        direct = ToolSpec(name="echo", description="", input_schema=SCHEMA, mutating=False,
                          run=_direct)  # fmt: skip
        yield {"direct": direct, "stdio": stdio.specs()[0], "http": http.specs()[0]}
    finally:
        await hub.aclose(5)


async def measure(calls: int, url: str) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {"direct": [], "stdio": [], "http": [], "sdk": []}
    for kind in list(samples):
        samples[f"{kind} cpu"] = []
    raw = Client(StdioServerParameters(command=sys.executable, args=[*ECHO, "stdio"]), cache=None)
    async with tools(url) as specs, raw:
        ctx: Any = None  # none of these tools reads its context
        for i in range(calls + 100):
            for kind, spec in specs.items():
                started, cpu = perf(), time.thread_time()
                outcome = await execute(spec, {"text": f"call {i}"}, ctx, timeout_s=30,
                                        max_output_chars=16_000)  # fmt: skip
                took, used = perf() - started, time.thread_time() - cpu
                if not outcome.ok or outcome.output != f"call {i}":
                    raise SystemExit(f"{kind}: {outcome}")
                if i >= 100:
                    samples[kind].append(took)
                    samples[f"{kind} cpu"].append(used)
            started, cpu = perf(), time.thread_time()
            await raw.call_tool("echo", {"text": f"call {i}"})
            if i >= 100:
                samples["sdk"].append(perf() - started)
                samples["sdk cpu"].append(time.thread_time() - cpu)
    return samples


async def large(sizes: tuple[int, ...]) -> list[tuple[str, int, float, float]]:
    """(transport, MB, wall s, loop CPU s): the median of three calls of each size."""
    hub = Hub(client_version="bench")
    ours = hub.source(ServerSpec(name="stdio", transport=Stdio(command=sys.executable,
                                                               args=(*ECHO, "stdio"))))  # fmt: skip
    await hub.start(20)
    blob = next(s for s in ours.specs() if s.name == "stdio__blob")
    raw = Client(StdioServerParameters(command=sys.executable, args=[*ECHO, "stdio"]), cache=None)
    found: list[tuple[str, int, float, float]] = []
    ctx: Any = None
    try:
        async with raw:
            for size in sizes:
                for name in ("ours", "sdk"):
                    runs: list[tuple[float, float]] = []
                    for _ in range(3):
                        started, cpu = perf(), time.thread_time()
                        if name == "ours":
                            outcome = await execute(blob, {"megabytes": size}, ctx, timeout_s=300,
                                                    max_output_chars=16_000)  # fmt: skip
                            assert outcome.ok and outcome.bytes == size * 1_000_000, outcome
                        else:
                            await raw.call_tool("blob", {"megabytes": size},
                                                read_timeout_seconds=300)  # fmt: skip
                        runs.append((perf() - started, time.thread_time() - cpu))
                    runs.sort()
                    found.append((name, size, *runs[1]))
    finally:
        await hub.aclose(5)
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="200 calls of each kind")
    args = parser.parse_args()
    calls = 200 if args.quick else args.calls
    with http_server() as url:
        samples = run_loop(measure(calls, url))
    direct = samples["direct"]
    section(f"tool calls by where the tool runs ({calls} each, one at a time, round robin)")
    lines = []
    for kind in ("direct", "stdio", "http", "sdk"):
        for q in (50, 99):
            base = None if kind == "direct" else pct(direct, q)
            lines.append(line(f"{kind} p{q}", pct(samples[kind], q), base, ms))
    added = Goal("<= 1 ms added", lambda ours, base: ours <= 0.001)
    for kind in ("stdio", "http"):
        for q in (50, 99):
            extra = pct(samples[kind], q) - pct(direct, q)
            goal = added if (kind, q) == ("stdio", 50) else None
            lines.append(line(f"{kind} adds, p{q}", extra, None, ms, goal))
    for q in (50, 99):
        extra = pct(samples["stdio"], q) - pct(samples["sdk"], q)
        lines.append(line(f"stdio over the SDK alone, p{q}", extra, None, ms))
    for kind in ("direct", "stdio", "http", "sdk"):
        cpu = samples[f"{kind} cpu"]
        base = None if kind == "direct" else sum(samples["direct cpu"]) / len(cpu)
        lines.append(line(f"{kind}: loop CPU per call, mean", sum(cpu) / len(cpu), base, ms))
    print_table(lines)
    if args.quick:
        return
    section("one large result over stdio (median of 3): our transport and the SDK's stdio_client")
    rows = run_loop(large((5, 50)))
    print_rows(("transport", "result", "wall", "loop CPU"),
               [(name, f"{size} MB", f"{wall:.2f} s", f"{cpu:.2f} s")
                for name, size, wall, cpu in rows], {1, 2, 3})  # fmt: skip


if __name__ == "__main__":
    main()

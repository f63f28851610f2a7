"""What tracing costs (bench/turns.py --tracing): windows of turns with tracing off, then on, in
the same node; the spans go by the real exporter to a sink in this process."""

from __future__ import annotations

from _report import Ends, ms, rate, section

# isort: split
from _turn_cost import Monitor
from _turn_load import Phase, Plan, run_load

# isort: split
import asyncio
import statistics
import threading
from collections.abc import Sequence
from typing import Any

from actors import tracing
from runtime.node import Node


class OtlpSink:
    """An OTLP/HTTP endpoint that takes every export and discards it, counting requests and
    bytes (a collector's cost is not the node's; the exporter's is)."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, HTTPServer

        sink = self
        self.requests = 0
        self.bytes = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                size = int(self.headers.get("Content-Length", "0"))
                self.rfile.read(size)
                sink.requests += 1
                sink.bytes += size
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        # One thread: the exporter sends one batch at a time, and the counts need no lock.
        self._server = HTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}/v1/traces"
        threading.Thread(target=self._server.serve_forever, name="otlp-sink", daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


TRACING_PAIRS = 5
TRACING_SESSIONS = 16


async def tracing_ab(
    node: Node, ends: Ends, monitor: Monitor, plan: Plan, phases: Sequence[Phase]
) -> None:
    """Tracing off, then on, window after window; per phase, the on/off ratios of turns/s and
    of the process's CPU per turn (the exporter's thread included), pair by pair and their
    medians."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    sink = OtlpSink()
    try:
        for phase in phases:
            section(f"tracing off vs on: phase {phase.key}, {TRACING_SESSIONS} sessions")
            rates: list[float] = []
            cpus: list[float] = []
            for pair in range(TRACING_PAIRS):
                off = await run_load(node, ends, monitor, phase, TRACING_SESSIONS, plan,
                                     f"{phase.key}off{pair}")  # fmt: skip
                handle = tracing.configure("bench", environ={},
                                           exporter=OTLPSpanExporter(sink.endpoint))  # fmt: skip
                assert handle is not None, "tracing was on already (OTEL_* set in the environment?)"
                try:
                    on = await run_load(node, ends, monitor, phase, TRACING_SESSIONS, plan,
                                        f"{phase.key}on{pair}")  # fmt: skip
                finally:
                    await asyncio.to_thread(handle.shutdown)
                rates.append(on.rate / off.rate)
                cpus.append(on.usage.process_cpu / off.usage.process_cpu)
                cpu_off, cpu_on = ms(off.usage.process_cpu), ms(on.usage.process_cpu)
                print(f"pair {pair + 1}: off {rate(off.rate)}, {cpu_off} CPU/turn; "
                      f"on {rate(on.rate)}, {cpu_on} CPU/turn")  # fmt: skip
            print(f"median on/off: turns/s {statistics.median(rates):.3f}x, process CPU per turn "
                  f"{statistics.median(cpus):.3f}x")  # fmt: skip
        print(f"\nexported: {sink.requests} OTLP requests, {sink.bytes / 1e6:.1f} MB")
    finally:
        sink.close()

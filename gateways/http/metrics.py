"""Prometheus metrics of the edges, and ``GET /metrics`` for the whole process.

Every layer defines its metrics where they are observed, in the default registry; this endpoint
exposes all of them (eventstore, actors and gateways alike).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from gateways.api.common import principal
from gateways.http.errors import error_response

# Labelled by route template (``/v1/agents/{agent}``), never the raw path: a path names agents,
# sessions and turns without bound. gateways/http/telemetry.py observes them.
HTTP_REQUESTS = Counter(
    "dispach_http_requests",
    "HTTP requests answered, by method, route template (unmatched: no route) and status; a "
    "WebSocket counts once, with status 101 when it was accepted.",
    ["method", "route", "status"],
)
HTTP_REQUEST_SECONDS = Histogram(
    "dispach_http_request_duration_seconds",
    "Seconds from a request's arrival to the start of its response (its status and headers): "
    "for a stream (SSE) that is the time to open it, not its life. WebSockets are not observed.",
    ["method", "route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)

STREAM_SUBSCRIBERS = Gauge(
    "dispach_stream_subscribers",
    "Clients streaming from this node now, by kind (sse_turn, sse_events, ws).",
    ["kind"],
)
WS_SLOW_CONSUMERS = Counter(
    "dispach_ws_slow_consumers",
    "WebSockets that fell too far behind and were dropped (closed 4008, or aborted when they did "
    "not take the close in time).",
)

MCP_SERVER_UP = Gauge(
    "dispach_mcp_server_up",
    "1 while this node's session with the MCP server is open, else 0.",
    ["server"],
)
MCP_SERVER_TOOLS = Gauge(
    "dispach_mcp_server_tools",
    "Tools the MCP server offers, as last listed (less those refused for their name or schema).",
    ["server"],
)
MCP_SERVER_FAILURES = Counter(
    "dispach_mcp_server_failures",
    "Sessions with the MCP server that failed to open or were lost (each is started again).",
    ["server"],
)
MCP_CALLS = Counter(
    "dispach_mcp_calls",
    "Tool calls sent to the MCP server, by outcome: ok, error (the tool's isError), unavailable "
    "(the server down or lost), refused (an MCP error), cancelled (a deadline or a stop).",
    ["server", "outcome"],
)


async def metrics_endpoint(request: Request) -> Response:
    """The whole process's series, for an unscoped token only: the series are not per agent's
    token (their labels name every agent, channel and tool), so a token scoped to some agents
    gets ``403 metrics_forbidden``. With no token configured (a loopback node) it is open."""
    caller = principal(request)
    if caller.agents is not None or caller.stream is not None:
        return error_response(403, "metrics_forbidden",
                              "the metrics cover every agent; this token is scoped to some",
                              "scrape /metrics with an unscoped token (one without @agents in "
                              "DISPACH_API_TOKEN)")  # fmt: skip
    # Rendering walks a few hundred samples in memory: well under a millisecond, fine on the loop.
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

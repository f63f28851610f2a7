"""Prometheus metrics of the edges, and ``GET /metrics`` for the whole process.

Every layer defines its metrics where they are observed, in the default registry; this endpoint
exposes all of them (eventstore, actors and gateways alike).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest
from starlette.requests import Request
from starlette.responses import Response

STREAM_SUBSCRIBERS = Gauge(
    "dispach_stream_subscribers",
    "Clients streaming from this node now, by kind (sse_turn, sse_events, ws).",
    ["kind"],
)


async def metrics_endpoint(request: Request) -> Response:
    # Rendering walks a few hundred samples in memory: well under a millisecond, fine on the loop.
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

"""Prometheus metrics of the outbox (default registry); channel types are the only labels."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

OUTBOX_DEPTH = Gauge(
    "dispach_outbox_depth",
    "Outbox items not yet settled (pending or in flight), as last read by this node's outbox.",
)

DELIVERIES = Counter(
    "dispach_deliveries",
    "Sends the outbox recorded, by channel type and outcome (sent, retry, failed).",
    ["channel", "outcome"],
)

DELIVERY_SECONDS = Histogram(
    "dispach_delivery_seconds",
    "Seconds of one send through a channel, from the request to the provider's answer.",
    ["channel"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)

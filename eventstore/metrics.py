"""Prometheus metrics of the log, observed by the group-commit writer (default registry).

The writer is the hot path: each metric is observed once per command or once per batch, never
per event (the event count is one ``inc(n)`` per batch).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

APPEND_SECONDS = Histogram(
    "dispach_append_seconds",
    "Seconds from an append's submit to the writer's answer (committed, or refused).",
    ["outcome"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
# Bound once: the label lookup would otherwise cost a lock and a dict probe per append.
APPEND_OK = APPEND_SECONDS.labels(outcome="ok")
APPEND_ERROR = APPEND_SECONDS.labels(outcome="error")

BATCH_COMMANDS = Histogram(
    "dispach_append_batch_commands",
    "Append commands settled by one group-commit transaction.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
)

EVENTS_APPENDED = Counter(
    "dispach_events_appended",
    "Events committed to the log by this node's writer (retried duplicates not counted).",
)

FENCE_REFUSALS = Counter(
    "dispach_fence_refusals",
    "Appends refused because their partition's fence is at a newer lease epoch (the partition "
    "moved to another node).",
)

HORIZON_AGE = Gauge(
    "dispach_postgres_horizon_age_seconds",
    "Age of the cluster's oldest transaction holding an xid, as the health probe last saw it "
    "(0: none): vacuum cannot reclaim rows that died after it began (eventstore/health.py).",
)

APPEND_LOCK_AGE = Gauge(
    "dispach_log_append_lock_age_seconds",
    "Age of the oldest open append (a transaction holding the log's append lock), as the health "
    "probe last saw it (0: none): every live stream waits for it (eventstore/health.py).",
)

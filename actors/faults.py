"""Fault-injection points for crash tests: ``DISPACH_FAULTS=point[,point...]`` makes the process
kill itself with SIGKILL when it reaches a named point, the way a power cut would. Unset (always,
in production) it costs one set lookup."""

from __future__ import annotations

import os
import signal

POINTS = frozenset(
    {
        "turn.ended",  # turn.end (with its delivery.enqueued) is committed; nothing sent yet
        "delivery.attempted",  # delivery.attempted is committed; the send has not begun
        "delivery.answered",  # the provider answered; its answer is not recorded yet
    }
)

_ARMED = frozenset(p.strip() for p in os.environ.get("DISPACH_FAULTS", "").split(",") if p.strip())


def point(name: str) -> None:
    if name in _ARMED:
        os.kill(os.getpid(), signal.SIGKILL)

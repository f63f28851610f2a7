"""``GET /v1/activity``: whether the cluster is idle (before a deploy, or for a controller that
suspends it), and what each node is doing.

The cluster's figures come from the read models (turns not ended, wherever they run or wait to
be resumed; the outbox's unsettled items; the schedules' next due time), so a node that does
not answer hides no work. Each node's own figures come over NATS (actors/cluster/activity.py)
from the members the lease bucket lists; a member that gave no answer within a second is named
in ``missing``. Admin only, with no agent list (``activity_needs_unscoped_key``).
"""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from actors.messages import NodeActivity
from actors.schedule.plan import ScheduleSpec, next_due
from gateways.api.common import fetch, not_ready, runtime, unrestricted
from gateways.http.errors import json_response
from gateways.http.operation import Operation, answer

GATHER_S = 1.0


class OutboxActivity(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    pending: int
    inflight: int
    next_attempt_at: str | None = None


class Deliveries(msgspec.Struct, frozen=True, kw_only=True):
    outbox: OutboxActivity
    """The agents' replies and deliveries."""
    webhooks: OutboxActivity
    """The event webhooks' deliveries (docs/channels.md, "Event webhooks")."""


class ActivityBody(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """The original's shape (``idle``, ``turnsRunning``, ``deliveries``, ``nextWakeAt``), with
    the answering node's own figures and every node's."""

    idle: bool
    """No turn running or waiting to resume, no delivery pending or being sent."""
    turns_running: int
    deliveries: Deliveries
    next_wake_at: str | None = None
    """The soonest next due time of an enabled schedule."""
    node: NodeActivity
    nodes: list[NodeActivity]
    missing: list[str]
    """Members of the cluster that did not answer in time."""


def is_idle(turns_running: int, *unsettled: int) -> bool:
    return turns_running == 0 and not any(unsettled)


def _unsettled(pending: int, inflight: int, next_attempt: datetime | None) -> OutboxActivity:
    at = None if next_attempt is None else next_attempt.isoformat()
    return OutboxActivity(pending=pending, inflight=inflight, next_attempt_at=at)


async def get_activity(request: Request) -> Response:
    unrestricted(request, "activity_needs_unscoped_key", "the cluster's activity")
    rt = runtime(request)
    replies, status = rt.activity, rt.cluster_status()
    if replies is None or status is None:
        raise not_ready()
    (
        (turns, pending, inflight, next_attempt, hooks_pending, hooks_inflight, hooks_next),
    ) = await fetch(request, "activity", {})
    wake = await _next_wake(request)
    local: NodeActivity = await replies.local()
    members = {n.id for n in status.nodes} | {local.node}
    nodes, missing = await replies.gather(members - {local.node}, GATHER_S)
    nodes = sorted([local, *(n for n in nodes if n.node != local.node)], key=lambda n: n.node)
    return json_response(ActivityBody(
        idle=is_idle(turns, pending, inflight, hooks_pending, hooks_inflight),
        turns_running=turns,
        deliveries=Deliveries(outbox=_unsettled(pending, inflight, next_attempt),
                              webhooks=_unsettled(hooks_pending, hooks_inflight, hooks_next)),
        next_wake_at=None if wake is None else wake.isoformat(),
        node=local, nodes=nodes, missing=missing,
    ))  # fmt: skip


async def _next_wake(request: Request) -> datetime | None:
    now = datetime.now(UTC)
    soonest: datetime | None = None
    for spec_text, created, last_due in await fetch(request, "activity_schedules", {}):
        try:
            spec = msgspec.json.decode(spec_text, type=ScheduleSpec)
            upcoming = next_due(spec, max(now, last_due) if last_due else now, anchor=created)
        except (msgspec.ValidationError, ValueError):  # a row older code wrote: not a wake-up
            continue
        if upcoming is not None and (soonest is None or upcoming < soonest):
            soonest = upcoming
    return soonest


ACTIVITY = Operation(
    "GET",
    "/v1/activity",
    get_activity,
    "Whether the cluster is idle: turns running, the outbox's pending and in-flight items, the "
    "next schedule wake-up; and each node's own (admin, no agent list)",
    {"200": answer(ActivityBody, "Activity")},
    errors=("401", "403", "503"),
)

"""The read models Dispach serves, as projections of the log (eventstore/projector.py runs
them): turns, sessions and messages, the outbox, schedules, approvals, each session's context
view, the usage meter and the webhook subscriptions."""

from __future__ import annotations

from eventstore.projections.approvals import ApprovalsProjection
from eventstore.projections.context import SessionContextProjection
from eventstore.projections.outbox import OutboxProjection
from eventstore.projections.schedules import SchedulesProjection
from eventstore.projections.sessions import MessagesProjection, SessionsProjection
from eventstore.projections.turns import TurnsProjection
from eventstore.projections.usage import UsageProjection
from eventstore.projections.webhooks import WebhooksProjection
from eventstore.projector import Projection

INLINE: tuple[Projection, ...] = (
    TurnsProjection(),
    MessagesProjection(),
    SessionsProjection(),
    OutboxProjection(),
    SchedulesProjection(),
    ApprovalsProjection(),
    SessionContextProjection(),
    UsageProjection(),
    WebhooksProjection(),
)
# Projections nobody reads right after a write run asynchronously (ProjectionRunner). `sessions`
# was one, but a runner costs the event loop a read and a checkpoint commit per wake-up, measured
# at 0.9 ms of the loop's 3.3 ms per turn (bench/turns.py profile), while inline it is one more
# pipelined statement in a transaction the writer commits anyway; it also makes a new session
# listable the moment its first turn is accepted.
ASYNC: tuple[Projection, ...] = ()

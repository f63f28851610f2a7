"""A session's policy state and what happens to it: the facts :func:`evolve` folds.

The decisions that produce those facts are actors/session/core.py.
"""

from __future__ import annotations

import msgspec

from actors.agent import Concurrency
from actors.turn.core import Approval

# --- the state -------------------------------------------------------------------------------


class Running(msgspec.Struct, frozen=True):
    turn_id: str
    end_decided: bool = False
    """Its turn.end is on its way to the log: for the policy it no longer runs (a client that
    has seen turn.end must not be refused because the news has not reached the session)."""


class Parked(msgspec.Struct, frozen=True):
    """A turn waiting for approvals: it holds the session without a task."""

    turn_id: str
    pending: tuple[Approval, ...]
    """Its approvals not answered yet."""


class SessionState(msgspec.Struct, frozen=True, kw_only=True):
    agent_id: str
    session_key: str
    policy: Concurrency = "queue"
    """The agent's concurrency policy, for a message that names none."""
    node_id: str = ""
    """The node this actor runs on: a turn accepted on an idle session begins here."""
    queue: tuple[str, ...] = ()
    """Turns accepted (or being accepted) and not started, in order."""
    uncommitted: frozenset[str] = frozenset()
    """Turns whose turn.start is submitted and not yet stored: none starts before it is."""
    running: Running | None = None
    parked: Parked | None = None
    handing_over: bool = False
    """The session's partition moves: no other turn starts here."""
    handed_over: bool = False
    """No turn runs here any more and the hand-over was answered."""
    superseded: frozenset[str] = frozenset()
    """Queued turns an ``interrupt`` message overtook: each starts already stopping (it ends
    ``stopped`` at once), so the interrupting message is the one that runs."""

    @property
    def busy(self) -> bool:
        """For the policy: a turn runs (its end not decided), waits, or is queued."""
        running = self.running is not None and not self.running.end_decided
        return running or bool(self.queue) or self.parked is not None

    @property
    def idle(self) -> bool:
        """Nothing runs, waits or is queued (the session may be passivated)."""
        return self.running is None and not self.queue and self.parked is None

    @property
    def between_turns(self) -> bool:
        """No turn runs or waits: the history the actor holds is the next turn's."""
        return self.running is None and self.parked is None


# --- what happened (folded by evolve) --------------------------------------------------------


class Queued(msgspec.Struct, frozen=True):
    """A message was accepted as a turn; its turn.start is on its way to the log."""

    turn_id: str


class Committed(msgspec.Struct, frozen=True):
    turn_id: str


class CommitFailed(msgspec.Struct, frozen=True):
    """The turn.start was not stored: the turn was never accepted (its asker got the error)."""

    turn_id: str


class Resumed(msgspec.Struct, frozen=True):
    """Turns the log shows unfinished, queued again (after a start or a partition move)."""

    turn_ids: tuple[str, ...]


class Dequeued(msgspec.Struct, frozen=True):
    """A queued turn was stopped before it started."""

    turn_id: str


class Superseded(msgspec.Struct, frozen=True):
    """An ``interrupt`` message arrived behind these queued turns."""

    turn_ids: tuple[str, ...]


class Started(msgspec.Struct, frozen=True):
    turn_id: str


class EndDecided(msgspec.Struct, frozen=True):
    turn_id: str


class Finished(msgspec.Struct, frozen=True):
    """The running turn's run returned: it ended, or it waits for ``waiting`` (not None)."""

    turn_id: str
    waiting: tuple[Approval, ...] | None = None


class Answered(msgspec.Struct, frozen=True):
    approval_id: str


class Unparked(msgspec.Struct, frozen=True):
    """The waiting turn goes back to the front of the queue (answered, stopped, interrupted)."""

    turn_id: str


class HandingOver(msgspec.Struct, frozen=True):
    pass


class HandedOver(msgspec.Struct, frozen=True):
    pass


Fact = (
    Queued | Committed | CommitFailed | Resumed | Dequeued | Superseded | Started | EndDecided
    | Finished | Answered | Unparked | HandingOver | HandedOver
)  # fmt: skip


def evolve(state: SessionState, fact: Fact) -> SessionState:
    """The state after ``fact``."""
    match fact:
        case Queued() | Committed() | CommitFailed() | Resumed() | Dequeued():
            return _acceptances(state, fact)
        case Superseded(turn_ids=turn_ids):
            return msgspec.structs.replace(state, superseded=state.superseded | set(turn_ids))
        case _:
            return _turns(state, fact)


def _acceptances(
    state: SessionState, fact: Queued | Committed | CommitFailed | Resumed | Dequeued
) -> SessionState:
    """The queue and the acceptances in flight."""
    replace = msgspec.structs.replace
    match fact:
        case Queued(turn_id=t):
            return replace(state, queue=(*state.queue, t), uncommitted=state.uncommitted | {t})
        case Committed(turn_id=t):
            return replace(state, uncommitted=state.uncommitted - {t})
        case CommitFailed(turn_id=t):
            return replace(state, queue=_without(state.queue, t),
                           uncommitted=state.uncommitted - {t})  # fmt: skip
        case Resumed(turn_ids=turn_ids):
            return replace(state, queue=(*state.queue, *turn_ids))
        case Dequeued(turn_id=t):
            return replace(state, queue=_without(state.queue, t))


def _turns(
    state: SessionState,
    fact: Started | EndDecided | Finished | Answered | Unparked | HandingOver | HandedOver,
) -> SessionState:
    """The turn that runs or waits here, and the hand-over."""
    replace = msgspec.structs.replace
    match fact:
        case Started(turn_id=t):
            return replace(state, queue=_without(state.queue, t), running=Running(t),
                           superseded=state.superseded - {t})  # fmt: skip
        case EndDecided(turn_id=t) if runs(state, t):
            return replace(state, running=Running(t, end_decided=True))
        case Finished(turn_id=t, waiting=waiting) if runs(state, t):
            parked = None if waiting is None else Parked(t, waiting)
            return replace(state, running=None, parked=parked)
        case Answered(approval_id=approval_id) if state.parked is not None:
            left = tuple(a for a in state.parked.pending if a.approval_id != approval_id)
            return replace(state, parked=Parked(state.parked.turn_id, left))
        case Unparked(turn_id=t):
            return replace(state, parked=None, queue=(t, *state.queue))
        case HandingOver():
            return replace(state, handing_over=True)
        case HandedOver():
            return replace(state, handed_over=True)
        case _:  # about a turn that does not run (or wait) here
            return state


def fold(state: SessionState, facts: tuple[Fact, ...]) -> SessionState:
    for fact in facts:
        state = evolve(state, fact)
    return state


def _without(queue: tuple[str, ...], turn_id: str) -> tuple[str, ...]:
    """``queue`` less the first ``turn_id`` in it."""
    if turn_id not in queue:
        return queue
    at = queue.index(turn_id)
    return (*queue[:at], *queue[at + 1 :])


def runs(state: SessionState, turn_id: str) -> bool:
    return state.running is not None and state.running.turn_id == turn_id

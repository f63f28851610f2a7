"""The pure core of a session: its policy state, and the decisions of that policy.

A session runs one turn at a time. A message that arrives while a turn runs is queued, refused
or made to interrupt the running turn (the ``concurrency`` policy); a turn waiting for approvals
holds the session as a running one does; a turn id the session already holds is a duplicate.
None of that touches the store, a timer or another actor here: :func:`decide` answers a command
with a :class:`Decision` (what to append, what to do, what to answer, and the facts that follow),
and :func:`evolve` folds each fact into the state. The SessionActor carries decisions out. A new
owner of the session (after a restart or a partition move) starts from an empty state and the
``Resume`` of the turns the log still shows running, so the policy is the same wherever it runs.
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from actors.messages import (
    Cleared,
    ClearSession,
    Forked,
    PhaseMoved,
    Refused,
    ResolveApproval,
    Resolved,
    Resume,
    SetPhase,
    StopResult,
    StopTurn,
    Submit,
)
from actors.session.state import (
    Answered,
    CommitFailed,
    Committed,
    Dequeued,
    Fact,
    Finished,
    HandedOver,
    HandingOver,
    Queued,
    Resumed,
    SessionState,
    Started,
    Superseded,
    Unparked,
    fold,
    runs,
)
from actors.turn.core import AWAITING_APPROVAL, Approval
from eventstore import ANY, NO_STREAM, Metadata, streams
from eventstore.catalogue import (
    ApprovalResolved,
    PhaseChanged,
    SessionCleared,
    SessionForked,
    Tokens,
    TurnEnd,
    TurnStart,
)
from eventstore.event import Event

# --- what the actor reports (commands of its own, beside the public ones) --------------------


class HandOver(msgspec.Struct, frozen=True):
    """Start no other turn; answered once no turn runs here."""


class StartStored(msgspec.Struct, frozen=True):
    """The append of a turn's turn.start settled."""

    turn_id: str
    ok: bool


class TurnEnded(msgspec.Struct, frozen=True):
    """A turn's run returned with ``reason`` (None: cancelled, or another node owns the turn)."""

    turn_id: str
    reason: str | None
    at: datetime
    """When it returned (approval deadlines are counted from it)."""
    waiting: tuple[Approval, ...] = ()
    """The approvals it waits for, when ``reason`` is AWAITING_APPROVAL."""


class ApprovalsAnswered(msgspec.Struct, frozen=True):
    """The last answer of a waiting turn is stored (or its append settled)."""

    turn_id: str


class Fork(msgspec.Struct, frozen=True):
    """Start this session from another's history (read by the engine from the source's read
    models, actors/context/fork.py): append ``event`` as the session's first event, answer
    ``answer`` once it is stored."""

    event: SessionForked
    answer: Forked


Command = (
    Submit | StopTurn | ClearSession | ResolveApproval | Resume | HandOver | StartStored
    | TurnEnded | ApprovalsAnswered | Fork | SetPhase
)  # fmt: skip


# --- decisions -------------------------------------------------------------------------------


class CommitOf(msgspec.Struct, frozen=True):
    """When the append settles, report :class:`StartStored` for this turn."""

    turn_id: str


class UnparkAfter(msgspec.Struct, frozen=True):
    """When the append settles (stored or not), report :class:`ApprovalsAnswered`."""

    turn_id: str


class Append(msgspec.Struct, frozen=True):
    stream: str
    event: Event
    metadata: Metadata
    expected: int = ANY
    then: CommitOf | UnparkAfter | None = None


class TellStop(msgspec.Struct, frozen=True):
    """Ask the running turn's actor to stop it."""

    turn_id: str
    by: str


class StartTurn(msgspec.Struct, frozen=True):
    turn_id: str
    stop_by: str | None = None
    """Start it already stopping (a waiting turn that was stopped ends as stopped)."""


class After(msgspec.Struct, frozen=True):
    """Tell the session ``command`` in ``seconds`` (an approval's deadline)."""

    seconds: float
    command: ResolveApproval


class Release(msgspec.Struct, frozen=True):
    """Let go of the finished turn's actor, keeping the history it left when ``keep_history``
    (the turn ended; otherwise the next turn reloads the history from the log)."""

    keep_history: bool


class ResetHistory(msgspec.Struct, frozen=True):
    """The session was cleared: the next turn starts from an empty history."""


class ReloadHistory(msgspec.Struct, frozen=True):
    """The session was forked: the next turn reads its history from the log's read models (the
    copied rows are there once the fork is stored, and only then; a turn starts only after its
    own turn.start, submitted after the fork, is stored)."""


class Forget(msgspec.Struct, frozen=True):
    """Drop what the actor holds for a turn that will not start here (its stored turn.start)."""

    turn_id: str


class AnswerHandOver(msgspec.Struct, frozen=True):
    """No turn runs here any more: resolve the hand-over's future."""


Effect = (
    TellStop | StartTurn | After | Release | ResetHistory | ReloadHistory | Forget
    | AnswerHandOver
)  # fmt: skip


class Accept(msgspec.Struct, frozen=True):
    """Answer ``Accepted``, durable once the decision's append is."""

    turn_id: str


class Duplicate(msgspec.Struct, frozen=True):
    """The session holds this turn already: nothing is appended; the asker answers from the
    stored turn.start once its commit (``pending``: the one still in flight) has settled."""

    turn_id: str
    pending: bool


class OnceStored(msgspec.Struct, frozen=True):
    """``answer`` holds once the decision's append is stored."""

    answer: StopResult | Cleared | Resolved | Forked | PhaseMoved


class HandOverAnswer(msgspec.Struct, frozen=True):
    """The hand-over's future (resolved by :class:`AnswerHandOver`)."""


Answer = Refused | StopResult | Accept | Duplicate | OnceStored | HandOverAnswer


class Decision(msgspec.Struct, frozen=True):
    """Carried out in this order: ``append`` (if it cannot even be submitted, nothing else
    happens and the asker gets the error), then ``facts`` folded, then ``effects``, then the
    ``answer``."""

    answer: Answer | None = None
    append: Append | None = None
    facts: tuple[Fact, ...] = ()
    effects: tuple[Effect, ...] = ()


NOTHING = Decision()


def decide(state: SessionState, command: Command) -> Decision:
    match command:
        case Submit():
            return _submit(state, command)
        case StopTurn():
            return _stop(state, command)
        case ClearSession(by=by):
            return _clear(state, by)
        case SetPhase():
            return _set_phase(state, command)
        case ResolveApproval():
            return _resolve(state, command)
        case Resume(turn_ids=turn_ids):
            return _resume(state, turn_ids)
        case HandOver():
            return _hand_over(state)
        case StartStored(turn_id=t, ok=ok):
            return _advance(state, facts=(Committed(t) if ok else CommitFailed(t),))
        case TurnEnded():
            return _ended(state, command)
        case ApprovalsAnswered(turn_id=t):
            if state.parked is None or state.parked.turn_id != t:
                return NOTHING
            return _advance(state, facts=(Unparked(t),))
        case Fork():
            return _fork(state, command)


def _resume(state: SessionState, turn_ids: list[str]) -> Decision:
    """Queue the turns the log shows unfinished and the queue does not hold. Only the queue is
    checked: a Resume comes when the node opens the session's partition, before any of those
    turns runs here (and one resumed twice finds its turn.end when it starts, and ends)."""
    added: list[str] = []
    for t in turn_ids:
        if t not in state.queue and t not in added:
            added.append(t)
    return _advance(state, facts=(Resumed(tuple(added)),) if added else ())


def _hand_over(state: SessionState) -> Decision:
    facts: tuple[Fact, ...] = () if state.handing_over else (HandingOver(),)
    if state.running is None and not state.handed_over:
        # A waiting turn holds no task: its session's next owner parks it again.
        return Decision(HandOverAnswer(), facts=(*facts, HandedOver()),
                        effects=(AnswerHandOver(),))  # fmt: skip
    return Decision(HandOverAnswer(), facts=facts)


def _submit(state: SessionState, submit: Submit) -> Decision:
    policy = submit.concurrency or state.policy
    if policy == "reject" and state.busy:
        return Decision(Refused(
            code="session_busy",
            message=f"session {state.session_key!r} is running a turn",
            hint="wait for its turn.end, send with concurrency 'queue', or stop it first",
        ))  # fmt: skip
    turn_id = submit.turn_id
    assert turn_id is not None, "the actor names the turn before deciding"  # ids are random
    if turn_id in state.uncommitted:
        return Decision(Duplicate(turn_id, pending=True))
    if turn_id in state.queue or runs(state, turn_id):
        return Decision(Duplicate(turn_id, pending=False))
    # On an idle session the turn starts the moment its turn.start commits: the accept is
    # also the start of its first attempt, one event and one commit (catalogue v2).
    begins = state.idle and not state.handing_over
    start = TurnStart(
        source=submit.source,
        input=submit.text,
        deliver=submit.deliver,
        idempotency_key=submit.idempotency_key,
        request_hash=submit.request_hash,
        sender=submit.sender,
        attempt=1 if begins else 0,
        node=state.node_id or None if begins else None,
        budget=submit.budget,
    )
    # 202 means durable: the turn exists once this append has committed. The actor does not
    # wait for the commit (the asker does); the turn starts only after it.
    # The trace context the message came in (tracing on) goes with it: the turn's span, on
    # whichever node runs or resumes it, is its child (actors/tracing.py).
    meta = Metadata(agent_id=state.agent_id, session_key=state.session_key, turn_id=turn_id,
                    correlation_id=submit.traceparent)  # fmt: skip
    append = Append(streams.turn(turn_id), start, meta, NO_STREAM, then=CommitOf(turn_id))
    if policy != "interrupt":
        return Decision(Accept(turn_id), append, (Queued(turn_id),))
    # Everything ahead of it gives way: the running turn is stopped, and the queued ones (say
    # accepted a moment ago through another node) start already stopping.
    ahead: tuple[Fact, ...] = (Superseded(state.queue),) if state.queue else ()
    if state.running is not None:
        stop = TellStop(state.running.turn_id, "interrupt")
        return Decision(Accept(turn_id), append, (*ahead, Queued(turn_id)), (stop,))
    if state.parked is not None:
        # The waiting turn runs again at once, already stopping: it ends as stopped.
        facts = (*ahead, Queued(turn_id), Unparked(state.parked.turn_id))
        return _advance(state, Accept(turn_id), append, facts, stop_by="interrupt")
    return Decision(Accept(turn_id), append, (*ahead, Queued(turn_id)))


def _stop(state: SessionState, stop: StopTurn) -> Decision:
    turn_id = stop.turn_id
    if runs(state, turn_id):
        return Decision(StopResult(stopping=True, state="stopping"),
                        effects=(TellStop(turn_id, stop.by),))  # fmt: skip
    if state.parked is not None and state.parked.turn_id == turn_id:
        # It ends as stopped; its waiting calls are not run.
        return _advance(state, StopResult(stopping=True, state="stopping"),
                        facts=(Unparked(turn_id),), stop_by=stop.by)  # fmt: skip
    if turn_id in state.queue:
        end = TurnEnd(reason="stopped", steps=0, tokens=Tokens(), duration_ms=0)
        # Answered once its turn.end is stored: a caller that reads the turn next sees it.
        return Decision(OnceStored(StopResult(stopping=True, state="stopped")),
                        Append(streams.turn(turn_id), end, _meta(state, turn_id)),
                        (Dequeued(turn_id),), (Forget(turn_id),))  # fmt: skip
    return Decision(StopResult(stopping=False, state="unknown"))


def _clear(state: SessionState, by: str) -> Decision:
    if state.busy:
        return Decision(Refused(
            code="session_busy",
            message=f"session {state.session_key!r} has a turn running or queued",
            hint="wait for its turn.end (or stop it), then clear the session",
        ))  # fmt: skip
    append = Append(streams.session(state.agent_id, state.session_key), SessionCleared(by=by),
                    Metadata(agent_id=state.agent_id, session_key=state.session_key))  # fmt: skip
    return Decision(OnceStored(Cleared(session_key=state.session_key)), append,
                    effects=(ResetHistory(),))  # fmt: skip


def _set_phase(state: SessionState, command: SetPhase) -> Decision:
    """A phase change from outside, taken at any time: a running turn keeps the phase it is in
    (its own ``phase.changed`` are in its stream); the session's next turn folds this one."""
    event = PhaseChanged(to=command.to, from_=command.left, by="api", tools=command.tools)
    append = Append(streams.session(state.agent_id, state.session_key), event,
                    Metadata(agent_id=state.agent_id, session_key=state.session_key))  # fmt: skip
    return Decision(OnceStored(PhaseMoved(session_key=state.session_key, phase=command.to)),
                    append)  # fmt: skip


def _fork(state: SessionState, fork: Fork) -> Decision:
    """The fork is the session's first event (NO_STREAM: a session whose stream has anything,
    a clear or a note, is not new); a session with a turn in hand is refused before that."""
    if state.busy:
        return Decision(Refused(
            code="session_busy",
            message=f"session {state.session_key!r} has a turn running or queued",
            hint="a fork starts a new session: name one that has no turns in newKey",
            field="newKey",
        ))  # fmt: skip
    append = Append(streams.session(state.agent_id, state.session_key), fork.event,
                    Metadata(agent_id=state.agent_id, session_key=state.session_key),
                    NO_STREAM)  # fmt: skip
    return Decision(OnceStored(fork.answer), append, effects=(ReloadHistory(),))


def _resolve(state: SessionState, resolve: ResolveApproval) -> Decision:
    parked = state.parked
    owner = resolve.turn_id
    restoring = owner is not None and (owner in state.queue or runs(state, owner))
    if restoring and (parked is None or parked.turn_id != owner):
        return Decision(Refused(
            code="approval_busy",
            message=f"the turn of approval {resolve.approval_id!r} is being restored",
            hint="retry in a moment (the node has just started, or the turn is resuming)",
        ))  # fmt: skip
    approval = None
    if parked is not None:
        approval = next((a for a in parked.pending if a.approval_id == resolve.approval_id), None)
    if parked is None or approval is None:
        return Decision(Refused(
            code="approval_not_found",
            message=f"approval {resolve.approval_id!r} is not waiting for an answer",
            hint="it was answered already, timed out, or its turn ended; GET "
            f"/v1/agents/{state.agent_id}/approvals lists the open ones",
        ))  # fmt: skip
    event = ApprovalResolved(approval_id=approval.approval_id, slug=approval.slug,
                             granted=resolve.granted, by=resolve.by)  # fmt: skip
    # The last answer: the turn runs on once it is stored.
    last = all(a.approval_id == approval.approval_id for a in parked.pending)
    append = Append(streams.turn(parked.turn_id), event, _meta(state, parked.turn_id), ANY,
                    then=UnparkAfter(parked.turn_id) if last else None)  # fmt: skip
    answer = OnceStored(Resolved(approval_id=resolve.approval_id, granted=resolve.granted))
    return Decision(answer, append, (Answered(approval.approval_id),))


def _ended(state: SessionState, ended: TurnEnded) -> Decision:
    if not runs(state, ended.turn_id):
        return _advance(state)
    waits = ended.reason == AWAITING_APPROVAL
    finished = Finished(ended.turn_id, ended.waiting if waits else None)
    effects: list[Effect] = [Release(keep_history=ended.reason is not None)]
    if waits:
        effects += [After(seconds, ResolveApproval(
            agent_id=state.agent_id, approval_id=approval_id, granted=False, by="timeout",
        )) for approval_id, seconds in deadlines(ended.waiting, ended.at)]  # fmt: skip
    return _advance(state, facts=(finished,), effects=tuple(effects))


def deadlines(waiting: tuple[Approval, ...], now: datetime) -> list[tuple[str, float]]:
    """Seconds from ``now`` until each approval counts as denied (0: due, or its expiry does
    not parse). The session arms a timer for each; a turn parked again after a restart gets
    its remaining time, not a new one."""
    due: list[tuple[str, float]] = []
    for approval in waiting:
        try:
            seconds = (datetime.fromisoformat(approval.expires_at) - now).total_seconds()
        except (ValueError, TypeError):  # unparsable, or without a time zone
            seconds = 0.0
        due.append((approval.approval_id, max(seconds, 0.0)))
    return due


def _advance(
    state: SessionState,
    answer: Answer | None = None,
    append: Append | None = None,
    facts: tuple[Fact, ...] = (),
    effects: tuple[Effect, ...] = (),
    stop_by: str | None = None,
) -> Decision:
    """The decision made of these parts, then what the session does next: start the turn at
    the front of the queue once nothing runs or waits and its turn.start is stored; while
    handing over, start nothing and answer the hand-over once nothing runs."""
    after = fold(state, facts)
    if after.handing_over:
        if after.running is None and not after.handed_over:
            return Decision(answer, append, (*facts, HandedOver()), (*effects, AnswerHandOver()))
        return Decision(answer, append, facts, effects)
    if (
        after.running is not None
        or after.parked is not None
        or not after.queue
        or after.queue[0] in after.uncommitted
    ):
        return Decision(answer, append, facts, effects)
    head = after.queue[0]
    if stop_by is None and head in after.superseded:
        stop_by = "interrupt"
    return Decision(answer, append, (*facts, Started(head)), (*effects, StartTurn(head, stop_by)))


def _meta(state: SessionState, turn_id: str) -> Metadata:
    return Metadata(agent_id=state.agent_id, session_key=state.session_key, turn_id=turn_id)

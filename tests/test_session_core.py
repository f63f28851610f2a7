"""The pure core of a session, table-driven: for each rule, the decision (what is appended,
what is done, what is answered) and the state after its facts, written out by hand."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from actors.messages import (
    Cleared,
    ClearSession,
    Policy,
    Refused,
    ResolveApproval,
    Resolved,
    Resume,
    StopResult,
    StopTurn,
    Submit,
)
from actors.session.core import (
    NOTHING,
    Accept,
    After,
    AnswerHandOver,
    Append,
    ApprovalsAnswered,
    Command,
    CommitOf,
    Decision,
    Duplicate,
    Effect,
    Forget,
    HandOver,
    HandOverAnswer,
    OnceStored,
    Release,
    ResetHistory,
    StartStored,
    StartTurn,
    TellStop,
    TurnEnded,
    UnparkAfter,
    deadlines,
    decide,
)
from actors.session.state import (
    Answered,
    CommitFailed,
    Committed,
    Dequeued,
    EndDecided,
    Fact,
    Finished,
    HandedOver,
    HandingOver,
    Parked,
    Queued,
    Resumed,
    Running,
    SessionState,
    Started,
    Superseded,
    Unparked,
    evolve,
    fold,
)
from actors.turn.core import Approval
from eventstore import ANY, NO_STREAM, Metadata, streams
from eventstore.catalogue import ApprovalResolved, SessionCleared, Tokens, TurnEnd, TurnStart

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
IDLE = SessionState(agent_id="a", session_key="k")
AP1 = Approval("ap1", "call1", "record", (NOW + timedelta(seconds=30)).isoformat())
AP2 = Approval("ap2", "call2", "wipe", (NOW - timedelta(seconds=5)).isoformat())


def state(**fields: object) -> SessionState:
    return msgspec.structs.replace(IDLE, **fields)


RUNNING = state(running=Running("t1"))
ENDING = state(running=Running("t1", end_decided=True))
PARKED = state(parked=Parked("t1", (AP1, AP2)))
QUEUED = state(queue=("t0",), uncommitted=frozenset({"t0"}))  # accepted, turn.start in flight


def submit(turn_id: str = "t2", policy: Policy | None = None) -> Submit:
    return Submit(agent_id="a", session_key="k", text="hi", concurrency=policy, turn_id=turn_id)


def meta(turn_id: str | None) -> Metadata:
    return Metadata(agent_id="a", session_key="k", turn_id=turn_id)


def start_of(turn_id: str = "t2", *, begins: bool = False) -> Append:
    """The acceptance of ``submit(turn_id)``: its turn.start, on a stream that must not exist;
    on an idle session (``begins``) it is also the start of the turn's first attempt."""
    start = TurnStart(source="api", input="hi", attempt=1 if begins else 0)
    return Append(f"turn-{turn_id}", start, meta(turn_id), NO_STREAM, then=CommitOf(turn_id))


def accepted(turn_id: str = "t2", *facts: Fact, effects: tuple[Effect, ...] = (),
             begins: bool = False) -> Decision:  # fmt: skip
    """The acceptance of ``submit(turn_id)``: queued, then ``facts`` and ``effects``."""
    start = start_of(turn_id, begins=begins)
    return Decision(Accept(turn_id), start, (Queued(turn_id), *facts), effects)


BUSY = Refused(
    code="session_busy",
    message="session 'k' is running a turn",
    hint="wait for its turn.end, send with concurrency 'queue', or stop it first",
)
CLEAR_BUSY = Refused(
    code="session_busy",
    message="session 'k' has a turn running or queued",
    hint="wait for its turn.end (or stop it), then clear the session",
)
STOPPING = StopResult(stopping=True, state="stopping")


def not_found(approval_id: str) -> Refused:
    return Refused(
        code="approval_not_found",
        message=f"approval {approval_id!r} is not waiting for an answer",
        hint="it was answered already, timed out, or its turn ended; GET "
        "/v1/agents/a/approvals lists the open ones",
    )


APPROVAL_BUSY = Refused(
    code="approval_busy",
    message="the turn of approval 'ap1' is being restored",
    hint="retry in a moment (the node has just started, or the turn is resuming)",
)


def answer(
    approval_id: str = "ap1", turn_id: str | None = "t1", by: str = "api"
) -> ResolveApproval:
    return ResolveApproval(agent_id="a", approval_id=approval_id, granted=True, by=by,
                           turn_id=turn_id)  # fmt: skip


def resolution(approval: Approval, last: bool) -> Append:
    event = ApprovalResolved(approval_id=approval.approval_id, slug=approval.slug, granted=True,
                             by="api")  # fmt: skip
    return Append("turn-t1", event, meta("t1"), ANY, then=UnparkAfter("t1") if last else None)


def timeout(approval_id: str) -> ResolveApproval:
    return ResolveApproval(agent_id="a", approval_id=approval_id, granted=False, by="timeout")


ROWS: list[object] = [
    # --- Submit: each policy while idle, running, ending, waiting, queued ----------------------
    pytest.param(
        IDLE,
        submit(),
        accepted(begins=True),
        state(queue=("t2",), uncommitted=frozenset({"t2"})),
        id="idle-queue",
    ),
    pytest.param(
        IDLE,
        submit(policy="reject"),
        accepted(begins=True),
        state(queue=("t2",), uncommitted=frozenset({"t2"})),
        id="idle-reject-accepts",
    ),
    pytest.param(
        IDLE,
        submit(policy="interrupt"),
        accepted(begins=True),
        state(queue=("t2",), uncommitted=frozenset({"t2"})),
        id="idle-interrupt-stops-nothing",
    ),
    pytest.param(
        RUNNING,
        submit(),
        accepted(),
        state(running=Running("t1"), queue=("t2",), uncommitted=frozenset({"t2"})),
        id="running-queue-waits-its-turn",
    ),
    pytest.param(
        RUNNING, submit(policy="reject"), Decision(BUSY), RUNNING, id="running-reject-refuses"
    ),
    pytest.param(
        RUNNING,
        submit(policy="interrupt"),
        accepted(effects=(TellStop("t1", "interrupt"),)),
        state(running=Running("t1"), queue=("t2",), uncommitted=frozenset({"t2"})),
        id="running-interrupt-stops-it",
    ),
    pytest.param(
        ENDING,
        submit(policy="reject"),
        accepted(),
        state(running=Running("t1", True), queue=("t2",), uncommitted=frozenset({"t2"})),
        id="ending-reject-accepts",
    ),  # its turn.end is decided: it no longer counts
    pytest.param(
        PARKED,
        submit(),
        accepted(),
        state(parked=Parked("t1", (AP1, AP2)), queue=("t2",), uncommitted=frozenset({"t2"})),
        id="waiting-queue-waits-behind-it",
    ),
    pytest.param(
        PARKED, submit(policy="reject"), Decision(BUSY), PARKED, id="waiting-reject-refuses"
    ),
    pytest.param(
        PARKED,
        submit(policy="interrupt"),
        accepted(
            "t2", Unparked("t1"), Started("t1"), effects=(StartTurn("t1", stop_by="interrupt"),)
        ),
        state(running=Running("t1"), queue=("t2",), uncommitted=frozenset({"t2"})),
        id="waiting-interrupt-runs-it-stopping",
    ),
    pytest.param(
        QUEUED, submit(policy="reject"), Decision(BUSY), QUEUED, id="queued-reject-refuses"
    ),
    pytest.param(
        QUEUED,
        submit(),
        accepted(),
        state(queue=("t0", "t2"), uncommitted=frozenset({"t0", "t2"})),
        id="queued-queue-appends-in-order",
    ),
    pytest.param(
        QUEUED,
        submit(policy="interrupt"),
        Decision(Accept("t2"), start_of("t2"), (Superseded(("t0",)), Queued("t2")), ()),
        state(
            queue=("t0", "t2"), uncommitted=frozenset({"t0", "t2"}), superseded=frozenset({"t0"})
        ),
        id="queued-interrupt-supersedes-what-is-ahead",
    ),  # accepted through another node a moment before: it must not run first
    pytest.param(
        state(policy="reject", running=Running("t1")),
        submit(),
        Decision(BUSY),
        state(policy="reject", running=Running("t1")),
        id="agent-default-reject",
    ),
    pytest.param(
        state(policy="reject", running=Running("t1")),
        submit(policy="queue"),
        accepted(),
        state(policy="reject", running=Running("t1"), queue=("t2",), uncommitted=frozenset({"t2"})),
        id="message-policy-overrides-agent",
    ),
    # --- duplicates: a turn id the session holds appends nothing --------------------------------
    pytest.param(
        QUEUED,
        submit("t0"),
        Decision(Duplicate("t0", pending=True)),
        QUEUED,
        id="duplicate-of-uncommitted-waits-for-its-commit",
    ),
    pytest.param(
        state(queue=("t0",), running=Running("t1")),
        submit("t0"),
        Decision(Duplicate("t0", pending=False)),
        state(queue=("t0",), running=Running("t1")),
        id="duplicate-of-queued",
    ),
    pytest.param(
        RUNNING,
        submit("t1"),
        Decision(Duplicate("t1", pending=False)),
        RUNNING,
        id="duplicate-of-running",
    ),
    pytest.param(
        RUNNING,
        submit("t1", policy="reject"),
        Decision(BUSY),
        RUNNING,
        id="reject-before-duplicate",
    ),
    # A waiting turn is not looked up: its turn.start exists, so the store refuses the append
    # (WrongExpectedVersion) and the engine answers from the stored turn.
    pytest.param(
        PARKED,
        submit("t1"),
        accepted("t1"),
        state(parked=Parked("t1", (AP1, AP2)), queue=("t1",), uncommitted=frozenset({"t1"})),
        id="duplicate-of-waiting-left-to-the-store",
    ),
    # --- stop of each kind ----------------------------------------------------------------------
    pytest.param(
        RUNNING,
        StopTurn(turn_id="t1"),
        Decision(STOPPING, effects=(TellStop("t1", "api"),)),
        RUNNING,
        id="stop-running-asks-its-actor",
    ),
    pytest.param(
        PARKED,
        StopTurn(turn_id="t1", by="ws"),
        Decision(
            STOPPING,
            facts=(Unparked("t1"), Started("t1")),
            effects=(StartTurn("t1", stop_by="ws"),),
        ),
        state(running=Running("t1")),
        id="stop-waiting-runs-it-stopping",
    ),
    pytest.param(
        state(running=Running("t1"), queue=("t2",)),
        StopTurn(turn_id="t2"),
        Decision(
            OnceStored(StopResult(stopping=True, state="stopped")),
            Append(
                "turn-t2",
                TurnEnd(reason="stopped", steps=0, tokens=Tokens(), duration_ms=0),
                meta("t2"),
            ),
            (Dequeued("t2"),),
            (Forget("t2"),),
        ),
        RUNNING,
        id="stop-queued-appends-its-end",
    ),
    pytest.param(
        RUNNING,
        StopTurn(turn_id="t9"),
        Decision(StopResult(stopping=False, state="unknown")),
        RUNNING,
        id="stop-unknown",
    ),
    # --- clear ----------------------------------------------------------------------------------
    pytest.param(
        IDLE,
        ClearSession(agent_id="a", session_key="k", by="ws"),
        Decision(
            OnceStored(Cleared(session_key="k")),
            Append(
                streams.session("a", "k"),
                SessionCleared(by="ws"),
                Metadata(agent_id="a", session_key="k"),
            ),
            effects=(ResetHistory(),),
        ),
        IDLE,
        id="clear-idle",
    ),
    pytest.param(
        ENDING,
        ClearSession(agent_id="a", session_key="k"),
        Decision(
            OnceStored(Cleared(session_key="k")),
            Append(
                streams.session("a", "k"),
                SessionCleared(by="api"),
                Metadata(agent_id="a", session_key="k"),
            ),
            effects=(ResetHistory(),),
        ),
        ENDING,
        id="clear-while-the-last-turn-ends",
    ),
    pytest.param(
        RUNNING,
        ClearSession(agent_id="a", session_key="k"),
        Decision(CLEAR_BUSY),
        RUNNING,
        id="clear-running-refused",
    ),
    pytest.param(
        PARKED,
        ClearSession(agent_id="a", session_key="k"),
        Decision(CLEAR_BUSY),
        PARKED,
        id="clear-waiting-refused",
    ),
    pytest.param(
        QUEUED,
        ClearSession(agent_id="a", session_key="k"),
        Decision(CLEAR_BUSY),
        QUEUED,
        id="clear-queued-refused",
    ),
    # --- approvals ------------------------------------------------------------------------------
    pytest.param(
        PARKED,
        answer("ap1"),
        Decision(
            OnceStored(Resolved(approval_id="ap1", granted=True)),
            resolution(AP1, last=False),
            (Answered("ap1"),),
        ),
        state(parked=Parked("t1", (AP2,))),
        id="answer-one-of-two",
    ),
    pytest.param(
        state(parked=Parked("t1", (AP2,))),
        answer("ap2"),
        Decision(
            OnceStored(Resolved(approval_id="ap2", granted=True)),
            resolution(AP2, last=True),
            (Answered("ap2"),),
        ),
        state(parked=Parked("t1", ())),
        id="last-answer-unparks-once-stored",
    ),
    pytest.param(
        state(parked=Parked("t1", (AP2,))),
        answer("ap1"),
        Decision(not_found("ap1")),
        state(parked=Parked("t1", (AP2,))),
        id="answer-not-waiting",
    ),
    pytest.param(
        IDLE,
        answer("ap1", turn_id=None, by="timeout"),
        Decision(not_found("ap1")),
        IDLE,
        id="late-timeout-finds-nothing",
    ),
    pytest.param(
        state(queue=("t1",)),
        answer("ap1"),
        Decision(APPROVAL_BUSY),
        state(queue=("t1",)),
        id="answer-while-resumed-turn-is-queued",
    ),
    pytest.param(
        RUNNING,
        answer("ap1"),
        Decision(APPROVAL_BUSY),
        RUNNING,
        id="answer-while-its-turn-runs-again",
    ),
    pytest.param(
        state(parked=Parked("t1", ())),
        ApprovalsAnswered("t1"),
        Decision(facts=(Unparked("t1"), Started("t1")), effects=(StartTurn("t1"),)),
        state(running=Running("t1")),
        id="answered-turn-runs-on",
    ),
    pytest.param(
        RUNNING, ApprovalsAnswered("t1"), NOTHING, RUNNING, id="answered-after-it-was-stopped"
    ),
    # --- commits of turn.start ------------------------------------------------------------------
    pytest.param(
        QUEUED,
        StartStored("t0", ok=True),
        Decision(facts=(Committed("t0"), Started("t0")), effects=(StartTurn("t0"),)),
        state(running=Running("t0")),
        id="stored-start-runs-when-idle",
    ),
    pytest.param(
        state(
            queue=("t0", "t2"), uncommitted=frozenset({"t0", "t2"}), superseded=frozenset({"t0"})
        ),
        StartStored("t0", ok=True),
        Decision(
            facts=(Committed("t0"), Started("t0")), effects=(StartTurn("t0", stop_by="interrupt"),)
        ),
        state(running=Running("t0"), queue=("t2",), uncommitted=frozenset({"t2"})),
        id="stored-superseded-start-runs-stopping",
    ),
    pytest.param(
        state(running=Running("t1"), queue=("t2",), uncommitted=frozenset({"t2"})),
        StartStored("t2", ok=True),
        Decision(facts=(Committed("t2"),)),
        state(running=Running("t1"), queue=("t2",)),
        id="stored-start-waits-its-turn",
    ),
    pytest.param(
        QUEUED,
        StartStored("t0", ok=False),
        Decision(facts=(CommitFailed("t0"),)),
        IDLE,
        id="failed-start-is-no-turn",
    ),
    pytest.param(
        state(queue=("t2", "t3"), uncommitted=frozenset({"t2", "t3"})),
        StartStored("t3", ok=True),
        Decision(facts=(Committed("t3"),)),
        state(queue=("t2", "t3"), uncommitted=frozenset({"t2"})),
        id="later-commit-does-not-jump-the-queue",
    ),
    # --- a turn's run returns -------------------------------------------------------------------
    pytest.param(
        state(running=Running("t1"), queue=("t2",)),
        TurnEnded("t1", "final", NOW),
        Decision(
            facts=(Finished("t1"), Started("t2")),
            effects=(Release(keep_history=True), StartTurn("t2")),
        ),
        state(running=Running("t2")),
        id="end-starts-the-next",
    ),
    pytest.param(
        RUNNING,
        TurnEnded("t1", None, NOW),
        Decision(facts=(Finished("t1"),), effects=(Release(keep_history=False),)),
        IDLE,
        id="cancelled-run-keeps-no-history",
    ),
    pytest.param(
        state(running=Running("t1"), queue=("t2",)),
        TurnEnded("t1", "awaiting_approval", NOW, (AP1, AP2)),
        Decision(
            facts=(Finished("t1", (AP1, AP2)),),
            effects=(
                Release(keep_history=True),
                After(30.0, timeout("ap1")),
                After(0.0, timeout("ap2")),
            ),
        ),
        state(parked=Parked("t1", (AP1, AP2)), queue=("t2",)),
        id="waiting-turn-parks-and-holds-the-session",
    ),
    pytest.param(
        RUNNING,
        TurnEnded("t9", "final", NOW),
        NOTHING,
        RUNNING,
        id="end-of-a-turn-not-running-here",
    ),
    # --- resume after a start or a partition move ----------------------------------------------
    pytest.param(
        IDLE,
        Resume(["t1", "t2", "t1"]),
        Decision(facts=(Resumed(("t1", "t2")), Started("t1")), effects=(StartTurn("t1"),)),
        state(running=Running("t1"), queue=("t2",)),
        id="resume-runs-in-order",
    ),
    pytest.param(
        state(running=Running("t0"), queue=("t1",)),
        Resume(["t1", "t2"]),
        Decision(facts=(Resumed(("t2",)),)),
        state(running=Running("t0"), queue=("t1", "t2")),
        id="resume-skips-what-is-queued",
    ),
    # --- hand-over: nothing new starts, answered once nothing runs ------------------------------
    pytest.param(
        IDLE,
        HandOver(),
        Decision(
            HandOverAnswer(), facts=(HandingOver(), HandedOver()), effects=(AnswerHandOver(),)
        ),
        state(handing_over=True, handed_over=True),
        id="hand-over-idle-answers-now",
    ),
    pytest.param(
        PARKED,
        HandOver(),
        Decision(
            HandOverAnswer(), facts=(HandingOver(), HandedOver()), effects=(AnswerHandOver(),)
        ),
        state(parked=Parked("t1", (AP1, AP2)), handing_over=True, handed_over=True),
        id="hand-over-waiting-answers-now",
    ),  # no task: the next owner parks it again
    pytest.param(
        RUNNING,
        HandOver(),
        Decision(HandOverAnswer(), facts=(HandingOver(),)),
        state(running=Running("t1"), handing_over=True),
        id="hand-over-running-waits",
    ),
    pytest.param(
        state(handing_over=True, handed_over=True),
        HandOver(),
        Decision(HandOverAnswer()),
        state(handing_over=True, handed_over=True),
        id="hand-over-asked-again",
    ),
    pytest.param(
        state(running=Running("t1"), queue=("t2",), handing_over=True),
        TurnEnded("t1", "final", NOW),
        Decision(
            facts=(Finished("t1"), HandedOver()),
            effects=(Release(keep_history=True), AnswerHandOver()),
        ),
        state(queue=("t2",), handing_over=True, handed_over=True),
        id="hand-over-answered-when-the-turn-ends-next-not-started",
    ),
    pytest.param(
        state(queue=("t2",), uncommitted=frozenset({"t2"}), handing_over=True, handed_over=True),
        StartStored("t2", ok=True),
        Decision(facts=(Committed("t2"),)),
        state(queue=("t2",), handing_over=True, handed_over=True),
        id="hand-over-stored-start-stays-queued",
    ),
    pytest.param(
        state(running=Running("t1"), handing_over=True),
        submit(),
        accepted(),
        state(
            running=Running("t1"), queue=("t2",), uncommitted=frozenset({"t2"}), handing_over=True
        ),
        id="hand-over-still-accepts-for-the-next-owner",
    ),
]


@pytest.mark.parametrize(("before", "command", "decision", "after"), ROWS)
def test_decide(before: SessionState, command: Command, decision: Decision,
                after: SessionState) -> None:  # fmt: skip
    decided = decide(before, command)
    assert decided == decision
    assert fold(before, decided.facts) == after


@pytest.mark.parametrize(
    ("current", "busy", "idle", "between_turns"),
    [
        (IDLE, False, True, True),
        (RUNNING, True, False, False),
        (ENDING, False, False, False),  # not busy for the policy, but the turn is still here
        (PARKED, True, False, False),
        (QUEUED, True, False, True),
    ],
)
def test_what_the_session_is_doing(current: SessionState, busy: bool, idle: bool,
                                   between_turns: bool) -> None:  # fmt: skip
    assert (current.busy, current.idle, current.between_turns) == (busy, idle, between_turns)


def test_a_turn_accepted_run_and_ended_leaves_the_session_idle() -> None:
    after = fold(IDLE, (Queued("t1"), Committed("t1"), Started("t1"), EndDecided("t1"),
                        Finished("t1")))  # fmt: skip
    assert after == IDLE


@pytest.mark.parametrize(
    ("fact", "before"),
    [
        (EndDecided("t9"), RUNNING),
        (Finished("t9"), RUNNING),
        (Answered("ap1"), IDLE),
    ],
)
def test_facts_about_a_turn_not_here_change_nothing(fact: Fact, before: SessionState) -> None:
    assert evolve(before, fact) == before


def test_an_end_decided_frees_the_session_for_the_policy_only() -> None:
    ending = evolve(RUNNING, EndDecided("t1"))
    assert ending.running == Running("t1", end_decided=True)
    assert decide(ending, submit(policy="reject")).answer == Accept("t2")
    assert decide(ending, StopTurn(turn_id="t1")).effects == (TellStop("t1", "api"),)


@pytest.mark.parametrize(
    ("expires_at", "seconds"),
    [
        ((NOW + timedelta(minutes=2)).isoformat(), 120.0),
        ((NOW - timedelta(minutes=2)).isoformat(), 0.0),  # overdue (e.g. across a restart)
        ("not a time", 0.0),
        ("2026-01-02T03:04:35", 0.0),  # no time zone: cannot be compared, counts as due
    ],
)
def test_approval_deadlines_count_from_the_end_of_the_run(expires_at: str, seconds: float) -> None:
    approval = Approval("ap", "call", "record", expires_at)
    assert deadlines((approval,), NOW) == [("ap", seconds)]

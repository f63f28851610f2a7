"""SessionActor: the single door of one session. It accepts messages as turns (appending each
``turn.start``), runs them one at a time, and applies the session's concurrency policy to a
message that arrives while a turn runs: ``queue`` it, ``reject`` it, or ``interrupt`` the running
turn and run it next. The policy is the pure core in actors/session/core.py; this actor loads,
decides, appends and evolves: it carries each decision out (appends, tells, timers, the turn's
actor) and answers with it."""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import msgspec
import pykka
import structlog

from actors import ids
from actors.actor import LoopActor, tell
from actors.context import fork
from actors.context.history import History
from actors.messages import (
    Accepted,
    ClearSession,
    Refused,
    ResolveApproval,
    Resume,
    SetPhase,
    StopResult,
    StopTurn,
    Submit,
    TurnFinished,
)
from actors.session.core import (
    Accept,
    After,
    AnswerHandOver,
    ApprovalsAnswered,
    Command,
    CommitOf,
    Decision,
    Duplicate,
    Forget,
    Fork,
    HandOver,
    HandOverAnswer,
    OnceStored,
    Release,
    ReloadHistory,
    ResetHistory,
    StartStored,
    StartTurn,
    TellStop,
    TurnEnded,
    UnparkAfter,
    decide,
)
from actors.session.state import (
    EndDecided,
    Queued,
    Resumed,
    SessionState,
    evolve,
)
from actors.turn.actor import TurnActor
from actors.turn.runner import TurnRunner
from eventstore import AppendResult, NewEvent, RecordedEvent, streams

if TYPE_CHECKING:
    from actors.session.directory import SessionDirectory

log = structlog.get_logger("dispach.session")

IDLE_FOR = "idle-for"
"""Ask: seconds since the session last did anything (0 while a turn runs or waits)."""
HAND_OVER = "hand-over"
"""Ask: start no other turn; answered with a future that resolves once no turn runs here (the
session's partition moves to another node, which resumes what is still queued)."""
HISTORY = "history"
"""Ask: a copy of the history the session's next turn would read, or None when the actor holds
none (no turn has ended here since it was activated) or a turn runs or waits (the next turn's
history is not known until it ends). Reading it is not activity: it keeps no session alive."""


@dataclass(frozen=True)
class Accepting:
    """The answer to a ``Submit``: the acceptance, once ``committed`` (its turn.start) is."""

    accepted: Accepted
    committed: Future[AppendResult]
    duplicate: bool = False
    """The turn id (derived from an Idempotency-Key) is already this session's: nothing was
    appended, and the asker answers from the stored turn.start once ``committed`` resolves."""


@dataclass(frozen=True)
class Pending:
    """An answer that holds once ``committed`` (an append the actor submitted) has: the asker
    awaits the commit, the actor never blocks on it."""

    answer: Any
    committed: Future[AppendResult]


@dataclass(frozen=True)
class _Committed:
    turn_id: str
    result: AppendResult | None
    """The stored turn.start, or None when the append failed."""


@dataclass(frozen=True)
class _Turn:
    """The running turn's actor, and its runner (read here, never changed but for a stop)."""

    turn_id: str
    ref: pykka.ActorRef[Any]
    runner: TurnRunner


def _settled(ref: pykka.ActorRef[Any], message: object, _done: Future[AppendResult]) -> None:
    tell(ref, message)


def _start_settled(ref: pykka.ActorRef[Any], turn_id: str, future: Future[AppendResult]) -> None:
    result = None if future.exception() is not None else future.result()
    tell(ref, _Committed(turn_id, result))


class SessionActor(LoopActor):
    """Handled on the event loop like the TurnActor (see LoopActor): a session actor only
    decides and submits appends, it never waits for one, so it needs no thread of its own; a
    node with ten thousand live sessions holds ten thousand small objects, not threads."""

    def __init__(self, engine: SessionDirectory, agent_id: str, session_key: str) -> None:
        super().__init__(engine.portal.loop)
        self._engine = engine
        self._agent = engine.agents[agent_id]
        self._session_key = session_key
        self._state = SessionState(agent_id=agent_id, session_key=session_key,
                                   policy=self._agent.concurrency,
                                   node_id=engine.node_id)  # fmt: skip
        self._commits: dict[str, Future[AppendResult]] = {}  # turn.start not yet committed
        self._accepted: dict[str, list[RecordedEvent]] = {}  # committed and queued: for its runner
        self._turn: _Turn | None = None
        self._history: History | None = None
        """The session's history as the next turn reads it, once a turn here has ended (None:
        the next turn loads it from the session's snapshot and messages)."""
        self.last_active = time.monotonic()
        self._handed_over: asyncio.Future[None] | None = None
        self._used = False
        """A turn was accepted or resumed here since activation: the session has a history of
        its own, whether or not its first turn.start has reached the read models yet (the
        engine checks those before a fork; this closes the window between)."""

    def on_stop(self) -> None:
        # Passivated (or the node drains, or the partition moved): askers that raced the stop
        # are refused (actors/actor.py) and activate a new actor. A turn still running here is
        # cancelled without a stop request: it stays unfinished in the log and its session's
        # next owner resumes it.
        if self._turn is not None:
            self._turn.ref.stop(block=False)

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, _Committed):
            self._commits.pop(message.turn_id, None)
            if message.result is not None and message.turn_id in self._state.queue:
                self._accepted[message.turn_id] = message.result.events
            return self._decide(StartStored(message.turn_id, ok=message.result is not None))
        if message == IDLE_FOR:
            return 0.0 if not self._state.idle else time.monotonic() - self.last_active
        if message == HAND_OVER:
            return self._decide(HandOver())
        if message == HISTORY:
            held = self._history
            return None if held is None or not self._state.between_turns else held.copy()
        self.last_active = time.monotonic()
        match message:
            case Submit(turn_id=None):
                return self._decide(msgspec.structs.replace(message, turn_id=ids.turn_id()))
            case Fork() if self._used:
                return fork.exists(self._state.agent_id, self._session_key)
            case (
                Submit() | StopTurn() | ClearSession() | Resume() | ResolveApproval()
                | ApprovalsAnswered() | Fork() | SetPhase()
            ):  # fmt: skip
                return self._decide(message)
            case TurnFinished(turn_id=turn_id, reason=reason):
                turn = self._turn
                waiting = () if turn is None or turn.turn_id != turn_id else turn.runner.parked
                ended = TurnEnded(turn_id, reason, datetime.now(UTC), tuple(waiting))
                return self._decide(ended)
        return None

    def _decide(self, command: Command) -> Any:
        turn = self._turn
        running = self._state.running
        if (
            turn is not None
            and running is not None
            and not running.end_decided
            and turn.runner.state.ended is not None  # its turn.end is on its way to the log
        ):
            self._state = evolve(self._state, EndDecided(turn.turn_id))
        return self._carry_out(decide(self._state, command))

    def _carry_out(self, decision: Decision) -> Any:
        """The decision's append first: if the store refuses to even take it (closed,
        overloaded), the asker gets the error and nothing else changes."""
        committed: Future[AppendResult] | None = None
        if (append := decision.append) is not None:
            committed = self._engine.store.submit(
                append.stream, [NewEvent(event=append.event, metadata=append.metadata)],
                append.expected,
            )  # fmt: skip
            match append.then:
                case CommitOf(turn_id=turn_id):
                    self._commits[turn_id] = committed
                    settled = functools.partial(_start_settled, self.actor_ref, turn_id)
                    committed.add_done_callback(settled)
                case UnparkAfter(turn_id=turn_id):
                    then = ApprovalsAnswered(turn_id)
                    committed.add_done_callback(functools.partial(_settled, self.actor_ref, then))
        for fact in decision.facts:
            self._used = self._used or isinstance(fact, Queued | Resumed)
            self._state = evolve(self._state, fact)
        for effect in decision.effects:
            self._effect(effect)
        return self._answer(decision, committed)

    def _effect(self, effect: object) -> None:
        match effect:
            case TellStop(turn_id=turn_id, by=by):
                assert self._turn is not None and self._turn.turn_id == turn_id
                self._turn.ref.tell(StopTurn(turn_id=turn_id, by=by))
            case StartTurn(turn_id=turn_id, stop_by=stop_by):
                self._start(turn_id, stop_by)
            case After(seconds=seconds, command=command):
                self._loop.call_later(seconds, tell, self.actor_ref, command)
            case Release(keep_history=keep):
                ran = self._turn.runner if self._turn is not None else None
                self._history = ran.history_after if ran is not None and keep else None
                self._turn = None
            case ResetHistory():
                self._history = History()
            case ReloadHistory():
                self._history = None
            case Forget(turn_id=turn_id):
                self._accepted.pop(turn_id, None)
            case AnswerHandOver():
                done = self._hand_over_future()
                if not done.done():
                    done.set_result(None)

    def _answer(self, decision: Decision, committed: Future[AppendResult] | None) -> Any:
        key = self._session_key
        match decision.answer:
            case Accept(turn_id=turn_id):
                assert committed is not None
                return Accepting(Accepted(turn_id=turn_id, session_key=key), committed)
            case Duplicate(turn_id=turn_id, pending=pending):
                known = self._commits[turn_id] if pending else _stored(turn_id)
                return Accepting(Accepted(turn_id=turn_id, session_key=key), known,
                                 duplicate=True)  # fmt: skip
            case OnceStored(answer=held):
                assert committed is not None
                return Pending(held, committed)
            case HandOverAnswer():
                return self._hand_over_future()
            case Refused() | StopResult() as plain:
                return plain
        return None

    def _hand_over_future(self) -> asyncio.Future[None]:
        if self._handed_over is None:
            self._handed_over = self._loop.create_future()
        return self._handed_over

    def _start(self, turn_id: str, stop_by: str | None) -> None:
        engine = self._engine
        # The agent as it is now: its tool list is built again when an MCP server's changes.
        self._agent = engine.agents.get(self._state.agent_id, self._agent)
        runner = TurnRunner(
            engine.store, self._agent, turn_id, self._session_key, engine.node_id,
            stored=self._accepted.pop(turn_id, None), history=self._history,
            versions=functools.partial(engine.agent_at, self._state.agent_id),
        )  # fmt: skip
        if stop_by is not None:
            runner.request_stop(stop_by)
        ref = engine.host.start(TurnActor, engine.portal.loop, runner, self.actor_ref.tell,
                                engine.running)  # fmt: skip
        self._turn = _Turn(turn_id, ref, runner)


def _stored(turn_id: str) -> Future[AppendResult]:
    """A settled commit for a turn whose turn.start is stored already (the asker reads it)."""
    done: Future[AppendResult] = Future()
    done.set_result(AppendResult(streams.turn(turn_id), []))
    return done

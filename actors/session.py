"""SessionActor: the single door of one session. It accepts messages as turns (appending each
``turn.start``), runs them one at a time, and applies the session's concurrency policy to a
message that arrives while a turn runs: ``queue`` it, ``reject`` it, or ``interrupt`` the running
turn and run it next."""

from __future__ import annotations

import contextlib
import functools
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pykka
import structlog

from actors import ids
from actors.bridge import Ask, LoopActor, answer, refuse_pending
from actors.context.history import History
from actors.messages import (
    Accepted,
    Cleared,
    ClearSession,
    Refused,
    ResolveApproval,
    Resolved,
    Resume,
    StopResult,
    StopTurn,
    Submit,
    TurnFinished,
)
from actors.turn.actor import TurnActor
from actors.turn.core import Approval
from actors.turn.runner import AWAITING_APPROVAL, TurnRunner
from eventstore import ANY, NO_STREAM, AppendResult, Metadata, NewEvent, RecordedEvent, streams
from eventstore.catalogue import ApprovalResolved, SessionCleared, Tokens, TurnEnd, TurnStart

if TYPE_CHECKING:
    from actors.engine import Engine

log = structlog.get_logger("dispach.session")

IDLE_FOR = "idle-for"
"""Ask: seconds since the session last did anything (0 while a turn runs or waits)."""
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
class _Committed:
    turn_id: str
    result: AppendResult | None
    """The stored turn.start, or None when the append failed."""


@dataclass(frozen=True)
class _Unpark:
    turn_id: str


@dataclass
class _Parked:
    turn_id: str
    pending: dict[str, str]
    """Approval ids not answered yet, with their tools' names."""


def _tell(ref: pykka.ActorRef[Any], message: object) -> None:
    with contextlib.suppress(pykka.ActorDeadError):
        ref.tell(message)


def _settled(ref: pykka.ActorRef[Any], message: object, _done: Future[AppendResult]) -> None:
    _tell(ref, message)


@dataclass(frozen=True)
class Pending:
    """An answer that holds once ``committed`` (an append the actor submitted) has: the asker
    awaits the commit, the actor never blocks on it."""

    answer: Any
    committed: Future[AppendResult]


class SessionActor(LoopActor):
    """Handled on the event loop like the TurnActor (see LoopActor): a session actor only
    decides and submits appends, it never waits for one, so it needs no thread of its own; a
    node with ten thousand live sessions holds ten thousand small objects, not threads."""

    def __init__(self, engine: Engine, agent_id: str, session_key: str) -> None:
        super().__init__(engine.portal.loop)
        self._engine = engine
        self._agent = engine.agents[agent_id]
        self._session_key = session_key
        self._queue: deque[str] = deque()
        self._uncommitted: dict[str, Future[AppendResult]] = {}  # turn.start not yet committed
        self._accepted: dict[str, list[RecordedEvent]] = {}  # committed, not yet started
        self._running: tuple[str, pykka.ActorRef[Any]] | None = None
        self._runner: TurnRunner | None = None  # the running turn's runner (read-only here)
        self._parked: _Parked | None = None
        """The turn waiting for approvals, if one is: it holds the session like a running one."""
        self._history: History | None = None
        """The session's history as the next turn reads it, once a turn here has ended (None:
        the next turn loads it from the session's snapshot and messages)."""
        self.last_active = time.monotonic()

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, Ask):
            answer(message, self._handle)
            return None
        return self._handle(message)

    def on_stop(self) -> None:
        # Passivated (or the node drains): askers that raced the stop activate a new actor.
        refuse_pending(self)

    def _handle(self, message: Any) -> Any:
        if isinstance(message, _Committed):
            self._committed(message)
            return None
        if message == IDLE_FOR:
            busy = self._running is not None or bool(self._queue) or self._parked is not None
            return 0.0 if busy else time.monotonic() - self.last_active
        if message == HISTORY:
            held = self._history
            busy = self._running is not None or self._parked is not None
            return None if held is None or busy else held.copy()
        self.last_active = time.monotonic()
        match message:
            case Submit() as submit:
                return self._submit(submit)
            case StopTurn() as stop:
                return self._stop_turn(stop)
            case ClearSession() as clear:
                return self._clear(clear)
            case Resume(turn_ids=turn_ids):
                self._queue.extend(t for t in turn_ids if t not in self._queue)
                self._start_next()
                return None
            case TurnFinished() as finished:
                self._finished(finished)
                return None
            case ResolveApproval() as resolve:
                return self._resolve(resolve)
            case _Unpark(turn_id=turn_id):
                if self._parked is not None and self._parked.turn_id == turn_id:
                    self._unpark()
                return None
        return None

    def _committed(self, message: _Committed) -> None:
        self._uncommitted.pop(message.turn_id, None)
        if message.result is None:
            if message.turn_id in self._queue:  # never accepted: the asker got the error
                self._queue.remove(message.turn_id)
        else:
            self._accepted[message.turn_id] = message.result.events
        self._start_next()

    def _finished(self, finished: TurnFinished) -> None:
        if self._running is not None and self._running[0] == finished.turn_id:
            ran, reason = self._runner, finished.reason
            self._history = ran.history_after if ran and reason is not None else None
            self._running = None
            self._runner = None
            if reason == AWAITING_APPROVAL and ran is not None:
                self._park(finished.turn_id, ran.parked)
        self._start_next()

    # --- tool calls waiting for approval ----------------------------------------------------

    def _park(self, turn_id: str, waiting: list[Approval]) -> None:
        """The turn waits for approvals: the session holds it (nothing else runs) without a
        task; each approval's deadline is a timer that answers it as denied."""
        self._parked = _Parked(turn_id, {a.approval_id: a.slug for a in waiting})
        now = datetime.now(UTC)
        me = self.actor_ref
        for approval in waiting:
            try:
                due = (datetime.fromisoformat(approval.expires_at) - now).total_seconds()
            except ValueError:
                due = 0.0
            timeout = ResolveApproval(agent_id=self._agent.id, approval_id=approval.approval_id,
                                      granted=False, by="timeout")  # fmt: skip
            self._loop.call_later(max(due, 0.0), _tell, me, timeout)

    def _resolve(self, resolve: ResolveApproval) -> Pending | Refused:
        parked = self._parked
        restoring = resolve.turn_id is not None and (
            resolve.turn_id in self._queue
            or (self._running is not None and self._running[0] == resolve.turn_id)
        )
        if restoring and (parked is None or parked.turn_id != resolve.turn_id):
            return Refused(
                code="approval_busy",
                message=f"the turn of approval {resolve.approval_id!r} is being restored",
                hint="retry in a moment (the node has just started, or the turn is resuming)",
            )
        if parked is None or resolve.approval_id not in parked.pending:
            return Refused(
                code="approval_not_found",
                message=f"approval {resolve.approval_id!r} is not waiting for an answer",
                hint="it was answered already, timed out, or its turn ended; GET "
                f"/v1/agents/{self._agent.id}/approvals lists the open ones",
            )
        slug = parked.pending.pop(resolve.approval_id)
        meta = Metadata(agent_id=self._agent.id, session_key=self._session_key,
                        turn_id=parked.turn_id)  # fmt: skip
        event = ApprovalResolved(approval_id=resolve.approval_id, slug=slug,
                                 granted=resolve.granted, by=resolve.by)  # fmt: skip
        committed = self._engine.store.submit(
            streams.turn(parked.turn_id), [NewEvent(event=event, metadata=meta)], ANY
        )
        if not parked.pending:  # the last answer: the turn runs on once it is stored
            unpark = _Unpark(parked.turn_id)
            committed.add_done_callback(functools.partial(_settled, self.actor_ref, unpark))
        return Pending(Resolved(approval_id=resolve.approval_id, granted=resolve.granted),
                       committed)  # fmt: skip

    def _unpark(self, stop_by: str | None = None) -> None:
        """Every approval is answered (or the turn is stopped): run the turn again, first."""
        assert self._parked is not None
        turn_id = self._parked.turn_id
        self._parked = None
        self._queue.appendleft(turn_id)
        self._start_next(stop_by)

    def _submit(self, submit: Submit) -> Accepting | Refused:
        policy = submit.concurrency or self._agent.concurrency
        # A turn whose end is decided (its turn.end is on its way to the log) no longer counts:
        # a client that has seen turn.end must not be refused because the news has not yet
        # reached this actor.
        busy = self._busy()
        if busy and policy == "reject":
            return Refused(
                code="session_busy",
                message=f"session {self._session_key!r} is running a turn",
                hint="wait for its turn.end, send with concurrency 'queue', or stop it first",
            )
        turn_id = submit.turn_id or ids.turn_id()
        known = self._known(turn_id)
        if known is not None:
            return Accepting(Accepted(turn_id=turn_id, session_key=self._session_key), known,
                             duplicate=True)  # fmt: skip
        meta = Metadata(agent_id=self._agent.id, session_key=self._session_key, turn_id=turn_id)
        start = TurnStart(
            source=submit.source,
            input=submit.text,
            deliver=submit.deliver,
            idempotency_key=submit.idempotency_key,
            request_hash=submit.request_hash,
            sender=submit.sender,
        )
        # 202 means durable: the turn exists once this append has committed. The actor does not
        # wait for the commit (the asker does); the turn starts only after it.
        committed = self._engine.store.submit(
            streams.turn(turn_id), [NewEvent(event=start, metadata=meta)], NO_STREAM
        )
        self._queue.append(turn_id)
        self._uncommitted[turn_id] = committed
        me = self.actor_ref

        def settled(future: Future[AppendResult]) -> None:
            result = None if future.exception() is not None else future.result()
            with contextlib.suppress(pykka.ActorDeadError):
                me.tell(_Committed(turn_id, result))

        committed.add_done_callback(settled)
        if policy == "interrupt" and self._running is not None:
            self._running[1].tell(StopTurn(turn_id=self._running[0], by="interrupt"))
        elif policy == "interrupt" and self._parked is not None:
            self._unpark(stop_by="interrupt")
        return Accepting(Accepted(turn_id=turn_id, session_key=self._session_key), committed)

    def _known(self, turn_id: str) -> Future[AppendResult] | None:
        """The commit of a turn this session already holds (queued or running), if it does."""
        pending = self._uncommitted.get(turn_id)
        if pending is not None:
            return pending
        if turn_id in self._queue or (self._running is not None and self._running[0] == turn_id):
            done: Future[AppendResult] = Future()
            done.set_result(AppendResult(streams.turn(turn_id), []))
            return done
        return None

    def _busy(self) -> bool:
        """A turn runs or waits. A turn whose end is decided (its turn.end is on its way to the
        log) no longer counts: a client that has seen turn.end must not be refused because the
        news has not yet reached this actor."""
        running = self._running is not None and (
            self._runner is None or self._runner.state.ended is None
        )
        return running or bool(self._queue) or self._parked is not None

    def _clear(self, clear: ClearSession) -> Pending | Refused:
        if self._busy():
            return Refused(
                code="session_busy",
                message=f"session {self._session_key!r} has a turn running or queued",
                hint="wait for its turn.end (or stop it), then clear the session",
            )
        meta = Metadata(agent_id=self._agent.id, session_key=self._session_key)
        committed = self._engine.store.submit(
            streams.session(self._agent.id, self._session_key),
            [NewEvent(event=SessionCleared(by=clear.by), metadata=meta)],
        )
        self._history = History()
        return Pending(Cleared(session_key=self._session_key), committed)

    def _stop_turn(self, stop: StopTurn) -> StopResult | Pending:
        if self._running is not None and self._running[0] == stop.turn_id:
            self._running[1].tell(stop)
            return StopResult(stopping=True, state="stopping")
        if self._parked is not None and self._parked.turn_id == stop.turn_id:
            self._unpark(stop_by=stop.by)  # it ends as stopped; its waiting calls are not run
            return StopResult(stopping=True, state="stopping")
        if stop.turn_id in self._queue:
            self._queue.remove(stop.turn_id)
            self._accepted.pop(stop.turn_id, None)
            # Answered once its turn.end is stored: a caller that reads the turn next sees it.
            return Pending(StopResult(stopping=True, state="stopped"),
                           self._end_queued(stop.turn_id))  # fmt: skip
        return StopResult(stopping=False, state="unknown")

    def _end_queued(self, turn_id: str) -> Future[AppendResult]:
        meta = Metadata(agent_id=self._agent.id, session_key=self._session_key, turn_id=turn_id)
        end = TurnEnd(reason="stopped", steps=0, tokens=Tokens(), duration_ms=0)
        return self._engine.store.submit(
            streams.turn(turn_id), [NewEvent(event=end, metadata=meta)]
        )

    def _start_next(self, stop_by: str | None = None) -> None:
        if (
            self._running is not None
            or self._parked is not None
            or not self._queue
            or self._queue[0] in self._uncommitted
        ):
            return
        turn_id = self._queue.popleft()
        engine = self._engine
        runner = TurnRunner(
            engine.store, self._agent, turn_id, self._session_key, engine.node_id,
            stored=self._accepted.pop(turn_id, None), history=self._history,
        )  # fmt: skip
        if stop_by is not None:
            runner.request_stop(stop_by)
        me = self.actor_ref
        ref = engine.host.start(TurnActor, engine.portal, runner, me.tell, engine.running)
        self._running = (turn_id, ref)
        self._runner = runner

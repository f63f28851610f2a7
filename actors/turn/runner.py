"""Running one turn: the step loop as a coroutine on the node's event loop.

Model streams and tool calls are I/O that a stop must interrupt within 250 ms, so the loop is a
coroutine (cancellation reaches any await at once) owned by a pykka TurnActor. Every fact is an
event appended to the turn's stream before the loop acts on it, and the state is the fold of
those events, so a turn resumed after a crash picks up exactly where its log ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import structlog

from actors import faults, tracing
from actors.agent import Agent
from actors.context import load as context_load
from actors.context.history import Entry, History, entry
from actors.metrics import (
    STEP_SECONDS,
    TOOL_CALL_SECONDS,
    TURNS_ENDED,
    TURNS_RUNNING,
    StepClock,
)
from actors.model import ModelError
from actors.phases import PhaseView
from actors.recall import NOTHING, Recalled
from actors.recall import resolve as resolve_recall
from actors.recall import select as select_recall
from actors.tools import ToolSpec, execute_calls
from actors.tools.notes import StoreNotes
from actors.turn import ending
from actors.turn.core import (
    AWAITING_APPROVAL,
    Approval,
    End,
    RunTools,
    TurnState,
    after_model,
    after_tools,
    attempt_events,
    bounded,
    last_reply,
    remaining,
    repair_outcome,
    unanswered_tool_uses,
)
from actors.turn.journal import Journal
from actors.turn.modelcall import Caller
from actors.turn.plan import (
    UNCERTAIN,
    announced,
    approvals,
    closed,
    gated,
    not_run,
    plan,
    repair_events,
    results,
)
from actors.turn.toolcontext import StoreArtifacts, ToolCallContext
from eventstore import (
    EventStore,
    Metadata,
    RecordedEvent,
    StoreError,
    WrongExpectedVersion,
    streams,
)
from eventstore.catalogue import PhaseChanged
from eventstore.projections.sessions import history_row
from eventstore.upcast import upcast

log = structlog.get_logger("dispach.turn")

_STORE_RETRIES = 5


class Parked(Exception):
    """The step needs approvals that are not answered yet."""

    def __init__(self, waiting: list[Approval]) -> None:
        super().__init__(f"{len(waiting)} approvals pending")
        self.waiting = waiting


class TurnRunner:
    def __init__(
        self,
        store: EventStore,
        agent: Agent,
        turn_id: str,
        session_key: str,
        node_id: str,
        stored: list[RecordedEvent] | None = None,
        history: History | None = None,
        versions: Callable[[str], Awaitable[Agent | None]] | None = None,
    ) -> None:
        self._known = stored  # the turn's events when the caller has them (a fresh turn)
        self._history = history  # the session's history when its actor holds it (not changed)
        self._versions = versions  # the agent's other versions this node has (a resume's)
        self._entries: list[Entry] = []  # this turn's own rows
        self._start = 0  # the log position of the turn's turn.start
        self.history_after: History | None = None
        """The session's history once this turn ended (for the session actor to keep)."""
        self.parked: list[Approval] = []
        """The approvals the turn waits for, when :meth:`run` returned AWAITING_APPROVAL."""
        self.store = store
        self.agent = agent
        self.turn_id = turn_id
        self.session_key = session_key
        self.node_id = node_id
        self.stream = streams.turn(turn_id)
        self.stop_requested: str | None = None
        meta = Metadata(agent_id=agent.id, session_key=session_key, turn_id=turn_id)
        self.journal = Journal(store, self.stream, meta)
        self._caller = Caller(agent, self.journal, turn_id)
        self._started_at = datetime.now(UTC)
        self._notes = StoreNotes(store, agent.id, session_key, turn_id)
        self._trace: tracing.Untraced = tracing.UNTRACED
        self._phase: str | None = None
        """The session's phase when this run began (None: the entry phase, or no phases)."""

    @property
    def state(self) -> TurnState:
        """The turn's state: the fold of its events, those staged included."""
        return self.journal.state

    def stopping(self) -> bool:
        """Whether a stop was asked for (a method: it changes across awaits)."""
        return self.stop_requested is not None

    def request_stop(self, by: str) -> None:
        """Mark the stop as asked for; the owner then cancels the task running :meth:`run`."""
        self.stop_requested = by

    async def run(self) -> str | None:
        """Run (or resume) the turn to its end; returns the end reason, or None if another node
        owns the turn. A cancellation without a stop request (the node draining) leaves the turn
        unfinished on purpose: it is resumed at the next start.

        When the store fails under it (the database went away), the turn is resumed from its
        log a few times with growing pauses, as a restart would, before it is left for the next
        start of the node."""
        with TURNS_RUNNING.track_inprogress():
            for attempt in range(_STORE_RETRIES):
                reason: str | None = None
                try:
                    reason = await self._run()
                except StoreError as e:
                    if isinstance(e, WrongExpectedVersion) or attempt == _STORE_RETRIES - 1:
                        raise
                    log.warning("turn_store_retry", turn=self.turn_id, error=e.message)
                    await asyncio.sleep(min(0.5 * 2**attempt, 8.0))
                    self._known = None
                    self._caller.reset()
                else:
                    return reason
                finally:  # a run that did not reach _finish: parked, taken over, cut short
                    self._trace.end(reason, self.state.steps)
                    self._trace = self._caller.trace = tracing.UNTRACED
        return None

    async def _run(self) -> str | None:
        stored = self._known or await self.store.aread_stream(self.stream)
        if not stored:
            return None
        self._started_at = stored[0].recorded_at
        self._start = stored[0].position
        handed, self._known = self._known is not None, None
        stored = upcast(stored)
        self.journal.read(stored)
        await self._adopt(self.state.agent_version)
        self._bound()
        self._entries = [self._entry(row) for e in stored if (row := history_row(e.data))]
        if self.state.ended is not None:
            return self.state.ended
        # The accept of a turn on an idle session began its first attempt (turn.start says
        # so); any other run of it is an attempt of its own, on the record before it acts.
        begin = attempt_events(self.state, self.node_id, began_in_accept=handed)
        self._traced(stored[0], begin[0].attempt if begin else self.state.attempt)
        self.journal.stage(begin)
        if self.stopping():  # stopped before it began
            await self._finish(End("stopped"))
            return "stopped"
        history: History | None = None
        try:
            history = await self._begin()
            budget = ending.time_left(stored, datetime.now(UTC), self.agent.limits)
            try:
                async with asyncio.timeout(budget):
                    end = await self._loop(history)
            except TimeoutError:
                end = ending.timed_out(self.agent.limits)
            except ModelError as e:
                end = ending.failed(e.code, e.message, e.hint)
            except (StoreError, asyncio.CancelledError, Parked):
                raise
            except Exception as e:  # a bug: end the turn honestly rather than leave it running
                log.exception("turn_internal_error", turn=self.turn_id)
                end = ending.broken(e)
        except asyncio.CancelledError:
            if not self.stopping():
                raise
            end = End("stopped")
        except WrongExpectedVersion:
            log.warning("turn_taken_over", turn=self.turn_id)
            return None
        except Parked as parked:
            # Nothing runs for the turn while it waits: no task, no thread. Its session actor
            # holds the session for it and restarts it once every approval is answered.
            self.parked = parked.waiting
            return AWAITING_APPROVAL
        await self._finish(end)
        if history is not None:
            self.history_after = await self._after(history, end)
        return end.reason

    def _bound(self) -> None:
        """A member turn of a handoff runs under its agent's limits and what its parent had
        left (the budget its turn.start carries), whichever is smaller."""
        if self.state.budget is not None:
            limits = bounded(self.agent.limits, self.state.budget)
            self.agent = self._caller.agent = dataclasses.replace(self.agent, limits=limits)

    async def _adopt(self, version: str | None) -> None:
        """A turn resumed (after a crash, on this node or another, or after the whole cluster
        restarted) runs on the version of its agent it started with: one this node built, or
        else built from the text the log holds of it (``agent.reloaded``); failing both, on the
        agent as it is now, which its next ``model.call`` records (``agentVersion``)."""
        if version is None or version == self.agent.version or self._versions is None:
            return
        found = await self._versions(version)
        if found is None:
            log.warning("turn_version_unavailable", turn=self.turn_id, started_with=version,
                        runs_on=self.agent.version)  # fmt: skip
            return
        self.agent = found
        self._caller = Caller(found, self.journal, self.turn_id)

    def _traced(self, start: RecordedEvent, attempt: int) -> None:
        """This run's trace: a child of the context that asked for the turn (stored with its
        turn.start). The turn's events carry the turn's own, for what follows it (its
        deliveries). Nothing changes with tracing off."""
        self._trace = tracing.turn(start.metadata.correlation_id, self.agent.id,
                                   self.session_key, self.turn_id, self.node_id,
                                   attempt)  # fmt: skip
        self._caller.trace = self._trace
        if self._trace.traceparent is not None:
            traced = {"correlation_id": self._trace.traceparent}
            self.journal.meta = msgspec.structs.replace(self.journal.meta, **traced)

    async def _after(self, history: History, end: End) -> History:
        """The session's history for its next turn: this turn's rows added, its end noted."""
        own = [*self._entries, *(self._entry(row) for row in self.journal.rows)]
        history.entries = (*history.entries, *own)
        error = end.error
        history.last_error = context_load.last_error_line(
            end.reason, error.code if error else None, error.message if error else None
        )
        if self._notes.written:
            history.notes = tuple(await self._notes.read())
        return history

    def _entry(self, row: tuple[str, Any]) -> Entry:
        return entry(self.turn_id, self._start, row[0], row[1])

    async def _begin(self) -> History:
        """What the run reads before its first step: the session's history and, for an agent
        with phases, the phase the session is in now."""
        history = await self._earlier()
        if self.agent.phases is not None:
            self._phase = await context_load.phase(self.store, self.agent.id, self.session_key)
        return history

    async def _earlier(self) -> History:
        """The session's history before this turn (the turn's own copy: compaction changes it
        as the turn goes): from its actor's memory, else the log."""
        if self._history is not None:
            return self._history.copy()
        return await context_load.load(self.store, self.agent.id, self.session_key, self._start)

    # --- the loop ------------------------------------------------------------------------------

    async def _recall(self, history: History) -> Recalled:
        """The turn's recall: chosen once, before its first model call (staged, it goes to the
        log with that call's ``model.call``), or read back from the log when the turn resumes.
        A turn begun before its agent recalled anything (steps already run) keeps to that."""
        policy = self.agent.recall
        chosen = self.state.recall
        if not policy.active or (chosen is None and self.state.steps > 0):
            return NOTHING
        if chosen is None:
            chosen = await select_recall(self.store, self.agent.id, policy, history,
                                         self.state.input)  # fmt: skip
            self.journal.stage([chosen])
        return await resolve_recall(self.store, self.agent.id, policy, history.notes, chosen)

    async def _loop(self, history: History) -> End:
        limits = self.agent.limits
        step = StepClock(STEP_SECONDS.labels(agent=self.agent.id))
        recalled = await self._recall(history)
        while True:
            pending = unanswered_tool_uses(self.state)
            if pending:
                ended = await self._run_tools(pending)
                step.done()
                self._trace.step_done()
                after = ended or after_tools(self.state, limits)
                if isinstance(after, End):
                    return after
                continue
            reply = last_reply(self.state)
            if reply is not None and self.state.last_finish_reason is not None:
                # A reply without tool calls is already stored (resumed after a crash that came
                # between it and turn.end): decide as if it had just arrived.
                decided = after_model(self.state, reply, self.state.last_finish_reason, limits)
                if isinstance(decided, End):
                    step.done()
                    self._trace.step_done()
                    return decided
            step.start()
            self._trace.step(self.state.steps + 1)
            completed = await self._caller.call(history, self._view().pinned, recalled)
            decided = after_model(self.state, completed.content, completed.stop_reason, limits)
            if isinstance(decided, End):
                step.done()
                self._trace.step_done()
                return decided
            assert isinstance(decided, RunTools)

    async def _run_tools(self, pending: list[dict[str, Any]]) -> End | None:
        """Validate, announce, run and record the tool calls of the last reply; an End when a
        second round of invalid input ends the turn."""
        step = plan(self.state, pending, self._view().tools, self.agent.limits.untrusted_on_mutate)
        ended = repair_outcome(self.state, step.invalid)
        journal = self.journal
        if step.invalid:
            await journal.append(repair_events(pending, step.invalid, last_chance=ended is None))
        if ended is not None:  # the step is over: its other calls never run
            why = "not run: the turn ended because another call's input was invalid"
            await self.journal.append([not_run(block, why) for block, _ in step.start])
            return ended
        if step.uncertain:
            await journal.append([closed(c, UNCERTAIN, uncertain=True) for c in step.uncertain])
        journal.stage(gated(step))
        if step.ask or step.waiting:
            await self._ask(step.ask)
            raise Parked([a for a in self.state.approvals if a.granted is None])
        if step.start:
            announce = announced(step.start)
            if any(spec.mutating for _, spec in step.start):
                # A side effect sits between two events: its tool.call is durable before it
                # runs, so after a crash it shows as open and is reported, never repeated.
                await self.journal.append(announce)
            else:
                # Read-only calls have no effect to protect: a crash before their tool.call
                # commits just means they run again on resume.
                self.journal.send(announce)
        calls = [(spec, block.get("input") or {}, block["id"]) for block, spec in step.start]
        calls += [(spec, call.args, call.call_id) for call, spec in step.rerun]
        if calls:
            with self._trace.current():  # the calls' spans are the step's children
                outcomes = await execute_calls(
                    [(spec, args, self._tool_context(call_id)) for spec, args, call_id in calls],
                    timeout_for=lambda s: s.timeout_s or self.agent.limits.tool_timeout_s,
                    max_output_chars=self.agent.limits.max_tool_output_chars,
                )
            for (spec, _, _), o in zip(calls, outcomes, strict=True):
                outcome = "ok" if o.ok else "error"
                TOOL_CALL_SECONDS.labels(tool=spec.name, outcome=outcome).observe(
                    o.latency_ms / 1000
                )
            # Results need not be durable before the next model call: staged, they share the
            # next append (the next step's model.call, or turn.end) instead of
            # costing a commit of their own; the stream's appends commit one after another, so
            # each one saved is a commit's latency off the step. A crash before that append
            # leaves the calls open: read-only ones run again, mutating ones are reported
            # uncertain (their tool.call was committed before they ran), as before.
            journal.stage(results([(spec, call_id) for spec, _, call_id in calls], outcomes))
        return None

    async def _ask(self, calls: list[tuple[dict[str, Any], ToolSpec]]) -> None:
        """Ask for a person's approval of each call (durable before the turn waits): the whole
        step waits, so none of its calls runs before every one that needs approval is answered."""
        if not calls:
            return
        expires = datetime.now(UTC) + timedelta(seconds=self.agent.limits.approval_timeout_s)
        await self.journal.append(approvals(self.turn_id, calls, expires))

    def _tool_context(self, call_id: str) -> ToolCallContext:
        return ToolCallContext(
            self.agent.id,
            self.session_key,
            self.turn_id,
            call_id,
            self._notes,
            StoreArtifacts(self.store, self.agent.id, self.session_key),
            self if self.agent.phases is not None else None,
            record=self.journal.append,
            remaining=remaining(self.state, self.agent.limits,
                                (datetime.now(UTC) - self._started_at).total_seconds()),
            stopping=self.stopping,
        )  # fmt: skip

    # --- phases --------------------------------------------------------------------------------

    def _view(self) -> PhaseView:
        """What this step offers the model: the tools of the phase the turn is in (the phase
        ``phase_set`` moved it to in this turn, else the session's when the run began)."""
        return self.agent.view(self.state.phase or self._phase)

    async def set(self, to: str) -> int:
        """``phase_set``'s effect (the turn is its PhaseSwitch): ``phase.changed`` staged now,
        so the turn's state, and with it the next model call's tools, change at once; it goes
        to the log with the step's tool results (a crash before loses both, and the read-only
        call runs again)."""
        view = self.agent.view(to)
        left = self._view().name
        self.journal.stage([PhaseChanged(to=view.name, from_=left, by="tool",
                                         tools=len(view.tools.names))])  # fmt: skip
        return len(view.tools.names)

    # --- the end -------------------------------------------------------------------------------

    async def _finish(self, end: End) -> None:
        """Append what the turn leaves behind (actors/turn/ending.py), then its one
        ``turn.end``."""
        cut_short = self._caller.cut_short()
        unflushed = self._caller.chunks.take()
        events, state = ending.closing(self.state, end, unflushed=unflushed, cut_short=cut_short)
        text = ending.reply_text(state, end, cut_short)
        duration = int((datetime.now(UTC) - self._started_at).total_seconds() * 1000)
        # The reply's outbox items go just before turn.end, in its append: turn.end stays the
        # stream's last event, and a turn that ended has promised its reply or has not ended.
        events.extend(ending.deliveries(self.agent, self.session_key, self.turn_id,
                                        state.deliver, text, end))  # fmt: skip
        events.append(ending.turn_end(state, end, text, duration))
        await self.journal.append(events)
        self._trace.end(end.reason, state.steps, end.error.code if end.error else None)
        TURNS_ENDED.labels(agent=self.agent.id, reason=end.reason).inc()
        faults.point("turn.ended")

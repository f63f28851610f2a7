"""Running one turn: the step loop as a coroutine on the node's event loop.

Model streams and tool calls are I/O that a stop must interrupt within 250 ms, so the loop is a
coroutine (cancellation reaches any await at once) owned by a pykka TurnActor. Every fact is an
event appended to the turn's stream before the loop acts on it, and the state is the fold of
those events, so a turn resumed after a crash picks up exactly where its log ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Sequence
from concurrent.futures import Future
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import msgspec
import prometheus_client
import structlog

from actors import faults, ids, tracing
from actors.agent import Agent
from actors.bridge import settled
from actors.context import load as context_load
from actors.context.assemble import Assembly
from actors.context.compact import Counter, prepare
from actors.context.history import Entry, History, entry
from actors.metrics import (
    MODEL_CALL_SECONDS,
    MODEL_TOKENS,
    STEP_SECONDS,
    TOOL_CALL_SECONDS,
    TURNS_ENDED,
    TURNS_RUNNING,
    StepClock,
)
from actors.model import Completed, ModelError, ModelRequest, Retrying, TextDelta
from actors.outbox import plan as outbox_plan
from actors.tools import ToolSpec, args_hash, execute_calls
from actors.tools.notes import StoreNotes
from actors.turn import server_tools
from actors.turn.core import (
    Approval,
    End,
    RunTools,
    TurnState,
    after_model,
    after_tools,
    apply,
    fold,
    kept_content,
    last_reply,
    remaining_output,
    repair_outcome,
    retry_truncated,
    unanswered_tool_uses,
)
from actors.turn.plan import UNCERTAIN, closed, not_run, plan, refusal, repair_events
from eventstore import (
    AppendResult,
    EventStore,
    Metadata,
    NewEvent,
    RecordedEvent,
    StoreError,
    WrongExpectedVersion,
    streams,
)
from eventstore.catalogue import (
    ApprovalRequested,
    ApprovalResolved,
    ContextAssembled,
    Deliver,
    ErrorDetail,
    ModelCall,
    ModelChunk,
    ModelResult,
    ModelRetry,
    Tokens,
    ToolCall,
    ToolGated,
    ToolResult,
    TurnAttempt,
    TurnEnd,
)
from eventstore.event import Event
from eventstore.projections import history_row

log = structlog.get_logger("dispach.turn")

_STORE_RETRIES = 5
AWAITING_APPROVAL = "awaiting_approval"
"""What :meth:`TurnRunner.run` returns for a turn that waits for approvals (not an end)."""


class Parked(Exception):
    """The step needs approvals that are not answered yet."""

    def __init__(self, waiting: list[Approval]) -> None:
        super().__init__(f"{len(waiting)} approvals pending")
        self.waiting = waiting


def _waited(stored: Sequence[RecordedEvent]) -> float:
    """Seconds the turn spent waiting for approvals (from each request to its answer)."""
    asked: dict[str, datetime] = {}
    waited = 0.0
    for event in stored:
        if isinstance(event.data, ApprovalRequested):
            asked[event.data.approval_id] = event.recorded_at
        elif isinstance(event.data, ApprovalResolved) and event.data.approval_id in asked:
            waited += (event.recorded_at - asked.pop(event.data.approval_id)).total_seconds()
    return waited


_DEFAULT_CHUNK = 4096
_CHUNK_CHARS = 512
_CHUNK_SECONDS = 0.05
_CALL_SEND_S = 0.005
"""How long a model call's ``model.call`` (and the context before it) waits to share a commit
with what the model answers: a model that replies at once (the scripted one, a cached reply)
makes the whole step one commit; a slow one has it on the record 5 ms into the call."""
_CANCELLED = (
    "cancelled: the turn ended before this tool call finished; any side effect it had may "
    "already have happened"
)


class ToolCallContext:
    """What a tool sees of its turn (the ``ToolContext`` port)."""

    def __init__(self, agent_id: str, session_key: str, turn_id: str, call_id: str,
                 notes: StoreNotes, artifacts: StoreArtifacts) -> None:  # fmt: skip
        self.agent_id = agent_id
        self.session_key = session_key
        self.turn_id = turn_id
        self.call_id = call_id
        self.notes = notes
        self.artifacts = artifacts


class StoreArtifacts:
    """The whole bodies of a session's tool results, read from the log (``artifact_read``)."""

    def __init__(self, store: EventStore, agent_id: str, session_key: str) -> None:
        self._store, self._agent_id, self._session_key = store, agent_id, session_key

    async def read(self, obs_id: str) -> str | None:
        return await context_load.artifact(self._store, self._agent_id, self._session_key, obs_id)


@functools.cache
def _token_series(agent_id: str, model: str) -> tuple[prometheus_client.Counter, ...]:
    """The four ``dispach_model_tokens_total`` series of an agent's model, looked up once."""
    kinds = ("prompt", "output", "cache_read", "cache_write")
    return tuple(MODEL_TOKENS.labels(agent_id, model, kind) for kind in kinds)


def _count_tokens(agent: Agent, completed: Completed) -> None:
    """``dispach_model_tokens_total``, once per model call (a reply discarded to be asked
    again included: its tokens were spent). ``prompt`` is everything the model read, as in
    ``model.result``: the cache's reads and writes are part of it."""
    usage = completed.usage
    series = _token_series(agent.id, agent.model_id)
    counts = (usage.prompt_tokens, usage.output_tokens, usage.cache_read_tokens,
              usage.cache_write_tokens)  # fmt: skip
    for counter, tokens in zip(series, counts, strict=True):
        if tokens:
            counter.inc(tokens)


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
    ) -> None:
        self._known = stored  # the turn's events when the caller has them (a fresh turn)
        self._history = history  # the session's history when its actor holds it (not changed)
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
        self.state = TurnState()
        self._meta = Metadata(agent_id=agent.id, session_key=session_key, turn_id=turn_id)
        self._step_id: str | None = None
        self._partial: list[str] = []
        self._unflushed: list[str] = []
        self._unflushed_kind: Literal["text", "reasoning"] = "text"
        self._latency = 0.0
        self._in_model_call = False
        self._staged: list[tuple[Event, str | None]] = []
        self._sent_version = -1
        self._in_flight: list[Future[AppendResult]] = []
        self._started_at = datetime.now(UTC)
        self._notes = StoreNotes(store, agent.id, session_key, turn_id)
        self._trace: tracing.Untraced = tracing.UNTRACED

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
                    self._staged, self._in_flight, self._unflushed = [], [], []
                    self._in_model_call = False
                else:
                    return reason
                finally:  # a run that did not reach _finish: parked, taken over, cut short
                    self._trace.end(reason, self.state.steps)
                    self._trace = tracing.UNTRACED
        return None

    async def _run(self) -> str | None:
        stored = self._known or await self.store.aread_stream(self.stream)
        if not stored:
            return None
        self._started_at = stored[0].recorded_at
        self._start = stored[0].position
        self.state = fold(stored)
        self._entries = [self._entry(row) for e in stored if (row := history_row(e.data))]
        self._sent_version = self.state.version
        if self.state.ended is not None:
            return self.state.ended
        self._traced(stored[0])
        if self.stopping():  # stopped before it began
            await self._finish(End("stopped"))
            return "stopped"
        history: History | None = None
        try:
            self._stage([TurnAttempt(
                attempt=self.state.attempt + 1, node=self.node_id,
                resumed_from_step=self.state.steps,
            )])  # fmt: skip
            history = await self._earlier()
            # Time spent waiting for a person's approval is not the turn's to spend.
            elapsed = (datetime.now(UTC) - self._started_at).total_seconds() - _waited(stored)
            budget = max(0.0, self.agent.limits.turn_timeout_s - elapsed)
            try:
                async with asyncio.timeout(budget):
                    end = await self._loop(history)
            except TimeoutError:
                end = End("timeout", ErrorDetail(
                    code="turn_timeout",
                    message=f"the turn ran past its {self.agent.limits.turn_timeout_s:g} s limit",
                    hint="raise limits.turn_timeout_s in the agent's manifest, or ask for less",
                ))  # fmt: skip
            except ModelError as e:
                end = End("error", ErrorDetail(code=e.code, message=e.message, hint=e.hint))
            except (StoreError, asyncio.CancelledError, Parked):
                raise
            except Exception as e:  # a bug: end the turn honestly rather than leave it running
                log.exception("turn_internal_error", turn=self.turn_id)
                end = End("error", ErrorDetail(
                    code="internal_error", message=f"{type(e).__name__}: {e}",
                    hint="this is a bug in Dispach; the node's log has the trace",
                ))  # fmt: skip
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

    def _traced(self, start: RecordedEvent) -> None:
        """This run's trace: a child of the context that asked for the turn (stored with its
        turn.start). The turn's events carry the turn's own, for what follows it (its
        deliveries). Nothing changes with tracing off."""
        self._trace = tracing.turn(start.metadata.correlation_id, self.agent.id,
                                   self.session_key, self.turn_id, self.node_id,
                                   self.state.attempt + 1)  # fmt: skip
        if self._trace.traceparent is not None:
            self._meta = msgspec.structs.replace(self._meta, correlation_id=self._trace.traceparent)

    async def _after(self, history: History, end: End) -> History:
        """The session's history for its next turn: this turn's rows added, its end noted."""
        history.entries = (*history.entries, *self._entries)
        error = end.error
        history.last_error = context_load.last_error_line(
            end.reason, error.code if error else None, error.message if error else None
        )
        if self._notes.written:
            history.notes = tuple(await self._notes.read())
        return history

    def _counter(self) -> Counter | None:
        """The provider's token count of a request, when the agent asks for one per call."""
        agent = self.agent
        count = getattr(agent.model, "count_tokens", None) if agent.context.count_tokens else None
        if count is None:
            return None

        async def counter(assembly: Assembly) -> int | None:
            request = ModelRequest(model=agent.model_id, system=assembly.system,
                                   history=assembly.history, messages=assembly.tail,
                                   tools=agent.pinned.tools, max_tokens=1)  # fmt: skip
            try:
                counted: int = await count(request)
            except ModelError as e:  # the local estimate serves; the call itself may still work
                log.warning("count_tokens_failed", turn=self.turn_id, error=e.code)
                return None
            return counted

        return counter

    def _entry(self, row: tuple[str, Any]) -> Entry:
        return entry(self.turn_id, self._start, row[0], row[1])

    async def _earlier(self) -> History:
        """The session's history before this turn (the turn's own copy: compaction changes it
        as the turn goes): from its actor's memory, else the log."""
        if self._history is not None:
            return self._history.copy()
        return await context_load.load(self.store, self.agent.id, self.session_key, self._start)

    # --- the loop ------------------------------------------------------------------------------

    async def _loop(self, history: History) -> End:
        limits = self.agent.limits
        step = StepClock(STEP_SECONDS.labels(agent=self.agent.id))
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
            completed = await self._call_model(history)
            decided = after_model(self.state, completed.content, completed.stop_reason, limits)
            if isinstance(decided, End):
                step.done()
                self._trace.step_done()
                return decided
            assert isinstance(decided, RunTools)

    async def _call_model(self, history: History) -> Completed:
        agent, state, policy = self.agent, self.state, self.agent.context
        prepared = await prepare(agent.pinned, history, state.input, state.transcript, policy,
                                 agent.digester, self._counter())  # fmt: skip
        assembly = prepared.assembly
        self._step_id = ids.step_id()
        *stages, pressure = prepared.events
        assembled = ContextAssembled(slots=assembly.slots, total=assembly.total,
                                     budget=policy.budget, window=policy.window,
                                     breakpoints=assembly.breakpoints)  # fmt: skip
        # Staged: they go to the log with the model.call below (one append, not two), or with
        # the turn's end when the request cannot be sent.
        self._stage([*stages, assembled, pressure])
        if prepared.over:  # on the record (what would not fit, and why), never sent
            raise ModelError(
                "context_over_budget",
                f"the request needs about {prepared.tokens} tokens, over the prompt budget of "
                f"{policy.budget} even after every compaction stage",
                "clear the session, raise model.context_window, or lower "
                "limits.max_tool_output_chars so one turn's tool results fit",
            )  # fmt: skip
        max_tokens = max(1, min(remaining_output(state, agent.limits, agent.max_tokens_per_call),
                                policy.window - prepared.tokens))  # fmt: skip
        while True:
            self._stage([ModelCall(role="main", model=agent.model_id,
                                   prompt_tokens=prepared.tokens)])  # fmt: skip
            request = ModelRequest(
                model=agent.model_id,
                system=assembly.system,
                history=assembly.history,
                messages=assembly.tail,
                tools=agent.pinned.tools,
                max_tokens=max_tokens,
                reasoning=agent.reasoning,
            )
            completed = await self._stream(request, history, assembly.total)
            # A reply cut off by its output limit is sent again once with a larger budget when
            # the manifest says so (never past the turn's own budget or the window).
            larger = min(max_tokens * 2, policy.window - prepared.tokens,
                         agent.limits.max_output_tokens - self.state.output_tokens
                         - completed.usage.output_tokens)  # fmt: skip
            if not retry_truncated(self.state, completed.stop_reason, agent.truncation,
                                   max_tokens, larger):  # fmt: skip
                result = self._result(completed, discarded=False)
                self._stage([result, *server_tools.events(result.content or [])])
                self._in_model_call = False
                return completed
            self._stage([self._result(completed, discarded=True)])
            self._in_model_call = False
            log.info("reply_truncated_retry", turn=self.turn_id, max_tokens=larger)
            max_tokens = larger

    async def _stream(self, request: ModelRequest, history: History, estimate: int) -> Completed:
        """One model call, its deltas sent as chunks as they come; the reply, with its last
        chunk staged (not yet its ``model.result``)."""
        agent = self.agent
        self._partial, self._unflushed, self._unflushed_kind = [], [], "text"
        self._in_model_call = True
        started = time.monotonic()
        last_flush = started
        completed: Completed | None = None
        early = asyncio.get_running_loop().call_later(_CALL_SEND_S, self._send_staged)
        self._trace.model_call(agent.model.label, agent.model_id)
        try:
            async for event in agent.model.stream(request):
                match event:
                    case TextDelta(text=text, kind=kind):
                        if kind != self._unflushed_kind:
                            self._flush_chunks()
                            self._unflushed_kind = kind
                        if kind == "text":  # a stopped turn keeps the answer, never reasoning
                            self._partial.append(text)
                        self._unflushed.append(text)
                        now = time.monotonic()
                        size = sum(len(t) for t in self._unflushed)
                        if size >= _CHUNK_CHARS or now - last_flush >= _CHUNK_SECONDS:
                            self._flush_chunks()
                            last_flush = now
                    case Retrying() as retry:
                        self._send([ModelRetry(
                            status=retry.status, attempt=retry.attempt, delay_ms=retry.delay_ms,
                        )])  # fmt: skip
                    case Completed():
                        completed = event
            if completed is None:
                raise ModelError(
                    "model_stream_incomplete", "the model's stream ended without a final message",
                    "retry the message; if it keeps happening, check the model provider's status",
                )  # fmt: skip
        except ModelError as e:
            # A stop or a timeout (a cancellation) is not the model's failure: not observed.
            MODEL_CALL_SECONDS.labels(agent=agent.id, outcome="error").observe(
                time.monotonic() - started
            )
            self._trace.model_failed(e.code)
            raise
        finally:
            early.cancel()
        self._latency = time.monotonic() - started
        MODEL_CALL_SECONDS.labels(agent=agent.id, outcome="ok").observe(self._latency)
        self._trace.model_done(completed.usage, completed.stop_reason)
        _count_tokens(agent, completed)
        if completed.usage.prompt_tokens:
            history.calibrate(estimate, completed.usage.prompt_tokens)
        # Staged, not appended: the reply goes to the log with whatever follows it (the step's
        # tool calls, or the turn's end), one commit instead of two.
        self._stage_chunk()
        return completed

    def _result(self, completed: Completed, *, discarded: bool) -> ModelResult:
        usage = completed.usage
        content = kept_content(completed.content, completed.stop_reason)
        text = "".join(b.get("text", "") for b in content if b.get("type") == "text")
        return ModelResult(
            output_tokens=usage.output_tokens,
            prompt_tokens=usage.prompt_tokens,
            prompt_tokens_reported=usage.prompt_tokens,
            finish_reason=completed.stop_reason,
            latency_ms=int(self._latency * 1000),
            cache_read_tokens=usage.cache_read_tokens,
            cache_write_tokens=usage.cache_write_tokens,
            first_token_ms=completed.first_token_ms,
            text="" if discarded else text,
            content=None if discarded else content,
            discarded=discarded,
            server_tool_requests=usage.server_tool_requests or None,
        )

    def _stage_chunk(self) -> None:
        if self._unflushed:
            delta = "".join(self._unflushed)
            self._unflushed = []
            self._stage([ModelChunk(delta=delta, kind=self._unflushed_kind)])

    def _flush_chunks(self) -> None:
        if self._unflushed:
            self._stage_chunk()
            self._send()

    async def _run_tools(self, pending: list[dict[str, Any]]) -> End | None:
        """Validate, announce, run and record the tool calls of the last reply; an End when a
        second round of invalid input ends the turn."""
        step = plan(self.state, pending, self.agent.tools, self.agent.limits.untrusted_on_mutate)
        ended = repair_outcome(self.state, step.invalid)
        if step.invalid:
            await self._append(repair_events(pending, step.invalid, last_chance=ended is None))
        if ended is not None:  # the step is over: its other calls never run
            why = "not run: the turn ended because another call's input was invalid"
            await self._append([not_run(block, why) for block, _ in step.start])
            return ended
        if step.uncertain:
            await self._append([closed(c, UNCERTAIN, uncertain=True) for c in step.uncertain])
        self._stage([e for block, why, policy in step.refused for e in refusal(block, why, policy)])
        self._stage([ToolGated(slug=block["name"], call_id=block["id"], reason=why,
                               policy="untrusted") for block, why in step.gated])  # fmt: skip
        if step.ask or step.waiting:
            await self._ask(step.ask)
            raise Parked([a for a in self.state.approvals if a.granted is None])
        if step.start:
            announce = [
                ToolCall(slug=spec.name, call_id=block["id"], mutating=spec.mutating,
                         args_hash=args_hash(block.get("input") or {}), args=block.get("input"),
                         source="mcp" if spec.mcp_server else None, mcp_server=spec.mcp_server)
                for block, spec in step.start
            ]  # fmt: skip
            if any(spec.mutating for _, spec in step.start):
                # A side effect sits between two events: its tool.call is durable before it
                # runs, so after a crash it shows as open and is reported, never repeated.
                await self._append(announce)
            else:
                # Read-only calls have no effect to protect: a crash before their tool.call
                # commits just means they run again on resume.
                self._send(announce)
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
            # next append (the next step's context.assembled + model.call, or turn.end) instead of
            # costing a commit of their own; the stream's appends commit one after another, so
            # each one saved is a commit's latency off the step. A crash before that append
            # leaves the calls open: read-only ones run again, mutating ones are reported
            # uncertain (their tool.call was committed before they ran), as before.
            self._stage([
                ToolResult(slug=spec.name, call_id=call_id, ok=o.ok, latency_ms=o.latency_ms,
                           bytes=o.bytes, truncated=o.truncated, output=o.output,
                           trust="untrusted" if spec.untrusted_output else "trusted",
                           error_code=o.error_code, content=o.content,
                           source="mcp" if spec.mcp_server else None, mcp_server=spec.mcp_server)
                for (spec, _, call_id), o in zip(calls, outcomes, strict=True)
            ])  # fmt: skip
        return None

    async def _ask(self, calls: list[tuple[dict[str, Any], ToolSpec]]) -> None:
        """Ask for a person's approval of each call (durable before the turn waits): the whole
        step waits, so none of its calls runs before every one that needs approval is answered."""
        if not calls:
            return
        expires = datetime.now(UTC) + timedelta(seconds=self.agent.limits.approval_timeout_s)
        await self._append([
            ApprovalRequested(
                approval_id=ids.approval_id(self.turn_id, block["id"]), slug=spec.name,
                call_id=block["id"], mutating=spec.mutating,
                reason=f"the agent's policy asks for approval before {spec.name} runs",
                expires_at=expires.isoformat(), args=block.get("input"),
            )
            for block, spec in calls
        ])  # fmt: skip

    def _tool_context(self, call_id: str) -> ToolCallContext:
        return ToolCallContext(
            self.agent.id,
            self.session_key,
            self.turn_id,
            call_id,
            self._notes,
            StoreArtifacts(self.store, self.agent.id, self.session_key),
        )

    # --- the end -------------------------------------------------------------------------------

    async def _finish(self, end: End) -> None:
        """Append what the turn leaves behind, then its one ``turn.end``: the unflushed text, the
        partial reply of an interrupted model call, and a result for every call left without
        one, so that the stored transcript stays valid for the next turn."""
        events: list[Event] = []
        if self._unflushed:
            events.append(ModelChunk(delta="".join(self._unflushed), kind=self._unflushed_kind))
            self._unflushed = []
        if self._in_model_call:
            # Only the answer's text is kept of a reply cut short: its thinking had no
            # signature yet (the API would refuse it back), and reasoning is never the answer.
            partial = "".join(self._partial)
            keep = end.reason in ("stopped", "timeout") and partial
            events.append(ModelResult(
                output_tokens=0, prompt_tokens=0, finish_reason=end.reason,
                latency_ms=0, text=partial, error=end.error,
                content=[{"type": "text", "text": partial}] if keep else None,
            ))  # fmt: skip
        state = self.state
        for new in events:
            state = apply(state, new, version=state.version + 1)
        for call in state.open_calls:
            events.append(closed(call, _CANCELLED))
            state = apply(state, events[-1], version=state.version + 1)
        # Approvals still waiting are closed with the turn (a stop while it waited): the log has
        # an answer for every request, and nobody is asked about a turn that is over.
        events.extend(ApprovalResolved(approval_id=a.approval_id, slug=a.slug, granted=False,
                                       by=f"turn {end.reason}")
                      for a in state.approvals if a.granted is None)  # fmt: skip
        events.extend(not_run(b, "not run: the turn ended first")
                      for b in unanswered_tool_uses(state))  # fmt: skip
        duration = int((datetime.now(UTC) - self._started_at).total_seconds() * 1000)
        text = (
            state.text
            if end.reason != "error"
            else "\n\n".join(
                [t for t in state.texts if t] + ["".join(self._partial)] * self._in_model_call
            ).strip()
        )
        # The reply's outbox items go just before turn.end, in its append: turn.end stays the
        # stream's last event, and a turn that ended has promised its reply or has not ended.
        events.extend(self._deliveries(state.deliver, text, end))
        events.append(TurnEnd(
            reason=end.reason, steps=state.steps,
            tokens=Tokens(prompt=state.prompt_tokens, output=state.output_tokens,
                          cache_read=state.cache_read_tokens,
                          cache_write=state.cache_write_tokens),
            duration_ms=duration, text=text, error=end.error,
        ))  # fmt: skip
        await self._append(events)
        self._trace.end(end.reason, state.steps, end.error.code if end.error else None)
        TURNS_ENDED.labels(agent=self.agent.id, reason=end.reason).inc()
        faults.point("turn.ended")

    def _deliveries(self, deliver: Deliver | None, text: str, end: End) -> list[Event]:
        """The reply's outbox items (one per chunk)."""
        if deliver is None:
            return []
        channel = self.agent.channels.get(deliver.channel)
        # A channel gone from the manifest since the message was accepted: its items fail
        # with delivery_channel_unknown (on the record) rather than vanish.
        return list(outbox_plan.enqueue(
            deliver,
            max_chars=channel.max_chars if channel else _DEFAULT_CHUNK,
            measure=channel.measure if channel else len,
            ordered=channel.ordered if channel else False,
            agent_id=self.agent.id, session_key=self.session_key, turn_id=self.turn_id,
            text=outbox_plan.reply_text(text, end.reason),
        ))  # fmt: skip

    def _stage(self, events: Sequence[Event]) -> None:
        """Fold events into the state now and append them with the next append: facts that no
        side effect waits on share a commit with what follows them."""
        for event in events:
            self.state = apply(self.state, event, version=self.state.version + 1)
            self._staged.append((event, self._step_id))
            row = history_row(event)
            if row is not None:
                self._entries.append(self._entry(row))

    def _send(self, events: Sequence[Event] = ()) -> None:
        """Submit the staged events and ``events`` as one append without waiting for it.

        Appends to one stream are committed in the order they were submitted (the writer never
        puts two of a stream's appends in one batch), so each can expect the version the one
        before it will leave: the runner is the stream's only writer. What must be durable
        before an effect (``tool.call`` before a tool runs, ``turn.end`` before the turn counts
        as over) is awaited with :meth:`_append`; a model call does not wait for its
        ``model.call`` to commit.
        """
        self._stage(events)
        staged = self._staged
        if not staged:
            return
        base = self._meta
        future = self.store.submit(
            self.stream,
            [
                NewEvent(event=e, metadata=msgspec.structs.replace(base, step_id=step))
                for e, step in staged
            ],
            self._sent_version,
        )  # a refusal to take it (closed, overloaded) leaves the events staged
        self._staged = []
        self._sent_version += len(staged)
        self._in_flight.append(future)

    def _send_staged(self) -> None:
        """A model call still runs after ``_CALL_SEND_S``: put what is staged on the record
        now (its model.call). Called by a timer: a store that refuses to take it now is told
        to the turn by its next append, which carries the same events."""
        with contextlib.suppress(StoreError):
            self._send()

    async def _append(self, events: Sequence[Event] = ()) -> None:
        """Submit (as :meth:`_send`) and wait until everything sent so far is committed.

        Only the last append is waited on: each expects the version the one before it leaves,
        so it commits only if they all did. Waiting on each in turn cost a callback per append,
        all in one run of the loop once they were answered (a 2,000-chunk reply: 0.5 s with
        nothing else served). When the last one failed, the first failure is the one raised."""
        self._send(events)
        in_flight, self._in_flight = self._in_flight, []
        if not in_flight:
            return
        try:
            await settled(in_flight[-1])
        except Exception:
            for future in in_flight[:-1]:
                await settled(future)  # raises the earliest failure, if an earlier one failed
            raise

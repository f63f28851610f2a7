"""One model call of a turn's step: the request assembled within its budget (compaction
included), the stream read into coalesced chunks, the reply recorded. I/O around pure parts:
the context (actors/context), the budgets and the reply's record (core), the chunks (chunks.py).
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import structlog

from actors import ids, tracing
from actors.agent import Agent
from actors.context.assemble import Assembly, Pinned
from actors.context.compact import Counter, prepare
from actors.context.history import History
from actors.metrics import MODEL_CALL_SECONDS, count_tokens
from actors.model import Completed, ModelError, ModelRequest, Retrying, TextDelta
from actors.recall import NOTHING, Recalled
from actors.turn import server_tools
from actors.turn.chunks import Chunks
from actors.turn.core import call_budget, model_result, retry_budget, retry_truncated
from actors.turn.journal import Journal
from eventstore.catalogue import (
    ContextAssembled,
    ContextPressure,
    ContextView,
    ModelCall,
    ModelRetry,
    Pressure,
)

log = structlog.get_logger("dispach.turn")

CALL_SEND_S = 0.005
"""How long a model call's ``model.call`` waits to share a commit with what the model answers:
a model that replies at once (the scripted one, a cached reply) makes the whole step one
commit; a slow one has it on the record 5 ms into the call."""


def _pressure(p: ContextPressure) -> Pressure:
    return Pressure(fraction=p.fraction, tokens=p.tokens, budget=p.budget, source=p.source,
                    peak=p.peak)  # fmt: skip


class Caller:
    """The turn's model calls, one at a time; what a call cut short leaves (its text so far)
    is what the turn's end keeps."""

    def __init__(self, agent: Agent, journal: Journal, turn_id: str) -> None:
        self.agent = agent
        self.journal = journal
        self.turn_id = turn_id
        self.chunks = Chunks()
        self.in_call = False
        self.latency = 0.0
        self.trace: tracing.Untraced = tracing.UNTRACED

    def reset(self) -> None:
        """The run is read again from the log: nothing of a call in flight is kept."""
        self.chunks.drop()
        self.in_call = False

    def cut_short(self) -> str | None:
        """The answer's text so far of a call still running (None between calls)."""
        return "".join(self.chunks.partial) if self.in_call else None

    def _counter(self, pinned: Pinned) -> Counter | None:
        """The provider's token count of a request, when the agent asks for one per call."""
        agent = self.agent
        count = getattr(agent.model, "count_tokens", None) if agent.context.count_tokens else None
        if count is None:
            return None

        async def counter(assembly: Assembly) -> int | None:
            request = ModelRequest(model=agent.model_id, system=assembly.system,
                                   history=assembly.history, messages=assembly.tail,
                                   tools=pinned.tools, max_tokens=1)  # fmt: skip
            try:
                counted: int = await count(request)
            except ModelError as e:  # the local estimate serves; the call itself may still work
                log.warning("count_tokens_failed", turn=self.turn_id, error=e.code)
                return None
            return counted

        return counter

    async def call(
        self, history: History, pinned: Pinned, recalled: Recalled = NOTHING
    ) -> Completed:
        """The step's model call (sent again once, larger, for a reply cut off when the
        manifest says so) with ``pinned``, the prefix of the session's phase, and the turn's
        recall; its events staged or sent on the journal."""
        agent, state, policy = self.agent, self.journal.state, self.agent.context
        prepared = await prepare(pinned, history, state.input, state.transcript, policy,
                                 agent.digester, self._counter(pinned), recalled)  # fmt: skip
        assembly = prepared.assembly
        self.journal.step_id = ids.step_id()
        *stages, pressure = prepared.events
        assert isinstance(pressure, ContextPressure)
        context = ContextView(slots=assembly.slots, total=assembly.total, budget=policy.budget,
                              window=policy.window, breakpoints=assembly.breakpoints)  # fmt: skip
        # Staged: they go to the log with the model.call below (one append, not two), or with
        # the turn's end when the request cannot be sent.
        self.journal.stage(stages)
        if prepared.over:  # on the record (what would not fit, and why), never sent
            self.journal.stage([ContextAssembled(**msgspec.structs.asdict(context)), pressure])
            raise ModelError(
                "context_over_budget",
                f"the request needs about {prepared.tokens} tokens, over the prompt budget of "
                f"{policy.budget} even after every compaction stage",
                "clear the session, raise model.context_window, or lower "
                "limits.max_tool_output_chars so one turn's tool results fit",
            )  # fmt: skip
        max_tokens = call_budget(state, agent.limits, agent.max_tokens_per_call,
                                 policy.window - prepared.tokens)  # fmt: skip
        first = True
        while True:
            # What the call reads goes with its first call; a cut-off reply asked again (below)
            # reads the same.
            self.journal.stage([ModelCall(
                role="main", model=agent.model_id, prompt_tokens=prepared.tokens,
                context=context if first else None,
                pressure=_pressure(pressure) if first else None,
                agent_version=agent.version or None,
            )])  # fmt: skip
            first = False
            request = ModelRequest(
                model=agent.model_id,
                system=assembly.system,
                history=assembly.history,
                messages=assembly.tail,
                tools=pinned.tools,
                max_tokens=max_tokens,
                reasoning=agent.reasoning,
            )
            completed = await self._stream(request, history, assembly.total)
            # A reply cut off by its output limit is sent again once with a larger budget when
            # the manifest says so (never past the turn's own budget or the window).
            larger = retry_budget(
                self.journal.state,
                agent.limits,
                max_tokens,
                policy.window - prepared.tokens,
                completed.usage.output_tokens,
            )
            if not retry_truncated(self.journal.state, completed.stop_reason, agent.truncation,
                                   max_tokens, larger):  # fmt: skip
                result = model_result(
                    completed, self.latency, discarded=False, model=agent.model_id
                )
                self.journal.stage([result, *server_tools.events(result.content or [])])
                self.in_call = False
                return completed
            self.journal.stage(
                [model_result(completed, self.latency, discarded=True, model=agent.model_id)]
            )
            self.in_call = False
            log.info("reply_truncated_retry", turn=self.turn_id, max_tokens=larger)
            max_tokens = larger

    async def _stream(self, request: ModelRequest, history: History, estimate: int) -> Completed:
        """One model call, its deltas sent as chunks as they come; the reply, with its last
        chunk staged (not yet its ``model.result``)."""
        agent = self.agent
        self.in_call = True
        started = time.monotonic()
        self.chunks.begin(started)
        completed: Completed | None = None
        early = asyncio.get_running_loop().call_later(CALL_SEND_S, self.journal.send_soon)
        self.trace.model_call(agent.model.label, agent.model_id)
        try:
            async for event in agent.model.stream(request):
                match event:
                    case TextDelta(text=text, kind=kind):
                        if chunks := self.chunks.add(text, kind, time.monotonic()):
                            self.journal.send(chunks)
                    case Retrying() as retry:
                        self.journal.send([ModelRetry(
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
            self.trace.model_failed(e.code)
            raise
        finally:
            early.cancel()
        self.latency = time.monotonic() - started
        MODEL_CALL_SECONDS.labels(agent=agent.id, outcome="ok").observe(self.latency)
        self.trace.model_done(completed.usage, completed.stop_reason)
        count_tokens(agent.id, agent.model_id, completed.usage)
        if completed.usage.prompt_tokens:
            history.calibrate(estimate, completed.usage.prompt_tokens)
        # Staged, not appended: the reply goes to the log with whatever follows it (the step's
        # tool calls, or the turn's end), one commit instead of two.
        self.journal.stage(self.chunks.take())
        return completed

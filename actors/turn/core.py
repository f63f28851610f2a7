"""The pure core of a turn: its state folded from its events, and the decisions of the loop.

Nothing here does I/O. The runner appends events and folds each into the state with
:func:`evolve`; after a crash the same fold over the stored stream rebuilds the state, which is
how a resumed turn knows which steps are done and which tool calls were left open.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import msgspec

from actors.model import Completed
from eventstore import RecordedEvent
from eventstore.catalogue import (
    ApprovalRequested,
    ApprovalResolved,
    Budget,
    Deliver,
    EndReason,
    ErrorDetail,
    ModelCall,
    ModelResult,
    PhaseChanged,
    SkillNone,
    SkillSelected,
    ToolCall,
    ToolRepair,
    ToolResult,
    TurnAttempt,
    TurnEnd,
    TurnStart,
)
from eventstore.event import Event, UnknownEvent

AWAITING_APPROVAL = "awaiting_approval"
"""What a run of the turn ends with when it waits for approvals (not an end of the turn)."""


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    max_steps: int = 8
    turn_timeout_s: float = 300.0
    tool_timeout_s: float = 30.0
    max_output_tokens: int = 32_000
    """Output tokens the whole turn may produce, over all its steps."""
    max_tool_output_chars: int = 16_000
    approval_timeout_s: float = 3600.0
    """How long a tool call that asks for approval waits before it counts as denied."""
    untrusted_on_mutate: Literal["ask", "deny", "allow"] = "ask"
    """What a mutating call whose tool would be allowed gets once untrusted content entered
    the turn (a prompt injection must not be able to act unasked)."""


class Approval(msgspec.Struct, frozen=True):
    """A tool call that asked for a person's approval, and the answer once there is one."""

    approval_id: str
    call_id: str
    slug: str
    expires_at: str
    granted: bool | None = None
    by: str | None = None


class OpenCall(msgspec.Struct, frozen=True):
    """A tool call whose start is in the log and whose result is not (yet)."""

    call_id: str
    slug: str
    mutating: bool
    args: dict[str, Any]
    mcp_server: str | None = None


class TurnState(msgspec.Struct, frozen=True, kw_only=True):
    turn_id: str = ""
    version: int = -1
    input: str = ""
    source: str = ""
    deliver: Deliver | None = None
    """Where the reply goes when the turn ends (the outbox), if anywhere."""
    started: bool = False
    attempt: int = 0
    steps: int = 0
    repairs: int = 0
    transcript: tuple[dict[str, Any], ...] = ()
    """This turn's messages after the person's input, in the model's format."""
    texts: tuple[str, ...] = ()
    prompt_tokens: int = 0
    """Prompt tokens of every model call of the turn, summed (each call reads the whole
    context again, and each is billed)."""
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    open_calls: tuple[OpenCall, ...] = ()
    approvals: tuple[Approval, ...] = ()
    tainted: bool = False
    """Untrusted content (a tool result marked so) entered this turn."""
    last_finish_reason: str | None = None
    truncations: int = 0
    """Replies cut off by ``max_tokens`` and sent again with a larger budget."""
    phase: str | None = None
    """The phase ``phase_set`` moved the session to in this turn (None: it did not); the
    turn's next model calls see that phase's tools."""
    recall: SkillSelected | SkillNone | None = None
    """What the turn recalled (its skills and notes), once chosen: a resumed turn reads it."""
    ended: EndReason | None = None
    budget: Budget | None = None
    """What the turn may spend at most, set by the turn that handed it its task (a handoff)."""
    agent_version: str | None = None
    """The version of the agent the turn started with: its first ``model.call``'s."""

    @property
    def text(self) -> str:
        """The prose of the turn so far, one paragraph per step that had any."""
        return "\n\n".join(t for t in self.texts if t)


def bounded(limits: Limits, budget: Budget | None) -> Limits:
    """``limits`` narrowed by a budget (each bound the smaller of the two); as they are
    without one."""
    if budget is None:
        return limits
    steps, seconds, tokens = budget.max_steps, budget.turn_timeout_s, budget.max_output_tokens
    return msgspec.structs.replace(
        limits,
        max_steps=max(1, min(limits.max_steps, steps)) if steps is not None else limits.max_steps,
        turn_timeout_s=min(limits.turn_timeout_s, seconds)
        if seconds is not None else limits.turn_timeout_s,
        max_output_tokens=max(1, min(limits.max_output_tokens, tokens))
        if tokens is not None else limits.max_output_tokens,
    )  # fmt: skip


def remaining(state: TurnState, limits: Limits, elapsed_s: float) -> Budget:
    """What is left of a turn's budget ``elapsed_s`` seconds after it began: what a turn it
    hands a task to may spend at most."""
    return Budget(
        max_steps=max(0, limits.max_steps - state.steps),
        turn_timeout_s=max(0.0, limits.turn_timeout_s - elapsed_s),
        max_output_tokens=max(0, limits.max_output_tokens - state.output_tokens),
    )


def evolve(state: TurnState, event: RecordedEvent) -> TurnState:
    """The state after ``event`` (which must be the next event of this turn's stream)."""
    return apply(state, event.data, version=event.version, turn_id=event.metadata.turn_id)


def apply(
    state: TurnState, data: Event | UnknownEvent, *, version: int, turn_id: str | None = None
) -> TurnState:
    """The state after an event's data, stored at ``version`` of the turn's stream."""
    replace = msgspec.structs.replace
    state = replace(state, version=version)
    match data:
        case TurnStart(input=text, source=source, deliver=deliver, attempt=attempt):
            return replace(state, turn_id=turn_id or "", input=text, source=source,
                           deliver=deliver, started=True, attempt=attempt,
                           budget=data.budget)  # fmt: skip
        case TurnAttempt(attempt=attempt):
            return replace(state, attempt=attempt)
        case ModelResult() as result:
            return _with_result(state, result)
        case ToolCall(server=True) | ToolResult(server=True):
            # The provider ran it inside the model call: nothing is open, nothing to answer;
            # what it fetched from outside still taints the turn.
            untrusted = isinstance(data, ToolResult) and data.trust == "untrusted"
            return replace(state, tainted=state.tainted or untrusted)
        case ToolCall() as call:
            opened = OpenCall(call.call_id, call.slug, call.mutating, dict(call.args or {}),
                              call.mcp_server)  # fmt: skip
            return replace(state, open_calls=(*state.open_calls, opened))
        case ToolResult() as result:
            block = {
                "type": "tool_result",
                "tool_use_id": result.call_id,
                "content": result.content or result.output or "",
                "is_error": not result.ok and not result.refused,
            }
            messages = list(state.transcript)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "user":
                messages[-1] = {"role": "user", "content": [*last["content"], block]}
            else:
                messages.append({"role": "user", "content": [block]})
            return replace(
                state,
                transcript=tuple(messages),
                open_calls=tuple(c for c in state.open_calls if c.call_id != result.call_id),
                tainted=state.tainted or result.trust == "untrusted",
            )
        case PhaseChanged(to=to):
            return replace(state, phase=to)
        case ApprovalRequested() | ApprovalResolved():
            return replace(state, approvals=_approvals(state.approvals, data))
        case _:
            return _noted(state, data)


def _noted(state: TurnState, data: Event | UnknownEvent) -> TurnState:
    """The state after an event that only notes a fact: a repair, the recall, the end."""
    replace = msgspec.structs.replace
    match data:
        case ToolRepair():
            return replace(state, repairs=state.repairs + 1)
        case SkillSelected() | SkillNone():
            return replace(state, recall=data)
        case TurnEnd(reason=reason):
            return replace(state, ended=reason)
        case _:
            return _started_with(state, data)


def _started_with(state: TurnState, data: Event | UnknownEvent) -> TurnState:
    """The version of the agent the turn started with: its first ``model.call``'s."""
    if isinstance(data, ModelCall) and state.agent_version is None and data.agent_version:
        return msgspec.structs.replace(state, agent_version=data.agent_version)
    return state


def _with_result(state: TurnState, result: ModelResult) -> TurnState:
    replace = msgspec.structs.replace
    if result.discarded:  # cut off and sent again: it cost a call, it says nothing
        return replace(state, steps=state.steps + 1,
                       prompt_tokens=state.prompt_tokens + result.prompt_tokens,
                       output_tokens=state.output_tokens + result.output_tokens,
                       truncations=state.truncations + 1)  # fmt: skip
    transcript = state.transcript
    if result.content:
        transcript = (*transcript, {"role": "assistant", "content": result.content})
    return replace(
        state,
        steps=state.steps + 1,
        transcript=transcript,
        texts=(*state.texts, result.text),
        last_finish_reason=result.finish_reason,
        prompt_tokens=state.prompt_tokens + result.prompt_tokens,
        output_tokens=state.output_tokens + result.output_tokens,
        cache_read_tokens=state.cache_read_tokens + result.cache_read_tokens,
        cache_write_tokens=state.cache_write_tokens + result.cache_write_tokens,
    )


def _approvals(
    approvals: tuple[Approval, ...], data: ApprovalRequested | ApprovalResolved
) -> tuple[Approval, ...]:
    if isinstance(data, ApprovalRequested):
        return (*approvals, Approval(data.approval_id, data.call_id, data.slug, data.expires_at))
    return tuple(
        msgspec.structs.replace(a, granted=data.granted, by=data.by)
        if a.approval_id == data.approval_id
        else a
        for a in approvals
    )


def attempts(events: Iterable[Event | UnknownEvent]) -> list[TurnStart | TurnAttempt]:
    """A turn's attempts in order, each with its number and node: its ``turn.start`` when its
    accept began the first (catalogue v2), then every ``turn.attempt``."""
    return [e for e in events
            if isinstance(e, TurnAttempt) or (isinstance(e, TurnStart) and e.attempt)]  # fmt: skip


def fold(events: list[RecordedEvent]) -> TurnState:
    state = TurnState()
    for event in events:
        state = evolve(state, event)
    return state


def last_reply(state: TurnState) -> list[dict[str, Any]] | None:
    """The content of the model's last reply if nothing has followed it yet in this turn."""
    if state.transcript and state.transcript[-1]["role"] == "assistant":
        content: list[dict[str, Any]] = state.transcript[-1]["content"]
        return content
    return None


def unanswered_tool_uses(state: TurnState) -> list[dict[str, Any]]:
    """``tool_use`` blocks of the last reply that have no ``tool_result`` yet, in order."""
    for index in range(len(state.transcript) - 1, -1, -1):
        message = state.transcript[index]
        if message["role"] == "assistant":
            answered = {
                block.get("tool_use_id")
                for later in state.transcript[index + 1 :]
                for block in later["content"]
            }
            return [
                block
                for block in message["content"]
                if block.get("type") == "tool_use" and block["id"] not in answered
            ]
    return []


# --- decisions ---------------------------------------------------------------------------------


def attempt_events(state: TurnState, node: str, *, began_in_accept: bool) -> list[TurnAttempt]:
    """What a run of the turn records before it acts: nothing when its accept began this very
    run (``turn.start`` with ``attempt`` 1, handed over by the session that accepted it, in
    this process), else a ``turn.attempt`` numbered after the last (a resume after a crash, a
    queued turn's start, another node taking the session over)."""
    if began_in_accept and state.attempt == 1 and state.steps == 0 and state.version == 0:
        return []
    return [TurnAttempt(attempt=state.attempt + 1, node=node, resumed_from_step=state.steps)]


class End(msgspec.Struct, frozen=True):
    reason: EndReason
    error: ErrorDetail | None = None


class RunTools(msgspec.Struct, frozen=True):
    calls: list[dict[str, Any]]
    """The ``tool_use`` blocks of the step, in the model's order."""


class Continue(msgspec.Struct, frozen=True):
    pass


StepOutcome = End | RunTools


def after_model(state: TurnState, content: list[dict[str, Any]], stop_reason: str,
                limits: Limits) -> StepOutcome:  # fmt: skip
    """What follows a model reply (``state`` already includes it)."""
    tool_uses = [block for block in content if block.get("type") == "tool_use"]
    if stop_reason == "pause_turn":
        # The provider paused a long turn (server tools at work): send its content back as it is
        # and let it go on.
        return (
            End("max_steps", _max_steps(state)) if state.steps >= limits.max_steps else RunTools([])
        )
    if stop_reason == "model_context_window_exceeded":
        return End("error", ErrorDetail(
            code="context_window_exceeded",
            message="the conversation no longer fits the model's context window",
            hint="clear the session, or lower limits so less history is kept",
        ))  # fmt: skip
    if stop_reason == "max_tokens":
        # Never a tool call from a cut-off reply: its input may be half written.
        if state.output_tokens >= limits.max_output_tokens:
            return End("output_limit", _output_limit(state, limits))
        return End("truncated", ErrorDetail(
            code="reply_truncated",
            message=f"the reply was cut off at the output limit of one model call "
                    f"({state.output_tokens} output tokens in the turn)",
            hint="raise model.max_output_tokens, set model.truncation: retry, or ask for a "
                 "shorter answer",
        ))  # fmt: skip
    if stop_reason == "refusal":
        return End("refused", ErrorDetail(
            code="model_refused", message="the model declined to answer",
            hint="rephrase the request; the refusal is in the turn's events",
        ))  # fmt: skip
    if not tool_uses:
        return End("final")
    if state.output_tokens >= limits.max_output_tokens:
        return End("output_limit", _output_limit(state, limits))
    return RunTools(tool_uses)


def kept_content(content: list[dict[str, Any]], stop_reason: str) -> list[dict[str, Any]]:
    """The blocks of a reply that enter the conversation. A reply cut off by ``max_tokens``
    loses its tool calls (never run, and a half-written input must not stand in the history as
    if it had been asked for) and any server tool use left without its result; everything else
    (its text, its thinking) is kept."""
    if stop_reason != "max_tokens":
        return content
    answered = {b.get("tool_use_id") for b in content if b.get("type", "").endswith("_result")}
    return [
        b
        for b in content
        if b.get("type") != "tool_use"
        and (b.get("type") != "server_tool_use" or b.get("id") in answered)
    ]


def model_result(
    completed: Completed, latency_s: float, *, discarded: bool, model: str | None = None
) -> ModelResult:
    """The ``model.result`` of a call: its reply as it enters the conversation (a reply the turn
    sends again, ``discarded``, enters nothing: no content, no text)."""
    usage = completed.usage
    content = kept_content(completed.content, completed.stop_reason)
    text = "".join(b.get("text", "") for b in content if b.get("type") == "text")
    return ModelResult(
        output_tokens=usage.output_tokens,
        prompt_tokens=usage.prompt_tokens,
        prompt_tokens_reported=usage.prompt_tokens,
        finish_reason=completed.stop_reason,
        latency_ms=int(latency_s * 1000),
        cache_read_tokens=usage.cache_read_tokens,
        cache_write_tokens=usage.cache_write_tokens,
        first_token_ms=completed.first_token_ms,
        text="" if discarded else text,
        content=None if discarded else content,
        discarded=discarded,
        server_tool_requests=usage.server_tool_requests or None,
        model=model,
    )


def retry_truncated(state: TurnState, stop_reason: str, policy: str, max_tokens: int,
                    larger: int) -> bool:  # fmt: skip
    """Whether a reply cut off by ``max_tokens`` is sent again with ``larger`` (once per turn,
    when the manifest asks for it and the budget does grow)."""
    return (
        stop_reason == "max_tokens"
        and policy == "retry"
        and state.truncations == 0
        and larger > max_tokens
    )


def after_tools(state: TurnState, limits: Limits) -> End | Continue:
    """After a step's tool results: another model call, or the step cap."""
    if state.steps >= limits.max_steps:
        return End("max_steps", _max_steps(state))
    return Continue()


def _max_steps(state: TurnState) -> ErrorDetail:
    return ErrorDetail(
        code="max_steps",
        message=f"stopped after {state.steps} steps with work still pending",
        hint='say "continue" to go on, or raise limits.max_steps in the agent\'s manifest',
    )


def repair_outcome(state: TurnState, invalid: dict[str, list[str]]) -> End | None:
    """One repair round is allowed per turn; invalid tool input after it ends the turn."""
    if invalid and state.repairs >= 1:
        slug_errors = "; ".join(f"{call}: {', '.join(errs)}" for call, errs in invalid.items())
        return End("error", ErrorDetail(
            code="tool_repair_failed",
            message=f"the model sent invalid tool input again after a repair round ({slug_errors})",
            hint="check the tool's input schema and description, or use a stronger model",
        ))  # fmt: skip
    return None


def remaining_output(state: TurnState, limits: Limits, per_call: int) -> int:
    return max(1, min(per_call, limits.max_output_tokens - state.output_tokens))


def call_budget(state: TurnState, limits: Limits, per_call: int, room: int) -> int:
    """A model call's ``max_tokens``: the per-call setting, within what the turn's output
    budget leaves and what the window leaves (``room``) after the prompt."""
    return max(1, min(remaining_output(state, limits, per_call), room))


def retry_budget(state: TurnState, limits: Limits, max_tokens: int, room: int,
                 spent: int) -> int:  # fmt: skip
    """The larger ``max_tokens`` a reply cut off at ``max_tokens`` is asked again with: twice
    as much, never past the window's ``room`` or the turn's own output budget (``spent``: what
    the cut-off reply used, on top of the state's)."""
    return min(max_tokens * 2, room, limits.max_output_tokens - state.output_tokens - spent)


def _output_limit(state: TurnState, limits: Limits) -> ErrorDetail:
    return ErrorDetail(
        code="output_limit",
        message=f"the reply reached the output limit ({state.output_tokens} output tokens)",
        hint="raise model.max_output_tokens or limits.max_output_tokens in the agent's manifest",
    )

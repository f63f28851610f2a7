"""How a turn ends: the end each failure maps to, the time it may still take, and the last events
it appends. Pure: the runner appends what these return (tests/test_turn_ending.py)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from actors.agent import Agent
from actors.outbox import plan as outbox_plan
from actors.turn.core import End, Limits, TurnState, apply, unanswered_tool_uses
from actors.turn.plan import closed, not_run
from eventstore import RecordedEvent
from eventstore.catalogue import (
    ApprovalRequested,
    ApprovalResolved,
    Deliver,
    ErrorDetail,
    ModelResult,
    Tokens,
    TurnEnd,
)
from eventstore.event import Event

_DEFAULT_CHUNK = 4096
CANCELLED = (
    "cancelled: the turn ended before this tool call finished; any side effect it had may "
    "already have happened"
)


def waited(stored: Sequence[RecordedEvent]) -> float:
    """Seconds the turn spent waiting for approvals (from each request to its answer): time
    spent waiting for a person is not the turn's to spend."""
    asked: dict[str, datetime] = {}
    total = 0.0
    for event in stored:
        if isinstance(event.data, ApprovalRequested):
            asked[event.data.approval_id] = event.recorded_at
        elif isinstance(event.data, ApprovalResolved) and event.data.approval_id in asked:
            total += (event.recorded_at - asked.pop(event.data.approval_id)).total_seconds()
    return total


def time_left(stored: Sequence[RecordedEvent], now: datetime, limits: Limits) -> float:
    """Seconds the turn may still run: its timeout less the time since its ``turn.start``,
    approvals' waits excepted (a resumed turn has used what it used before the crash)."""
    elapsed = (now - stored[0].recorded_at).total_seconds() - waited(stored)
    return max(0.0, limits.turn_timeout_s - elapsed)


def timed_out(limits: Limits) -> End:
    return End("timeout", ErrorDetail(
        code="turn_timeout",
        message=f"the turn ran past its {limits.turn_timeout_s:g} s limit",
        hint="raise limits.turn_timeout_s in the agent's manifest, or ask for less",
    ))  # fmt: skip


def failed(code: str, message: str, hint: str) -> End:
    """A model call that failed for good (its retries spent, or refused outright)."""
    return End("error", ErrorDetail(code=code, message=message, hint=hint))


def broken(error: Exception) -> End:
    """A bug of ours: the turn ends honestly rather than stay running."""
    return End("error", ErrorDetail(
        code="internal_error", message=f"{type(error).__name__}: {error}",
        hint="this is a bug in Dispach; the node's log has the trace",
    ))  # fmt: skip


def closing(
    state: TurnState, end: End, *, unflushed: Sequence[Event], cut_short: str | None
) -> tuple[list[Event], TurnState]:
    """What the turn leaves behind before its ``turn.end``, and the state after it: the text
    not yet on the record (``unflushed``), the partial reply of a model call cut short
    (``cut_short``: its text so far), a result for every call left without one and an answer
    for every approval still waiting, so that the stored transcript stays valid for the next
    turn and nobody is asked about a turn that is over."""
    events: list[Event] = list(unflushed)
    if cut_short is not None:
        # Only the answer's text is kept of a reply cut short: its thinking had no signature
        # yet (the API would refuse it back), and reasoning is never the answer.
        keep = end.reason in ("stopped", "timeout") and cut_short
        events.append(ModelResult(
            output_tokens=0, prompt_tokens=0, finish_reason=end.reason, latency_ms=0,
            text=cut_short, error=end.error,
            content=[{"type": "text", "text": cut_short}] if keep else None,
        ))  # fmt: skip
    for new in events:
        state = apply(state, new, version=state.version + 1)
    more: list[Event] = [closed(call, CANCELLED) for call in state.open_calls]
    more += [ApprovalResolved(approval_id=a.approval_id, slug=a.slug, granted=False,
                              by=f"turn {end.reason}")
             for a in state.approvals if a.granted is None]  # fmt: skip
    for new in more:
        state = apply(state, new, version=state.version + 1)
    # A reply's tool uses that got no result (the turn ended between the reply and its calls).
    unanswered: list[Event] = [not_run(b, "not run: the turn ended first")
                               for b in unanswered_tool_uses(state)]  # fmt: skip
    for new in unanswered:
        state = apply(state, new, version=state.version + 1)
    return [*events, *more, *unanswered], state


def reply_text(state: TurnState, end: End, cut_short: str | None) -> str:
    """The turn's text: its replies' prose; for an error, what it had written so far too."""
    if end.reason != "error":
        return state.text
    return "\n\n".join([t for t in state.texts if t] + [cut_short or ""]).strip()


def turn_end(state: TurnState, end: End, text: str, duration_ms: int) -> TurnEnd:
    return TurnEnd(
        reason=end.reason, steps=state.steps,
        tokens=Tokens(prompt=state.prompt_tokens, output=state.output_tokens,
                      cache_read=state.cache_read_tokens, cache_write=state.cache_write_tokens),
        duration_ms=duration_ms, text=text, error=end.error,
    )  # fmt: skip


def deliveries(agent: Agent, session_key: str, turn_id: str, deliver: Deliver | None, text: str,
               end: End) -> list[Event]:  # fmt: skip
    """The reply's outbox items (one per chunk of the channel's size), promised in the append of
    ``turn.end``. A channel gone from the manifest since the message was accepted still gets its
    items: they fail with ``delivery_channel_unknown`` (on the record) rather than vanish."""
    if deliver is None:
        return []
    channel = agent.channels.get(deliver.channel)
    return list(outbox_plan.enqueue(
        deliver,
        max_chars=channel.max_chars if channel else _DEFAULT_CHUNK,
        measure=channel.measure if channel else len,
        ordered=channel.ordered if channel else False,
        agent_id=agent.id, session_key=session_key, turn_id=turn_id,
        text=outbox_plan.reply_text(text, end.reason),
    ))  # fmt: skip

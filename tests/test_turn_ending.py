"""The pure pieces of a turn's shell, table by table: how it ends (actors/turn/ending.py), when
it begins an attempt (actors/turn/core.py ``attempt_events``), and how a reply's deltas become
``model.chunk`` events (actors/turn/chunks.py)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from actors.turn import chunks, ending
from actors.turn.core import (
    End,
    Limits,
    TurnState,
    apply,
    attempt_events,
    call_budget,
    fold,
    retry_budget,
)
from eventstore import Metadata, RecordedEvent
from eventstore.catalogue import (
    ApprovalRequested,
    ApprovalResolved,
    ErrorDetail,
    ModelChunk,
    ModelResult,
    ToolCall,
    ToolResult,
    TurnAttempt,
    TurnStart,
)
from eventstore.event import Event

T0 = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
USE: dict[str, object] = {
    "type": "tool_use",
    "id": "toolu_1",
    "name": "calculator",
    "input": {"expression": "1"},
}


def recorded(events: list[tuple[Event, float]]) -> list[RecordedEvent]:
    """Events of turn t1, each recorded ``seconds`` after T0."""
    meta = Metadata(agent_id="a", session_key="k", turn_id="t1")
    return [
        RecordedEvent(
            "turn-t1", i, i + 1, 9, uuid.uuid4(), e.TYPE, e, meta, T0 + timedelta(seconds=seconds)
        )
        for i, (e, seconds) in enumerate(events)
    ]


def state_of(*events: Event) -> TurnState:
    state = TurnState()
    for event in events:
        state = apply(state, event, version=state.version + 1, turn_id="t1")
    return state


ASKED = ApprovalRequested(approval_id="ap1", slug="x", call_id="c1", mutating=True, reason="ask")
ANSWERED = ApprovalResolved(approval_id="ap1", slug="x", granted=True, by="api")


@pytest.mark.parametrize(
    ("events", "now", "left"),
    [
        pytest.param([(TurnStart(source="api"), 0)], 10, 290, id="fresh"),
        pytest.param([(TurnStart(source="api"), 0)], 400, 0, id="past-its-limit"),
        pytest.param(
            [(TurnStart(source="api"), 0), (ASKED, 5), (ANSWERED, 105)],
            110,
            290,
            id="an-approvals-wait-is-not-the-turns",
        ),
        pytest.param(
            [(TurnStart(source="api"), 0), (ASKED, 5)],
            110,
            190,
            id="an-unanswered-request-counts-until-answered",
        ),
    ],
)
def test_time_left(events: list[tuple[Event, float]], now: float, left: float) -> None:
    limits = Limits(turn_timeout_s=300)
    assert ending.time_left(recorded(events), T0 + timedelta(seconds=now), limits) == left


def test_ends_carry_a_code_message_and_hint() -> None:
    timeout = ending.timed_out(Limits(turn_timeout_s=2.5))
    assert timeout.reason == "timeout" and timeout.error is not None
    assert timeout.error.code == "turn_timeout" and "2.5 s" in timeout.error.message
    failed = ending.failed("model_overloaded", "busy", "retry later")
    assert failed == End("error", ErrorDetail(code="model_overloaded", message="busy",
                                              hint="retry later"))  # fmt: skip
    broken = ending.broken(KeyError("x"))
    assert broken.error is not None and broken.error.code == "internal_error"
    assert broken.error.message == "KeyError: 'x'" and broken.error.hint


def test_closing_a_stopped_turn_mid_call_keeps_its_text_and_closes_every_open_thing() -> None:
    call = ToolCall(slug="calculator", call_id="c0", args_hash="h", mutating=True, args={})
    state = state_of(TurnStart(source="api", attempt=1), call, ASKED)
    chunk = ModelChunk(delta="par")
    events, after = ending.closing(state, End("stopped"), unflushed=[chunk], cut_short="partial")
    assert events[0] == chunk
    result = events[1]
    assert isinstance(result, ModelResult) and result.finish_reason == "stopped"
    assert result.content == [{"type": "text", "text": "partial"}]
    closed = events[2]
    assert isinstance(closed, ToolResult) and closed.call_id == "c0" and not closed.ok
    assert closed.output == ending.CANCELLED and closed.error_code == "tool_cancelled"
    resolved = events[3]
    assert isinstance(resolved, ApprovalResolved) and not resolved.granted
    assert resolved.by == "turn stopped"
    assert len(events) == 4
    assert after.open_calls == () and all(a.granted is False for a in after.approvals)
    assert after.version == state.version + 4
    assert ending.reply_text(after, End("stopped"), "partial") == "partial"


def test_closing_answers_the_tool_uses_of_a_reply_that_got_no_result() -> None:
    content: list[dict[str, object]] = [{"type": "text", "text": "let me"}, USE]
    reply = ModelResult(output_tokens=1, prompt_tokens=1, finish_reason="tool_use", latency_ms=0,
                        text="let me", content=content)  # fmt: skip
    state = state_of(TurnStart(source="api"), reply)
    events, after = ending.closing(state, End("timeout"), unflushed=[], cut_short=None)
    (result,) = events
    assert isinstance(result, ToolResult) and result.call_id == "toolu_1" and not result.ok
    assert after.transcript[-1]["content"][0]["tool_use_id"] == "toolu_1"


def test_an_errors_text_is_what_was_written_so_far() -> None:
    first = ModelResult(output_tokens=1, prompt_tokens=1, finish_reason="tool_use",
                        latency_ms=0, text="step one")  # fmt: skip
    state = state_of(TurnStart(source="api"), first)
    failed = End("error", ErrorDetail(code="x", message="y", hint="z"))
    assert ending.reply_text(state, failed, None) == "step one"
    assert ending.reply_text(state, failed, "and then") == "step one\n\nand then"
    assert ending.reply_text(state, End("final"), "ignored") == "step one"


def test_turn_end_totals_the_turns_calls() -> None:
    call = ModelResult(output_tokens=3, prompt_tokens=10, finish_reason="end_turn", latency_ms=0,
                       cache_read_tokens=4, cache_write_tokens=2, text="hi")  # fmt: skip
    state = state_of(TurnStart(source="api"), call, call)
    end = ending.turn_end(state, End("final"), "hi", 12)
    assert (end.reason, end.steps, end.duration_ms, end.text) == ("final", 2, 12, "hi")
    tokens = end.tokens
    assert (tokens.prompt, tokens.output, tokens.cache_read, tokens.cache_write) == (20, 6, 8, 4)


@pytest.mark.parametrize(
    ("events", "handed", "expected"),
    [
        pytest.param(
            [TurnStart(source="api", attempt=1, node="n1")],
            True,
            [],
            id="the-accept-began-this-run",
        ),
        pytest.param(
            [TurnStart(source="api", attempt=1, node="n1")],
            False,
            [(2, 0)],
            id="read-from-the-log-it-is-a-resume",
        ),
        pytest.param([TurnStart(source="api")], True, [(1, 0)], id="queued-behind-another"),
        pytest.param(
            [TurnStart(source="api"), TurnAttempt(attempt=1, node="n1")],
            False,
            [(2, 0)],
            id="a-v1-turn-resumed",
        ),
        pytest.param(
            [
                TurnStart(source="api", attempt=1, node="n1"),
                ModelResult(
                    output_tokens=1, prompt_tokens=1, finish_reason="tool_use", latency_ms=0
                ),
            ],
            False,
            [(2, 1)],
            id="resumed-after-a-step",
        ),
    ],
)
def test_attempt_events(events: list[Event], handed: bool, expected: list[tuple[int, int]]) -> None:
    state = fold(recorded([(e, 0) for e in events]))
    made = attempt_events(state, "n2", began_in_accept=handed)
    assert [(a.attempt, a.resumed_from_step) for a in made] == expected
    assert all(a.node == "n2" for a in made)


def test_chunks_coalesce_by_size_time_and_kind() -> None:
    coalesce = chunks.Chunks()
    coalesce.begin(0.0)
    assert coalesce.add("a" * 100, "text", 0.001) == []
    assert coalesce.add("b" * 100, "text", 0.002) == []
    (by_time,) = coalesce.add("c", "text", 0.06)  # 50 ms since the call began
    assert by_time == ModelChunk(delta="a" * 100 + "b" * 100 + "c")
    (by_size,) = coalesce.add("d" * chunks.CHARS, "text", 0.061)
    assert by_size.delta == "d" * chunks.CHARS
    assert coalesce.add("e", "text", 0.062) == []
    (switched,) = coalesce.add("hmm", "reasoning", 0.063)  # the text so far, then reasoning
    assert switched == ModelChunk(delta="e")
    assert coalesce.take() == [ModelChunk(delta="hmm", kind="reasoning")]
    assert coalesce.take() == []
    assert "".join(coalesce.partial) == "a" * 100 + "b" * 100 + "c" + "d" * chunks.CHARS + "e"


def test_chunks_dropped_and_begun_again_forget_the_last_call() -> None:
    coalesce = chunks.Chunks()
    coalesce.begin(0.0)
    coalesce.add("x", "reasoning", 0.001)
    coalesce.drop()
    assert coalesce.take() == []
    coalesce.begin(1.0)
    assert coalesce.partial == [] and coalesce.add("y", "text", 1.001) == []
    assert coalesce.take() == [ModelChunk(delta="y")]


@pytest.mark.parametrize(
    ("spent_before", "per_call", "room", "expected"),
    [
        pytest.param(0, 4096, 100_000, 4096, id="the-per-call-setting"),
        pytest.param(31_000, 4096, 100_000, 1000, id="what-the-turns-budget-leaves"),
        pytest.param(0, 4096, 500, 500, id="what-the-window-leaves"),
        pytest.param(32_000, 4096, 100_000, 1, id="never-below-one"),
    ],
)
def test_call_budget(spent_before: int, per_call: int, room: int, expected: int) -> None:
    state = TurnState(output_tokens=spent_before)
    assert call_budget(state, Limits(max_output_tokens=32_000), per_call, room) == expected


@pytest.mark.parametrize(
    ("spent_before", "max_tokens", "room", "spent", "expected"),
    [
        pytest.param(0, 1000, 100_000, 1000, 2000, id="twice-as-much"),
        pytest.param(0, 1000, 1500, 1000, 1500, id="within-the-window"),
        pytest.param(30_000, 1000, 100_000, 1000, 1000, id="within-the-turns-budget"),
    ],
)
def test_retry_budget(spent_before: int, max_tokens: int, room: int, spent: int,
                      expected: int) -> None:  # fmt: skip
    state = TurnState(output_tokens=spent_before)
    limits = Limits(max_output_tokens=32_000)
    assert retry_budget(state, limits, max_tokens, room, spent) == expected

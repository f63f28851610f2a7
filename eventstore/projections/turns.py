"""The turns read model: one row per turn, folded from its stream (the turn resource)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from psycopg.types.json import Jsonb

from eventstore.catalogue import (
    ApprovalRequested,
    ApprovalResolved,
    DeliveryEnqueued,
    HandoffResult,
    HandoffStart,
    ModelResult,
    TurnAttempt,
    TurnEnd,
    TurnStart,
)
from eventstore.envelope import RecordedEvent
from eventstore.event import Event, UnknownEvent
from eventstore.projector import Statement


def reasoning_of(result: ModelResult) -> str:
    """What the model thought in one call: the texts of its ``thinking`` blocks, a blank line
    between blocks (a ``redacted_thinking`` block has no text to show). Nothing for a reply the
    turn discarded and asked again (``model.truncation: retry``): it is not part of the turn."""
    if result.discarded or not result.content:
        return ""
    texts = [block.get("thinking") for block in result.content if block.get("type") == "thinking"]
    return "\n\n".join(text for text in texts if isinstance(text, str) and text)


# Every call adds its tokens to the turn's (prompt tokens too: what the turn read in all, as the
# output and cache figures are). A call with thinking also appends it to the turn's `reasoning`,
# after a blank line (concat_ws skips the NULL of a turn that has none yet); a call without
# leaves the column out, so a long reasoning is not rewritten by every later call of the turn.
_MODEL_RESULT = """UPDATE turns SET steps = steps + 1, prompt_tokens = prompt_tokens + %s,
                          output_tokens = output_tokens + %s,
                          cache_read_tokens = cache_read_tokens + %s,
                          cache_write_tokens = cache_write_tokens + %s,
                          calls = calls || %s,
                          state = 'running', last_position = %s
                    WHERE turn_id = %s AND status = 'running'"""
_MODEL_RESULT_THINKING = _MODEL_RESULT.replace(
    "SET ", "SET reasoning = concat_ws(E'\\n\\n', nullif(reasoning, ''), %s::text), ", 1
)


def call_usage(result: ModelResult) -> dict[str, Any]:
    """One entry of a turn's ``calls``: what the call read and wrote."""
    usage: dict[str, Any] = {
        "promptTokens": result.prompt_tokens,
        "outputTokens": result.output_tokens,
        "cacheReadTokens": result.cache_read_tokens,
        "cacheWriteTokens": result.cache_write_tokens,
        "latencyMs": result.latency_ms,
        "finishReason": result.finish_reason,
    }
    if result.server_tool_requests:
        usage["serverToolRequests"] = result.server_tool_requests
    if result.model is not None:
        usage["model"] = result.model
    return usage


# A handoff's entry is appended at its start and completed in place by its result (`||` of two
# objects keeps the start's keys the result does not set); the order is the calls' order.
_HANDOFF_START = """UPDATE turns SET handoffs = handoffs || %s, last_position = %s
                     WHERE turn_id = %s AND status = 'running'"""
_HANDOFF_RESULT = """UPDATE turns SET last_position = %s, handoffs = (
                         SELECT coalesce(jsonb_agg(CASE WHEN h->>'callId' = %s THEN h || %s
                                                        ELSE h END ORDER BY n), '[]'::jsonb)
                           FROM jsonb_array_elements(handoffs) WITH ORDINALITY AS e(h, n))
                      WHERE turn_id = %s AND status = 'running'"""


def handoff_entry(data: HandoffStart | HandoffResult) -> dict[str, Any]:
    """What the turn resource's ``handoffs`` says of a handoff: at its start, then what its
    result adds."""
    if isinstance(data, HandoffStart):
        return {"callId": data.call_id, "member": data.member, "sessionKey": data.session_key,
                "turnId": data.turn_id, "outcome": "running"}  # fmt: skip
    return {"outcome": data.outcome, "turnIds": data.turn_ids, "steps": data.steps,
            "promptTokens": data.tokens.prompt, "outputTokens": data.tokens.output,
            "repaired": data.repaired,
            "errorCode": data.error.code if data.error else None}  # fmt: skip


class TurnsProjection:
    """The turn resource: ``status`` is ``running`` until ``turn.end``, then its reason."""

    name: str = "turns"
    tables: tuple[str, ...] = ("turns",)
    types: frozenset[str] = frozenset(
        {
            TurnStart.TYPE,
            TurnAttempt.TYPE,
            ModelResult.TYPE,
            ApprovalRequested.TYPE,
            ApprovalResolved.TYPE,
            HandoffStart.TYPE,
            HandoffResult.TYPE,
            TurnEnd.TYPE,
        }
    )

    def statements(self, event: RecordedEvent) -> Iterable[Statement]:
        turn_id = event.metadata.turn_id
        if turn_id is None:
            return []
        at, pos = event.recorded_at, event.position
        match event.data:
            case TurnStart(source=source, input=text, attempt=attempt):
                return [
                    (
                        """INSERT INTO turns (turn_id, agent_id, session_key, source, input,
                                              status, state, attempt, started_at,
                                              last_position, start_position)
                           VALUES (%s, %s, %s, %s, %s, 'running', %s, %s, %s, %s, %s)
                           ON CONFLICT (turn_id) DO NOTHING""",
                        [
                            turn_id,
                            event.metadata.agent_id or "",
                            event.metadata.session_key or "",
                            source,
                            text,
                            _state_after(event.data),
                            attempt,
                            at,
                            pos,
                            pos,
                        ],
                    )
                ]
            case TurnAttempt(attempt=attempt):
                return [
                    (
                        """UPDATE turns SET attempt = %s, state = %s, last_position = %s
                            WHERE turn_id = %s AND status = 'running'""",
                        [attempt, _state_after(event.data), pos, turn_id],
                    )
                ]
            case ModelResult() as r:
                thought = reasoning_of(r)
                return [
                    (
                        _MODEL_RESULT_THINKING if thought else _MODEL_RESULT,
                        [
                            *([thought] if thought else []),
                            r.prompt_tokens,
                            r.output_tokens,
                            r.cache_read_tokens,
                            r.cache_write_tokens,
                            Jsonb([call_usage(r)]),
                            pos,
                            turn_id,
                        ],
                    )
                ]
            case ApprovalRequested() | ApprovalResolved():
                return [
                    (
                        """UPDATE turns SET state = %s, last_position = %s
                            WHERE turn_id = %s AND status = 'running'""",
                        [_state_after(event.data), pos, turn_id],
                    )
                ]
            case HandoffStart() as start:
                return [(_HANDOFF_START, [Jsonb([handoff_entry(start)]), pos, turn_id])]
            case HandoffResult() as result:
                entry = Jsonb(handoff_entry(result))
                return [(_HANDOFF_RESULT, [pos, result.call_id, entry, turn_id])]
            case TurnEnd() as end:
                err = end.error
                return [
                    (
                        """UPDATE turns SET status = %s, state = 'ended', steps = %s,
                                  prompt_tokens = %s, output_tokens = %s,
                                  cache_read_tokens = %s, cache_write_tokens = %s, text = %s,
                                  error_code = %s, error_message = %s, error_hint = %s,
                                  ended_at = %s, duration_ms = %s, last_position = %s
                            WHERE turn_id = %s""",
                        [
                            end.reason,
                            end.steps,
                            end.tokens.prompt,
                            end.tokens.output,
                            end.tokens.cache_read,
                            end.tokens.cache_write,
                            end.text,
                            err.code if err else None,
                            err.message if err else None,
                            err.hint if err else None,
                            at,
                            end.duration_ms,
                            pos,
                            turn_id,
                        ],
                    )
                ]
            case _:
                return []

    def statements_many(self, events: Sequence[RecordedEvent]) -> list[Statement]:
        """:meth:`statements` of each event in order, but a run of one running turn's
        attempts, model results and approvals (and the ``turn.end`` right after them) as one
        UPDATE (:func:`_folded`): a plain turn's second commit updates its row once, not
        three times. Equal rows either way (tests/test_projections_fold.py)."""
        out: list[Statement] = []
        run: list[RecordedEvent] = []

        def flush() -> None:
            if len(run) > 1:
                out.append(_folded(run))
            elif run:
                out.extend(self.statements(run[0]))
            run.clear()

        for event in events:
            turn_id = event.metadata.turn_id
            if run and turn_id != run[0].metadata.turn_id:
                flush()
            if turn_id is not None and isinstance(event.data, _FOLDED):
                run.append(event)
            elif run and isinstance(event.data, TurnEnd):
                run.append(event)
                flush()
            else:
                flush()
                out.extend(self.statements(event))
        flush()
        return out


_FOLDED = (TurnAttempt, ModelResult, ApprovalRequested, ApprovalResolved)
"""What changes a running turn's row by degrees: a run of these (ended, perhaps, by the turn's
``turn.end``) in one commit is one UPDATE of the row, not one each."""


def _state_after(data: Event | UnknownEvent) -> str:
    """A running turn's ``state`` after an attempt, a model result or an approval event: the
    one rule the projection's statements, their fold and the memory fold all follow."""
    match data:
        case TurnStart(attempt=attempt):  # v2: an accept that began the turn's first attempt
            return "running" if attempt == 1 else "accepted"
        case TurnAttempt(attempt=attempt):
            return "running" if attempt == 1 else "resuming"
        case ApprovalRequested():
            return "awaiting_approval"
    return "running"


def _folded(run: Sequence[RecordedEvent]) -> Statement:
    """One UPDATE that leaves the turn's row as :meth:`TurnsProjection.statements` of each
    event of ``run`` in turn would: ``run`` is a running turn's attempts, model results and
    approvals, all of one turn in log order, perhaps ended by its ``turn.end``. Before an end,
    the row changes only while its status is ``running`` (as each statement's WHERE says);
    every SET reads the row as it was, so that test is the status before this UPDATE. A
    ``turn.end`` then sets the totals outright, whatever the row said."""
    last = run[-1]
    end = last.data if isinstance(last.data, TurnEnd) else None
    results = [e.data for e in run if isinstance(e.data, ModelResult)]
    attempts = [e.data.attempt for e in run if isinstance(e.data, TurnAttempt)]
    thoughts = [t for r in results if (t := reasoning_of(r))]
    changes: list[tuple[str, str, Any]] = []  # column, its new value with one %s, the value
    if attempts:
        changes.append(("attempt", "%s", attempts[-1]))
    if results:
        changes.append(("calls", "calls || %s", Jsonb([call_usage(r) for r in results])))
    if thoughts:
        changes.append(("reasoning", "concat_ws(E'\\n\\n', nullif(reasoning, ''), %s::text)",
                        "\n\n".join(thoughts)))  # fmt: skip
    if end is None:
        if results:
            changes.append(("steps", "steps + %s", len(results)))
            changes += [(column, f"{column} + %s", sum(getattr(r, column) for r in results))
                        for column in _TOKENS]  # fmt: skip
        changes += [("state", "%s", _state_after(last.data)),
                    ("last_position", "%s", last.position)]  # fmt: skip
        sets = ", ".join(f"{column} = {value}" for column, value, _ in changes)
        params = [v for _, _, v in changes] + [last.metadata.turn_id]
        # Only this module's column fragments are in the text; every value is a parameter.
        query = f"UPDATE turns SET {sets} WHERE turn_id = %s AND status = 'running'"  # noqa: S608
        return query, params
    err = end.error
    sets = ", ".join(
        f"{column} = CASE WHEN status = 'running' THEN {value} ELSE {column} END"
        for column, value, _ in changes
    )
    params = [v for _, _, v in changes] + [
        end.reason, end.steps, end.tokens.prompt, end.tokens.output, end.tokens.cache_read,
        end.tokens.cache_write, end.text, err.code if err else None,
        err.message if err else None, err.hint if err else None, last.recorded_at,
        end.duration_ms, last.position, last.metadata.turn_id,
    ]  # fmt: skip
    query = f"UPDATE turns SET {sets}{', ' if sets else ''}{_END_SET} WHERE turn_id = %s"  # noqa: S608
    return query, params


_TOKENS = ("prompt_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens")
"""A model result's token counts: its fields and the turn row's columns have the same names."""
_END_SET = """status = %s, state = 'ended', steps = %s, prompt_tokens = %s, output_tokens = %s,
              cache_read_tokens = %s, cache_write_tokens = %s, text = %s, error_code = %s,
              error_message = %s, error_hint = %s, ended_at = %s, duration_ms = %s,
              last_position = %s"""


def turn_row(events: Sequence[RecordedEvent]) -> dict[str, Any] | None:
    """The ``turns`` row that :class:`TurnsProjection` leaves after ``events``, the same rules
    folded in memory, when they hold a turn's stream from its ``turn.start`` without a gap and
    it promised no delivery (its ``deliveries`` are outbox rows, which the fold cannot know).
    None otherwise. Whether the events are all the stream holds is the caller's to know;
    after a ``turn.end`` nothing changes the row, so an ended one is final.

    Keys are ``sql/turn.sql``'s columns; ``deliveries`` is empty. Events of other streams (a
    note the turn wrote on its session's) are skipped. tests/test_turn_memory.py checks that
    this equals the projection's row for every kind of turn."""
    row: dict[str, Any] | None = None
    version = -1
    for event in events:
        if event.category != "turn":
            continue
        if event.version != version + 1:
            return None
        version = event.version
        if row is None:
            row = _started(event)
            if row is None:
                return None
        elif row["status"] != "running" or not _evolve_turn(row, event):
            return None  # past turn.end, or an event the row cannot be folded without
    return row


TURN_COLUMNS = (
    "turn_id", "agent_id", "session_key", "status", "state", "source", "input", "text",
    "reasoning", "steps", "attempt", "prompt_tokens", "output_tokens", "cache_read_tokens",
    "cache_write_tokens", "started_at", "error_code", "error_message", "error_hint", "ended_at",
    "duration_ms", "deliveries", "calls", "handoffs",
)  # fmt: skip
"""The keys of a :func:`turn_row`, in its order."""


def _started(event: RecordedEvent) -> dict[str, Any] | None:
    data, meta = event.data, event.metadata
    if not isinstance(data, TurnStart):
        return None
    return {
        "turn_id": event.stream.split("-", 1)[1], "agent_id": meta.agent_id or "",
        "session_key": meta.session_key or "", "status": "running",
        "state": _state_after(data), "source": data.source, "input": data.input, "text": "",
        "reasoning": "", "steps": 0, "attempt": data.attempt, "prompt_tokens": 0,
        "output_tokens": 0, "cache_read_tokens": 0, "cache_write_tokens": 0,
        "started_at": event.recorded_at, "error_code": None, "error_message": None,
        "error_hint": None, "ended_at": None, "duration_ms": None, "deliveries": [], "calls": [],
        "handoffs": [],
    }  # fmt: skip


def _evolve_turn(row: dict[str, Any], event: RecordedEvent) -> bool:
    """Fold one event of a running turn into its row, as TurnsProjection's statements do;
    False for a promised delivery (the row's ``deliveries`` live in the outbox)."""
    match event.data:
        case TurnAttempt(attempt=attempt):
            row["attempt"] = attempt
            row["state"] = _state_after(event.data)
        case ModelResult() as r:
            thought = reasoning_of(r)
            if thought:  # concat_ws over nullif(reasoning, '')
                row["reasoning"] = (
                    f"{row['reasoning']}\n\n{thought}" if row["reasoning"] else thought
                )
            row["steps"] += 1
            row["prompt_tokens"] += r.prompt_tokens
            row["output_tokens"] += r.output_tokens
            row["cache_read_tokens"] += r.cache_read_tokens
            row["cache_write_tokens"] += r.cache_write_tokens
            row["calls"].append(call_usage(r))
            row["state"] = _state_after(event.data)
        case ApprovalRequested() | ApprovalResolved():
            row["state"] = _state_after(event.data)
        case DeliveryEnqueued():
            return False
        case HandoffStart() as start:
            row["handoffs"].append(handoff_entry(start))
        case HandoffResult() as result:
            row["handoffs"] = [
                {**h, **handoff_entry(result)} if h.get("callId") == result.call_id else h
                for h in row["handoffs"]
            ]
        case TurnEnd() as end:
            err = end.error
            row.update(
                status=end.reason, state="ended", steps=end.steps,
                prompt_tokens=end.tokens.prompt, output_tokens=end.tokens.output,
                cache_read_tokens=end.tokens.cache_read, cache_write_tokens=end.tokens.cache_write,
                text=end.text, error_code=err.code if err else None,
                error_message=err.message if err else None, error_hint=err.hint if err else None,
                ended_at=event.recorded_at, duration_ms=end.duration_ms,
            )  # fmt: skip
    return True

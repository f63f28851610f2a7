"""The ``handoff`` tool: a supervisor's call starts a normal turn of a member in the member's
own session, waits for it, and returns only its artifact.

Every step is keyed so that running the call again is harmless, which is what a resumed
supervisor does (the call is read-only to the turn engine: after a crash it runs again rather
than being reported uncertain): ``handoff.start`` is on the supervisor's record before the
member's turn is asked for and is not written twice; each round's member turn has an
Idempotency-Key derived from the supervisor's turn and call, so asking again is answered with
the turn already accepted (running, resumed by its own partition's owner, or ended), and the
supervisor waits for that one. The member's reply is untrusted data: the tool says so
(``untrusted_output``), so the supervisor's mutating calls after it need approval.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import Any

from actors import ids
from actors.handoff import plan
from actors.handoff.plan import Member
from actors.messages import HANDOFF, Accepted, CommandPath, StopTurn, Submit
from actors.tools import ToolCallFailed, ToolContext, ToolSpec
from actors.turn.toolcontext import ToolCallContext
from eventstore import EventStore, streams
from eventstore.catalogue import (
    Budget,
    ErrorDetail,
    HandoffOutcome,
    HandoffResult,
    HandoffStart,
    ModelResult,
    TurnEnd,
)

NAME = "handoff"
_GRACE_S = 30.0
"""How long past its own time limit a member turn is waited for (it ends itself by then)."""
_POLL_S = 0.25
_STOP_S = 2.0
"""How long a stopping supervisor's call waits for its member turn's stop to be taken."""


class Handoffs:
    """What a handoff reaches beyond its turn: the log and the command path. The node binds
    them once it has them (the agents, and so their tools, are built first)."""

    def __init__(self) -> None:
        self.store: EventStore | None = None
        self.commands: CommandPath | None = None

    def bind(self, store: EventStore, commands: CommandPath) -> None:
        self.store, self.commands = store, commands

    async def recorded(self, turn_id: str, call_id: str) -> tuple[bool, bool]:
        """Whether the supervisor's turn has this call's ``handoff.start``, and its
        ``handoff.result``, on its record (a resumed call)."""
        assert self.store is not None
        events = await self.store.aread_stream(streams.turn(turn_id))
        started = any(isinstance(e.data, HandoffStart) and e.data.call_id == call_id
                      for e in events)  # fmt: skip
        ended = any(isinstance(e.data, HandoffResult) and e.data.call_id == call_id
                    for e in events)  # fmt: skip
        return started, ended

    async def ended(self, turn_id: str, timeout_s: float) -> tuple[TurnEnd, str] | None:
        """The member turn's ``turn.end`` and its last reply's text, once it is stored; None if
        it is not within ``timeout_s``. Woken by the node's commit hints (its own commits and
        other nodes'), polling as a fallback."""
        store = self.store
        assert store is not None
        deadline = time.monotonic() + timeout_s
        stream = streams.turn(turn_id)
        while True:
            generation = store.hints.generation
            last = await store.alast(stream)
            if last is not None and isinstance(last.data, TurnEnd):
                return last.data, _last_reply(await store.aread_stream(stream), last.data)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            await store.hints.wait(generation, min(_POLL_S, left))


def _last_reply(events: list[Any], end: TurnEnd) -> str:
    """The text of the member's last reply (its final answer, without the prose of the steps
    before it)."""
    for event in reversed(events):
        if isinstance(event.data, ModelResult) and not event.data.discarded:
            return str(event.data.text)
    return end.text


def handoff_tool(members: Mapping[str, Member], port: Handoffs, timeout_s: float) -> ToolSpec:
    """The supervisor's ``handoff`` tool for its ``members``; ``timeout_s``: the supervisor's
    own turn limit (the call waits for the member, bounded by what is left of it)."""
    listed = "\n".join(f"- {m.id}: {m.description}" for m in members.values())
    schema = {
        "type": "object",
        "properties": {
            "member": {"type": "string", "enum": list(members),
                       "description": "the member to hand the task to"},
            "task": {"type": "string", "minLength": 1,
                     "description": "what the member is to do, self-contained"},
            "context": {"type": "string",
                        "description": "what the member needs to know that the task does not say"},
        },
        "required": ["member", "task"],
        "additionalProperties": False,
    }  # fmt: skip

    async def run(args: dict[str, Any], ctx: ToolContext) -> str:
        if not isinstance(ctx, ToolCallContext) or ctx.record is None or port.commands is None:
            raise ToolCallFailed("handoff runs only inside a turn of a node", "tool_unavailable")
        member = members[str(args["member"])]
        return await _handoff(port, member, ctx, str(args["task"]), args.get("context"), timeout_s)

    return ToolSpec(
        name=NAME,
        description=(
            "Hand a task to a member agent of your team. It works on it in a session of its "
            "own and returns a JSON artifact, which is what this call returns. Members:\n" + listed
        ),
        input_schema=schema,
        mutating=False,  # asked again, it names the same member turns (see the module's doc)
        run=run,
        timeout_s=timeout_s,
        untrusted_output=True,
    )


async def _handoff(port: Handoffs, member: Member, ctx: ToolCallContext, task: str,
                   context: object, timeout_s: float) -> str:  # fmt: skip
    assert port.commands is not None and ctx.record is not None
    parent, call_id = ctx.turn_id, ctx.call_id
    session = plan.session_key(parent, call_id)
    budget = ctx.remaining or Budget()
    started, finished = await port.recorded(parent, call_id)
    if not started:
        first = ids.keyed_turn_id(member.id, plan.round_key(parent, call_id, 1))
        await ctx.record([HandoffStart(call_id=call_id, member=member.id, session_key=session,
                                       turn_id=first, budget=budget)])  # fmt: skip
    began = time.monotonic()
    text = plan.task_text(task, context if isinstance(context, str) else None, member)
    ends: list[TurnEnd] = []
    turn_ids: list[str] = []
    outcome: HandoffOutcome = "invalid"
    detail, artifact = "", None
    for round_no in (1, 2):
        left = plan.after_round(budget, *_spent(ends), time.monotonic() - began)
        accepted = await port.commands.submit(Submit(
            agent_id=member.id, session_key=session, text=text, source=HANDOFF,
            idempotency_key=plan.round_key(parent, call_id, round_no), budget=left,
        ))  # fmt: skip
        if not isinstance(accepted, Accepted):
            outcome, detail = "refused", f"{accepted.code}: {accepted.message}"
            break
        turn_ids.append(accepted.turn_id)
        wait = (left.turn_timeout_s if left.turn_timeout_s is not None else timeout_s) + _GRACE_S
        try:
            found = await port.ended(accepted.turn_id, wait)
        except asyncio.CancelledError:
            if ctx.stopping():  # the supervisor's turn is stopped: so is the work it handed out
                with contextlib.suppress(Exception):
                    await port.commands.stop(StopTurn(turn_id=accepted.turn_id, by="handoff"),
                                             _STOP_S)  # fmt: skip
            raise  # a drain leaves the member turn to resume, and this call to run again
        if found is None:
            outcome, detail = "timeout", f"its turn {accepted.turn_id} did not end in time"
            break
        end, reply = found
        ends.append(end)
        ended = plan.end_outcome(end)
        if ended is not None:
            outcome = ended
            detail = f"its turn ended {end.reason}" + (f" ({end.error.message})" if end.error
                                                        else "")  # fmt: skip
            break
        artifact, errors = plan.read_artifact(reply, member)
        if not errors:
            outcome = "ok"
            break
        detail = "; ".join(errors)
        text = plan.repair_text(errors)
    steps, tokens = plan.cost(ends)
    error: ErrorDetail | None = None if outcome == "ok" else plan.failure(member, outcome, detail)
    if not finished:
        await ctx.record([HandoffResult(
            call_id=call_id, member=member.id, session_key=session, outcome=outcome,
            turn_ids=turn_ids, steps=steps, tokens=tokens, repaired=len(turn_ids) > 1,
            error=error,
        )])  # fmt: skip
    if error is not None:
        raise ToolCallFailed(f"{error.message}. {error.hint}", error.code)
    return plan.delivered(member, artifact)


def _spent(ends: list[TurnEnd]) -> tuple[int, int]:
    return sum(e.steps for e in ends), sum(e.tokens.output for e in ends)

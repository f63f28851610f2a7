"""Planning a step's tool calls: which run now, which were cut short by a crash, which are
invalid. Pure: the runner appends and executes what the plan says."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from actors import ids
from actors.tools import ToolRegistry, ToolSpec, args_hash
from actors.tools.spec import ToolOutcome
from actors.turn.core import Approval, OpenCall, TurnState
from eventstore.catalogue import ApprovalRequested, ToolCall, ToolGated, ToolRepair, ToolResult
from eventstore.event import Event

_UNTRUSTED = "untrusted content entered this turn, so {name} (which changes things) needs approval"
UNCERTAIN = (
    "uncertain: the node stopped while this call was running, so it may or may not have taken "
    "effect; check before repeating it"
)


@dataclass
class ToolPlan:
    start: list[tuple[dict[str, Any], ToolSpec]] = field(default_factory=list)
    """New calls, valid: announced with ``tool.call``, then run."""
    rerun: list[tuple[OpenCall, ToolSpec]] = field(default_factory=list)
    """Read-only calls a crash cut short: run again (no side effect to repeat)."""
    uncertain: list[OpenCall] = field(default_factory=list)
    """Mutating calls a crash cut short: never re-run, reported as uncertain."""
    invalid: dict[str, list[str]] = field(default_factory=dict)
    """Call id → its input's errors (``path: message``)."""
    refused: list[tuple[dict[str, Any], str, str]] = field(default_factory=list)
    """Valid calls that do not run: (block, why, policy) for the model and ``tool.gated``."""
    ask: list[tuple[dict[str, Any], ToolSpec]] = field(default_factory=list)
    """Calls whose tool asks for approval and that have not asked yet."""
    waiting: list[Approval] = field(default_factory=list)
    """Approvals asked for and not answered yet: the step waits (parks) until they are."""
    gated: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    """Calls gated because untrusted content entered the turn: (block, why) for ``tool.gated``
    when they ask (a refusal carries its own)."""


def plan(
    state: TurnState,
    pending: list[dict[str, Any]],
    registry: ToolRegistry,
    untrusted_on_mutate: Literal["ask", "deny", "allow"] = "ask",
) -> ToolPlan:
    opened = {c.call_id: c for c in state.open_calls}
    asked = {a.call_id: a for a in state.approvals}
    result = ToolPlan()
    for block in pending:
        call_id, name = block["id"], block["name"]
        spec = registry.get(name)
        if call_id in opened:  # started before a crash, never finished
            if spec is None or opened[call_id].mutating:
                result.uncertain.append(opened[call_id])
            else:
                result.rerun.append((opened[call_id], spec))
            continue
        errors = registry.validate(name, block.get("input") or {})
        if block.get("invalid_json"):
            errors = [f"$: the input is not valid JSON ({block['invalid_json']})"]
        if errors or spec is None:
            result.invalid[call_id] = errors
            continue
        policy, why = spec.policy, None
        if state.tainted and spec.mutating and policy == "allow" and untrusted_on_mutate != "allow":
            # Untrusted content may not act unasked (a prompt injection in a fetched page).
            policy, why = untrusted_on_mutate, _UNTRUSTED.format(name=name)
        if policy == "deny":
            reason = (
                f"refused: {why}" if why else f"refused: the agent's policy does not allow {name}"
            )
            result.refused.append((block, reason, "untrusted" if why else "deny"))
        elif policy == "ask":
            if why and call_id not in asked:
                result.gated.append((block, why))
            _gate(result, block, spec, asked.get(call_id))
        else:
            result.start.append((block, spec))
    return result


def _gate(result: ToolPlan, block: dict[str, Any], spec: ToolSpec, asked: Approval | None) -> None:
    """Where a call that needs approval goes: ask, wait, run, or be refused."""
    if asked is None:
        result.ask.append((block, spec))
    elif asked.granted is None:
        result.waiting.append(asked)
    elif asked.granted:
        result.start.append((block, spec))
    else:
        who = "the approval timed out" if asked.by == "timeout" else f"{asked.by} denied it"
        result.refused.append((block, f"refused: {spec.name} needs approval and {who}", "ask"))


def refusal(block: dict[str, Any], why: str, policy: str) -> list[Event]:
    """A call that does not run: ``tool.gated`` and a result the model reads as a refusal."""
    return [
        ToolGated(slug=block["name"], call_id=block["id"], reason=why, policy=policy),
        ToolResult(slug=block["name"], call_id=block["id"], ok=False, latency_ms=0,
                   bytes=len(why.encode()), output=why, refused=True),
    ]  # fmt: skip


def repair_events(pending: list[dict[str, Any]], invalid: dict[str, list[str]],
                  last_chance: bool) -> list[Event]:  # fmt: skip
    """``tool.repair`` and an error result per invalid call, naming each field's problem."""
    blocks = [b for b in pending if b["id"] in invalid]
    events: list[Event] = [ToolRepair(
        slugs=[b["name"] for b in blocks],
        errors=[f"{b['name']} {e}" for b in blocks for e in invalid[b["id"]]],
    )]  # fmt: skip
    for block in blocks:
        message = "invalid input: " + "; ".join(invalid[block["id"]])
        if last_chance:
            message += ". Fix the input and call the tool again."
        events.append(not_run(block, message))
    return events


def not_run(block: dict[str, Any], why: str) -> ToolResult:
    return ToolResult(slug=block["name"], call_id=block["id"], ok=False, latency_ms=0,
                      bytes=len(why.encode()), output=why)  # fmt: skip


def closed(call: OpenCall, why: str, *, uncertain: bool = False) -> ToolResult:
    """The result of a call left open: ``uncertain`` (a crash cut it short: it may have run),
    else cancelled (its turn stopped)."""
    return ToolResult(slug=call.slug, call_id=call.call_id, ok=False, latency_ms=0,
                      bytes=len(why.encode()), uncertain=uncertain, output=why,
                      error_code=None if uncertain else "tool_cancelled",
                      source="mcp" if call.mcp_server else None,
                      mcp_server=call.mcp_server)  # fmt: skip


def announced(start: Sequence[tuple[dict[str, Any], ToolSpec]]) -> list[ToolCall]:
    """The ``tool.call`` of each new call, before any of them runs (``args`` stay private)."""
    return [
        ToolCall(slug=spec.name, call_id=block["id"], mutating=spec.mutating,
                 args_hash=args_hash(block.get("input") or {}), args=block.get("input"),
                 source="mcp" if spec.mcp_server else None, mcp_server=spec.mcp_server)
        for block, spec in start
    ]  # fmt: skip


def gated(step: ToolPlan) -> list[Event]:
    """What the step records of the calls that do not run now: each refusal (``tool.gated`` and
    the refused result the model reads) and each call gated for untrusted content."""
    events: list[Event] = [
        e for block, why, rule in step.refused for e in refusal(block, why, rule)
    ]
    events += [ToolGated(slug=block["name"], call_id=block["id"], reason=why, policy="untrusted")
               for block, why in step.gated]  # fmt: skip
    return events


def results(calls: Sequence[tuple[ToolSpec, str]], outcomes: Sequence[ToolOutcome]) -> list[Event]:
    """The ``tool.result`` of each call that ran, (its spec, its call id), in the calls' order."""
    return [
        ToolResult(slug=spec.name, call_id=call_id, ok=o.ok, latency_ms=o.latency_ms,
                   bytes=o.bytes, truncated=o.truncated, output=o.output,
                   trust="untrusted" if spec.untrusted_output else "trusted",
                   error_code=o.error_code, content=o.content,
                   source="mcp" if spec.mcp_server else None, mcp_server=spec.mcp_server)
        for (spec, call_id), o in zip(calls, outcomes, strict=True)
    ]  # fmt: skip


def approvals(turn_id: str, calls: Sequence[tuple[dict[str, Any], ToolSpec]],
              expires: datetime) -> list[ApprovalRequested]:  # fmt: skip
    """A request for a person's approval of each call, answered by ``expires`` or denied."""
    return [
        ApprovalRequested(
            approval_id=ids.approval_id(turn_id, block["id"]), slug=spec.name,
            call_id=block["id"], mutating=spec.mutating,
            reason=f"the agent's policy asks for approval before {spec.name} runs",
            expires_at=expires.isoformat(), args=block.get("input"),
        )
        for block, spec in calls
    ]  # fmt: skip

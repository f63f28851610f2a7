"""What ``dispach agents``, ``sessions`` and ``approvals`` print: the API's bodies as lines.

Pure functions of the bodies (camelCase, as the node sends them), so the CLI's commands only
fetch and echo. A field a node does not send yet is left out of the line, never guessed.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from datetime import datetime
from typing import Any

__all__ = [
    "answer_commands",
    "approval_note",
    "approval_resolved",
    "approval_waits",
    "at_turn",
    "describe_agent",
    "describe_agents",
    "describe_approvals",
    "describe_fork",
    "describe_session",
    "describe_sessions",
]


def at_turn(value: str) -> str | int:
    """``--at`` as the fork body's ``atTurn``: digits are a 1-based index, anything else an id."""
    return int(value) if value.isdigit() else value


def answer_commands(agent: str, approval_id: str) -> tuple[str, str]:
    """The two commands that answer an approval, ready to paste into a shell."""
    tail = f"{shlex.quote(approval_id)} --agent {shlex.quote(agent)}"
    return f"dispach approvals grant {tail}", f"dispach approvals deny {tail}"


def approval_note(agent: str, data: dict[str, Any]) -> list[str]:
    """An ``approval.requested`` event for a person following the turn: what waits, and how to
    answer it (the turn stays parked until someone does, or the request expires)."""
    grant, deny = answer_commands(agent, str(data.get("approvalId")))
    expires = f", expires {_when(data['expiresAt'])}" if data.get("expiresAt") else ""
    lines = [approval_waits(data) + expires]
    if data.get("reason"):
        lines.append(f"  reason: {data['reason']}")
    return [*lines, f"  grant: {grant}", f"  deny:  {deny}"]


def approval_waits(data: dict[str, Any]) -> str:
    """An ``approval.requested`` event's data in a few words."""
    return f"{_tool(data)} waits for approval {data.get('approvalId')}"


def approval_resolved(data: dict[str, Any]) -> str:
    """An ``approval.resolved`` event's data in a few words."""
    answer = "granted" if data.get("granted") else "denied"
    return f"{data.get('slug')} {answer} by {data.get('by')} ({data.get('approvalId')})"


def describe_agents(agents: Sequence[dict[str, Any]]) -> list[str]:
    """``dispach agents``: one row per agent (from each agent's detail)."""
    if not agents:
        return ["no agents (or none this token may reach)"]
    rows = [
        [a["id"], a.get("model", ""), str(a.get("tools", "")), _names(a.get("channels"), "-")]
        for a in agents
    ]
    return _table(["ID", "MODEL", "TOOLS", "CHANNELS"], rows)


def describe_change(kind: str, state: dict[str, Any]) -> list[str]:
    """``dispach agents reload|stop|start``: what the node asked says now."""
    done = {"reload": "reloaded", "stop": "stopped", "start": "started"}[kind]
    head = f"agent {state['id']} {done if state.get('changed') else 'unchanged'}: " + (
        f"{state['status']}, version {state['version']}"
    )
    lines = [head]
    if kind == "reload" and state.get("previousVersion"):
        lines.append(f"  was {state['previousVersion']}; running turns finish on theirs")
    if state.get("status") == "disabled":
        reason = f" ({state['reason']})" if state.get("reason") else ""
        lines.append(f"  since {state.get('disabledAt')} by {state.get('disabledBy')}{reason}")
    lines += [f"  warning: {w}" for w in state.get("warnings", [])]
    return lines


def describe_agent(
    agent: dict[str, Any], tools: Sequence[dict[str, Any]], schedules: Sequence[dict[str, Any]]
) -> list[str]:
    """``dispach agents show``: the agent, its tools with their policy, channels, schedules and
    limits."""
    lines = [
        f"agent {agent['id']} ({agent.get('name', agent['id'])}), {agent.get('status')}",
        f"model {_model(agent)}, max {agent.get('maxOutputTokens')} output tokens,"
        f" concurrency {agent.get('concurrency')}",
        f"channels: {_names(agent.get('channels'), 'none')}",
        f"tools ({len(tools)}):",
    ]
    if tools:
        header = ["SLUG", "POLICY", "MUTATING", "TIMEOUT", "SUMMARY"]
        lines += _indent(_table(header, [_tool_row(t) for t in tools]))
    lines.append(f"schedules ({len(schedules)}):")
    if schedules:
        header = ["ID", "WHEN", "SESSION", "ENABLED", "NEXT DUE"]
        lines += _indent(_table(header, [_schedule_row(s) for s in schedules]))
    limits = agent.get("limits") or {}
    lines.append("limits: " + (", ".join(f"{k}={v}" for k, v in sorted(limits.items())) or "none"))
    lines += [f"warning: {w}" for w in agent.get("warnings") or []]
    return lines


def describe_sessions(agent: str, sessions: Sequence[dict[str, Any]]) -> list[str]:
    """``dispach sessions list``: one row per session, most recently active first."""
    if not sessions:
        return [f"agent {agent} has no sessions that match"]
    header = ["KEY", "TURNS", "MESSAGES", "LAST STATUS", "LAST ACTIVE", "LAST TURN"]
    return _table(header, [_session_row(s) for s in sessions])


def describe_session(session: dict[str, Any], messages: Sequence[dict[str, Any]]) -> list[str]:
    """``dispach sessions show``: the summary, then the history oldest first (``messages`` is
    a page as the API gives it: newest first), a header where each turn starts."""
    cleared = f", cleared {_when(session['clearedAt'])}" if session.get("clearedAt") else ""
    lines = [
        f"session {session['sessionKey']}  agent {session['agentId']}",
        f"{session.get('turns')} turn(s), {session.get('messages')} message(s),"
        f" created {_when(session['createdAt'])}, last active {_when(session['lastActivityAt'])}"
        + cleared,
    ]
    origin = session.get("forkedFrom")
    if origin:
        lines.append(
            f"forked from {origin.get('agentId')}/{origin.get('sessionKey')}"
            f" at turn {origin.get('turnId')}"
        )
    if len(messages) < int(session.get("messages") or 0):
        lines.append(f"history (the last {len(messages)}):")
    else:
        lines.append("history:")
    turn = None
    for m in reversed(messages):
        if m.get("turnId") != turn:
            turn = m.get("turnId")
            lines.append(f"  turn {turn}")
        lines.append(f"    {m['role']:<9} {_message(m)}".rstrip())
    return lines


def describe_approvals(approvals: Sequence[dict[str, Any]]) -> list[str]:
    """``dispach approvals list``: each waiting call, where it waits and how to answer it."""
    if not approvals:
        return ["no approvals waiting"]
    lines: list[str] = []
    for a in approvals:
        grant, deny = answer_commands(a["agentId"], a["approvalId"])
        mutating = ", mutating" if a.get("mutating") else ""
        lines += [
            f"{a['approvalId']}  agent {a['agentId']}  session {a.get('sessionKey')}"
            f"  turn {a.get('turnId')}",
            f"  tool {a.get('slug')} ({a.get('callId')}{mutating}),"
            f" requested {_when(a['requestedAt'])}"
            + (f", expires {_when(a['expiresAt'])}" if a.get("expiresAt") else ""),
        ]
        if a.get("reason"):
            lines.append(f"  reason: {a['reason']}")
        if a.get("args") is not None:
            lines.append(f"  arguments: {json.dumps(a['args'], ensure_ascii=False)}")
        lines += [f"  grant: {grant}", f"  deny:  {deny}"]
    return lines


def describe_fork(answer: dict[str, Any]) -> str:
    """``dispach sessions fork``: where the new session came from."""
    source = answer.get("forkedFrom") or {}
    copied = answer.get("messages")
    count = len(copied) if isinstance(copied, list) else copied
    return (
        f"forked {source.get('agentId')}/{source.get('sessionKey')} up to turn"
        f" {source.get('turnId')} ({source.get('turns')} turn(s), {count} message(s))"
        f" into {answer['agentId']}/{answer['sessionKey']}"
    )


def _model(agent: dict[str, Any]) -> str:
    model, provider = agent.get("model"), agent.get("provider")
    return f"{model}" if provider in (None, model) else f"{model} ({provider})"


def _tool_row(t: dict[str, Any]) -> list[str]:
    timeout = f"{t['timeoutS']:g} s" if t.get("timeoutS") is not None else "-"
    mutating = "yes" if t.get("mutating") else "no"
    return [t["slug"], t.get("policy", "-"), mutating, timeout, _clip(t.get("summary", ""), 60)]


def _schedule_row(s: dict[str, Any]) -> list[str]:
    enabled = "yes" if s.get("enabled") else "no"
    when = f"{s.get('kind')} {s.get('expr')}"
    return [s["id"], when, s.get("session", "-"), enabled, _when_or(s.get("nextDue"))]


def _session_row(s: dict[str, Any]) -> list[str]:
    counts = [str(s.get("turns", "-")), str(s.get("messages", "-"))]
    last = [s.get("lastTurnStatus"), _when_or(s.get("lastActivityAt")), s.get("lastTurnId")]
    return [s["sessionKey"], *counts, *(v or "-" for v in last)]


def _names(names: Sequence[str] | None, none: str) -> str:
    return ", ".join(names or []) or none


def _when_or(ts: str | None) -> str:
    return _when(ts) if ts else "-"


def _tool(data: dict[str, Any]) -> str:
    mutating = ", mutating" if data.get("mutating") else ""
    return f"{data.get('slug')} ({data.get('callId')}{mutating})"


def _message(m: dict[str, Any]) -> str:
    calls = m.get("toolCalls") or []
    text = _clip(" ".join(str(m.get("content", "")).split()), 100)
    if calls:
        asked = "asks for " + ", ".join(str(c.get("name")) for c in calls)
        text = f"{text}  [{asked}]" if text else f"[{asked}]"
    return f"{text}  [error]" if m.get("isError") else text


def _when(ts: str) -> str:
    """An ISO 8601 time to the second, as a person reads it."""
    try:
        at = datetime.fromisoformat(ts)
    except ValueError:
        return ts
    offset = at.utcoffset()
    zone = "" if offset is None else " UTC" if not offset else at.strftime(" %z")
    return at.strftime("%Y-%m-%d %H:%M:%S") + zone


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in [header, *rows]]  # fmt: skip


def _indent(lines: list[str]) -> list[str]:
    return [f"  {line}" for line in lines]


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"

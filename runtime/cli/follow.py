"""Following a turn live in a terminal: its stream's frames as lines."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click
import msgspec

from runtime.cli import describe as admin

if TYPE_CHECKING:
    from gateways.client import Client, StreamFrame


def follow(client: Client, agent: str, turn_id: str, prefix: str = "",
            reasoning: bool = False) -> str | None:  # fmt: skip
    """Print a turn's stream until it ends; return its end reason."""
    printer = _TurnPrinter(prefix, agent)
    try:
        for frame in client.stream_turn(agent, turn_id, reasoning=reasoning):
            printer.frame(frame)
    except KeyboardInterrupt:
        printer.end_line()
        click.secho(f"interrupted; turn {turn_id} runs on (dispach turns stop {turn_id})", err=True)
        sys.exit(130)
    return printer.reason


class _TurnPrinter:
    """Writes the frames of one turn for a person at a terminal."""

    _NOTED = frozenset(
        {"model.retry", "tool.call", "tool.result", "tool.gated", "tool.repair",
         "approval.resolved", "turn.stopping", "delivery.failed"}
    )  # fmt: skip

    def __init__(self, prefix: str, agent: str) -> None:
        self.prefix = prefix
        self.agent = agent
        self.reason: str | None = None
        self.replied = False
        self._open = False  # stdout has a line without its end
        self._thinking = False  # stderr has thinking without its line end

    def frame(self, frame: StreamFrame) -> None:
        data: dict[str, Any] = frame.data.get("data") or {}
        match frame.event:
            case "model.chunk" if data.get("kind", "text") == "text":
                self._reply(str(data.get("delta", "")))
            case "model.chunk":  # the model's thinking (asked for with --reasoning): not the reply
                self._think(str(data.get("delta", "")))
            case "turn.attempt" if data.get("attempt", 1) > 1:
                self._note(frame.event, data)
            case "turn.end":
                if not self.replied and data.get("text"):
                    self._reply(str(data["text"]))  # its chunks were not on the stream
                self.reason = data.get("reason")
                self.end_line()
                colour = "green" if self.reason == "final" else "red"
                click.secho(summary("turn.end", data), fg=colour, err=True)
            case "stream.ended" if self.reason is None:
                self.reason = frame.data.get("status")
            case "approval.requested":  # the turn is parked: say how to let it go on
                self.end_line()
                first, *rest = admin.approval_note(frame.data.get("agentId") or self.agent, data)
                click.secho(f"  {frame.event}  {first}", fg="yellow", bold=True, err=True)
                for line in rest:
                    click.echo(f"  {line}", err=True)
            case event if event in self._NOTED:
                self._note(event, data)

    def end_line(self) -> None:
        if self._open:
            click.echo()
            self._open = False

    def _think(self, delta: str) -> None:
        if self._open and not self._thinking:
            self.end_line()
        self._thinking = True
        click.secho(delta, dim=True, italic=True, nl=False, err=True)

    def _reply(self, delta: str) -> None:
        if not delta:
            return
        if self._thinking:  # the answer starts on a line of its own
            click.echo(err=True)
            self._thinking = False
        if not self._open and self.prefix:
            click.secho(self.prefix, bold=True, nl=False)
        click.echo(delta, nl=False)
        self.replied = True
        self._open = not delta.endswith("\n")

    def _note(self, event: str, data: dict[str, Any]) -> None:
        self.end_line()
        click.secho(f"  {event}  {summary(event, data)}", dim=True, err=True)


def _call_summary(d: dict[str, Any]) -> str:
    """A ``model.call``: catalogue v2 carries its context and pressure (v1 wrote them as the
    ``context.assembled`` and ``context.pressure`` before it)."""
    line = f"{d.get('role')} {d.get('model')}, {d.get('promptTokens')} prompt tokens"
    if isinstance(context := d.get("context"), dict):
        line += f" in {len(context.get('slots') or [])} blocks"
    if isinstance(pressure := d.get("pressure"), dict):
        line += f", {pressure.get('fraction', 0):.0%} of the budget"
    return line


def summary(event: str, d: dict[str, Any]) -> str:
    """A short line about one event's public data."""
    match event:
        case "turn.start":
            return f"{d.get('source')}: {_clip(repr(d.get('input', '')))}"
        case "turn.attempt":
            return f"attempt {d.get('attempt')} on {d.get('node')}" + (
                f", resumed from step {d['resumedFromStep']}" if d.get("resumedFromStep") else ""
            )
        case "context.assembled":
            return f"{d.get('total')} tokens in {len(d.get('slots') or [])} blocks"
        case "model.call":
            return _call_summary(d)
        case "model.chunk":
            return f"{d.get('kind', 'text')} {_clip(repr(d.get('delta', '')))}"
        case "model.retry":
            return f"status {d.get('status')}, attempt {d.get('attempt')}, in {d.get('delayMs')} ms"
        case "model.result":
            return (
                f"{d.get('finishReason')}, {d.get('outputTokens')} output tokens,"
                f" {d.get('latencyMs')} ms" + _error(d)
            )
        case "tool.call":
            mutating = ", mutating" if d.get("mutating") else ""
            return f"{d.get('slug')} ({d.get('callId')}), args #{d.get('argsHash')}{mutating}"
        case "tool.result":
            flags = [f for f in ("truncated", "uncertain") if d.get(f)]
            return (
                f"{d.get('slug')} {'ok' if d.get('ok') else 'failed'}, {d.get('latencyMs')} ms,"
                f" {d.get('bytes')} bytes" + "".join(f", {f}" for f in flags)
            )
        case "approval.requested":
            return admin.approval_waits(d)
        case "approval.resolved":
            return admin.approval_resolved(d)
        case "turn.end":
            tokens = d.get("tokens") or {}
            return (
                f"{d.get('reason')}: {_steps(d.get('steps'))}, {tokens.get('prompt', 0)} prompt +"
                f" {tokens.get('output', 0)} output tokens, {d.get('durationMs')} ms" + _error(d)
            )
    return _clip(msgspec.json.encode(d).decode())


def _error(d: dict[str, Any]) -> str:
    error = d.get("error")
    if not error:
        return ""
    return f"\n  {error.get('code')}: {error.get('message')}\n  hint: {error.get('hint')}"


def _steps(count: object) -> str:
    return "1 step" if count == 1 else f"{count} steps"


def _clip(text: str, width: int = 100) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def describe_turn(t: dict[str, Any]) -> list[str]:
    lines = [
        f"turn {t['turnId']}  agent {t.get('agentId')}  session {t.get('sessionKey')}",
        f"status {t.get('status')} ({t.get('state')}), {_steps(t.get('steps'))},"
        f" {t.get('promptTokens')} prompt + {t.get('outputTokens')} output tokens"
        + (f", {t['durationMs']} ms" if t.get("durationMs") is not None else ""),
        f"input: {_clip(repr(t.get('input', '')))}",
    ]
    if t.get("text"):
        lines.append(f"reply: {_clip(repr(t['text']))}")
    if t.get("errorCode"):
        lines.append(f"error {t['errorCode']}: {t.get('errorMessage')}")
        lines.append(f"  hint: {t.get('errorHint')}")
    return [*lines, "timeline:"]


def instant(ts: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(ts).timestamp()

"""The tools every agent can be given: the clock, arithmetic and its session notes."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from actors.tools._calculator import MAX_LENGTH, SUPPORTED, calculate
from actors.tools.spec import ToolContext, ToolSpec

Clock = Callable[[], datetime]
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def current_time(clock: Clock = lambda: datetime.now(UTC)) -> ToolSpec:
    def run(args: dict[str, Any], ctx: ToolContext) -> str:
        name = args.get("timezone", "UTC")
        try:
            zone = ZoneInfo(name)
        except (ZoneInfoNotFoundError, ValueError) as e:
            raise ValueError(
                f"unknown time zone {name!r}; use an IANA name such as 'Europe/Berlin', "
                "'America/New_York' or 'UTC'"
            ) from e
        now = clock().astimezone(zone)
        return f"{now.isoformat(timespec='seconds')} ({_WEEKDAYS[now.weekday()]})"

    return ToolSpec(
        name="current_time",
        description=(
            "The current date and time, as ISO-8601 with the UTC offset, followed by the weekday, "
            'e.g. "2026-11-29T20:04:05+01:00 (Sunday)". Use it whenever the answer depends on '
            "today's date or the time of day; you do not otherwise know it."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "timezone": {
                    "type": "string",
                    "description": "IANA time zone name, e.g. Europe/Berlin. Default: UTC.",
                    "minLength": 1,
                }
            },
            "additionalProperties": False,
        },
        mutating=False,
        run=run,
    )


def calculator() -> ToolSpec:
    def run(args: dict[str, Any], ctx: ToolContext) -> str:
        return calculate(args["expression"])

    return ToolSpec(
        name="calculator",
        description=(
            "Evaluate an arithmetic expression exactly and return the number. Use it for any "
            f"arithmetic beyond the trivial. Supported: {SUPPORTED} (angles in radians, log(x) is "
            "natural, log(x, base) takes a base). Integers are exact; for example "
            '"2**64 - 1" gives 18446744073709551615 and "sqrt(2) * 3" gives 4.242640687119286.'
        ),
        input_schema={
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": "The expression, e.g. (17 + 3) * 2 / 7",
                    "minLength": 1,
                    "maxLength": MAX_LENGTH,
                }
            },
            "required": ["expression"],
            "additionalProperties": False,
        },
        mutating=False,
        run=run,
    )


def session_notes() -> ToolSpec:
    async def run(args: dict[str, Any], ctx: ToolContext) -> str:
        action = args["action"]
        if action == "read":
            notes = await ctx.notes.read()
            return "\n".join(f"{i}. {note}" for i, note in enumerate(notes, 1)) or "(no notes)"
        text = args.get("text")
        if text is None:
            raise ValueError(f"action {action!r} needs `text`")
        if action == "append" and not text:
            raise ValueError("action 'append' needs a `text` that is not empty")
        if action == "append":
            await ctx.notes.append(text)
            return "note added"
        await ctx.notes.replace(text)
        return "notes replaced" if text else "notes cleared"

    return ToolSpec(
        name="session_notes",
        description=(
            "Your notes for this conversation, kept from turn to turn. Write down what you must "
            "not forget: the user's preferences, decisions, open tasks. action=read lists the "
            "notes numbered; action=append adds `text` as one more note; action=replace sets the "
            "notes to `text` alone, and an empty `text` deletes them all."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "action": {
                    "type": "string",
                    "enum": ["read", "append", "replace"],
                    "description": "read the notes, append one, or replace them all",
                },
                "text": {
                    "type": "string",
                    "description": "append: the note (not empty); replace: the new notes, or an "
                    "empty string to delete them all. Not used by read.",
                    "maxLength": 4000,
                },
            },
            "required": ["action"],
            "additionalProperties": False,
        },
        mutating=True,  # reading is harmless, but a call may write: it runs in the model's order
        run=run,
    )


ARTIFACT_PAGE = 12_000


def artifact_read() -> ToolSpec:
    async def run(args: dict[str, Any], ctx: ToolContext) -> str:
        obs_id = args["id"]
        body = await ctx.artifacts.read(obs_id)
        if body is None:
            raise ValueError(
                f"no tool result {obs_id!r} in this session: use the id a compacted result "
                'names (artifact_read("..."))'
            )
        offset = args.get("offset", 0)
        page = body[offset : offset + args.get("length", ARTIFACT_PAGE)]
        end = offset + len(page)
        more = (f"; {len(body) - end} more: call again with offset {end}"
                if end < len(body) else "")  # fmt: skip
        return f"[{obs_id}: characters {offset}-{end} of {len(body)}{more}]\n{page}"

    return ToolSpec(
        name="artifact_read",
        description=(
            "Read the whole of an earlier tool result that compaction shortened, excerpted or "
            "replaced with a stub: pass the id it names. Long results come in pages: the header "
            "says where the page ends and how to get the next one."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "id": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 200,
                    "description": "the tool call id named by the compacted result",
                },
                "offset": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "the character to start at (default 0)",
                },
                "length": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": ARTIFACT_PAGE,
                    "description": f"how many characters (default {ARTIFACT_PAGE})",
                },
            },
            "required": ["id"],
            "additionalProperties": False,
        },
        mutating=False,
        run=run,
    )


BUILTINS: dict[str, Callable[[], ToolSpec]] = {
    "current_time": current_time,
    "calculator": calculator,
    "session_notes": session_notes,
    "artifact_read": artifact_read,
}

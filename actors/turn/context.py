"""Assembling what the model reads: pinned instructions, tools, history, the input, this turn."""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from typing import Any

import msgspec

from eventstore import EventStore
from eventstore.catalogue import ContextSlot

_HISTORY = resources.files("actors.turn").joinpath("history.sql").read_text().encode()
_JSON = msgspec.json.Decoder(Any)


HistoryRow = tuple[str, Any]
"""``(role, content)`` as the messages projection stores it (eventstore.projections.history_row)."""


async def load_history(
    store: EventStore, agent_id: str, session_key: str, turn_id: str
) -> list[HistoryRow]:
    """The rows of the session's earlier turns, from the messages projection."""
    rows = await store.afetch(
        _HISTORY, {"agent_id": agent_id, "session_key": session_key, "turn_id": turn_id}
    )
    return [(role, _JSON.decode(content_text)) for role, content_text in rows]


def merge(rows: Sequence[HistoryRow]) -> list[dict[str, Any]]:
    """History rows as alternating model messages."""
    messages: list[dict[str, Any]] = []
    for role, content in rows:
        blocks = content if isinstance(content, list) else [content]
        append_message(messages, "assistant" if role == "assistant" else "user", blocks)
    return messages


def append_message(messages: list[dict[str, Any]], role: str, blocks: list[Any]) -> None:
    """Add blocks as a message, merging with the previous one when it has the same role (the
    API would merge them too; merging here keeps tool results first in a user message)."""
    blocks = [_wire_block(b) for b in blocks]
    if messages and messages[-1]["role"] == role:
        messages[-1] = {"role": role, "content": [*messages[-1]["content"], *blocks]}
    else:
        messages.append({"role": role, "content": list(blocks)})


def _wire_block(block: Any) -> Any:
    """A stored block as the API accepts it: our own annotations (such as ``invalid_json`` on a
    tool_use whose input did not parse) stay in the log."""
    if isinstance(block, dict) and block.get("type") == "tool_use":
        return {k: block[k] for k in ("type", "id", "name", "input") if k in block}
    return block


def conversation(
    history: list[dict[str, Any]], text: str, transcript: tuple[dict[str, Any], ...]
) -> list[dict[str, Any]]:
    messages = [dict(m) for m in history]
    append_message(messages, "user", [{"type": "text", "text": text}])
    for message in transcript:
        append_message(messages, message["role"], message["content"])
    return messages


def estimate_tokens(value: object) -> int:
    """A local estimate (about 4 bytes of JSON per token), corrected by reported usage later."""
    return max(1, len(msgspec.json.encode(value)) // 4)


def slots(
    system: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    history: list[dict[str, Any]],
    text: str,
    transcript: tuple[dict[str, Any], ...],
) -> list[ContextSlot]:
    return [
        ContextSlot(slot=0, label="instructions", tokens=estimate_tokens(system), pinned=True),
        ContextSlot(slot=1, label="tools", tokens=estimate_tokens(tools), pinned=True),
        ContextSlot(slot=2, label="history", tokens=estimate_tokens(history), pinned=False),
        ContextSlot(slot=3, label="input", tokens=estimate_tokens(text), pinned=True),
        ContextSlot(slot=4, label="this turn", tokens=estimate_tokens(transcript), pinned=False),
    ]

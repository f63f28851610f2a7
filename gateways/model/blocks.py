"""What every adapter does the same way to the blocks it builds from a streamed reply."""

from __future__ import annotations

from typing import Any

import msgspec

_DECODE = msgspec.json.Decoder().decode


def finish_tool_input(block: dict[str, Any], text: str) -> None:
    """Set a tool call's ``input`` from the JSON text its deltas carried. Text that is no JSON
    object (malformed, cut off, a list) leaves ``input: {}`` and notes why in ``invalid_json``:
    the turn reports it to the model as a repairable input error instead of crashing, and
    ``history.wire`` keeps the note out of every request."""
    block["input"] = {}
    if not text.strip():
        return
    try:
        parsed = _DECODE(text)
    except msgspec.DecodeError as e:
        block["invalid_json"] = f"{e.__class__.__name__}: {e}"[:300]
        return
    if isinstance(parsed, dict):
        block["input"] = parsed
    else:
        block["invalid_json"] = f"expected a JSON object, got {type(parsed).__name__}"

"""Functions loaded as custom tools by tests/test_tools.py (as "tests.fixtures_tools:...")."""

from __future__ import annotations

from typing import Any

NOT_CALLABLE = 42


def shout(args: dict[str, Any], ctx: object) -> str:
    return str(args["text"]).upper()


async def whisper(args: dict[str, Any], ctx: object) -> str:
    return str(args["text"]).lower()

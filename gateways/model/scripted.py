"""The offline scripted model: deterministic, instant, and clearly labelled in its replies.

It lets ``dispach serve`` work on first run without an API key, and it is the "instant model" of
the benchmarks. It answers the person's last message by the first matching rule of its script,
then, once tools have answered, with a short report of what they returned.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from actors.model import Completed, ModelEvent, ModelRequest, TextDelta, Usage

LABEL = "[scripted model, offline]"


class ScriptRule(msgspec.Struct, frozen=True, kw_only=True):
    """When the person's message matches ``match`` (a regular expression, case-insensitive),
    call ``tool`` with ``input`` (``{1}``-style group references are filled in), or say
    ``reply``."""

    match: str
    reply: str | None = None
    tool: str | None = None
    input: dict[str, Any] = msgspec.field(default_factory=dict)


DEFAULT_SCRIPT = (
    ScriptRule(match=r"\b(time|clock|date)\b", tool="current_time", input={}),
    ScriptRule(
        match=r"^(?:calc(?:ulate)?|compute|what is)\s*:?\s*([-+*/().\d\s^%a-z]+?)\??$",
        tool="calculator",
        input={"expression": "{1}"},
    ),
    ScriptRule(
        match=r"^(?:note|remember)\s*:?\s*(.+)$",
        tool="session_notes",
        input={"action": "append", "text": "{1}"},
    ),
    ScriptRule(match=r"\bnotes\b", tool="session_notes", input={"action": "read"}),
)


class ScriptedModel:
    def __init__(self, script: tuple[ScriptRule, ...] | list[ScriptRule] = DEFAULT_SCRIPT) -> None:
        self.label = "scripted (offline)"
        self._rules = [(re.compile(r.match, re.IGNORECASE | re.DOTALL), r) for r in script]
        self._calls = 0

    async def aclose(self) -> None:
        return None

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        content = self._reply(request)
        for block in content:
            if block["type"] == "text":
                text = block["text"]
                for start in range(0, len(text), 64):
                    yield TextDelta(text[start : start + 64])
        has_tools = any(block["type"] == "tool_use" for block in content)
        yield Completed(
            content=content,
            stop_reason="tool_use" if has_tools else "end_turn",
            usage=Usage(
                input_tokens=request.size() // 4,  # the history is not decoded for it
                output_tokens=max(1, len(msgspec.json.encode(content)) // 4),
            ),
            first_token_ms=0,
        )

    def _reply(self, request: ModelRequest) -> list[dict[str, Any]]:
        last = request.messages[-1]
        results = [b for b in last["content"] if b.get("type") == "tool_result"]
        # A new message can follow the results of a stopped turn in the same user message: then
        # the message is what to answer.
        answered_after = last["content"] and last["content"][-1].get("type") == "text"
        if results and not answered_after:
            lines = [f"- {_first_line(b.get('content'))}" for b in results]
            return [_text(f"{LABEL} The tools answered:\n" + "\n".join(lines))]
        said = " ".join(b.get("text", "") for b in last["content"] if b.get("type") == "text")
        available = {tool["name"] for tool in request.tools}
        for pattern, rule in self._rules:
            found = pattern.search(said.strip())
            if found is None:
                continue
            if rule.tool is not None and rule.tool in available:
                self._calls += 1
                return [{
                    "type": "tool_use", "id": f"toolu_scripted_{self._calls:06d}",
                    "name": rule.tool, "input": _fill(rule.input, found),
                }]  # fmt: skip
            if rule.reply is not None:
                return [_text(f"{LABEL} {_fill_text(rule.reply, found)}")]
        return [_text(f"{LABEL} You said: {said.strip()}\n(Set ANTHROPIC_API_KEY for a real "
                      "model.)")]  # fmt: skip


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _first_line(content: Any) -> str:
    text = content if isinstance(content, str) else str(content)
    return text.strip().splitlines()[0] if text.strip() else "(empty)"


def _fill_text(template: str, found: re.Match[str]) -> str:
    return re.sub(r"\{(\d+)\}", lambda m: (found.group(int(m.group(1))) or "").strip(), template)


def _fill(value: Any, found: re.Match[str]) -> Any:
    if isinstance(value, str):
        return _fill_text(value, found)
    if isinstance(value, dict):
        return {k: _fill(v, found) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, found) for v in value]
    return value

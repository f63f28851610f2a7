"""Server tools (web search, web fetch, code execution): run by the provider inside a model
call, recorded by us as ``tool.call`` / ``tool.result`` with ``server: true``.

The provider puts both the use (``server_tool_use``) and its result (``web_search_tool_result``
and the like) in the model's own reply, which stays in ``model.result.content`` and goes back
to the model as it came; these events are the record people and policies read: what ran, with
which input, whether it failed, and a short text of what it returned (never the encrypted page
contents).
"""

from __future__ import annotations

from typing import Any

import msgspec

from actors.tools import args_hash
from eventstore.catalogue import ToolCall, ToolResult

UNTRUSTED = frozenset({"web_search", "web_fetch"})
"""Server tools whose results come from outside: they taint the turn like an untrusted tool."""
_SUMMARY_CHARS = 2000
_OPAQUE = frozenset({"encrypted_content", "encrypted_index", "signature"})
_ENCODE = msgspec.json.Encoder().encode


def events(content: list[dict[str, Any]]) -> list[ToolCall | ToolResult]:
    """The record of every server tool use in a reply and of each result it got, in order."""
    names: dict[str, str] = {}
    out: list[ToolCall | ToolResult] = []
    for block in content:
        kind = block.get("type", "")
        if kind == "server_tool_use":
            name, call_id = str(block.get("name", "")), str(block.get("id", ""))
            names[call_id] = name
            args = block.get("input") if isinstance(block.get("input"), dict) else {}
            out.append(ToolCall(slug=name, call_id=call_id, args_hash=args_hash(args),
                                mutating=False, args=args, server=True))  # fmt: skip
        elif kind.endswith("_tool_result") and "tool_use_id" in block:
            call_id = str(block["tool_use_id"])
            name = names.get(call_id, kind.removesuffix("_tool_result"))
            body = block.get("content")
            summary = summary_of(body)
            out.append(ToolResult(
                slug=name, call_id=call_id, ok=not failed(body), latency_ms=0,
                bytes=len(_ENCODE(body)), output=summary,
                trust="untrusted" if name in UNTRUSTED else "trusted", server=True,
            ))  # fmt: skip
    return out


def failed(body: Any) -> bool:
    """Whether a server tool's result is its error object (``*_tool_result_error``)."""
    return isinstance(body, dict) and str(body.get("type", "")).endswith("_error")


def summary_of(body: Any) -> str:
    """A short text of a result: one line per search result (title and address), else the
    result's JSON without its opaque fields, cut at a few thousand characters."""
    if isinstance(body, list) and all(isinstance(item, dict) and "url" in item for item in body):
        lines = [f"{item.get('title') or item['url']} <{item['url']}>" for item in body]
        return "\n".join(lines)[:_SUMMARY_CHARS]
    if failed(body):
        return f"error: {body.get('error_code') or body.get('type')}"
    text = _ENCODE(_without_opaque(body)).decode()
    return text if len(text) <= _SUMMARY_CHARS else text[:_SUMMARY_CHARS] + "…"


def _without_opaque(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_opaque(v) for k, v in value.items() if k not in _OPAQUE}
    if isinstance(value, list):
        return [_without_opaque(v) for v in value]
    return value

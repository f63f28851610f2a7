"""The prompt of a Messages API request as the fake measures it: token estimates and the
canonical text prompt-cache prefixes are taken from.

``estimate_input_tokens(body)`` is the length of the canonical JSON of the prompt (tools, system,
messages, cache markers left out) divided by four: the same figure for ``count_tokens`` and for
``usage``. Each marked block ends a prefix of that same text, so a cache prefix is a true prefix
of what the estimate is taken from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["Prompt", "blocks_of", "estimate_input_tokens", "without_cache_control"]


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def without_cache_control(value: Any) -> Any:
    """``value`` (a request body, or a part of one) with every ``cache_control`` marker taken
    out: what the cache compares, where the markers sit being no part of a prefix's bytes."""
    if isinstance(value, dict):
        return {k: without_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [without_cache_control(v) for v in value]
    return value


def _markers_in(value: Any) -> list[dict[str, Any]]:
    """Every ``cache_control`` found in a block, nested ones (tool_result content) included."""
    found: list[dict[str, Any]] = []
    if isinstance(value, dict):
        marker = value.get("cache_control")
        if isinstance(marker, dict):
            found.append(marker)
        for key, inner in value.items():
            if key != "cache_control":
                found.extend(_markers_in(inner))
    elif isinstance(value, list):
        for inner in value:
            found.extend(_markers_in(inner))
    return found


def blocks_of(content: Any) -> list[Any]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return content
    return []


@dataclass(frozen=True)
class Prompt:
    """The prompt as a list of canonical segments (tools, then system, then message blocks);
    its canonical JSON is ``"[" + ",".join(segments) + "]"``, so every cache prefix is a true
    prefix of the text the estimate is taken from."""

    segments: tuple[str, ...]
    markers: tuple[tuple[int, str], ...]  # (index of the marked segment, ttl)
    marker_count: int

    @classmethod
    def of(cls, body: dict[str, Any]) -> Prompt:
        segments: list[str] = []
        markers: list[tuple[int, str]] = []
        count = 0

        def add(segment: list[Any], block: Any) -> None:
            nonlocal count
            found = _markers_in(block)
            segments.append(_canonical([*segment, without_cache_control(block)]))
            if found:
                count += len(found)
                markers.append((len(segments) - 1, str(found[-1].get("ttl", "5m"))))

        tools = body.get("tools")
        for tool in tools if isinstance(tools, list) else []:
            add(["tool"], tool)
        for block in blocks_of(body.get("system")):
            add(["system"], block)
        messages = body.get("messages")
        for index, message in enumerate(messages if isinstance(messages, list) else []):
            if isinstance(message, dict):
                for block in blocks_of(message.get("content")):
                    add(["message", index, message.get("role")], block)
        automatic = body.get("cache_control")
        if isinstance(automatic, dict) and segments:
            count += 1
            markers.append((len(segments) - 1, str(automatic.get("ttl", "5m"))))
        return cls(tuple(segments), tuple(sorted(set(markers))), count)

    def text(self, upto: int | None = None) -> str:
        chosen = self.segments if upto is None else self.segments[: upto + 1]
        closing = "]" if upto is None else ""
        return "[" + ",".join(chosen) + closing

    def tokens(self, upto: int | None = None) -> int:
        return max(1, len(self.text(upto)) // 4)


def estimate_input_tokens(body: dict[str, Any]) -> int:
    """The fake's token estimate of a request's prompt: ``len(canonical JSON) // 4`` (at least
    1), where the canonical JSON covers tools, system and messages without cache markers."""
    return Prompt.of(body).tokens()

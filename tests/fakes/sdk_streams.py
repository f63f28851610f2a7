"""The Messages streams the official SDK's own tests recorded, found where a developer keeps a
checkout of ``anthropics/anthropic-sdk-python`` (none of it is copied into this project).

``DISPACH_SDK_STREAMS`` names the directory (the checkout, or its ``tests`` folder); unset, there
are no streams and the replay tests that use them do not run. The SDK keeps them in three forms:

- ``tests/lib/streaming/fixtures/*.txt``: one SSE body each;
- ``tests/fixtures/<scenario>/*.sse``: one SSE body each;
- ``tests/**/__inline_snapshot__/**/<uuid>.json``: a JSON list of recorded HTTP exchanges,
  ``{"request": {"method", "url", "headers", "body"}, "response": {"status_code", "headers",
  "body"}}``, where a streamed response's ``body`` is its SSE text.

A file counts if it holds an SSE body whose first event is ``message_start``, so other ``.txt``
files (``tests/sample_file.txt``) are passed over; an exchange counts if its request went to
``/v1/messages`` and its response is ``text/event-stream``. ``fold`` rebuilds the final message
a stream describes, independently of the SDK, for a replay test to compare against.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jiter

__all__ = ["ENV", "Event", "SdkStream", "fold", "parse_sse", "sdk_recorded_streams"]

ENV = "DISPACH_SDK_STREAMS"
_BODY_SUFFIXES = (".txt", ".sse")


@dataclass(frozen=True)
class Event:
    """One server-sent event: its ``event:`` name (None if it had none) and its parsed data."""

    name: str | None
    data: Any


@dataclass(frozen=True)
class SdkStream:
    """One recorded Messages stream. ``name`` is the file's path under the root, with
    ``#<n>`` for the n-th exchange of a snapshot; ``beta`` whether it went to the beta
    endpoint (``?beta=true``) or holds a block only the beta types know (``compaction``);
    ``request`` the recorded request body, if the recording kept it."""

    name: str
    path: Path
    text: str
    events: tuple[Event, ...]
    beta: bool
    request: dict[str, Any] | None = None


def parse_sse(text: str) -> list[Event]:
    """The events of an SSE body: blocks separated by a blank line, ``data:`` lines joined,
    data parsed as JSON (trailing spaces, which the SDK's recordings have, allowed)."""
    events = []
    for frame in text.replace("\r\n", "\n").split("\n\n"):
        name: str | None = None
        data: list[str] = []
        for line in frame.split("\n"):
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
        if data:
            events.append(Event(name, json.loads("\n".join(data))))
    return events


def _is_messages_stream(events: list[Event]) -> bool:
    first = events[0].data if events else None
    return isinstance(first, dict) and first.get("type") == "message_start"


def _beta_only(events: list[Event]) -> bool:
    return any(
        isinstance(e.data, dict)
        and e.data.get("type") == "content_block_start"
        and e.data.get("content_block", {}).get("type") == "compaction"
        for e in events
    )


def _body_stream(root: Path, path: Path) -> SdkStream | None:
    try:
        text = path.read_text(encoding="utf-8")
        events = parse_sse(text)
    except (UnicodeDecodeError, ValueError):
        return None
    if not _is_messages_stream(events):
        return None
    name = path.relative_to(root).as_posix()
    return SdkStream(name, path, text, tuple(events), _beta_only(events))


def _snapshot_streams(root: Path, path: Path) -> Iterator[SdkStream]:
    try:
        exchanges = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError):
        return
    if not isinstance(exchanges, list):
        return
    for position, exchange in enumerate(exchanges):
        if not isinstance(exchange, dict):
            continue
        request, response = exchange.get("request") or {}, exchange.get("response") or {}
        url = urlsplit(str(request.get("url", "")))
        headers = {str(k).lower(): str(v) for k, v in (response.get("headers") or {}).items()}
        body = response.get("body")
        streamed = headers.get("content-type", "").startswith("text/event-stream")
        if not (url.path.endswith("/v1/messages") and streamed and isinstance(body, str)):
            continue
        events = parse_sse(body)
        if not _is_messages_stream(events):
            continue
        sent = request.get("body")
        yield SdkStream(
            f"{path.relative_to(root).as_posix()}#{position}",
            path,
            body,
            tuple(events),
            "beta=true" in url.query or _beta_only(events),
            sent if isinstance(sent, dict) else None,
        )


def sdk_recorded_streams(root: str | Path | None = None) -> list[SdkStream]:
    """Every recorded Messages stream under ``root`` (default: ``$DISPACH_SDK_STREAMS``; no
    streams when neither is set), sorted by name."""
    where = root if root is not None else os.environ.get(ENV)
    if not where:
        return []
    base = Path(where)
    found: list[SdkStream] = []
    for path in sorted(p for p in base.rglob("*") if p.is_file()):
        if path.suffix in _BODY_SUFFIXES:
            stream = _body_stream(base, path)
            found.extend([] if stream is None else [stream])
        elif path.suffix == ".json" and "__inline_snapshot__" in path.parts:
            found.extend(_snapshot_streams(base, path))
    return sorted(found, key=lambda s: s.name)


def _folded_delta(block: dict[str, Any], delta: dict[str, Any], json_text: str) -> str:
    """Fold one delta into its block; returns the tool input JSON received so far."""
    kind = delta.get("type")
    if kind == "text_delta":
        block["text"] = block.get("text", "") + delta["text"]
    elif kind == "thinking_delta":
        block["thinking"] = block.get("thinking", "") + delta["thinking"]
    elif kind == "signature_delta":
        block["signature"] = delta["signature"]
    elif kind == "citations_delta":
        block["citations"] = [*(block.get("citations") or []), delta["citation"]]
    elif kind == "input_json_delta":
        json_text += delta["partial_json"]
        if json_text:
            block["input"] = jiter.from_json(json_text.encode(), partial_mode=True)
    elif kind == "compaction_delta":
        block.update({k: v for k, v in delta.items() if k != "type"})
    return json_text


def fold(events: tuple[Event, ...] | list[Event]) -> dict[str, Any]:
    """The message a stream describes, as JSON: ``message_start``'s message, each block as its
    start gave it with its deltas folded in (tool input parsed from the JSON received, an
    unfinished end dropped as the SDK's partial parser does), ``message_delta``'s stop fields
    and usage laid over."""
    message: dict[str, Any] = {}
    blocks: dict[int, dict[str, Any]] = {}
    json_texts: dict[int, str] = {}
    for event in events:
        data = event.data if isinstance(event.data, dict) else {}
        kind = data.get("type")
        if kind == "message_start":
            message = dict(data["message"])
        elif kind == "content_block_start":
            blocks[data["index"]] = dict(data["content_block"])
        elif kind == "content_block_delta":
            index = data["index"]
            text = json_texts.get(index, "")
            json_texts[index] = _folded_delta(blocks[index], data["delta"], text)
        elif kind == "message_delta":
            message.update({k: v for k, v in data["delta"].items() if k != "container"})
            usage = {k: v for k, v in (data.get("usage") or {}).items() if v is not None}
            message["usage"] = {**(message.get("usage") or {}), **usage}
    message["content"] = [blocks[i] for i in sorted(blocks)]
    return message

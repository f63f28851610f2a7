"""A faithful fake of the Anthropic Messages API, served on a real local socket.

The official SDK talks to it unchanged (``AsyncAnthropic(api_key="test", base_url=fake.url)``).
It is a stdlib ``ThreadingHTTPServer`` speaking HTTP/1.1 with keep-alive; streams are sent with
chunked transfer-encoding, one chunk per SSE event, so a client sees each event when it is sent
(an ASGI transport would buffer the whole response and hide timing, stalls and drops).

Each ``POST /v1/messages`` consumes one scripted item (``Reply``, ``HttpError`` or
``StreamFault``) from a FIFO queue; with the queue empty, ``responder`` (if set) computes the
item from the request body, else ``default`` is answered. Requests are validated before an item
is consumed, the way the real API rejects a request before generating anything, so a request
answered with a 400 (or 401/404) leaves the script untouched.

Token counts are estimates: ``estimate_input_tokens(body)`` is the length of the canonical JSON
of the prompt (tools, system, messages) divided by four, the same figure for
``count_tokens`` and for ``usage``. Prompt caching is emulated on the same canonical text.

``context_window`` (None: unlimited) models the model's window: a ``/v1/messages`` request whose
estimate plus ``max_tokens`` does not fit is refused with the real API's 400 before any item is
consumed; ``largest_prompt`` is the biggest estimate seen, so a test can assert the margin left.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from tests.fakes._local_server import Handler, LocalServer

__all__ = [
    "FakeAnthropic",
    "HttpError",
    "Item",
    "Recorded",
    "Reply",
    "StreamFault",
    "ToolUse",
    "estimate_input_tokens",
    "without_cache_control",
]

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
MAX_CACHE_MARKERS = 4
CACHE_LOOKBACK_BLOCKS = 20
REMOVED_SAMPLING_PARAMETERS = ("temperature", "top_p", "top_k")

_DEFAULT_MESSAGES = {
    "invalid_request_error": "Invalid request",
    "authentication_error": "invalid x-api-key",
    "billing_error": "Your credit balance is too low to access the Anthropic API.",
    "permission_error": "Your API key does not have permission to use the specified resource.",
    "not_found_error": "Not found",
    "request_too_large": "Request exceeds the maximum allowed number of bytes.",
    "rate_limit_error": "Number of request tokens has exceeded your per-minute rate limit",
    "api_error": "Internal server error",
    "overloaded_error": "Overloaded",
    "timeout_error": "Request timed out",
    "conflict_error": "Conflict",
}
# The HTTP status the real API uses for each error type (a non-streaming StreamFault "error").
_STATUS_OF_TYPE = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "conflict_error": 409,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}
_REASONS = {529: "Site Overloaded"}


# --------------------------------------------------------------------------------------------
# Scripted items


@dataclass(frozen=True)
class ToolUse:
    """One ``tool_use`` block. ``raw_json`` (if given) is sent verbatim instead of ``input``:
    chunked into ``input_json_delta`` events when streaming, spliced into the body as the
    ``input`` value otherwise. Use it to send malformed or invalid JSON."""

    name: str
    input: dict[str, Any] | None = None
    raw_json: str | None = None
    id: str | None = None

    def __post_init__(self) -> None:
        if self.input is not None and self.raw_json is not None:
            raise ValueError("ToolUse takes input or raw_json, not both")

    def json_text(self) -> str:
        """The tool input exactly as it goes on the wire."""
        if self.raw_json is not None:
            return self.raw_json
        return json.dumps(self.input or {}, ensure_ascii=False)


@dataclass(frozen=True)
class Reply:
    """A successful assistant message: an optional thinking block, a text block (if ``text``),
    then one ``tool_use`` block per entry of ``tool_uses``.

    ``stop_reason`` defaults to ``"tool_use"`` if there are tool uses, else ``"end_turn"``.
    ``input_tokens`` (if given) is reported verbatim; by default it is the estimate minus the
    tokens read from or written to the emulated prompt cache. ``output_tokens`` defaults to a
    quarter of the characters generated. Text, thinking and tool JSON are streamed in deltas of
    ``chunk_size`` characters (cut mid-token); ``event_delay`` seconds pass between SSE events.
    """

    text: str = ""
    tool_uses: Sequence[ToolUse] = ()
    stop_reason: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    chunk_size: int = 8
    event_delay: float = 0.0
    thinking: str | None = None

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError("chunk_size must be at least 1")
        if self.event_delay < 0:
            raise ValueError("event_delay must not be negative")

    @property
    def effective_stop_reason(self) -> str:
        if self.stop_reason is not None:
            return self.stop_reason
        return "tool_use" if self.tool_uses else "end_turn"

    def estimated_output_tokens(self) -> int:
        if self.output_tokens is not None:
            return self.output_tokens
        generated = len(self.text) + len(self.thinking or "")
        generated += sum(len(tool.json_text()) for tool in self.tool_uses)
        return max(1, generated // 4)


@dataclass(frozen=True)
class HttpError:
    """An HTTP error answer (for streaming and non-streaming requests alike). An empty
    ``message`` is replaced by a standard one for ``type``."""

    status: int
    type: str
    message: str = ""
    retry_after_ms: float | None = None
    retry_after: float | None = None
    should_retry: bool | None = None
    error_code: str | None = None


FaultKind: TypeAlias = Literal["error", "drop", "truncate", "stall"]


@dataclass(frozen=True)
class StreamFault:
    """Stream ``reply`` but break off after ``after_events`` SSE events (``ping`` included):

    - ``"error"``: send ``event: error`` with ``error_type``, then end the body cleanly;
    - ``"drop"``: close the TCP connection without the final chunk;
    - ``"truncate"``: end the body cleanly (final zero-length chunk) with no more events;
    - ``"stall"``: send nothing for ``stall_seconds`` (``stop()`` cuts it short), then close the
      connection without the final chunk.

    If ``after_events`` is at least the number of events, the fault comes after the last one.
    A non-streaming request gets, for ``"error"``, the HTTP status of ``error_type`` (529 for
    ``overloaded_error``); for ``"drop"``/``"truncate"``, a connection closed with no response;
    for ``"stall"``, no response for ``stall_seconds`` and then a closed connection.
    """

    reply: Reply
    after_events: int
    kind: FaultKind
    error_type: str = "overloaded_error"
    stall_seconds: float = 30.0

    def __post_init__(self) -> None:
        if self.after_events < 0:
            raise ValueError("after_events must not be negative")
        if self.kind not in ("error", "drop", "truncate", "stall"):
            raise ValueError(f"unknown fault kind {self.kind!r}")


Item: TypeAlias = Reply | HttpError | StreamFault
Responder: TypeAlias = Callable[[dict[str, Any]], Item]


@dataclass(frozen=True)
class Recorded:
    """One request as the server received it. ``body`` is ``{}`` if it was not a JSON object."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: dict[str, Any]
    retry_count: int
    at: float


# --------------------------------------------------------------------------------------------
# Prompt analysis: validation, token estimates, cache prefixes


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


def _blocks_of(content: Any) -> list[Any]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return content
    return []


@dataclass(frozen=True)
class _Prompt:
    """The prompt as a list of canonical segments (tools, then system, then message blocks);
    its canonical JSON is ``"[" + ",".join(segments) + "]"``, so every cache prefix is a true
    prefix of the text the estimate is taken from."""

    segments: tuple[str, ...]
    markers: tuple[tuple[int, str], ...]  # (index of the marked segment, ttl)
    marker_count: int

    @classmethod
    def of(cls, body: dict[str, Any]) -> _Prompt:
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
        for block in _blocks_of(body.get("system")):
            add(["system"], block)
        messages = body.get("messages")
        for index, message in enumerate(messages if isinstance(messages, list) else []):
            if isinstance(message, dict):
                for block in _blocks_of(message.get("content")):
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
    return _Prompt.of(body).tokens()


def _tool_pairing_error(messages: list[Any]) -> str | None:
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") != "assistant":
            continue
        use_ids = [
            str(block.get("id"))
            for block in _blocks_of(message.get("content"))
            if isinstance(block, dict) and block.get("type") == "tool_use"
        ]
        following = messages[index + 1] if index + 1 < len(messages) else None
        blocks = []
        if isinstance(following, dict) and following.get("role") == "user":
            blocks = [b for b in _blocks_of(following.get("content")) if isinstance(b, dict)]
        result_ids = [str(b.get("tool_use_id")) for b in blocks if b.get("type") == "tool_result"]
        leading = 0
        while leading < len(blocks) and blocks[leading].get("type") == "tool_result":
            leading += 1
        if use_ids:
            missing = [use_id for use_id in use_ids if use_id not in result_ids]
            if missing:
                return (
                    f"messages.{index}: `tool_use` ids were found without `tool_result` blocks "
                    f"immediately after: {', '.join(missing)}. Each `tool_use` block must have a "
                    "corresponding `tool_result` block in the next message."
                )
            if leading < len(use_ids):
                return (
                    f"messages.{index + 1}: Did not find {len(use_ids)} `tool_result` block(s) "
                    "at the beginning of this message. Messages following `tool_use` blocks must "
                    "begin with a matching number of `tool_result` blocks."
                )
        for position, block in enumerate(blocks):
            wanted = str(block.get("tool_use_id"))
            if block.get("type") == "tool_result" and wanted not in use_ids:
                return (
                    f"messages.{index + 1}.content.{position}: unexpected `tool_use_id` found in "
                    f"`tool_result` blocks: {wanted}. Each `tool_result` block must have a "
                    "corresponding `tool_use` block in the previous message."
                )
    first = messages[0] if messages else None
    if isinstance(first, dict) and first.get("role") == "user":
        for position, block in enumerate(_blocks_of(first.get("content"))):
            if isinstance(block, dict) and block.get("type") == "tool_result":
                return (
                    f"messages.0.content.{position}: unexpected `tool_use_id` found in "
                    f"`tool_result` blocks: {block.get('tool_use_id')}. Each `tool_result` block "
                    "must have a corresponding `tool_use` block in the previous message."
                )
    return None


def _window_error(prompt: int, max_tokens: int, window: int) -> str | None:
    """The real API's 400 for a request that does not fit the model's context window: the
    prompt alone, or the prompt with room for ``max_tokens`` of output."""
    if prompt > window:
        return f"prompt is too long: {prompt} tokens > {window} maximum"
    if prompt + max_tokens > window:
        return (
            f"input length and `max_tokens` exceed context limit: {prompt} + {max_tokens} > "
            f"{window}, decrease input length or `max_tokens` and try again"
        )
    return None


def _field_error(body: dict[str, Any], *, needs_max_tokens: bool) -> str | None:
    for name in REMOVED_SAMPLING_PARAMETERS:
        if name in body:
            return f"{name}: Extra inputs are not permitted"
    if "model" not in body:
        return "model: Field required"
    if not isinstance(body["model"], str):
        return "model: Input should be a valid string"
    if needs_max_tokens:
        if "max_tokens" not in body:
            return "max_tokens: Field required"
        max_tokens = body["max_tokens"]
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            return "max_tokens: Input should be a valid integer"
        if max_tokens < 0:
            return "max_tokens: Input should be greater than or equal to 0"
    return None


def _messages_error(messages: Any) -> str | None:
    if not isinstance(messages, list):
        return "messages: Input should be a valid list"
    if not messages:
        return "messages: at least one message is required"
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages.{index}: Input should be a valid dictionary"
        if message.get("role") not in ("user", "assistant", "system"):
            return f"messages.{index}.role: Input should be 'user', 'assistant' or 'system'"
        if "content" not in message:
            return f"messages.{index}.content: Field required"
    return _tool_pairing_error(messages)


def _validation_error(body: dict[str, Any], *, needs_max_tokens: bool) -> str | None:
    """The message of the 400 the real API would give, or None if the body is acceptable."""
    problem = _field_error(body, needs_max_tokens=needs_max_tokens)
    if problem is None and "messages" not in body:
        problem = "messages: Field required"
    if problem is None:
        problem = _messages_error(body["messages"])
    if problem is not None:
        return problem
    found = _Prompt.of(body).marker_count
    if found > MAX_CACHE_MARKERS:
        return (
            f"A maximum of {MAX_CACHE_MARKERS} blocks with cache_control may be provided. "
            f"Found {found}."
        )
    return None


# --------------------------------------------------------------------------------------------
# What a request is answered with


@dataclass(frozen=True)
class _Usage:
    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    ephemeral_1h_input_tokens: int

    def as_dict(self, output_tokens: int) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "cache_creation_input_tokens": self.cache_creation_input_tokens,
            "cache_read_input_tokens": self.cache_read_input_tokens,
            "cache_creation": {
                "ephemeral_5m_input_tokens": (
                    self.cache_creation_input_tokens - self.ephemeral_1h_input_tokens
                ),
                "ephemeral_1h_input_tokens": self.ephemeral_1h_input_tokens,
            },
            "output_tokens": output_tokens,
            "service_tier": "standard",
        }


@dataclass(frozen=True)
class _JsonAnswer:
    status: int
    text: str
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class _StreamAnswer:
    events: tuple[tuple[str, str], ...]  # (event name, data JSON)
    delay: float
    fault: StreamFault | None


@dataclass(frozen=True)
class _SilentAnswer:
    """No response at all: wait ``seconds`` (cut short by stop), then close the connection."""

    seconds: float


_Answer: TypeAlias = _JsonAnswer | _StreamAnswer | _SilentAnswer


def _error_text(error_type: str, message: str, request_id: str, code: str | None = None) -> str:
    error: dict[str, Any] = {"type": error_type, "message": message}
    if code is not None:
        error["details"] = {"error_code": code}
    return json.dumps({"type": "error", "error": error, "request_id": request_id})


def _http_error_answer(item: HttpError, request_id: str) -> _JsonAnswer:
    headers: list[tuple[str, str]] = []
    if item.retry_after_ms is not None:
        headers.append(("retry-after-ms", repr(item.retry_after_ms)))
    if item.retry_after is not None:
        headers.append(("retry-after", repr(item.retry_after)))
    if item.should_retry is not None:
        headers.append(("x-should-retry", "true" if item.should_retry else "false"))
    message = item.message or _DEFAULT_MESSAGES.get(item.type, item.type)
    return _JsonAnswer(
        item.status, _error_text(item.type, message, request_id, item.error_code), tuple(headers)
    )


def _invalid(message: str, request_id: str, status: int = 400) -> _JsonAnswer:
    error_type = {401: "authentication_error", 404: "not_found_error"}.get(
        status, "invalid_request_error"
    )
    return _JsonAnswer(status, _error_text(error_type, message, request_id))


def _chunks(text: str, size: int) -> list[str]:
    return [text[start : start + size] for start in range(0, len(text), size)]


def _signature(thinking: str) -> str:
    return hashlib.sha256(thinking.encode()).hexdigest()


_RAW_PLACEHOLDER = "\x00fake-anthropic-raw-json-{}\x00"


def _message_json(
    reply: Reply, tools: list[ToolUse], message_id: str, model: str, usage: _Usage
) -> str:
    content: list[dict[str, Any]] = []
    if reply.thinking is not None:
        signature = _signature(reply.thinking)
        content.append({"type": "thinking", "thinking": reply.thinking, "signature": signature})
    if reply.text:
        content.append({"type": "text", "text": reply.text})
    for position, tool in enumerate(tools):
        tool_input: Any = tool.input or {}
        if tool.raw_json is not None:
            tool_input = _RAW_PLACEHOLDER.format(position)
        content.append({"type": "tool_use", "id": tool.id, "name": tool.name, "input": tool_input})
    text = json.dumps(
        {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": reply.effective_stop_reason,
            "stop_sequence": None,
            "stop_details": None,
            "container": None,
            "usage": usage.as_dict(reply.estimated_output_tokens()),
        }
    )
    for position, tool in enumerate(tools):
        if tool.raw_json is not None:
            text = text.replace(json.dumps(_RAW_PLACEHOLDER.format(position)), tool.raw_json)
    return text


def _stream_events(
    reply: Reply, tools: list[ToolUse], message_id: str, model: str, usage: _Usage
) -> tuple[tuple[str, str], ...]:
    events: list[tuple[str, dict[str, Any]]] = []
    start_usage = usage.as_dict(output_tokens=1)
    events.append(
        (
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": message_id,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "stop_details": None,
                    "usage": start_usage,
                },
            },
        )
    )
    blocks: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    size = reply.chunk_size
    if reply.thinking is not None:
        deltas = [{"type": "thinking_delta", "thinking": c} for c in _chunks(reply.thinking, size)]
        deltas.append({"type": "signature_delta", "signature": _signature(reply.thinking)})
        blocks.append(({"type": "thinking", "thinking": "", "signature": ""}, deltas))
    if reply.text:
        deltas = [{"type": "text_delta", "text": c} for c in _chunks(reply.text, size)]
        blocks.append(({"type": "text", "text": ""}, deltas))
    for tool in tools:
        pieces = ["", *_chunks(tool.json_text(), size)]
        deltas = [{"type": "input_json_delta", "partial_json": p} for p in pieces]
        blocks.append(({"type": "tool_use", "id": tool.id, "name": tool.name, "input": {}}, deltas))
    if not blocks:
        events.append(("ping", {"type": "ping"}))
    for index, (start, deltas) in enumerate(blocks):
        opening = {"type": "content_block_start", "index": index, "content_block": start}
        events.append(("content_block_start", opening))
        if index == 0:
            events.append(("ping", {"type": "ping"}))
        events.extend(
            ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d})
            for d in deltas
        )
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    final_usage = usage.as_dict(reply.estimated_output_tokens())
    del final_usage["cache_creation"], final_usage["service_tier"]
    events.append(
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {
                    "stop_reason": reply.effective_stop_reason,
                    "stop_sequence": None,
                    "stop_details": None,
                },
                "usage": final_usage,
            },
        )
    )
    events.append(("message_stop", {"type": "message_stop"}))
    return tuple((name, json.dumps(data, ensure_ascii=False)) for name, data in events)


# --------------------------------------------------------------------------------------------
# The server


class FakeAnthropic(LocalServer):
    """The fake API server. Thread-safe; use as a context manager or ``start()``/``stop()``
    (which cuts every open connection: stalls and delays wake at once)."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(_Handler, "fake-anthropic", host=host, port=port)
        self.default: Item = Reply(text="ok")
        self.responder: Responder | None = None
        self.cache_min_tokens = 1024
        self.context_window: int | None = None
        """The model's window in tokens (None: unlimited): a request whose prompt estimate plus
        ``max_tokens`` exceeds it is refused with a 400, as the real API does."""
        self._script: deque[Item] = deque()
        self._requests: list[Recorded] = []
        self._cache: set[str] = set()
        self._largest_prompt = 0

    # scripting ------------------------------------------------------------------------------

    def script(self, *items: Item) -> None:
        """Queue items; each ``POST /v1/messages`` that passes validation takes the next one."""
        for item in items:
            if not isinstance(item, Reply | HttpError | StreamFault):
                raise TypeError(f"not a scripted item: {item!r}")
        with self._lock:
            self._script.extend(items)

    @property
    def pending(self) -> int:
        """How many scripted items have not been consumed yet."""
        with self._lock:
            return len(self._script)

    def reset(self) -> None:
        """Forget the script, the request log, the prompt cache and the largest prompt."""
        with self._lock:
            self._script.clear()
            self._requests.clear()
            self._cache.clear()
            self._largest_prompt = 0

    # the request log ------------------------------------------------------------------------

    @property
    def requests(self) -> list[Recorded]:
        """Every request received so far, in arrival order (a copy)."""
        with self._lock:
            return list(self._requests)

    @property
    def largest_prompt(self) -> int:
        """The largest prompt estimate (``estimate_input_tokens``) of any well-formed
        ``POST /v1/messages`` so far, refused ones included (0 before the first)."""
        with self._lock:
            return self._largest_prompt

    def take_requests(self) -> list[Recorded]:
        """Every request received so far, leaving the log empty (the script, the prompt cache
        and ``largest_prompt`` stay): a long test keeps what it needs of each request, not the
        whole parsed log."""
        with self._lock:
            taken, self._requests = self._requests, []
            return taken

    def message_requests(self) -> list[Recorded]:
        """The ``POST /v1/messages`` requests only."""
        return [r for r in self.requests if r.path == MESSAGES_PATH]

    def wait_for_requests(
        self, n: int, timeout: float = 5.0, *, path: str | None = None
    ) -> list[Recorded]:
        """Block until at least ``n`` requests (to ``path``, if given) have arrived."""

        def matching() -> list[Recorded]:
            return [r for r in self._requests if path is None or r.path == path]

        with self._changed:
            if not self._changed.wait_for(lambda: len(matching()) >= n, timeout):
                raise TimeoutError(f"{len(matching())} of {n} requests arrived in {timeout} s")
            return matching()

    async def await_requests(
        self, n: int, timeout: float = 5.0, *, path: str | None = None
    ) -> list[Recorded]:
        """``wait_for_requests`` for async tests: polls without blocking the event loop."""
        import asyncio

        deadline = time.monotonic() + timeout
        while True:
            found = [r for r in self.requests if path is None or r.path == path]
            if len(found) >= n:
                return found
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{len(found)} of {n} requests arrived in {timeout} s")
            await asyncio.sleep(0.01)

    # answering (called on connection threads) -----------------------------------------------

    def _record(self, recorded: Recorded) -> None:
        with self._changed:
            self._requests.append(recorded)
            self._changed.notify_all()

    def _next_item(self, body: dict[str, Any]) -> Item:
        with self._lock:
            if self._script:
                return self._script.popleft()
            responder = self.responder
        if responder is not None:
            return responder(body)
        return self.default

    def _usage(self, body: dict[str, Any], reply: Reply) -> _Usage:
        """Cache emulation. Each marker's prefix (tools, system, messages up to the marked
        block) is written if it is at least ``cache_min_tokens`` long. A read is the longest
        prefix already written that ends at a marked block or at one of the
        ``CACHE_LOOKBACK_BLOCKS - 1`` blocks before it (so a marker that moves to the newest
        block still reads the previous turn's prefix). Written = longest new prefix - read."""
        prompt = _Prompt.of(body)
        model = str(body.get("model"))

        def key(index: int) -> str:
            return hashlib.sha256(f"{model}\x00{prompt.text(index)}".encode()).hexdigest()

        writes = [
            (prompt.tokens(index), key(index), ttl)
            for index, ttl in prompt.markers
            if prompt.tokens(index) >= self.cache_min_tokens
        ]
        candidates = {
            position
            for index, _ in prompt.markers
            for position in range(max(0, index - CACHE_LOOKBACK_BLOCKS + 1), index + 1)
        }
        looked_up = [(prompt.tokens(position), key(position)) for position in candidates]
        with self._lock:
            read = max((tokens for tokens, k in looked_up if k in self._cache), default=0)
            self._cache.update(k for _, k, _ in writes)
        written = written_1h = 0
        if writes:
            longest, _, ttl = max(writes)
            written = max(0, longest - read)
            written_1h = written if ttl == "1h" else 0
        uncached = max(0, prompt.tokens() - read - written)
        if reply.input_tokens is not None:
            uncached = reply.input_tokens
        return _Usage(uncached, written, read, written_1h)

    def _answer(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        body: dict[str, Any] | None,
        request_id: str,
    ) -> _Answer:
        if method != "POST" or path not in (MESSAGES_PATH, COUNT_TOKENS_PATH):
            return _invalid(f"{method} {path} not found", request_id, 404)
        authorization = headers.get("authorization", "")
        bearer = authorization[7:].strip() if authorization.lower().startswith("bearer ") else ""
        if not bearer and not headers.get("x-api-key", "").strip():
            return _invalid("invalid x-api-key", request_id, 401)
        if body is None:
            return _invalid("There was an error parsing the body: expected an object", request_id)
        problem = _validation_error(body, needs_max_tokens=path == MESSAGES_PATH)
        if problem is not None:
            return _invalid(problem, request_id)
        prompt = estimate_input_tokens(body)
        if path == COUNT_TOKENS_PATH:
            return _JsonAnswer(200, json.dumps({"input_tokens": prompt}))
        with self._lock:
            self._largest_prompt = max(self._largest_prompt, prompt)
            window = self.context_window
        if window is not None:
            problem = _window_error(prompt, int(body["max_tokens"]), window)
            if problem is not None:
                return _invalid(problem, request_id)

        item = self._next_item(body)
        if isinstance(item, HttpError):
            return _http_error_answer(item, request_id)
        reply = item.reply if isinstance(item, StreamFault) else item
        streaming = body.get("stream") is True
        if isinstance(item, StreamFault) and not streaming:
            if item.kind == "error":
                status = _STATUS_OF_TYPE.get(item.error_type, 500)
                message = _DEFAULT_MESSAGES.get(item.error_type, item.error_type)
                return _JsonAnswer(status, _error_text(item.error_type, message, request_id))
            return _SilentAnswer(item.stall_seconds if item.kind == "stall" else 0.0)
        tools = [
            ToolUse(t.name, t.input, t.raw_json, t.id or f"toolu_01{secrets.token_hex(12)}")
            for t in reply.tool_uses
        ]
        message_id = f"msg_01{secrets.token_hex(12)}"
        model = str(body["model"])
        usage = self._usage(body, reply)
        if not streaming:
            return _JsonAnswer(200, _message_json(reply, tools, message_id, model, usage))
        fault = item if isinstance(item, StreamFault) else None
        events = _stream_events(reply, tools, message_id, model, usage)
        return _StreamAnswer(events, reply.event_delay, fault)


class _Handler(Handler[FakeAnthropic]):
    server_version = "fake-anthropic"
    sys_version = ""

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def do_PUT(self) -> None:
        self._serve()

    def do_PATCH(self) -> None:
        self._serve()

    def do_DELETE(self) -> None:
        self._serve()

    def _serve(self) -> None:
        fake = self.owner
        request_id = f"req_01{secrets.token_hex(12)}"
        raw = self._read_body()
        path, _, query = self.path.partition("?")
        headers = self._lowered_headers()
        body: dict[str, Any] | None = None
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            body = parsed
        try:
            retry_count = int(headers.get("x-stainless-retry-count", "0"))
        except ValueError:
            retry_count = 0
        fake._record(
            Recorded(self.command, path, query, headers, body or {}, retry_count, time.monotonic())
        )
        try:
            answer = fake._answer(self.command, path, headers, body, request_id)
        except Exception as error:  # a bug in the fake or in a responder: say so, as a 500
            fake._record_error(error)
            message = f"fake server error: {error!r}"
            answer = _JsonAnswer(500, _error_text("api_error", message, request_id))
        try:
            if isinstance(answer, _JsonAnswer):
                self._send_json(answer, request_id)
            elif isinstance(answer, _StreamAnswer):
                self._send_stream(answer, request_id)
            else:
                fake._stopping.wait(answer.seconds)
                self._drop()
        except (ConnectionError, TimeoutError):
            self.close_connection = True

    def _start(self, status: int, request_id: str, headers: Sequence[tuple[str, str]]) -> None:
        self.send_response(status, _REASONS.get(status))
        self.send_header("request-id", request_id)
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()

    def _send_json(self, answer: _JsonAnswer, request_id: str) -> None:
        data = answer.text.encode()
        headers = [
            ("content-type", "application/json"),
            ("content-length", str(len(data))),
            *answer.headers,
        ]
        self._start(answer.status, request_id, headers)
        self.wfile.write(data)
        self.wfile.flush()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _send_stream(self, answer: _StreamAnswer, request_id: str) -> None:
        stopping = self.owner._stopping
        self._start(
            200,
            request_id,
            [
                ("content-type", "text/event-stream; charset=utf-8"),
                ("cache-control", "no-cache"),
                ("transfer-encoding", "chunked"),
            ],
        )
        fault = answer.fault
        events = answer.events
        point = len(events) if fault is None else min(fault.after_events, len(events))
        for sent, (name, data) in enumerate(events[:point]):
            if sent and answer.delay and stopping.wait(answer.delay):
                self._drop()
                return
            self._chunk(f"event: {name}\ndata: {data}\n\n".encode())
        if fault is None:
            self._chunk(b"")
        else:
            self._fault(fault, request_id)

    def _fault(self, fault: StreamFault, request_id: str) -> None:
        if fault.kind == "error":
            message = _DEFAULT_MESSAGES.get(fault.error_type, fault.error_type)
            data = _error_text(fault.error_type, message, request_id)
            self._chunk(f"event: error\ndata: {data}\n\n".encode())
            self._chunk(b"")
        elif fault.kind == "truncate":
            self._chunk(b"")
        elif fault.kind == "drop":
            self._drop()
        else:
            self.owner._stopping.wait(fault.stall_seconds)
            self._drop()

"""A faithful fake of the Anthropic Messages API, served on a real local socket.

The official SDK talks to it unchanged (``AsyncAnthropic(api_key="test", base_url=fake.url)``).
It is a stdlib ``ThreadingHTTPServer`` speaking HTTP/1.1 with keep-alive; streams are sent with
chunked transfer-encoding, one chunk per SSE event, so a client sees each event when it is sent
(an ASGI transport would buffer the whole response and hide timing, stalls and drops).

Each ``POST /v1/messages`` consumes one scripted item (``Reply``, ``HttpError``, ``StreamFault``
or ``RawStream``) from a FIFO queue; with the queue empty, ``responder`` (if set) computes the
item from the request body, else ``default`` is answered. Requests are validated before an item
is consumed, the way the real API rejects a request before generating anything, so a request
answered with a 400 (or 401/404) leaves the script untouched.

A ``Reply`` is an ordered list of content blocks of every type the API streams (``Text``,
``Thinking``, ``Redacted``, ``ToolUse``, ``ServerToolUse`` and its result, ``Compaction``,
``Unknown``; see ``_anthropic_blocks``), or the older shorthand of an optional thinking, a text
and tool uses. What the fake issues opaque (thinking signatures, redacted data, compaction
fields) it checks when it comes back (``_anthropic_checks``): a client that edits, invents or
drops them is refused as the real API refuses it.

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
import re
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeAlias

from tests.fakes._anthropic_blocks import (
    Block,
    CodeRun,
    Compaction,
    Cut,
    Fetched,
    Issuer,
    Redacted,
    SearchResult,
    ServerResult,
    ServerToolUse,
    Text,
    Thinking,
    ToolError,
    ToolUse,
    Unknown,
    WireBlock,
    billed_server_tools,
    cite_chars,
    cite_search,
    dumps_message,
    wire_blocks,
)
from tests.fakes._anthropic_checks import (
    MAX_CACHE_MARKERS,
    REMOVED_SAMPLING_PARAMETERS,
    validation_error,
    window_error,
)
from tests.fakes._anthropic_prompt import Prompt, estimate_input_tokens, without_cache_control
from tests.fakes._local_server import Handler, LocalServer, Recorded

__all__ = [
    "MAX_CACHE_MARKERS",
    "REMOVED_SAMPLING_PARAMETERS",
    "Block",
    "CodeRun",
    "Compaction",
    "Cut",
    "FakeAnthropic",
    "Fetched",
    "HttpError",
    "Issuer",
    "Item",
    "RawStream",
    "Recorded",
    "Redacted",
    "Reply",
    "SearchResult",
    "ServerResult",
    "ServerToolUse",
    "StreamFault",
    "Text",
    "Thinking",
    "ToolError",
    "ToolUse",
    "Unknown",
    "cite_chars",
    "cite_search",
    "estimate_input_tokens",
    "without_cache_control",
]

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
CACHE_LOOKBACK_BLOCKS = 20

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
_REFUSED = {"type": "refusal", "category": None, "explanation": None}


# --------------------------------------------------------------------------------------------
# Scripted items


@dataclass(frozen=True)
class Reply:
    """A successful assistant message: the blocks of ``content`` in order or, with no
    ``content``, the shorthand of an optional thinking block, a text block (if ``text``), then
    one ``tool_use`` block per entry of ``tool_uses``.

    ``stop_reason`` defaults to ``"max_tokens"`` if ``cut``, else ``"stop_sequence"`` if
    ``stop_sequence``, else ``"tool_use"`` if there are tool uses, else ``"end_turn"``; any
    string goes (``"refusal"``, ``"pause_turn"``, ``"model_context_window_exceeded"``). A
    refusal's ``stop_details`` defaults to ``{"type": "refusal", "category": None, ...}``.
    ``cut`` cuts the answer off part-way through one block (``Cut(block, chars)``).

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
    content: Sequence[Block] = ()
    cut: Cut | None = None
    stop_sequence: str | None = None
    stop_details: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError("chunk_size must be at least 1")
        if self.event_delay < 0:
            raise ValueError("event_delay must not be negative")
        if self.content and (self.text or self.tool_uses or self.thinking is not None):
            raise ValueError("Reply takes content, or the text/thinking/tool_uses shorthand")

    def blocks(self) -> list[Block]:
        """The scripted blocks, in order."""
        if self.content:
            return list(self.content)
        blocks: list[Block] = [] if self.thinking is None else [Thinking(self.thinking)]
        return [*blocks, *([Text(self.text)] if self.text else []), *self.tool_uses]

    @property
    def effective_stop_reason(self) -> str:
        if self.stop_reason is not None:
            return self.stop_reason
        if self.cut is not None:
            return "max_tokens"
        if self.stop_sequence is not None:
            return "stop_sequence"
        return "tool_use" if any(isinstance(b, ToolUse) for b in self.blocks()) else "end_turn"

    def delta(self) -> dict[str, Any]:
        """The ``message_delta``'s ``delta`` (and the non-streaming answer's stop fields)."""
        reason = self.effective_stop_reason
        details = self.stop_details
        if details is None and reason == "refusal":
            details = _REFUSED
        return {"stop_reason": reason, "stop_sequence": self.stop_sequence, "stop_details": details}


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


_FRAME = re.compile(r".*?(?:\r?\n\r?\n|\Z)", re.DOTALL)


@dataclass(frozen=True)
class RawStream:
    """An SSE body sent verbatim as a ``200 text/event-stream`` (to streaming and non-streaming
    requests alike), one chunk per event: a recorded stream replayed byte for byte, or one no
    generator would make. ``event_delay`` seconds pass between chunks."""

    text: str
    event_delay: float = 0.0

    @classmethod
    def read(cls, path: str | Path, event_delay: float = 0.0) -> RawStream:
        """The stream recorded in the file at ``path``, its line endings kept."""
        with open(path, encoding="utf-8", newline="") as file:
            return cls(file.read(), event_delay)

    def frames(self) -> tuple[bytes, ...]:
        """The body cut after each blank line: one event (and what it trails) per chunk."""
        return tuple(m.group().encode() for m in _FRAME.finditer(self.text) if m.group())


Item: TypeAlias = Reply | HttpError | StreamFault | RawStream
Responder: TypeAlias = Callable[[dict[str, Any]], Item]


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
    frames: tuple[bytes, ...]  # one SSE event (with what trails it) each, sent as a chunk
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


def _invalid(
    message: str, request_id: str, status: int = 400, code: str | None = None
) -> _JsonAnswer:
    error_type = {401: "authentication_error", 404: "not_found_error"}.get(
        status, "invalid_request_error"
    )
    return _JsonAnswer(status, _error_text(error_type, message, request_id, code))


def _message_json(
    reply: Reply, wired: list[WireBlock], message_id: str, model: str, usage: _Usage
) -> str:
    message = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [block.render() for block in wired],
        **reply.delta(),
        "container": None,
        "usage": _final_usage(reply, wired, usage, streamed=False),
    }
    return dumps_message(message, wired)


def _output_tokens(reply: Reply, wired: list[WireBlock]) -> int:
    if reply.output_tokens is not None:
        return reply.output_tokens
    return max(1, sum(block.generated for block in wired) // 4)


def _final_usage(
    reply: Reply, wired: list[WireBlock], usage: _Usage, *, streamed: bool
) -> dict[str, Any]:
    """The answer's usage; in a stream, the ``message_delta``'s cumulative counts (no cache
    split, no tier), with ``server_tool_use`` when server tools ran."""
    final = usage.as_dict(_output_tokens(reply, wired))
    if streamed:
        del final["cache_creation"], final["service_tier"]
    server = billed_server_tools(wired)
    if server is not None:
        final["server_tool_use"] = server
    return final


def _frame(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def _stream_frames(
    reply: Reply, wired: list[WireBlock], message_id: str, model: str, usage: _Usage
) -> tuple[bytes, ...]:
    message: dict[str, Any] = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "stop_details": None,
        "usage": usage.as_dict(output_tokens=1),
    }
    frames = [_frame("message_start", {"type": "message_start", "message": message})]
    if not wired:
        frames.append(_frame("ping", {"type": "ping"}))
    for index, block in enumerate(wired):
        start = {"type": "content_block_start", "index": index, "content_block": block.start()}
        frames.append(_frame("content_block_start", start))
        if index == 0:
            frames.append(_frame("ping", {"type": "ping"}))
        frames.extend(
            _frame(
                "content_block_delta", {"type": "content_block_delta", "index": index, "delta": d}
            )
            for d in block.deltas(reply.chunk_size)
        )
        closed = reply.cut is None or reply.cut.stop or index < len(wired) - 1
        if closed:
            frames.append(
                _frame("content_block_stop", {"type": "content_block_stop", "index": index})
            )
    final = {
        "type": "message_delta",
        "delta": reply.delta(),
        "usage": _final_usage(reply, wired, usage, streamed=True),
    }
    frames.append(_frame("message_delta", final))
    frames.append(_frame("message_stop", {"type": "message_stop"}))
    return tuple(frames)


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
        self._issuer = Issuer()
        self._script: deque[Item] = deque()
        self._requests: list[Recorded] = []
        self._cache: set[str] = set()
        self._largest_prompt = 0

    # scripting ------------------------------------------------------------------------------

    def script(self, *items: Item) -> None:
        """Queue items; each ``POST /v1/messages`` that passes validation takes the next one."""
        for item in items:
            if not isinstance(item, Reply | HttpError | StreamFault | RawStream):
                raise TypeError(f"not a scripted item: {item!r}")
        with self._lock:
            self._script.extend(items)

    @property
    def pending(self) -> int:
        """How many scripted items have not been consumed yet."""
        with self._lock:
            return len(self._script)

    def reset(self) -> None:
        """Forget the script, the request log, the prompt cache and the largest prompt (the
        issuer's secret stays: what the fake signed before is still taken back)."""
        with self._lock:
            self._script.clear()
            self._requests.clear()
            self._cache.clear()
            self._largest_prompt = 0

    @property
    def issuer(self) -> Issuer:
        """What signs this fake's thinking, redacted data and compaction blocks (a secret of its
        own): ``issuer.thinking_signature(text)`` and the like make a valid history by hand."""
        return self._issuer

    def problem_with(self, body: dict[str, Any], path: str = MESSAGES_PATH) -> str | None:
        """The 400 message this fake would answer ``body`` with (None: it would take it), without
        answering: to assert on a recorded request that a next one built like it is valid."""
        refusal = validation_error(body, self._issuer, needs_max_tokens=path == MESSAGES_PATH)
        return None if refusal is None else refusal.message

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
        prompt = Prompt.of(body)
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
        refusal = validation_error(body, self._issuer, needs_max_tokens=path == MESSAGES_PATH)
        if refusal is not None:
            return _invalid(refusal.message, request_id, code=refusal.code)
        prompt = estimate_input_tokens(body)
        if path == COUNT_TOKENS_PATH:
            return _JsonAnswer(200, json.dumps({"input_tokens": prompt}))
        with self._lock:
            self._largest_prompt = max(self._largest_prompt, prompt)
            window = self.context_window
        if window is not None:
            problem = window_error(prompt, int(body["max_tokens"]), window)
            if problem is not None:
                return _invalid(problem, request_id)

        item = self._next_item(body)
        if isinstance(item, HttpError):
            return _http_error_answer(item, request_id)
        if isinstance(item, RawStream):
            return _StreamAnswer(item.frames(), item.event_delay, None)
        reply = item.reply if isinstance(item, StreamFault) else item
        streaming = body.get("stream") is True
        if isinstance(item, StreamFault) and not streaming:
            if item.kind == "error":
                status = _STATUS_OF_TYPE.get(item.error_type, 500)
                message = _DEFAULT_MESSAGES.get(item.error_type, item.error_type)
                return _JsonAnswer(status, _error_text(item.error_type, message, request_id))
            return _SilentAnswer(item.stall_seconds if item.kind == "stall" else 0.0)
        wired = wire_blocks(reply.blocks(), self._issuer, reply.cut)
        message_id = f"msg_01{secrets.token_hex(12)}"
        model = str(body["model"])
        usage = self._usage(body, reply)
        if not streaming:
            return _JsonAnswer(200, _message_json(reply, wired, message_id, model, usage))
        fault = item if isinstance(item, StreamFault) else None
        frames = _stream_frames(reply, wired, message_id, model, usage)
        return _StreamAnswer(frames, reply.event_delay, fault)


class _Handler(Handler[FakeAnthropic]):
    server_version = "fake-anthropic"
    sys_version = ""

    def _serve(self) -> None:
        fake = self.owner
        request_id = f"req_01{secrets.token_hex(12)}"
        raw = self._read_body()
        path, _, query = self.path.partition("?")
        headers = self._lowered_headers()
        body = self._json_object(raw)
        retry_count = self._retry_count(headers)
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
        self._send_json_text(answer.status, answer.text, request_id, answer.headers)

    def _send_stream(self, answer: _StreamAnswer, request_id: str) -> None:
        stopping = self.owner._stopping
        self._start_event_stream(request_id)
        fault = answer.fault
        frames = answer.frames
        point = len(frames) if fault is None else min(fault.after_events, len(frames))
        for sent, frame in enumerate(frames[:point]):
            if sent and answer.delay and stopping.wait(answer.delay):
                self._drop()
                return
            self._chunk(frame)
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

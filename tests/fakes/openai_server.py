"""A faithful fake of OpenAI's Chat Completions API, served on a real local socket.

The official SDK talks to it unchanged (``AsyncOpenAI(api_key="test", base_url=fake.url +
"/v1")``), and so does every client of an OpenAI-compatible server (vLLM, llama.cpp, Ollama,
OpenRouter speak the same wire). It serves ``POST /v1/chat/completions`` and ``GET /v1/models``
over HTTP/1.1 with keep-alive; a stream goes out with chunked transfer-encoding, one chunk per
server-sent event, so a client sees each event when it is sent.

Each completion request that passes validation consumes one scripted item (``Reply``,
``HttpError`` or ``StreamFault``) from a FIFO queue; with the queue empty, ``responder`` (if
set) computes the item from the request body, else ``default`` is answered. Requests are
validated first, the way the real API refuses a request before generating anything, so a request
answered with a 400 (or 401/404) leaves the script untouched. Error bodies have the API's shape,
``{"error": {"message", "type", "param", "code"}}``.

A stream is what the real API sends: ``data: <chat.completion.chunk>`` events, the first with
``delta.role``; reasoning (as the compatible servers stream it, ``reasoning_content``, or
``reasoning`` as OpenRouter does), text or refusal in pieces of ``chunk_size`` characters; each
tool call opened by a delta with its index, id, type and name and empty ``arguments``, then the
arguments in pieces; a chunk with ``finish_reason``; a usage chunk with ``choices: []`` when the
request asked for ``stream_options.include_usage`` (every chunk then carries ``usage: null``);
and ``data: [DONE]``.

Token counts are estimates: ``estimate_prompt_tokens(body)`` is the length of the canonical JSON
of the tools and messages divided by four. ``context_window`` (None: unlimited) refuses a request
whose estimate plus its output limit does not fit with the API's ``context_length_exceeded``.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import pytest

from tests.fakes._local_server import Handler, LocalServer, Recorded, isolate_from_environment

__all__ = [
    "COMPLETIONS_PATH",
    "FakeOpenAI",
    "HttpError",
    "Item",
    "Recorded",
    "Reply",
    "StreamFault",
    "ToolCall",
    "estimate_prompt_tokens",
    "fake_openai",
]

COMPLETIONS_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
_PART_TYPES = {
    "system": ("text",),
    "developer": ("text",),
    "user": ("text", "image_url", "input_audio", "file"),
    "assistant": ("text", "refusal"),
    "tool": ("text",),
}
_NAME = re.compile(r"^[a-zA-Z0-9_-]+$")
_MAX_NAME = 64

_DEFAULT_MESSAGES = {
    "invalid_request_error": "Invalid request.",
    "authentication_error": "Incorrect API key provided.",
    "permission_error": "You are not allowed to sample from this model.",
    "not_found_error": "Not found.",
    "requests": "Rate limit reached for requests per min (RPM). Please try again in 1s.",
    "tokens": "Rate limit reached for tokens per min (TPM). Please try again in 1s.",
    "insufficient_quota": "You exceeded your current quota, please check your plan and "
    "billing details.",
    "server_error": "The server had an error while processing your request. Sorry about that!",
    "overloaded_error": "The engine is currently overloaded, please try again later.",
}
_NO_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header "
    "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)


# --------------------------------------------------------------------------------------------
# Scripted items


@dataclass(frozen=True)
class ToolCall:
    """One function call. ``raw_arguments`` (if given) is sent verbatim instead of the JSON of
    ``arguments``: use it for malformed or non-object arguments."""

    name: str
    arguments: dict[str, Any] | None = None
    raw_arguments: str | None = None
    id: str | None = None

    def __post_init__(self) -> None:
        if self.arguments is not None and self.raw_arguments is not None:
            raise ValueError("ToolCall takes arguments or raw_arguments, not both")

    def arguments_text(self) -> str:
        """The arguments exactly as they go on the wire (always a string, as in the API)."""
        if self.raw_arguments is not None:
            return self.raw_arguments
        return json.dumps(self.arguments or {}, ensure_ascii=False)


@dataclass(frozen=True)
class Reply:
    """A successful completion: reasoning (streamed under ``reasoning_field``), then text or a
    refusal, then the tool calls.

    ``finish_reason`` defaults to ``tool_calls`` with tool calls, else ``stop``.
    ``prompt_tokens`` defaults to the estimate, ``cached_tokens`` (part of it) to 0;
    ``completion_tokens`` to a quarter of the characters generated (reasoning included, as the
    API counts it; ``reasoning_tokens`` likewise). Text, reasoning, refusal and arguments go out
    in pieces of ``chunk_size`` characters; ``event_delay`` seconds pass between events."""

    text: str = ""
    reasoning: str | None = None
    reasoning_field: Literal["reasoning_content", "reasoning"] = "reasoning_content"
    tool_calls: Sequence[ToolCall] = ()
    refusal: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    chunk_size: int = 8
    event_delay: float = 0.0

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError("chunk_size must be at least 1")
        if self.event_delay < 0:
            raise ValueError("event_delay must not be negative")

    @property
    def effective_finish_reason(self) -> str:
        if self.finish_reason is not None:
            return self.finish_reason
        return "tool_calls" if self.tool_calls else "stop"

    def estimated_reasoning_tokens(self) -> int:
        if self.reasoning_tokens is not None:
            return self.reasoning_tokens
        return len(self.reasoning or "") // 4

    def estimated_completion_tokens(self) -> int:
        if self.completion_tokens is not None:
            return self.completion_tokens
        generated = len(self.text) + len(self.reasoning or "") + len(self.refusal or "")
        generated += sum(len(call.arguments_text()) for call in self.tool_calls)
        return max(1, generated // 4)


@dataclass(frozen=True)
class HttpError:
    """An HTTP error answer. ``type`` and ``code`` are the API's (a 429 is ``type: tokens``
    or ``requests`` with ``code: rate_limit_exceeded``, or ``insufficient_quota``); an empty
    ``message`` is replaced by a standard one for ``type``."""

    status: int
    type: str
    message: str = ""
    code: str | None = None
    param: str | None = None
    retry_after: float | None = None
    retry_after_ms: float | None = None
    should_retry: bool | None = None


FaultKind: TypeAlias = Literal["error", "drop", "truncate", "stall", "linger"]


@dataclass(frozen=True)
class StreamFault:
    """Stream ``reply`` but break off after ``after_chunks`` completion chunks (the role chunk
    and the usage chunk count; ``[DONE]`` does not):

    - ``"error"``: send ``data: {"error": {...}}`` with ``error_type`` (as the API does when a
      generation fails mid-stream), then end the body cleanly;
    - ``"drop"``: close the TCP connection without the final chunk;
    - ``"truncate"``: end the body cleanly with no more events (no ``[DONE]``);
    - ``"stall"``: send nothing for ``stall_seconds`` (``stop()`` cuts it short), then close the
      connection;
    - ``"linger"``: send ``[DONE]``, then hold the body open for ``stall_seconds`` before ending
      it (a proxy that is slow to close the stream).

    If ``after_chunks`` is at least the number of chunks, the fault comes after the last one.
    A non-streaming request gets, for ``"error"``, a 500 with ``error_type``; for ``"linger"``
    the completion; otherwise a connection closed with no response (after ``stall_seconds`` for
    ``"stall"``)."""

    reply: Reply
    after_chunks: int
    kind: FaultKind
    error_type: str = "server_error"
    error_message: str = ""
    stall_seconds: float = 30.0

    def __post_init__(self) -> None:
        if self.after_chunks < 0:
            raise ValueError("after_chunks must not be negative")
        if self.kind not in ("error", "drop", "truncate", "stall", "linger"):
            raise ValueError(f"unknown fault kind {self.kind!r}")


Item: TypeAlias = Reply | HttpError | StreamFault
Responder: TypeAlias = Callable[[dict[str, Any]], Item]


# --------------------------------------------------------------------------------------------
# Validation, as the real API refuses a request


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """The fake's estimate of a request's prompt: ``len(canonical JSON) // 4`` (at least 1) of
    its tools and messages."""
    prompt = {"tools": body.get("tools") or [], "messages": body.get("messages") or []}
    text = json.dumps(prompt, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return max(1, len(text) // 4)


@dataclass(frozen=True)
class _Problem:
    message: str
    param: str | None = None
    code: str | None = None


def _missing(param: str) -> _Problem:
    return _Problem(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")


def _wrong_type(param: str, expected: str) -> _Problem:
    return _Problem(f"Invalid type for '{param}': expected {expected}.", param, "invalid_type")


def _bad_value(value: object, supported: Sequence[str], param: str) -> _Problem:
    listed = ", ".join(f"'{s}'" for s in supported)
    message = f"Invalid value: '{value}'. Supported values are: {listed}."
    return _Problem(message, param, "invalid_value")


def _unanswered(ids: list[str], index: int) -> _Problem:
    return _Problem(
        "An assistant message with 'tool_calls' must be followed by tool messages responding to "
        f"each 'tool_call_id'. The following tool_call_ids did not have response messages: "
        f"{', '.join(ids)}",
        f"messages.[{index}].role",
    )


def _content_problem(message: dict[str, Any], where: str) -> _Problem | None:
    role, content = message["role"], message.get("content")
    if content is None:
        if role != "assistant":
            return _missing(f"{where}.content")
        if message.get("tool_calls") or message.get("function_call"):
            return None
        return _Problem(f"Invalid value for '{where}.content': expected a string, got null.",
                        f"{where}.content")  # fmt: skip
    if isinstance(content, str):
        return None
    if not isinstance(content, list):
        return _wrong_type(f"{where}.content", "one of a string or an array of objects")
    allowed = _PART_TYPES.get(role, ("text",))
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            return _bad_value(kind, allowed, f"{where}.content[{index}].type")
        if kind == "text" and not isinstance(part.get("text"), str):
            return _missing(f"{where}.content[{index}].text")
    return None


def _function_problem(function: Any, at: str, *, definition: bool) -> _Problem | None:
    """A call's ``function`` (name and string arguments) or a tool's (name and parameters)."""
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return _missing(f"{at}.name")
    name = function["name"]
    if len(name) > _MAX_NAME:
        return _Problem(f"Invalid '{at}.name': string too long. Expected a string with maximum "
                        f"length {_MAX_NAME}, but got a string with length {len(name)} instead.",
                        f"{at}.name", "string_above_max_length")  # fmt: skip
    if not _NAME.match(name):
        return _Problem(f"Invalid '{at}.name': string does not match pattern. Expected a string "
                        f"that matches the pattern '{_NAME.pattern}'.", f"{at}.name",
                        "invalid_value")  # fmt: skip
    if definition:
        parameters = function.get("parameters")
        ok = parameters is None or isinstance(parameters, dict)
        return None if ok else _wrong_type(f"{at}.parameters", "an object")
    return None if isinstance(function.get("arguments"), str) else \
        _wrong_type(f"{at}.arguments", "a string")  # fmt: skip


def _tool_calls_problem(calls: Any, where: str) -> _Problem | None:
    if not isinstance(calls, list):
        return _wrong_type(f"{where}.tool_calls", "an array of objects")
    for index, call in enumerate(calls):
        at = f"{where}.tool_calls[{index}]"
        if not isinstance(call, dict) or not isinstance(call.get("id"), str):
            return _missing(f"{at}.id")
        if call.get("type") != "function":
            return _bad_value(call.get("type"), ("function", "custom"), f"{at}.type")
        problem = _function_problem(call.get("function"), f"{at}.function", definition=False)
        if problem is not None:
            return problem
    return None


def _pairing_problem(messages: list[dict[str, Any]]) -> _Problem | None:
    """Tool messages answer the ``tool_calls`` of the assistant message right before them, and
    every call is answered before the next message of another role."""
    pending: list[str] = []
    open_ids: set[str] = set()
    opened_at = 0
    for index, message in enumerate(messages):
        if message["role"] == "tool":
            wanted = message.get("tool_call_id")
            if not isinstance(wanted, str):
                return _missing(f"messages[{index}].tool_call_id")
            if not open_ids:
                return _Problem("Invalid parameter: messages with role 'tool' must be a response "
                                "to a preceeding message with 'tool_calls'.",
                                f"messages.[{index}].role")  # fmt: skip
            if wanted not in open_ids:
                return _Problem(f"Invalid parameter: 'tool_call_id' of '{wanted}' not found in "
                                "'tool_calls' of previous message.",
                                f"messages.[{index}].tool_call_id")  # fmt: skip
            if wanted in pending:
                pending.remove(wanted)
            continue
        if pending:
            return _unanswered(pending, opened_at)
        calls = message.get("tool_calls") if message["role"] == "assistant" else None
        pending = [str(c["id"]) for c in calls] if calls else []
        open_ids, opened_at = set(pending), index
    return _unanswered(pending, opened_at) if pending else None


def _messages_problem(messages: Any) -> _Problem | None:
    if messages is None:
        return _missing("messages")
    if not isinstance(messages, list):
        return _wrong_type("messages", "an array of objects")
    if not messages:
        return _Problem("Invalid 'messages': empty array. Expected an array with minimum length 1, "
                        "but got an empty array instead.", "messages", "empty_array")  # fmt: skip
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            return _wrong_type(where, "an object")
        if "role" not in message:
            return _missing(f"{where}.role")
        if message["role"] not in ROLES:
            return _bad_value(message["role"], ROLES, f"{where}.role")
        problem = _content_problem(message, where)
        if problem is None and "tool_calls" in message:
            problem = (
                _tool_calls_problem(message["tool_calls"], where)
                if message["role"] == "assistant"
                else _Problem(f"Unrecognized request argument supplied: {where}.tool_calls")
            )
        if problem is not None:
            return problem
    return _pairing_problem(messages)


def _tools_problem(tools: Any) -> _Problem | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        return _wrong_type("tools", "an array of objects")
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            return _bad_value(kind, ("function", "custom"), f"tools[{index}].type")
        problem = _function_problem(tool.get("function"), f"tools[{index}].function",
                                    definition=True)  # fmt: skip
        if problem is not None:
            return problem
    return None


def _body_problem(body: dict[str, Any]) -> _Problem | None:
    if not isinstance(body.get("model"), str) or not body["model"]:
        return _Problem("you must provide a model parameter")
    problem = _messages_problem(body.get("messages")) or _tools_problem(body.get("tools"))
    if problem is not None:
        return problem
    if body.get("stream_options") is not None and body.get("stream") is not True:
        return _Problem("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                        "stream_options", "invalid_value")  # fmt: skip
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            return _wrong_type(name, "an integer")
        if value < 1:
            return _Problem(f"Invalid '{name}': integer below minimum value. Expected a value "
                            f">= 1, but got {value} instead.", name,
                            "integer_below_min_value")  # fmt: skip
    return None


def _window_problem(prompt: int, completion: int | None, window: int) -> _Problem | None:
    """The API's 400 for a request that does not fit the model's context window."""
    if completion is None and prompt > window:
        message = (f"This model's maximum context length is {window} tokens. However, your "
                   f"messages resulted in {prompt} tokens. Please reduce the length of the "
                   "messages.")  # fmt: skip
    elif completion is not None and prompt + completion > window:
        message = (f"This model's maximum context length is {window} tokens. However, you "
                   f"requested {prompt + completion} tokens ({prompt} in the messages, "
                   f"{completion} in the completion). Please reduce the length of the messages "
                   "or completion.")  # fmt: skip
    else:
        return None
    return _Problem(message, "messages", "context_length_exceeded")


# --------------------------------------------------------------------------------------------
# What a request is answered with


@dataclass(frozen=True)
class _JsonAnswer:
    status: int
    text: str
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class _StreamAnswer:
    chunks: tuple[str, ...]  # the JSON of each chunk, [DONE] not included
    delay: float
    fault: StreamFault | None


@dataclass(frozen=True)
class _SilentAnswer:
    """No response at all: wait ``seconds`` (cut short by stop), then close the connection."""

    seconds: float


_Answer: TypeAlias = _JsonAnswer | _StreamAnswer | _SilentAnswer


def _error_text(message: str, error_type: str, param: str | None, code: str | None) -> str:
    error = {"message": message, "type": error_type, "param": param, "code": code}
    return json.dumps({"error": error})


def _invalid(problem: _Problem, status: int = 400) -> _JsonAnswer:
    return _JsonAnswer(
        status, _error_text(problem.message, "invalid_request_error", problem.param, problem.code)
    )


def _http_error_answer(item: HttpError) -> _JsonAnswer:
    headers: list[tuple[str, str]] = []
    if item.retry_after_ms is not None:
        headers.append(("retry-after-ms", repr(item.retry_after_ms)))
    if item.retry_after is not None:
        headers.append(("retry-after", repr(item.retry_after)))
    if item.should_retry is not None:
        headers.append(("x-should-retry", "true" if item.should_retry else "false"))
    message = item.message or _DEFAULT_MESSAGES.get(item.type, item.type)
    return _JsonAnswer(
        item.status, _error_text(message, item.type, item.param, item.code), tuple(headers)
    )


def _pieces(text: str, size: int) -> list[str]:
    return [text[start : start + size] for start in range(0, len(text), size)]


@dataclass(frozen=True)
class _Completion:
    """What every chunk of one completion shares, and its usage."""

    id: str
    model: str
    created: int
    calls: tuple[ToolCall, ...]  # ids filled in
    usage: dict[str, Any]
    include_usage: bool

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> str:
        data: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "service_tier": "default",
            "system_fingerprint": "fp_fake",
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }
        if self.include_usage:
            data["usage"] = None
        return json.dumps(data, ensure_ascii=False)

    def usage_chunk(self) -> str:
        data = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "service_tier": "default",
            "system_fingerprint": "fp_fake",
            "choices": [],
            "usage": self.usage,
        }
        return json.dumps(data)


def _usage(reply: Reply, prompt: int) -> dict[str, Any]:
    prompt_tokens = reply.prompt_tokens if reply.prompt_tokens is not None else prompt
    completion = reply.estimated_completion_tokens()
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": reply.cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": reply.estimated_reasoning_tokens(),
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def _stream_chunks(reply: Reply, completion: _Completion) -> tuple[str, ...]:
    size = reply.chunk_size
    calls = completion.calls
    chunks: list[str] = []
    opening: dict[str, Any] = {"role": "assistant", "content": "", "refusal": None}
    if reply.refusal is not None:
        opening = {"role": "assistant", "content": None, "refusal": ""}
    first_call_in_opening = (
        bool(calls) and not reply.text and reply.reasoning is None and reply.refusal is None
    )
    if first_call_in_opening:
        # A reply of calls only: the API opens the first call in the chunk carrying the role.
        opening = {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "tool_calls": [_call_opener(0, calls[0])],
        }
    chunks.append(completion.chunk(opening))
    for piece in _pieces(reply.reasoning or "", size):
        chunks.append(completion.chunk({reply.reasoning_field: piece}))
    for piece in _pieces(reply.text, size):
        chunks.append(completion.chunk({"content": piece}))
    for piece in _pieces(reply.refusal or "", size):
        chunks.append(completion.chunk({"refusal": piece}))
    for index, call in enumerate(calls):
        if index or not first_call_in_opening:
            chunks.append(completion.chunk({"tool_calls": [_call_opener(index, call)]}))
        for piece in _pieces(call.arguments_text(), size):
            argument = {"index": index, "function": {"arguments": piece}}
            chunks.append(completion.chunk({"tool_calls": [argument]}))
    chunks.append(completion.chunk({}, reply.effective_finish_reason))
    if completion.include_usage:
        chunks.append(completion.usage_chunk())
    return tuple(chunks)


def _call_opener(index: int, call: ToolCall) -> dict[str, Any]:
    return {
        "index": index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": ""},
    }


def _completion_json(reply: Reply, completion: _Completion) -> str:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": reply.text if reply.text or reply.refusal is None else None,
        "refusal": reply.refusal,
        "annotations": [],
    }
    if reply.reasoning is not None:
        message[reply.reasoning_field] = reply.reasoning
    if completion.calls:
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments_text()},
            }
            for c in completion.calls
        ]
    return json.dumps(
        {
            "id": completion.id,
            "object": "chat.completion",
            "created": completion.created,
            "model": completion.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": reply.effective_finish_reason,
                }
            ],
            "usage": completion.usage,
            "service_tier": "default",
            "system_fingerprint": "fp_fake",
        },
        ensure_ascii=False,
    )


# --------------------------------------------------------------------------------------------
# The server


class FakeOpenAI(LocalServer):
    """The fake API server. Thread-safe; use as a context manager or ``start()``/``stop()``
    (which cuts every open connection: stalls and delays wake at once).

    ``api_key`` (None: any non-empty key) is the only key accepted; ``models`` is what
    ``GET /v1/models`` lists, and with ``strict_models`` the only models a completion may
    name (others get the API's 404 ``model_not_found``)."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(_Handler, "fake-openai", host=host, port=port)
        self.default: Item = Reply(text="ok")
        self.responder: Responder | None = None
        self.context_window: int | None = None
        """The model's window in tokens (None: unlimited): a request whose prompt estimate plus
        its output limit exceeds it is refused with a 400, as the real API does."""
        self.api_key: str | None = None
        self.models: list[str] = ["gpt-test"]
        self.strict_models = False
        self._script: deque[Item] = deque()
        self._requests: list[Recorded] = []

    # scripting ------------------------------------------------------------------------------

    def script(self, *items: Item) -> None:
        """Queue items; each completion request that passes validation takes the next one."""
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
        """Forget the script and the request log."""
        with self._lock:
            self._script.clear()
            self._requests.clear()

    # the request log ------------------------------------------------------------------------

    @property
    def requests(self) -> list[Recorded]:
        """Every request received so far, in arrival order (a copy)."""
        with self._lock:
            return list(self._requests)

    def completion_requests(self) -> list[Recorded]:
        """The ``POST /v1/chat/completions`` requests only."""
        return [r for r in self.requests if r.path == COMPLETIONS_PATH]

    async def await_requests(self, n: int, timeout: float = 5.0) -> list[Recorded]:
        """Wait (without blocking the event loop) until ``n`` completion requests arrived."""
        import asyncio

        deadline = time.monotonic() + timeout
        while len(found := self.completion_requests()) < n:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{len(found)} of {n} requests arrived in {timeout} s")
            await asyncio.sleep(0.01)
        return found

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

    def _auth_problem(self, headers: dict[str, str]) -> _JsonAnswer | None:
        authorization = headers.get("authorization", "")
        bearer = authorization[7:].strip() if authorization.lower().startswith("bearer ") else ""
        if not bearer:
            return _invalid(_Problem(_NO_KEY), 401)
        with self._lock:
            expected = self.api_key
        if expected is not None and bearer != expected:
            shown = f"{bearer[:3]}*****{bearer[-4:]}" if len(bearer) > 8 else "*****"
            message = (
                f"Incorrect API key provided: {shown}. You can find your API key at "
                "https://platform.openai.com/account/api-keys."
            )
            return _invalid(_Problem(message, None, "invalid_api_key"), 401)
        return None

    def _models_answer(self) -> _JsonAnswer:
        with self._lock:
            models = list(self.models)
        data = [
            {"id": m, "object": "model", "created": 1_700_000_000, "owned_by": "system"}
            for m in models
        ]
        return _JsonAnswer(200, json.dumps({"object": "list", "data": data}))

    def _answer(
        self, method: str, path: str, headers: dict[str, str], body: dict[str, Any] | None
    ) -> _Answer:
        known = (method, path) in (("POST", COMPLETIONS_PATH), ("GET", MODELS_PATH))
        if not known:
            return _invalid(_Problem(f"Invalid URL ({method} {path})"), 404)
        refused = self._auth_problem(headers)
        if refused is not None:
            return refused
        if path == MODELS_PATH:
            return self._models_answer()
        if body is None:
            return _invalid(
                _Problem(
                    "We could not parse the JSON body of your request. (HINT: "
                    "This likely means you aren't using your HTTP library "
                    "correctly.)"
                )
            )
        problem = _body_problem(body)
        if problem is not None:
            return _invalid(problem)
        with self._lock:
            window, strict, models = self.context_window, self.strict_models, list(self.models)
        model = str(body["model"])
        if strict and model not in models:
            message = f"The model `{model}` does not exist or you do not have access to it."
            return _invalid(_Problem(message, None, "model_not_found"), 404)
        prompt = estimate_prompt_tokens(body)
        if window is not None:
            limit = body.get("max_completion_tokens") or body.get("max_tokens")
            problem = _window_problem(prompt, limit, window)
            if problem is not None:
                return _invalid(problem)

        item = self._next_item(body)
        if isinstance(item, HttpError):
            return _http_error_answer(item)
        streaming = body.get("stream") is True
        if isinstance(item, StreamFault) and not streaming and item.kind != "linger":
            if item.kind == "error":
                message = item.error_message or _DEFAULT_MESSAGES.get(item.error_type, "")
                return _JsonAnswer(500, _error_text(message, item.error_type, None, None))
            return _SilentAnswer(item.stall_seconds if item.kind == "stall" else 0.0)
        reply = item.reply if isinstance(item, StreamFault) else item
        options = body.get("stream_options")
        completion = _Completion(
            id=f"chatcmpl-{secrets.token_hex(12)}",
            model=model,
            created=int(time.time()),
            calls=tuple(
                ToolCall(
                    c.name, c.arguments, c.raw_arguments, c.id or f"call_{secrets.token_hex(12)}"
                )
                for c in reply.tool_calls
            ),
            usage=_usage(reply, prompt),
            include_usage=streaming
            and isinstance(options, dict)
            and options.get("include_usage") is True,
        )
        if not streaming:
            return _JsonAnswer(200, _completion_json(reply, completion))
        fault = item if isinstance(item, StreamFault) else None
        return _StreamAnswer(_stream_chunks(reply, completion), reply.event_delay, fault)


class _Handler(Handler[FakeOpenAI]):
    server_version = "fake-openai"
    sys_version = ""

    def _serve(self) -> None:
        fake = self.owner
        request_id = f"req_{secrets.token_hex(16)}"
        raw = self._read_body()
        path, _, query = self.path.partition("?")
        headers = self._lowered_headers()
        body = self._json_object(raw)
        retry_count = self._retry_count(headers)
        fake._record(
            Recorded(
                self.command,
                path,
                query,
                headers,
                body or {},
                retry_count,
                time.monotonic(),
                self.client_address[1],
            )
        )
        try:
            answer = fake._answer(self.command, path, headers, body)
        except Exception as error:  # a bug in the fake or in a responder: say so, as a 500
            fake._record_error(error)
            answer = _JsonAnswer(
                500, _error_text(f"fake server error: {error!r}", "server_error", None, None)
            )
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
        self.send_response(status)
        self.send_header("x-request-id", request_id)
        self.send_header("openai-processing-ms", "1")
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()

    def _send_json(self, answer: _JsonAnswer, request_id: str) -> None:
        self._send_json_text(answer.status, answer.text, request_id, answer.headers)

    def _send_stream(self, answer: _StreamAnswer, request_id: str) -> None:
        stopping = self.owner._stopping
        self._start_event_stream(request_id)
        fault, chunks = answer.fault, answer.chunks
        point = len(chunks) if fault is None else min(fault.after_chunks, len(chunks))
        for sent, data in enumerate(chunks[:point]):
            if sent and answer.delay and stopping.wait(answer.delay):
                self._drop()
                return
            self._chunk(f"data: {data}\n\n".encode())
        if fault is None:
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
        else:
            self._fault(fault)

    def _fault(self, fault: StreamFault) -> None:
        if fault.kind == "error":
            message = fault.error_message or _DEFAULT_MESSAGES.get(fault.error_type, "")
            data = _error_text(message, fault.error_type, None, None)
            self._chunk(f"data: {data}\n\n".encode())
            self._chunk(b"")
        elif fault.kind == "truncate":
            self._chunk(b"")
        elif fault.kind == "drop":
            self._drop()
        elif fault.kind == "linger":
            self._chunk(b"data: [DONE]\n\n")
            self.owner._stopping.wait(fault.stall_seconds)
            self._chunk(b"")
        else:
            self.owner._stopping.wait(fault.stall_seconds)
            self._drop()


@pytest.fixture
def fake_openai(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeOpenAI]:
    """A running ``FakeOpenAI`` for one test, with no ``OPENAI_*`` or proxy settings leaking in
    from the environment. Fails the test if the fake itself hit an internal error."""
    isolate_from_environment(monkeypatch, "OPENAI_")
    with FakeOpenAI() as fake:
        yield fake
    assert fake.errors == [], f"the fake OpenAI server failed internally: {fake.errors!r}"

"""OpenAI's Chat Completions API through the official SDK, always streaming: OpenAI itself and
every server that speaks it (vLLM, llama.cpp, Ollama, OpenRouter, DeepSeek).

The history's canonical form is Anthropic's (content blocks); this adapter converts it both ways.

Request:

- ``system`` text blocks: one ``system`` message, their texts joined by blank lines
  (``cache_control`` markers dropped: OpenAI caches prefixes by itself).
- A user message: its ``tool_result`` blocks become ``tool`` messages (``tool_call_id``, the
  result's text; ``is_error`` prefixes ``Error: ``), sent first because they answer the
  assistant message just before; its text blocks one ``user`` message (joined by blank lines;
  other blocks, such as images, are not sent).
- An assistant message: text blocks become ``content`` (``null`` beside calls and no text),
  ``tool_use`` blocks ``tool_calls`` (``arguments`` as JSON text); ``thinking``,
  ``redacted_thinking`` and every other block are dropped (Chat Completions takes no reasoning
  back). A message left with nothing is not sent.
- Tools: ``{"type": "function", "function": {name, description, parameters}}``; a server tool
  (one with a ``type``) has no equivalent and fails the call as ``model_bad_request``.
- ``max_tokens`` goes in ``max_completion_tokens`` (or ``max_tokens`` for older servers),
  ``reasoning.effort`` in ``reasoning_effort``; ``stream_options.include_usage`` asks for usage.

Reply (read from the body's bytes, each chunk decoded once into a few typed fields):

- ``delta.content`` streams as text; ``delta.refusal`` too, and makes the stop ``refusal``;
  reasoning (``reasoning_content`` from vLLM, DeepSeek and llama.cpp, ``reasoning`` from
  OpenRouter) streams as ``kind="reasoning"``.
- The assistant message is rebuilt in Anthropic's blocks: ``thinking`` (empty signature) first,
  then ``text``, then a ``tool_use`` per call (its pieces joined by index; arguments that are no
  JSON object give ``input: {}`` and an ``invalid_json`` note).
- ``finish_reason``: ``stop`` → ``end_turn`` (``tool_use`` if calls came anyway, as some local
  servers do), ``tool_calls``/``function_call`` → ``tool_use``, ``length`` → ``max_tokens``,
  ``content_filter`` → ``refusal``; a stream without one is ``model_stream_truncated``.
- Usage: ``prompt_tokens`` includes the cached ones (``prompt_tokens_details.cached_tokens``,
  or DeepSeek's ``prompt_cache_hit_tokens``); ``completion_tokens`` includes reasoning.

Errors: before the first byte, a retryable status (``retry.RETRYABLE_STATUS``; not a 429 for an
exhausted quota) or a connection failure is retried by us, announced with ``Retrying``, at the
delay the server asked for; the SDK's own retries are off. After the first byte nothing is
retried: the deltas are already in the log, so a failure ends the step with a typed error.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, Literal, cast

import httpx2
import msgspec
import openai

from actors.model import (
    Completed,
    ModelError,
    ModelEvent,
    ModelRequest,
    Retrying,
    TextDelta,
    Usage,
)
from gateways.model import retry
from gateways.model.blocks import finish_tool_input

ReasoningField = Literal["auto", "reasoning_content", "reasoning", "none"]
"""Where a server streams its reasoning: ``auto`` reads ``reasoning_content`` (vLLM, DeepSeek,
llama.cpp), else ``reasoning`` (OpenRouter, newer vLLM; one per chunk, never both, since some
servers send the same text under both names); ``none`` ignores reasoning."""

_FATAL_CODES = {
    400: ("model_bad_request", "the request was refused as invalid; this is a bug, see the log"),
    401: ("model_auth_failed", "check OPENAI_API_KEY (or model.api_key_env)"),
    402: ("model_billing", "check the provider account's billing"),
    403: ("model_forbidden", "the API key may not use this model"),
    404: ("model_not_found", "check model.id (and model.base_url) in the agent's manifest"),
    413: ("model_request_too_large", "the context is too large for one request"),
    422: ("model_bad_request", "the request was refused as invalid; this is a bug, see the log"),
}
_FINISH = {
    "stop": "end_turn",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "length": "max_tokens",
    "content_filter": "refusal",
}
_TOO_LONG = (
    "context length",  # OpenAI, vLLM, DeepSeek, OpenRouter, Groq: "maximum context length is"
    "context size",  # llama.cpp: "exceeds the available context size"
    "context window",
    "maximum model length",  # vLLM: "longer than the maximum model length"
    "too large for model",  # Mistral
    "prompt is too long",
)
"""How servers say a request does not fit the model's window (a 400), lower-cased."""
_UNKNOWN_PARAMETER = (
    ("max_completion_tokens", "the server may only know max_tokens: set model.max_tokens_param: "
     "max_tokens"),
    ("stream_options", "the server may not take stream_options: set model.stream_usage: false"),
    ("reasoning_effort", "the model may not take reasoning_effort: remove model.thinking"),
)  # fmt: skip
"""A 400 naming a parameter that only some compatible servers know, and the setting to change."""
_QUOTA = "insufficient_quota"
"""OpenAI's 429 for an account out of credit: retrying cannot help."""

_DRAIN_S = 0.1
"""How long the end of a body may take after ``[DONE]``."""

_ENCODE = msgspec.json.Encoder().encode


class _Function(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class _CallDelta(msgspec.Struct):
    index: int | None = None
    id: str | None = None
    function: _Function | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[_CallDelta] | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    finish_reason: str | None = None


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None
    prompt_cache_hit_tokens: int | None = None


class _Chunk(msgspec.Struct):
    """The fields of a ``chat.completion.chunk`` this adapter reads (the rest are skipped by the
    decoder, never built)."""

    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None


_DECODE_CHUNK = msgspec.json.Decoder(_Chunk).decode


class OpenAIModel:
    def __init__(
        self,
        model_id: str,
        *,
        api_key: str,
        base_url: str | None = None,
        max_retries: int = 2,
        connect_timeout_s: float = 10.0,
        stall_timeout_s: float = 120.0,
        max_tokens_param: Literal["max_completion_tokens", "max_tokens"] = "max_completion_tokens",
        stream_usage: bool = True,
        reasoning_field: ReasoningField = "auto",
    ) -> None:
        self.label = f"openai:{model_id}"
        self.max_retries = max_retries
        self._max_tokens_param = max_tokens_param
        self._stream_options: Any = {"include_usage": True} if stream_usage else openai.omit
        self._reasoning_field = reasoning_field
        self._tools: tuple[list[dict[str, Any]], list[dict[str, Any]]] | None = None
        self._client = openai.AsyncOpenAI(
            api_key=api_key,
            base_url=base_url,
            max_retries=0,
            # Read is per socket read: a stream that sends nothing for this long has stalled.
            timeout=openai.Timeout(stall_timeout_s, connect=connect_timeout_s),
        )

    async def aclose(self) -> None:
        await self._client.close()

    def _function_tools(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The request's tools as functions. An agent sends the same list object on every call
        (its pinned tools, rendered once), so the conversion is kept for that object."""
        held = self._tools
        if held is not None and held[0] is tools:
            return held[1]
        converted = function_tools(tools)
        self._tools = (tools, converted)
        return converted

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        messages = chat_messages(request.system, request.conversation())
        tools = self._function_tools(request.tools) if request.tools else None
        effort = request.reasoning.effort if request.reasoning is not None else None
        limit = {self._max_tokens_param: request.max_tokens}
        body: dict[str, Any] = (
            {"messages": messages, "tools": tools} if tools else {"messages": messages}
        )
        attempt = 0
        while True:
            attempt += 1
            started = time.monotonic()
            async with contextlib.AsyncExitStack() as stack:
                try:
                    raw = await stack.enter_async_context(
                        self._client.chat.completions.with_streaming_response.create(
                            model=request.model,
                            # The conversation and the tools ride in extra_body, already in
                            # the wire's shape: the SDK walks every named parameter through
                            # its TypedDict transform, 9.6 ms of CPU for a 61-message history
                            # on every call; extra_body is merged into the body untouched.
                            messages=(),
                            extra_body=body,
                            reasoning_effort=cast(Any, effort) if effort else openai.omit,
                            stream=True,
                            stream_options=self._stream_options,
                            **cast(Any, limit),
                        )
                    )
                except openai.APIStatusError as e:
                    retryable = e.status_code in retry.RETRYABLE_STATUS and e.code != _QUOTA
                    if not retryable or attempt > self.max_retries:
                        raise _fatal(e) from e
                    delay = retry.delay(e.response.headers, attempt)
                    yield Retrying(status=e.status_code, attempt=attempt,
                                   delay_ms=int(delay * 1000),
                                   error=str(e.code or e.type or e.status_code))  # fmt: skip
                    await asyncio.sleep(delay)
                    continue
                except openai.APIConnectionError as e:
                    if attempt > self.max_retries:
                        raise ModelError(
                            "model_unreachable", f"cannot reach the model API: {e}",
                            "check the network, model.base_url and the provider's status",
                        ) from e  # fmt: skip
                    delay = retry.delay({}, attempt)
                    yield Retrying(status=0, attempt=attempt, delay_ms=int(delay * 1000),
                                   error=type(e).__name__)  # fmt: skip
                    await asyncio.sleep(delay)
                    continue
                async for event in _read(raw, started, self._reasoning_field):
                    yield event
                return


# --------------------------------------------------------------------------------------------
# The request: Anthropic's blocks as Chat Completions messages


def function_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Our tools as Chat Completions functions; a server tool (with a ``type``) cannot be one."""
    converted = []
    for tool in tools:
        if "type" in tool:
            raise ModelError(
                "model_bad_request",
                f"the server tool {tool.get('name')!r} ({tool['type']}) runs only on Anthropic's "
                "API, not on an OpenAI-compatible endpoint",
                "remove model.server_tools from the agent's manifest",
            )
        function = {"name": tool["name"], "description": tool.get("description", ""),
                    "parameters": tool.get("input_schema") or {"type": "object"}}  # fmt: skip
        converted.append({"type": "function", "function": function})
    return converted


def chat_messages(system: list[dict[str, Any]], messages: list[dict[str, Any]]) -> list[Any]:
    """The system blocks and the conversation as Chat Completions messages."""
    out: list[Any] = []
    text = "\n\n".join(b["text"] for b in system if b.get("text"))
    if text:
        out.append({"role": "system", "content": text})
    for message in messages:
        content = message["content"]
        if message["role"] == "assistant":
            _assistant(content, out)
        elif isinstance(content, str):
            if content:
                out.append({"role": "user", "content": content})
        else:
            _user(content, out)
    return out


def _user(blocks: list[dict[str, Any]], out: list[Any]) -> None:
    """Tool results first (they answer the assistant message before), then the text."""
    texts = []
    for block in blocks:
        kind = block.get("type")
        if kind == "tool_result":
            result = _text(block.get("content"))
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        elif kind == "text" and block.get("text"):
            texts.append(block["text"])
    if texts:
        out.append({"role": "user", "content": "\n\n".join(texts)})


def _assistant(content: str | list[dict[str, Any]], out: list[Any]) -> None:
    if isinstance(content, str):
        if content:
            out.append({"role": "assistant", "content": content})
        return
    # Consecutive text blocks are one text (the Messages API splits it at citations), so they
    # are joined as they are.
    texts, calls = [], []
    for block in content:
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text") or "")
        elif kind == "tool_use":
            arguments = _ENCODE(block.get("input") or {}).decode()
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": arguments}})  # fmt: skip
    text = "".join(texts)
    if calls:
        out.append({"role": "assistant", "content": text or None, "tool_calls": calls})
    elif text:
        out.append({"role": "assistant", "content": text})


def _text(content: Any) -> str:
    """A tool result's content as text: a string, or its text blocks joined by blank lines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n\n".join(
            b.get("text") or "" for b in content if isinstance(b, dict) and b.get("type") == "text"
        )
    return ""


# --------------------------------------------------------------------------------------------
# The reply: chunks folded into Anthropic's blocks


class _Reply:
    """The reply as its chunks arrive: text, refusal and reasoning pieces, each tool call's id,
    name and argument pieces by index, the finish reason, the last usage seen."""

    __slots__ = ("calls", "finish", "first_token_ms", "reasoning", "refusal", "started",
                 "text", "usage", "which")  # fmt: skip

    def __init__(self, started: float, which: ReasoningField) -> None:
        self.started = started
        self.which = which
        self.text: list[str] = []
        self.refusal: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, list[Any]] = {}  # index -> [id, name, [argument pieces]]
        self.finish: str | None = None
        self.usage: _Usage | None = None
        self.first_token_ms: int | None = None

    def take(self, chunk: _Chunk) -> tuple[TextDelta, ...]:
        if chunk.error is not None:
            raise _stream_error(chunk.error)
        if chunk.usage is not None:
            self.usage = chunk.usage
        deltas: tuple[TextDelta, ...] = ()
        for choice in chunk.choices or ():
            delta = choice.delta
            if delta is not None:
                deltas = self._delta(delta)
            if choice.finish_reason:
                self.finish = choice.finish_reason
        return deltas

    def _delta(self, delta: _Delta) -> tuple[TextDelta, ...]:
        out: tuple[TextDelta, ...] = ()
        which = self.which
        thought = None
        if which == "auto":
            thought = delta.reasoning_content or delta.reasoning
        elif which == "reasoning_content":
            thought = delta.reasoning_content
        elif which == "reasoning":
            thought = delta.reasoning
        if thought:
            self.reasoning.append(thought)
            out = (TextDelta(thought, kind="reasoning"),)
        content, refusal = delta.content, delta.refusal
        if content or refusal:
            if content:
                self.text.append(content)
            if refusal:
                self.refusal.append(refusal)
            text = (content or "") + (refusal or "")
            if self.first_token_ms is None:
                self.first_token_ms = int((time.monotonic() - self.started) * 1000)
            out = (*out, TextDelta(text))
        if delta.tool_calls:
            self._calls(delta.tool_calls)
        return out

    def _calls(self, pieces: list[_CallDelta]) -> None:
        calls = self.calls
        for piece in pieces:
            index = piece.index
            if index is None:  # a server that omits it sends each call whole, or one at a time
                fresh = piece.id is not None and all(c[0] != piece.id for c in calls.values())
                index = len(calls) if fresh or not calls else max(calls)
            call = calls.get(index)
            if call is None:
                call = calls[index] = [piece.id, None, []]
            elif piece.id and not call[0]:
                call[0] = piece.id
            function = piece.function
            if function is not None:
                if function.name and not call[1]:
                    call[1] = function.name
                if function.arguments:
                    call[2].append(function.arguments)

    def completed(self) -> Completed:
        if self.finish is None:
            raise ModelError("model_stream_truncated",
                             "the model stream ended before its finish reason",
                             "retry the message; the provider closed the reply early")  # fmt: skip
        content: list[dict[str, Any]] = []
        if self.reasoning:
            content.append({"type": "thinking", "thinking": "".join(self.reasoning),
                            "signature": ""})  # fmt: skip
        text = "".join(self.text) + "".join(self.refusal)
        if text:
            content.append({"type": "text", "text": text})
        for index in sorted(self.calls):
            call_id, name, parts = self.calls[index]
            call_id = call_id or f"call_{secrets.token_hex(12)}"  # a server that sends none
            block: dict[str, Any] = {"type": "tool_use", "id": call_id, "name": name or "",
                                     "input": {}}  # fmt: skip
            finish_tool_input(block, "".join(parts))
            content.append(block)
        stop = _FINISH.get(self.finish, self.finish)
        if self.refusal:
            stop = "refusal"
        elif stop == "end_turn" and self.calls:
            stop = "tool_use"
        return Completed(content=content, stop_reason=stop, usage=_usage(self.usage),
                         first_token_ms=self.first_token_ms)  # fmt: skip


def _usage(usage: _Usage | None) -> Usage:
    if usage is None:
        return Usage()
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens if details is not None else None) \
        or usage.prompt_cache_hit_tokens or 0  # fmt: skip
    prompt = usage.prompt_tokens or 0
    return Usage(input_tokens=max(0, prompt - cached), cache_read_tokens=cached,
                 output_tokens=usage.completion_tokens or 0)  # fmt: skip


def _payloads(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The data of each complete server-sent event in ``buffer``, and what is left of it
    (comment lines, which some servers send as keep-alives, are skipped). Called once per
    network read and slicing each payload once: this is the hot loop."""
    if b"\r" in buffer:
        buffer = buffer.replace(b"\r\n", b"\n")
    found = []
    start = 0
    while (end := buffer.find(b"\n\n", start)) >= 0:
        if buffer.startswith(b"data: ", start) and buffer.find(b"\n", start, end) < 0:
            found.append(buffer[start + 6 : end])  # the usual frame: one data line
        else:
            lines = [line[5:].lstrip(b" ") for line in buffer[start:end].split(b"\n")
                     if line[:5] == b"data:"]  # fmt: skip
            if lines:
                found.append(b"\n".join(lines))
        start = end + 2
    return found, buffer[start:]


async def _read(raw: Any, started: float, which: ReasoningField) -> AsyncIterator[ModelEvent]:
    reply = _Reply(started, which)
    pieces = raw.iter_bytes()
    buffer = b""
    try:
        async for piece in pieces:
            payloads, buffer = _payloads(buffer + piece if buffer else piece)
            done = False
            for data in payloads:
                if data == b"[DONE]":
                    done = True
                    break
                for delta in reply.take(_DECODE_CHUNK(data)):
                    yield delta
            if done:
                await _drain(pieces)
                break
    except httpx2.TimeoutException as e:
        raise ModelError("model_stalled", "the model stream stalled (no data within the read "
                         "timeout)", "retry the message; if it recurs, check the provider's "
                         "status, or raise model.stall_timeout_s for a slow local "
                         "server") from e  # fmt: skip
    except (httpx2.HTTPError, openai.APIConnectionError) as e:
        raise ModelError(
            "model_connection_dropped",
            f"the model stream broke off: {e}",
            "retry the message; the connection to the provider dropped",
        ) from e
    except msgspec.DecodeError as e:
        raise ModelError("model_invalid_stream", f"the model stream could not be read: {e}",
                         "retry the message; if it recurs, the endpoint does not speak Chat "
                         "Completions as OpenAI does") from e  # fmt: skip
    yield reply.completed()


async def _drain(pieces: AsyncIterator[bytes]) -> None:
    """Read the body to its end after ``[DONE]`` (normally already here), so the connection
    goes back to the pool instead of being closed; a server that keeps it open past the drain
    time loses it, never the reply."""
    with contextlib.suppress(TimeoutError, httpx2.HTTPError):
        async with asyncio.timeout(_DRAIN_S):
            async for _ in pieces:
                pass


def _stream_error(error: Any) -> ModelError:
    """An error object inside the stream (the status was 200: the failure came mid-reply)."""
    error = error if isinstance(error, dict) else {"message": str(error)}
    kind = str(error.get("type") or error.get("code") or "server_error")
    lowered = kind.lower()
    code = "model_stream_error"
    if "overloaded" in lowered:
        code = "model_overloaded"
    elif "rate_limit" in lowered or lowered in ("tokens", "requests"):
        code = "model_rate_limited"
    return ModelError(code, f"the model stream failed: {kind}: {error.get('message', '')}",
                      "retry the message; the provider reported the failure mid-reply")  # fmt: skip


def _message(e: openai.APIStatusError) -> str:
    body = e.body if isinstance(e.body, dict) else {}
    return str(body.get("message") or e.message)


def _fatal(e: openai.APIStatusError) -> ModelError:
    status, message = e.status_code, _message(e)
    lowered = message.lower()
    if status == 400 and (
        e.code == "context_length_exceeded" or any(m in lowered for m in _TOO_LONG)
    ):
        # The local estimate fell short of the provider's count (the session's correction ratio
        # learns from each reported figure; a reserve of output tokens leaves a margin).
        code = "context_window_exceeded"
        hint = ("set model.context_window to the server's real window, raise "
                "model.reserve_output, or lower the compaction thresholds")  # fmt: skip
    elif e.code == _QUOTA:
        code, hint = "model_billing", "the account is out of quota; check its plan and billing"
    elif status in _FATAL_CODES:
        code, hint = _FATAL_CODES[status]
        if status in (400, 422):
            hint = next((h for name, h in _UNKNOWN_PARAMETER if name in lowered), hint)
    elif status == 429:
        code, hint = "model_rate_limited", "the provider kept refusing with 429; send less often"
    elif status in (503, 529):
        code, hint = "model_overloaded", "the provider is overloaded; retry later"
    else:
        code, hint = "model_api_error", "the provider failed; retry later"
    return ModelError(code, f"the model API answered {status}: {message}", hint, status=status)

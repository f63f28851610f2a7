"""The Anthropic Messages API through the official SDK, always streaming.

Retries before the first byte are ours (the SDK's are switched off), so that each one is an event
(``model.retry``) with the delay the server asked for. After the first byte nothing is retried:
the deltas are already in the log, so a failure ends the step with a typed error instead.

The SDK sends the request (auth, headers, status errors); the reply's body is read as it comes,
server-sent events decoded straight from bytes, and each content block is kept as the JSON the
API sent, deltas folded in. So every block type the API streams, including ones newer than this
code (server tool results, compaction, whatever comes next), is stored whole and can be sent back
as it came, which the API requires of thinking signatures and compaction content; and no typed
objects are built per delta only to be dumped again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx2
import msgspec

from actors.model import (
    Completed,
    ModelError,
    ModelEvent,
    ModelRequest,
    Reasoning,
    Retrying,
    TextDelta,
    Usage,
)
from gateways.model import retry
from gateways.model.blocks import finish_tool_input

_FATAL_CODES = {
    400: ("model_bad_request", "the request was refused as invalid; this is a bug, see the log"),
    401: ("model_auth_failed", "check ANTHROPIC_API_KEY"),
    402: ("model_billing", "check the Anthropic account's billing"),
    403: ("model_forbidden", "the API key may not use this model"),
    404: ("model_not_found", "check model.id in the agent's manifest"),
    413: ("model_request_too_large", "the context is too large for one request"),
}
_STREAM_ERROR_CODES = {
    "overloaded_error": "model_overloaded",
    "api_error": "model_api_error",
    "rate_limit_error": "model_rate_limited",
}
MIN_THINKING_BUDGET = 1024
"""The API's smallest ``budget_tokens``."""

_TOO_LONG = ("prompt is too long", "exceed context limit")
"""How the API says a request does not fit the model's window (a 400)."""

_DECODE = msgspec.json.Decoder().decode


def thinking_param(reasoning: Reasoning | None, max_tokens: int) -> dict[str, Any] | None:
    """The request's ``thinking``: adaptive, or a budget below the call's ``max_tokens`` (the
    API requires it). A call left with too little room for the smallest budget does not think:
    its output limit is the turn's to keep, and thinking tokens count toward it."""
    if reasoning is None:
        return None
    if reasoning.adaptive:
        return {"type": "adaptive"}
    if reasoning.budget_tokens is None:
        return None
    budget = min(reasoning.budget_tokens, max_tokens - 1)
    return {"type": "enabled", "budget_tokens": budget} if budget >= MIN_THINKING_BUDGET else None


class AnthropicModel:
    def __init__(
        self,
        model_id: str,
        *,
        api_key: str,
        base_url: str | None = None,
        max_retries: int = 2,
        connect_timeout_s: float = 10.0,
        stall_timeout_s: float = 120.0,
        betas: tuple[str, ...] = (),
    ) -> None:
        self.label = f"anthropic:{model_id}"
        self.max_retries = max_retries
        self._client = anthropic.AsyncAnthropic(
            api_key=api_key,
            base_url=base_url,
            max_retries=0,
            # Read is per socket read: a stream that sends nothing for this long has stalled.
            timeout=anthropic.Timeout(stall_timeout_s, connect=connect_timeout_s),
            default_headers={"anthropic-beta": ",".join(betas)} if betas else None,
        )

    async def aclose(self) -> None:
        await self._client.close()

    async def count_tokens(self, request: ModelRequest) -> int:
        """The provider's count of the request's prompt tokens (``/v1/messages/count_tokens``)."""
        try:
            counted = await self._client.messages.count_tokens(
                model=request.model,
                system=request.system or anthropic.omit,  # type: ignore[arg-type]
                messages=request.conversation(),  # type: ignore[arg-type]
                tools=request.tools or anthropic.omit,  # type: ignore[arg-type]
            )
        except anthropic.APIStatusError as e:
            raise _fatal(e) from e
        except anthropic.APIConnectionError as e:
            raise ModelError(
                "model_unreachable",
                f"cannot reach the model API: {e}",
                "check the network and the model provider's status",
            ) from e
        return int(counted.input_tokens)

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        thinking = thinking_param(request.reasoning, request.max_tokens)
        attempt = 0
        while True:
            attempt += 1
            started = time.monotonic()
            async with contextlib.AsyncExitStack() as stack:
                try:
                    raw = await stack.enter_async_context(
                        self._client.messages.with_streaming_response.create(
                            model=request.model,
                            max_tokens=request.max_tokens,
                            # An empty list would still go on the wire; leave it out instead.
                            system=request.system or anthropic.omit,  # type: ignore[arg-type]
                            messages=request.conversation(),  # type: ignore[arg-type]
                            tools=request.tools or anthropic.omit,  # type: ignore[arg-type]
                            thinking=thinking or anthropic.omit,  # type: ignore[arg-type]
                            stream=True,
                        )
                    )
                except anthropic.APIStatusError as e:
                    retryable = e.status_code in retry.RETRYABLE_STATUS and not _spend(e)
                    if not retryable or attempt > self.max_retries:
                        raise _fatal(e) from e
                    delay = retry.delay(e.response.headers, attempt)
                    yield Retrying(status=e.status_code, attempt=attempt,
                                   delay_ms=int(delay * 1000),
                                   error=str(e.type or e.status_code))  # fmt: skip
                    await asyncio.sleep(delay)
                    continue
                except anthropic.APIConnectionError as e:
                    if attempt > self.max_retries:
                        raise ModelError(
                            "model_unreachable", f"cannot reach the model API: {e}",
                            "check the network and the model provider's status",
                        ) from e  # fmt: skip
                    delay = retry.delay({}, attempt)
                    yield Retrying(status=0, attempt=attempt, delay_ms=int(delay * 1000),
                                   error=type(e).__name__)  # fmt: skip
                    await asyncio.sleep(delay)
                    continue
                async for event in _read(raw, started):
                    yield event
                return


class _Reply:
    """The reply as its events arrive: each block the JSON object the API started it with,
    deltas folded in; tool input JSON kept as text until its block ends (so malformed or cut-off
    JSON becomes a note, not a crash); usage."""

    __slots__ = ("blocks", "first_token_ms", "partial_json", "started", "stop_reason", "usage")

    def __init__(self, started: float) -> None:
        self.started = started
        self.blocks: dict[int, dict[str, Any]] = {}
        self.partial_json: dict[int, list[str]] = {}
        self.usage: dict[str, Any] = {}
        self.stop_reason: str | None = None
        self.first_token_ms: int | None = None

    def take(self, event: dict[str, Any]) -> TextDelta | None:
        kind = event.get("type")
        if kind == "content_block_delta":
            return self._delta(event["index"], event["delta"])
        if kind == "content_block_start":
            self.blocks[event["index"]] = event["content_block"]
        elif kind == "content_block_stop":
            self._close(event["index"])
        elif kind == "message_delta":
            self.stop_reason = event["delta"].get("stop_reason") or self.stop_reason
            self.usage.update(event.get("usage") or {})
        elif kind == "message_start":
            self.usage.update(event["message"].get("usage") or {})
        elif kind == "error":
            raise _stream_error(event.get("error") or {})
        return None

    def _delta(self, index: int, delta: dict[str, Any]) -> TextDelta | None:
        block = self.blocks[index]
        match delta.get("type"):
            case "text_delta":
                text = delta["text"]
                if self.first_token_ms is None:
                    self.first_token_ms = int((time.monotonic() - self.started) * 1000)
                block["text"] = block.get("text", "") + text
                return TextDelta(text)
            case "thinking_delta":
                text = delta["thinking"]
                block["thinking"] = block.get("thinking", "") + text
                return TextDelta(text, kind="reasoning")
            case "input_json_delta":
                self.partial_json.setdefault(index, []).append(delta["partial_json"])
            case "signature_delta":
                block["signature"] = delta["signature"]
            case "citations_delta":
                block["citations"] = [*(block.get("citations") or ()), delta["citation"]]
            case _:
                # A delta of a kind this code does not know (compaction_delta, and whatever
                # comes next): strings are appended to the field of the same name, anything
                # else replaces it, so the block ends as the API built it.
                for key, value in delta.items():
                    if key == "type" or value is None:
                        continue
                    held = block.get(key)
                    block[key] = held + value if isinstance(held, str) and isinstance(value, str) \
                        else value  # fmt: skip
        return None

    def _close(self, index: int) -> None:
        parts = self.partial_json.pop(index, None)
        if parts is not None:
            finish_tool_input(self.blocks[index], "".join(parts))

    def completed(self) -> Completed:
        if self.stop_reason is None:
            raise ModelError("model_stream_truncated",
                             "the model stream ended before its last event",
                             "retry the message; the provider closed the reply early")  # fmt: skip
        for index in list(self.partial_json):  # a block cut off without its stop
            self._close(index)
        usage = self.usage
        server = usage.get("server_tool_use")
        billed = {k: int(v) for k, v in server.items() if v} if isinstance(server, dict) else {}
        return Completed(
            content=[b for _, b in sorted(self.blocks.items()) if not _empty(b)],
            stop_reason=self.stop_reason,
            usage=Usage(
                input_tokens=usage.get("input_tokens") or 0,
                output_tokens=usage.get("output_tokens") or 0,
                cache_read_tokens=usage.get("cache_read_input_tokens") or 0,
                cache_write_tokens=usage.get("cache_creation_input_tokens") or 0,
                server_tool_requests=billed,
            ),
            first_token_ms=self.first_token_ms,
        )


def _empty(block: dict[str, Any]) -> bool:
    """A block the API would refuse to take back and that says nothing: a text block with no
    text (a refusal can start one), a thinking block with neither thinking nor signature."""
    kind = block.get("type")
    if kind == "text":
        return not block.get("text") and not block.get("citations")
    if kind == "thinking":
        return not block.get("thinking") and not block.get("signature")
    return False


async def _events(response: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON data of each server-sent event of a response body, decoded from bytes as they
    arrive (``event:`` lines are redundant: every data object names its ``type``)."""
    buffer = b""
    async for chunk in response.iter_bytes():
        buffer = buffer + chunk if buffer else chunk
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        while (end := buffer.find(b"\n\n")) >= 0:
            frame, buffer = buffer[:end], buffer[end + 2 :]
            data = [line[5:].lstrip(b" ") for line in frame.split(b"\n") if line[:5] == b"data:"]
            if data:
                yield _DECODE(data[0] if len(data) == 1 else b"\n".join(data))


async def _read(raw: Any, started: float) -> AsyncIterator[ModelEvent]:
    reply = _Reply(started)
    try:
        async for event in _events(raw):
            delta = reply.take(event)
            if delta is not None:
                yield delta
    except httpx2.TimeoutException as e:
        raise ModelError("model_stalled", "the model stream stalled (no data within the read "
                         "timeout)", "retry the message; if it recurs, check the provider's "
                         "status") from e  # fmt: skip
    except (httpx2.HTTPError, anthropic.APIConnectionError) as e:
        raise ModelError(
            "model_connection_dropped",
            f"the model stream broke off: {e}",
            "retry the message; the connection to the provider dropped",
        ) from e
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelError("model_invalid_stream", f"the model stream could not be read: "
                         f"{type(e).__name__}: {e}", "retry the message") from e  # fmt: skip
    yield reply.completed()


def _stream_error(error: dict[str, Any]) -> ModelError:
    """An ``error`` event inside the stream (the status was 200: the failure came mid-reply)."""
    kind = str(error.get("type") or "api_error")
    return ModelError(_STREAM_ERROR_CODES.get(kind, "model_stream_error"),
                      f"the model stream failed: {kind}: {error.get('message', '')}",
                      "retry the message; the provider reported the failure mid-reply",
                      status=529 if kind == "overloaded_error" else 0)  # fmt: skip


def _spend(e: anthropic.APIStatusError) -> bool:
    return type(e).__name__ == "EnforcedSpendLimitReachedError"


def _message(e: anthropic.APIStatusError) -> str:
    body = e.body if isinstance(e.body, dict) else {}
    error = body.get("error", {}) if isinstance(body, dict) else {}
    return str(error.get("message") or e.message)


def _fatal(e: anthropic.APIStatusError) -> ModelError:
    status = e.status_code
    if status == 400 and any(m in _message(e) for m in _TOO_LONG):
        # The local estimate fell short of the provider's count (the session's correction ratio
        # learns from each reported figure; a reserve of output tokens leaves a margin).
        code = "context_window_exceeded"
        hint = ("raise model.reserve_output (more margin), set context.count_tokens: true, or "
                "lower the compaction thresholds")  # fmt: skip
    elif status in _FATAL_CODES:
        code, hint = _FATAL_CODES[status]
    elif _spend(e):
        code, hint = "model_spend_limit", "the account's spend limit is reached"
    elif status == 429:
        code, hint = "model_rate_limited", "the provider kept refusing with 429; send less often"
    elif status == 529:
        code, hint = "model_overloaded", "the provider is overloaded; retry later"
    else:
        code, hint = "model_api_error", "the provider failed; retry later"
    return ModelError(code, f"the model API answered {status}: {_message(e)}", hint, status=status)

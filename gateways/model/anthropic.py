"""The Anthropic Messages API through the official SDK, always streaming.

Retries before the first byte are ours (the SDK's are switched off), so that each one is an event
(``model.retry``) with the delay the server asked for. After the first byte nothing is retried:
the deltas are already in the log, so a failure ends the step with a typed error instead.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx2

from actors.model import Completed, ModelError, ModelEvent, ModelRequest, Retrying, TextDelta, Usage

_RETRYABLE = frozenset({408, 409, 429, 500, 502, 503, 504, 529})
_FATAL_CODES = {
    400: ("model_bad_request", "the request was refused as invalid; this is a bug, see the log"),
    401: ("model_auth_failed", "check ANTHROPIC_API_KEY"),
    402: ("model_billing", "check the Anthropic account's billing"),
    403: ("model_forbidden", "the API key may not use this model"),
    404: ("model_not_found", "check model.id in the agent's manifest"),
    413: ("model_request_too_large", "the context is too large for one request"),
}


_TOO_LONG = ("prompt is too long", "exceed context limit")
"""How the API says a request does not fit the model's window (a 400)."""


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
    ) -> None:
        self.label = f"anthropic:{model_id}"
        self.max_retries = max_retries
        self._client = anthropic.AsyncAnthropic(
            api_key=api_key,
            base_url=base_url,
            max_retries=0,
            # Read is per socket read: a stream that sends nothing for this long has stalled.
            timeout=anthropic.Timeout(stall_timeout_s, connect=connect_timeout_s),
        )

    async def aclose(self) -> None:
        await self._client.close()

    async def count_tokens(self, request: ModelRequest) -> int:
        """The provider's count of the request's prompt tokens (``/v1/messages/count_tokens``)."""
        try:
            counted = await self._client.messages.count_tokens(
                model=request.model,
                system=request.system or anthropic.omit,  # type: ignore[arg-type]
                messages=request.messages,  # type: ignore[arg-type]
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
        attempt = 0
        while True:
            attempt += 1
            started = time.monotonic()
            try:
                raw = await self._client.messages.create(
                    model=request.model,
                    max_tokens=request.max_tokens,
                    # An empty list would still go on the wire; leave the parameter out instead.
                    system=request.system or anthropic.omit,  # type: ignore[arg-type]
                    messages=request.messages,  # type: ignore[arg-type]
                    tools=request.tools or anthropic.omit,  # type: ignore[arg-type]
                    stream=True,
                )
            except anthropic.APIStatusError as e:
                if e.status_code not in _RETRYABLE or attempt > self.max_retries or _spend(e):
                    raise _fatal(e) from e
                delay = _delay(e.response.headers, attempt)
                yield Retrying(status=e.status_code, attempt=attempt, delay_ms=int(delay * 1000),
                               error=str(e.type or e.status_code))  # fmt: skip
                await asyncio.sleep(delay)
                continue
            except anthropic.APIConnectionError as e:
                if attempt > self.max_retries:
                    raise ModelError(
                        "model_unreachable", f"cannot reach the model API: {e}",
                        "check the network and the model provider's status",
                    ) from e  # fmt: skip
                delay = _delay({}, attempt)
                yield Retrying(status=0, attempt=attempt, delay_ms=int(delay * 1000),
                               error=type(e).__name__)  # fmt: skip
                await asyncio.sleep(delay)
                continue
            async for event in _read(raw, started):
                yield event
            return


class _Reply:
    """The reply as its raw events arrive: blocks by index, tool input JSON kept as text until
    its block ends (so malformed JSON becomes a repairable error, not a crash), usage."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.blocks: dict[int, dict[str, Any]] = {}
        self.partial_json: dict[int, list[str]] = {}
        self.usage: dict[str, int] = {}
        self.stop_reason: str | None = None
        self.first_token_ms: int | None = None

    def take(self, event: Any) -> TextDelta | None:
        match event.type:
            case "message_start":
                self.usage.update(_usage(event.message.usage))
            case "content_block_start":
                block = event.content_block.model_dump(exclude_none=True)
                self.blocks[event.index] = block
                if block.get("type") == "tool_use":
                    self.partial_json[event.index] = []
            case "content_block_delta":
                return self._delta(self.blocks[event.index], event.index, event.delta)
            case "content_block_stop":
                if event.index in self.partial_json:
                    text = "".join(self.partial_json[event.index])
                    _finish_tool_input(self.blocks[event.index], text)
            case "message_delta":
                self.stop_reason = event.delta.stop_reason
                self.usage.update(_usage(event.usage))
        return None

    def _delta(self, block: dict[str, Any], index: int, delta: Any) -> TextDelta | None:
        match delta.type:
            case "text_delta":
                if self.first_token_ms is None:
                    self.first_token_ms = int((time.monotonic() - self.started) * 1000)
                block["text"] = block.get("text", "") + delta.text
                return TextDelta(delta.text)
            case "input_json_delta":
                self.partial_json[index].append(delta.partial_json)
            case "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta.thinking
                return TextDelta(delta.thinking, kind="reasoning")
            case "signature_delta":
                block["signature"] = delta.signature
        return None

    def completed(self) -> Completed:
        if self.stop_reason is None:
            raise ModelError("model_stream_truncated",
                             "the model stream ended before its last event",
                             "retry the message; the provider closed the reply early")  # fmt: skip
        usage = self.usage
        return Completed(
            content=[self.blocks[i] for i in sorted(self.blocks)],
            stop_reason=self.stop_reason,
            usage=Usage(
                input_tokens=usage.get("input_tokens", 0),
                output_tokens=usage.get("output_tokens", 0),
                cache_read_tokens=usage.get("cache_read_input_tokens", 0),
                cache_write_tokens=usage.get("cache_creation_input_tokens", 0),
            ),
            first_token_ms=self.first_token_ms,
        )


async def _read(raw: Any, started: float) -> AsyncIterator[ModelEvent]:
    reply = _Reply(started)
    try:
        async for event in raw:
            delta = reply.take(event)
            if delta is not None:
                yield delta
    except anthropic.APIStatusError as e:  # an `error` event inside the stream
        kind = e.type or "api_error"
        code = {"overloaded_error": "model_overloaded", "api_error": "model_api_error"}.get(
            kind, "model_stream_error"
        )
        raise ModelError(code, f"the model stream failed: {kind}: {_message(e)}",
                         "retry the message; the provider reported the failure mid-reply",
                         status=e.status_code) from e  # fmt: skip
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
    except ValueError as e:
        raise ModelError("model_invalid_stream", f"the model stream could not be read: {e}",
                         "retry the message") from e  # fmt: skip
    finally:
        await raw.close()
    yield reply.completed()


def _finish_tool_input(block: dict[str, Any], text: str) -> None:
    if not text.strip():
        block["input"] = {}
        return
    try:
        parsed = json.loads(text)
    except ValueError as e:
        block["input"] = {}
        block["invalid_json"] = f"{e.__class__.__name__}: {e}"[:300]
        return
    if isinstance(parsed, dict):
        block["input"] = parsed
    else:
        block["input"] = {}
        block["invalid_json"] = f"expected a JSON object, got {type(parsed).__name__}"


def _usage(raw: Any) -> dict[str, int]:
    if raw is None:
        return {}
    fields = ("input_tokens", "output_tokens", "cache_read_input_tokens",
              "cache_creation_input_tokens")  # fmt: skip
    return {f: int(v) for f in fields if (v := getattr(raw, f, None)) is not None}


def _delay(headers: Any, attempt: int) -> float:
    """The wait before a retry: what the server asked for, else exponential backoff with
    jitter (0.5 s doubling, capped at 8 s)."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name) if headers else None
        if value:
            try:
                seconds = float(value) * scale
            except ValueError:
                continue
            if seconds > 0:
                return min(seconds, 60.0)
    backoff: float = min(0.5 * 2 ** (attempt - 1), 8.0)
    return backoff * (1 - 0.25 * random.random())  # noqa: S311 - jitter, not security


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

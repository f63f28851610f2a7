"""The port to a language model: what the turn engine sends and what it gets back.

Implementations live in ``gateways/model/`` (Anthropic through the official SDK, and the offline
scripted model). The turn engine only sees these types.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal, Protocol

import msgspec

from eventstore.errors import DispachError

_ENCODE = msgspec.json.Encoder().encode
_DECODE = msgspec.json.Decoder().decode


class Reasoning(msgspec.Struct, frozen=True, kw_only=True):
    """How much the model may think before it answers (the manifest's ``model.thinking``).
    Each adapter maps what its provider takes: Anthropic a token budget or adaptive thinking,
    OpenAI-compatible endpoints ``reasoning_effort``."""

    budget_tokens: int | None = None
    adaptive: bool = False
    effort: str | None = None


class ModelRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    system: list[dict[str, Any]]
    """Text blocks, Anthropic's shape (``cache_control`` markers included)."""
    messages: list[dict[str, Any]]
    """The conversation in Anthropic's shape: the history's canonical form, whatever the
    provider (an adapter for another API converts it). When ``history`` is set, these are the
    messages after it (the last message of the history, the input, this turn's); the whole
    conversation is :meth:`conversation`."""
    tools: list[dict[str, Any]]
    """Our tools (``name``, ``description``, ``input_schema``) and the provider's server tools
    (those with a ``type``), in Anthropic's shape."""
    max_tokens: int
    reasoning: Reasoning | None = None
    history: bytes = b""
    """The messages before ``messages``, as stored: JSON array items joined by commas, in the
    same shape. Not decoded by the turn (a window's worth of objects per call); an adapter that
    needs them as objects calls :meth:`conversation`."""

    def conversation(self) -> list[dict[str, Any]]:
        """Every message as objects, in a new list (the history decoded afresh)."""
        return joined(self.history, self.messages)

    def size(self) -> int:
        """The bytes of the whole conversation as one JSON array, without decoding it."""
        tail = len(_ENCODE(self.messages))
        if not self.history:
            return tail
        return len(self.history) + tail + (1 if self.messages else 0)


def joined(history: bytes, tail: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages of ``history`` (JSON array items joined by commas) decoded, then ``tail``,
    in a new list."""
    if not history:
        return list(tail)
    decoded: list[dict[str, Any]] = _DECODE(b"[" + history + b"]")
    decoded.extend(tail)
    return decoded


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    server_tool_requests: dict[str, int] = msgspec.field(default_factory=dict)
    """Server tool uses the provider bills, by kind (``web_search_requests``: 2)."""

    @property
    def prompt_tokens(self) -> int:
        """Everything the model read: uncached input plus cache reads and writes."""
        return self.input_tokens + self.cache_read_tokens + self.cache_write_tokens


class TextDelta(msgspec.Struct, frozen=True):
    """Reply text as it streams: ``kind`` ``text`` is the answer, ``reasoning`` the model's
    thinking (never part of the answer)."""

    text: str
    kind: Literal["text", "reasoning"] = "text"


class Retrying(msgspec.Struct, frozen=True, kw_only=True):
    """The request failed before its first byte and will be sent again after ``delay_ms``."""

    status: int
    attempt: int
    delay_ms: int
    error: str


class Completed(msgspec.Struct, frozen=True, kw_only=True):
    content: list[dict[str, Any]]
    """The assistant message as the model sent it, block by block in Anthropic's shape: ``text``
    (with ``citations``), ``thinking`` (with its ``signature``), ``redacted_thinking``,
    ``tool_use``, ``server_tool_use`` and the server tools' ``*_tool_result`` blocks,
    ``compaction``, and any type not known yet, kept whole so it can be sent back. A
    ``tool_use`` whose input did not parse has ``input: {}`` and ``invalid_json`` (our note,
    never sent to the API)."""
    stop_reason: str
    """In Anthropic's words (``end_turn``, ``tool_use``, ``max_tokens``, ``refusal``,
    ``pause_turn``, ``stop_sequence``, ``model_context_window_exceeded``); adapters for other
    APIs map theirs."""
    usage: Usage
    first_token_ms: int | None = None


ModelEvent = TextDelta | Retrying | Completed


class ModelError(DispachError):
    """A model call failed for good (after retries where retrying made sense)."""

    code = "model_error"

    def __init__(self, code: str, message: str, hint: str, *, status: int = 0) -> None:
        super().__init__(message, hint)
        self.code = code
        self.status = status


class Model(Protocol):
    """A model the turn engine can call; ``label`` says which (shown to operators)."""

    label: str

    def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        """Stream one reply: text deltas as they come, then exactly one ``Completed`` — or raise
        ``ModelError``. Retries before the first byte are announced with ``Retrying``."""
        ...

    async def aclose(self) -> None:
        """Release connections (the node is stopping)."""
        ...

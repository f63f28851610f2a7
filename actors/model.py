"""The port to a language model: what the turn engine sends and what it gets back.

Implementations live in ``gateways/model/`` (Anthropic through the official SDK, and the offline
scripted model). The turn engine only sees these types.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import msgspec

from eventstore.errors import DispachError


class ModelRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    system: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    max_tokens: int


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        """Everything the model read: uncached input plus cache reads and writes."""
        return self.input_tokens + self.cache_read_tokens + self.cache_write_tokens


class TextDelta(msgspec.Struct, frozen=True):
    text: str
    kind: str = "text"


class Retrying(msgspec.Struct, frozen=True, kw_only=True):
    """The request failed before its first byte and will be sent again after ``delay_ms``."""

    status: int
    attempt: int
    delay_ms: int
    error: str


class Completed(msgspec.Struct, frozen=True, kw_only=True):
    content: list[dict[str, Any]]
    """The assistant message: ``text`` and ``tool_use`` blocks as the model sent them."""
    stop_reason: str
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

"""What several events carry: how a turn ended, an error, token counts, where a reply goes,
who sent a message, a budget handed down, a slot of the context."""

from __future__ import annotations

from typing import Literal

import msgspec

EndReason = Literal[
    "final", "stopped", "max_steps", "timeout", "output_limit", "truncated", "refused", "error"
]
"""How a turn ended. ``truncated``: a reply cut off by the per-call output limit (its text kept,
a cut-off tool call never run); ``output_limit``: the turn's own output budget is spent;
``refused``: the model declined (its partial text kept)."""


class ErrorDetail(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    code: str
    message: str
    hint: str
    field: str | None = None


class Tokens(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    prompt: int = 0
    output: int = 0
    cache_read: int = 0
    cache_write: int = 0


class Deliver(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Where a turn's reply goes: a channel of the agent and a recipient on it (a Telegram chat
    id, a webhook's label), plus a thread where the channel has them (a forum topic)."""

    channel: str
    to: str
    thread: str | None = None


class Sender(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Who sent the message, as the caller says (Dispach v1's ``from``)."""

    id: str
    name: str | None = None
    kind: Literal["user", "agent"] = "user"


class Budget(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """What a turn started by another turn (a handoff's member turn) may spend at most: the
    parent's remaining steps, seconds and output tokens when it started. The turn runs under
    the smaller of this and its own agent's limits."""

    max_steps: int | None = None
    turn_timeout_s: float | None = None
    max_output_tokens: int | None = None


class ContextSlot(msgspec.Struct, frozen=True, kw_only=True):
    slot: int
    label: str
    tokens: int
    pinned: bool

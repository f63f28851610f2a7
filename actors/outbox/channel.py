"""The port a delivery channel implements (Telegram, webhook: see gateways/channels/).

A channel is a transport only: chunking, ordering, retries, deduplication and recovery live in the
outbox. It says how long a message may be, whether its provider deduplicates a resend by key
(``idempotent``), and what to do with an item whose send may or may not have happened
(``on_uncertain``): the node died in its send window, or the send's answer never came.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

import msgspec


class Outbound(msgspec.Struct, frozen=True, kw_only=True):
    """One chunk to send."""

    key: str
    """The item's derived id: an idempotent provider gets it as the idempotency key."""
    agent_id: str
    session_key: str
    turn_id: str
    to: str
    thread: str | None
    text: str
    chunk_index: int
    chunk_total: int
    attempt: int
    uncertain: bool
    """A resend of an item whose earlier send may have reached the provider."""


class SendResult(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    provider_message_id: str | None = None
    retryable: bool = False
    in_doubt: bool = False
    """The request may have reached the provider and been acted on, and no answer says whether
    (the connection dropped or timed out after the request went out): the same doubt as a node
    dying in its send window. The outbox records ``delivery.uncertain`` and follows the channel's
    ``on_uncertain``; only a failure that proves the request was not taken (refused, DNS, an
    answer saying so) is retried blindly."""
    code: str = ""
    """A stable code for the failure (``delivery_provider_unavailable``, ...)."""
    error: str = ""
    retry_after_s: float | None = None
    """The provider asked to wait this long (Telegram's ``retry_after``, HTTP Retry-After)."""


class Channel(Protocol):
    id: str
    type: str
    idempotent: bool
    on_uncertain: Literal["resend", "skip"]
    max_chars: int
    backoff_s: tuple[float, ...]
    """Pauses before the 2nd, 3rd, ... attempt (jittered); their count + 1 bounds the attempts."""
    concurrency: int
    """How many sends may be in flight at once on this channel."""
    ordered: bool
    """Replies to one recipient arrive in the order they were promised (a chat), even across
    turns and retries; otherwise only a reply's own chunks are kept in order."""
    measure: Callable[[str], int]
    """How the provider counts a message's length (Telegram: UTF-16 code units)."""
    allow_from: frozenset[str]
    """Inbound: who may talk to the agent (ids, ``@handles``, or ``*``); empty admits nobody."""
    singleton: str | None
    """Inbound runs on one node of the cluster at a time, under this lease (a bot's long poll:
    two pollers would split its updates); None: every node takes inbound (webhooks)."""

    def target_problem(self, to: str, thread: str | None) -> str | None:
        """Why ``to`` (and ``thread``) cannot be a recipient on this channel, or None: checked
        when a message is accepted, so a bad target is a 400, not a failed delivery later."""
        ...

    async def send(self, item: Outbound) -> SendResult:
        """Send one chunk. Never raises for a provider or network failure: it is a result."""
        ...

    async def start(self, inbound: Inbound) -> None:
        """Begin taking messages in (a long-poll loop, say); return once started."""
        ...

    async def stop(self) -> None:
        """Stop taking messages in (the node is draining)."""
        ...

    async def pause(self, paused: bool) -> None:
        """Hold inbound while the agent is stopped (True), take it again once it is started
        (False): the provider keeps what arrives meanwhile (a bot's updates wait unfetched),
        so nothing is refused and nothing is lost. Started or not, the channel remembers it."""
        ...

    async def aclose(self) -> None:
        """Release the transport (after the outbox has stopped sending)."""
        ...


class InboundMessage(msgspec.Struct, frozen=True, kw_only=True):
    """A message that reached the agent through a channel, in the channel's own terms."""

    channel_id: str
    update_id: str
    """The provider's id of this delivery: the same id twice is the same message."""
    peer: str
    """The conversation (a Telegram chat id): one session per peer (and thread)."""
    thread: str | None = None
    sender_id: str
    sender_handle: str | None = None
    sender_name: str | None = None
    text: str | None
    """None when the message holds nothing the agent can read (a sticker, a photo)."""


class Inbound(Protocol):
    """What a channel hands an inbound message to (the node's channel host)."""

    async def receive(self, message: InboundMessage) -> None: ...

"""The request and response bodies of the HTTP API, as msgspec types.

Handlers decode and encode with these, and ``/v1/openapi.json`` is generated from the same types,
so the document cannot drift from the code. Field names are camelCase on the wire (Dispach v1's).
"""

from __future__ import annotations

import typing
from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec

from actors.usage import Bucket
from eventstore import WireEvent
from eventstore.catalogue import Deliver, Sender

Policy = Literal["queue", "reject", "interrupt"]


class _Body(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    pass


class MessageBody(_Body, frozen=True):
    """``POST /v1/agents/{agent}/messages``. Unknown fields are ignored (v1 clients may send
    newer ones)."""

    text: str
    session_key: str = "api:default"
    deliver: Deliver | Literal["none"] | None = None
    concurrency: Policy | None = None
    stream: bool = False
    """Answer ``202`` with the turn's SSE stream as the body (Dispach v1)."""
    chunks: bool = False
    """With ``stream``: include ``model.chunk`` text deltas."""
    reasoning: bool = False
    """With ``stream``: include ``model.chunk`` deltas of the model's thinking (kind
    ``reasoning``), with or without ``chunks``."""
    sender: Sender | None = msgspec.field(default=None, name="from")


class AcceptedBody(_Body, frozen=True):
    turn_id: str
    session_key: str
    replayed: bool = False
    """Present (true) when an Idempotency-Key named a turn accepted before; nothing new runs."""


class DeliveryInfo(_Body, frozen=True):
    """Where a turn's reply went: one entry per channel and recipient, over its chunks."""

    channel: str
    to: str
    status: Literal["pending", "sending", "sent", "failed", "uncertain"]
    """``sent`` when every chunk is; ``failed`` when one failed for good (the rest were
    abandoned); ``uncertain`` when settled without knowing (on_uncertain: skip, or the attempts
    ran out while in doubt)."""
    chunks: int
    sent: int
    attempts: int
    thread: str | None = None
    uncertain: bool = False
    """A chunk was in doubt (a crash in its send window, or its answer was lost): resent, it may
    show twice; settled as ``uncertain``, it may never have arrived."""
    error_code: str | None = None


class CallUsage(_Body, frozen=True):
    """One model call of a turn: what it read (cache reads and writes included) and wrote."""

    prompt_tokens: int
    output_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    latency_ms: int
    finish_reason: str
    model: str | None = None
    """The model that answered; None for calls logged before ``model.result`` named it."""
    server_tool_requests: dict[str, int] = msgspec.field(default_factory=dict)
    cost_usd: float | None = None
    """What the call cost by the node's price table; None when it cannot be known."""


class HandoffInfo(_Body, frozen=True):
    """One handoff of a supervisor's turn: its member's turn, and once it is over, how it went
    (docs/events.md, ``handoff.result``)."""

    call_id: str
    member: str
    session_key: str
    turn_id: str
    outcome: str
    """``running`` until ``handoff.result``, then its outcome."""
    turn_ids: list[str] = msgspec.field(default_factory=list)
    steps: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    repaired: bool = False
    error_code: str | None = None


class TurnResource(_Body, frozen=True):
    """The stored turn: ``status`` is ``running`` until the end, then the end reason."""

    turn_id: str
    agent_id: str
    session_key: str
    status: str
    state: str
    source: str
    input: str
    text: str
    reasoning: str
    """What the model thought (its thinking blocks' texts, calls apart by a blank line); empty
    when it did not think or its provider shows none (a redacted block)."""
    steps: int
    attempt: int
    prompt_tokens: int
    output_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    started_at: datetime
    cost_usd: float | None
    """What the turn's model calls cost by the node's price table (``calls`` item by item);
    None when a call's model has no price, ``costReason`` then says which."""
    error_code: str | None = None
    error_message: str | None = None
    error_hint: str | None = None
    ended_at: datetime | None = None
    duration_ms: int | None = None
    deliveries: list[DeliveryInfo] = msgspec.field(default_factory=list)
    """Present when the turn's reply was promised to a channel (``deliver``)."""
    calls: list[CallUsage] = msgspec.field(default_factory=list)
    """Each model call's usage, in order."""
    handoffs: list[HandoffInfo] = msgspec.field(default_factory=list)
    """A supervisor's handoffs, in the order its calls started (ours)."""
    archived: bool = False
    """The turn's events were archived with their partition of the log (``dispach log
    archive``): this resource still answers, its events and stream answer ``410
    cursor_archived`` until ``dispach log restore`` of ``archive_id``."""
    archive_id: str | None = None
    cost_reason: str | None = None


class TurnPage(_Body, frozen=True):
    turns: list[TurnResource]
    next_before: str | None = None
    """Pass as ``before`` for the next (older) page."""


class EventsPage(_Body, frozen=True):
    events: list[WireEvent]
    next: str | None = None
    """The cursor of the last event: pass as ``after`` to read on."""


class StopAnswer(_Body, frozen=True):
    turn_id: str
    stopping: bool
    state: str
    """``stopping`` (it was running), ``stopped`` (it was queued)."""


class ToolInfo(_Body, frozen=True):
    """A tool of an agent (``GET …/tools``: v1's ``slug, summary, mutating, trust, provider``;
    ``policy`` and ``timeoutS`` ours). No field has a default, so every one is always sent: v1
    clients read ``trust`` and ``provider`` without a fallback."""

    slug: str
    summary: str
    mutating: bool
    trust: Literal["trusted", "untrusted"]
    """``untrusted``: what it returns comes from outside (``untrusted_output``), so the turn's
    mutating calls after it need approval."""
    provider: str
    """Where the tool runs: ``local`` (in the node: built-ins and Python tools) or
    ``mcp:<server>`` (an MCP server the manifest declares)."""
    policy: Literal["allow", "deny", "ask"]
    """``ask``: each call waits for a person's approval; ``deny``: never run."""
    timeout_s: float
    """Seconds a call may run (the tool's own, else the agent's ``limits.tool_timeout_s``)."""


class SkillInfo(_Body, frozen=True):
    """One of an agent's skills: what a turn's words are matched against, and its size."""

    id: str
    title: str
    description: str
    tokens: int
    """Tokens its section of a skills block takes."""
    pinned: bool
    digest: str
    """The version of its file this node loaded (``skill.selected`` names it)."""


class SkillSelection(_Body, frozen=True):
    """How the agent's turns select skills (its manifest's ``skills``)."""

    dir: str | None
    max: int
    max_tokens: int
    pinned: list[str]
    ranking: str


class MemoryRecall(_Body, frozen=True):
    """How the agent's turns recall the session's notes (its manifest's ``memory.recall``)."""

    recall: bool
    max: int
    max_tokens: int


class SkillList(_Body, frozen=True):
    """``GET …/skills``: the agent's skills and how each turn selects among them (v1 0.1.0
    answered ``{skills: [], supported: false}``; ``supported`` stays, now true)."""

    skills: list[SkillInfo]
    supported: bool
    selection: SkillSelection
    memory: MemoryRecall


class PhaseBody(_Body, frozen=True):
    """``POST …/sessions/{key}/phase`` (v1): a phase the agent declares, or null for its entry
    phase."""

    phase: str | None


class PhaseSet(_Body, frozen=True):
    """The session's phase after ``POST …/phase``, and how many tools it shows the model."""

    phase: str
    tools: int


class AgentInfo(_Body, frozen=True):
    """An agent as the API shows it (``GET /v1/agents`` lists these without ``detail``)."""

    id: str
    name: str
    status: str
    model: str
    provider: str
    channels: list[str] = msgspec.field(default_factory=list)
    phase: str | None = None
    version: str = ""
    disabled_at: str | None = None
    disabled_by: str | None = None
    reason: str | None = None
    addressable: bool = True
    """Whether messages reach it from outside (HTTP, WebSocket, NATS, schedules, channels): a
    team's member, by default, takes work only from its supervisor's handoff."""
    member_of: list[str] = msgspec.field(default_factory=list)
    """The supervisors whose team it is in (their ``members`` name it)."""


class AgentDetail(_Body, frozen=True):
    id: str
    name: str
    status: str
    model: str
    provider: str
    tools: int
    tool_list: list[ToolInfo]
    concurrency: Policy
    limits: dict[str, Any]
    max_output_tokens: int
    skills: int = 0
    schedules: int = 0
    channels: list[str] = msgspec.field(default_factory=list)
    warnings: list[str] = msgspec.field(default_factory=list)
    phase: str | None = None
    """The entry phase, where a new session starts (null: the agent declares no phases)."""
    entry_phase: str | None = None
    """v1's name for ``phase``."""
    phases: dict[str, int] = msgspec.field(default_factory=dict)
    """The phases the manifest declares, in order, each with how many tools it shows."""
    members: list[str] = msgspec.field(default_factory=list)
    """The agents it hands tasks to (its team); empty for an agent without members."""
    addressable: bool = True
    """Whether messages reach it from outside (a member of a team, by default, is not)."""
    member_of: list[str] = msgspec.field(default_factory=list)
    """The supervisors whose team it is in."""
    version: str = ""
    """The content hash of the manifest this node runs for new turns (``agent.reloaded``)."""
    disabled_at: str | None = None
    disabled_by: str | None = None
    reason: str | None = None
    """Why it was stopped, as the caller said."""
    reloaded_at: str | None = None


Who = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._@:-]+$")]


class AgentChangeBody(_Body, frozen=True):
    """``POST …/reload``, ``…/stop``, ``…/start`` (every field optional, the body too):
    ``by`` names the caller on the record (``api`` when absent), ``reason`` why it stops."""

    by: Who | None = None
    reason: Annotated[str, msgspec.Meta(max_length=500)] | None = None


class AgentState(_Body, frozen=True):
    """What a reload, stop or start left: the agent's status (v1's ``loaded`` or ``disabled``)
    and version on the node asked, whether this request changed anything (a stop of a stopped
    agent does not), and what a reload could not change while the node runs (``warnings``).
    The other nodes fold the same event from the log within about a second."""

    id: str
    status: str
    version: str
    changed: bool
    previous_version: str | None = None
    disabled_at: str | None = None
    disabled_by: str | None = None
    reason: str | None = None
    reloaded_at: str | None = None
    warnings: list[str] = msgspec.field(default_factory=list)


class ForkOrigin(_Body, frozen=True):
    """The session, and the turn of it, a session was forked from."""

    agent_id: str
    session_key: str
    turn_id: str


class SessionSummary(_Body, frozen=True):
    agent_id: str
    session_key: str
    turns: int
    messages: int
    created_at: datetime
    updated_at: datetime
    last_activity_at: datetime
    forked_from: ForkOrigin | None
    """Where the session's history began (``POST …/fork``), null for one that was not forked
    (always present)."""
    last_turn_status: str | None
    """The last turn's ``status``: ``running``, or how it ended (an end reason); null for a
    session without a turn (always present)."""
    last_turn_at: datetime | None
    """When the last turn started; null for a session without a turn (always present)."""
    last_turn_id: str | None = None
    cleared_at: datetime | None = None
    phase: str | None = None
    """The phase the session is in (its next turn's tools); null when the agent has none."""


class ForkBody(_Body, frozen=True):
    """``POST /v1/agents/{agent}/sessions/{key}/fork``."""

    at_turn: int | float | str
    """A turnId of the session, or a turn's 1-based index among its turns (oldest first). An
    index may come as a JSON number with a zero fraction (``3.0``): JSON Schema's ``integer``
    takes it, so a client generated from the document may send one."""
    new_key: str | None = None
    """The new session's key (default: ``<key>.fork-<6 hex digits>``)."""
    agent: str | None = None
    """The new session's agent (default: the session's own)."""


class ForkSource(_Body, frozen=True):
    agent_id: str
    session_key: str
    turn_id: str
    turns: int
    """How many turns' history was copied."""


class ForkedBody(_Body, frozen=True):
    agent_id: str
    session_key: str
    forked_from: ForkSource
    messages: int
    """How many history rows were copied."""


DeliveryStatus = Literal["pending", "retrying", "sending", "sent", "failed", "uncertain"]
DELIVERY_STATUSES: tuple[str, ...] = typing.get_args(DeliveryStatus)


class DeliveryError(_Body, frozen=True):
    """Why the item's last attempt did not deliver it, as the channel said (its provider's
    answer, with any credential redacted at the channel)."""

    code: str | None
    """Stable (``delivery_http_503``, ``delivery_timeout``, ``delivery_chunk_abandoned``...)."""
    message: str | None


class DeliveryItem(_Body, frozen=True):
    """One outbox item: one chunk of one reply to one recipient (``GET …/deliveries``). Every
    field is always sent, null included. The reply's text is not in it."""

    id: str
    channel: str
    to: str
    thread: str | None
    session_key: str
    turn_id: str
    chunk_index: int
    chunk_total: int
    status: DeliveryStatus
    """``pending`` (no attempt yet), ``retrying`` (an attempt failed or was in doubt; the next
    is due at ``nextAttemptAt``), ``sending`` (an attempt is in flight), ``sent``, ``failed``
    (for good, or abandoned with an earlier chunk), ``uncertain`` (settled without knowing
    whether it arrived)."""
    attempts: int
    uncertain: bool
    """An attempt was in doubt: a ``sent`` item may have arrived twice."""
    last_error: DeliveryError | None
    """The last failure's code and message (null once sent, or before any failure)."""
    provider_message_id: str | None
    created_at: datetime
    updated_at: datetime
    sent_at: datetime | None
    next_attempt_at: datetime | None
    """When a ``pending`` or ``retrying`` item is next tried; null otherwise."""


class DeliveryList(_Body, frozen=True):
    deliveries: list[DeliveryItem]
    """Newest first."""


class StoredMessage(_Body, frozen=True):
    """One history row. ``id`` is its log position: the only total order."""

    id: int
    session_key: str
    turn_id: str
    role: Literal["user", "assistant", "tool"]
    content: str
    created_at: datetime | None = None
    tool_calls: list[dict[str, str]] | None = None
    """The tools the model asked for (``{id, name}``; arguments stay in the log)."""
    tool_call_id: str | None = None
    origin: Literal["observation", "call"] | None = None
    is_error: bool = False


class MessagePage(_Body, frozen=True):
    messages: list[StoredMessage]
    """Newest first."""
    next_before: int | None = None


class ClearedBody(_Body, frozen=True):
    cleared: str
    memory_files_kept: bool
    """v1's flag that the agent's memory, what it keeps beyond one session (v1: its memory
    markdown files), outlived the clear. True: a clear touches nothing beyond the session (and
    the log keeps every event); what the session itself had is in ``reset``."""
    reset: list[str] = msgspec.field(default_factory=lambda: ["history", "notes", "phase"])
    """What the session's next turn starts without: its history, its session notes (they are
    the session's, not the agent's memory), and its phase (back to the entry phase)."""


class Health(_Body, frozen=True):
    status: str
    version: str
    node_id: str
    uptime_ms: int
    agents: int


class Ready(_Body, frozen=True):
    ready: bool
    phase: str
    checks: dict[str, bool]
    warnings: list[str] = msgspec.field(default_factory=list)
    """Ready, but serving less well than it should: e.g. an append left open (live streams wait
    for it) or a transaction holding vacuum back, named by pid and age."""


class UsagePage(_Body, frozen=True):
    """``GET /v1/usage``: the usage meter's calls in ``[from, to)`` grouped by ``by``, each
    bucket with its cost by the node's price table (None, with ``costReason``, when a model
    in it has no price)."""

    by: list[str]
    buckets: list[Bucket]
    from_: datetime | None = msgspec.field(default=None, name="from")
    to: datetime | None = None
    truncated: bool = False
    """More buckets matched than the page holds (10,000): narrow the range or the grouping."""

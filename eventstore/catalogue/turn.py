"""A turn's lifecycle, in its stream ``turn-<turnId>``: start and attempts, the context sent,
compaction, model calls and chunks, tool calls and their results, approvals, handoffs to team
members, the end."""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

from eventstore.catalogue.shared import (
    Budget,
    ContextSlot,
    Deliver,
    EndReason,
    ErrorDetail,
    Sender,
    Tokens,
)
from eventstore.event import Event, register

# --- turn lifecycle (stream turn-<turnId>) -------------------------------------------------------


class TurnStart(Event, frozen=True):
    """The acceptance event: a turn exists once this is committed (202 means durable)."""

    TYPE: ClassVar[str] = "turn.start"
    PRIVATE: ClassVar[frozenset[str]] = frozenset({"idempotency_key", "request_hash"})
    source: str
    input_tokens: int = 0
    input: str = ""
    trust: str = "trusted"
    deliver: Deliver | None = None
    idempotency_key: str | None = None
    """The caller's ``Idempotency-Key``: the turn's id is derived from it (see actors/ids.py)."""
    request_hash: str | None = None
    """A digest of what was asked (text, session, delivery): a replay must match it."""
    sender: Sender | None = None
    attempt: int = 0
    """Catalogue v2: 1 when the accept is also the start of the turn's first attempt (its
    session was idle, so the turn runs as soon as this commits, on ``node``), with no
    ``turn.attempt`` after it; 0 for a turn accepted behind another (its ``turn.attempt``
    follows when it starts) and in every v1 event."""
    node: str | None = None
    """With ``attempt`` 1: the node that accepted the turn and runs it."""
    budget: Budget | None = None
    """A member turn of a handoff: the parent turn's budget left when it was handed the task;
    None for every other turn."""


class TurnAttempt(Event, frozen=True):
    """A node began (attempt 1) or resumed (attempt > 1, after a crash) running the turn.

    Catalogue v2: a turn accepted on an idle session begins in its ``turn.start``
    (``attempt`` 1) and has this event only when it is resumed."""

    TYPE: ClassVar[str] = "turn.attempt"
    attempt: int
    node: str
    resumed_from_step: int = 0


class ContextView(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """What one model call reads, block by block (estimated tokens; ``pinned`` blocks are never
    compacted), with the budget it was assembled against: ``model.call.context``."""

    slots: list[ContextSlot]
    total: int
    budget: int = 0
    """The prompt budget: the model's window less the output reserve."""
    window: int = 0
    breakpoints: int = 0
    """How many ``cache_control`` breakpoints the request carries (at most 4)."""


class Pressure(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """How full the prompt budget is after compaction: ``model.call.pressure`` (see
    :class:`ContextPressure` for the fields)."""

    fraction: float
    tokens: int
    budget: int
    source: Literal["reported", "corrected", "estimated"]
    peak: float | None = None


class ContextAssembled(Event, frozen=True):
    """What a request reads, block by block, with the budget it was assembled against.

    v2 writes it only for a request over its budget, never sent (with its ``context.pressure``);
    a sent request carries it as ``model.call.context``. v1 wrote it before every model call,
    and eventstore/upcast.py reads those as v2."""

    TYPE: ClassVar[str] = "context.assembled"
    slots: list[ContextSlot]
    total: int
    budget: int = 0
    """The prompt budget: the model's window less the output reserve."""
    window: int = 0
    breakpoints: int = 0
    """How many ``cache_control`` breakpoints the request carries (at most 4)."""


class ContextPressure(Event, frozen=True):
    """How full the prompt budget is after compaction: ``tokens / budget``. ``source`` says
    where the figure comes from: ``estimated`` (local), ``corrected`` (local, scaled by what
    the provider reported for this session's earlier calls) or ``reported`` (counted by the
    provider's count_tokens for this very request).

    v2 writes it only beside a ``context.assembled`` of a request over its budget, never sent;
    a sent request carries both in its ``model.call`` (v1 wrote them before it)."""

    TYPE: ClassVar[str] = "context.pressure"
    fraction: float
    tokens: int
    budget: int
    source: Literal["reported", "corrected", "estimated"]
    peak: float | None = None
    """The fraction before compaction ran, when it did."""


class CompactionStage(Event, frozen=True):
    """One rung of the compaction ladder ran before a model call. The stored history is never
    rewritten: ``ids`` (the observations it excerpted, dropped as superseded or stubbed) and,
    for ``digest``/``reset``, the digest itself are enough to rebuild the view the model read."""

    TYPE: ClassVar[str] = "compaction.stage"
    PRIVATE: ClassVar[frozenset[str]] = frozenset({"text", "requests"})
    stage: str
    before: int
    after: int
    changed: bool = True
    digest: Literal["model", "mechanical"] | None = None
    ids: list[str] = msgspec.field(default_factory=list)
    """Observation (tool_use) ids the stage marked, oldest first."""
    through: int | None = None
    """digest/reset: the log position of the turn.start of the last turn the digest covers."""
    turns: int = 0
    """digest/reset: how many turns the digest covers in all."""
    text: str | None = None
    requests: list[str] | None = None
    """digest/reset: the person's requests the digest covers, verbatim."""
    archived: int = 0
    """digest/reset: how many of the earliest requests the digest summarises instead of listing
    (when the list would outgrow its share of the budget)."""
    kept: dict[str, str] | None = None
    """digest/reset: the marks still applying to the turns the digest left out."""
    fallback: str | None = None
    """Why a configured compactor model was not used (its error), when it was not."""


class ModelCall(Event, frozen=True):
    """A model call is sent. Catalogue v2 carries what it reads (``context``) and how full
    that is (``pressure``), which v1 wrote as ``context.assembled`` and ``context.pressure``
    just before it, always in the same commit."""

    TYPE: ClassVar[str] = "model.call"
    role: Literal["main", "selector", "compactor"]
    model: str
    prompt_tokens: int
    cached: bool = False
    attempt: int = 1
    context: ContextView | None = None
    pressure: Pressure | None = None
    agent_version: str | None = None
    """The version of the agent that made the call: the content hash of its manifest (see
    ``agent.reloaded``). A turn runs on one version from its first call to its end."""


class ModelChunk(Event, frozen=True):
    """Coalesced text deltas; the live stream and the replay carry exactly these."""

    TYPE: ClassVar[str] = "model.chunk"
    delta: str
    kind: Literal["text", "reasoning"] = "text"


class ModelRetry(Event, frozen=True):
    TYPE: ClassVar[str] = "model.retry"
    status: int
    attempt: int
    delay_ms: int


class ModelResult(Event, frozen=True):
    """One model call finished (or was cut short: ``finish_reason`` says how). ``content`` is the
    assistant message as the model sent it, every block kept whole (text with citations,
    thinking with its signature, tool uses, server tool uses and results, compaction): it is
    kept in the log for the transcript, sent back to the model as it came, and never sent on
    public streams. ``text`` is the answer's prose only, never the model's reasoning.

    ``discarded``: a reply cut off by ``max_tokens`` that the turn sent again with a larger
    budget (``model.truncation: retry``); it is not part of the conversation."""

    TYPE: ClassVar[str] = "model.result"
    PRIVATE: ClassVar[frozenset[str]] = frozenset({"content"})
    output_tokens: int
    prompt_tokens: int
    finish_reason: str
    latency_ms: int
    prompt_tokens_reported: int | None = None
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    first_token_ms: int | None = None
    text: str = ""
    error: ErrorDetail | None = None
    content: list[dict[str, object]] | None = None
    discarded: bool = False
    server_tool_requests: dict[str, int] | None = None
    """Server tool uses the provider counted for this call (``webSearchRequests``: 2)."""
    model: str | None = None
    """The model that answered (its ``model.call``'s), so that the call's usage can be priced
    without pairing events; None in logs written before it was recorded."""


class ToolCall(Event, frozen=True):
    """A tool call the model asked for. ``args`` stays in the log; streams carry ``argsHash``."""

    TYPE: ClassVar[str] = "tool.call"
    PRIVATE: ClassVar[frozenset[str]] = frozenset({"args"})
    REVEALABLE: ClassVar[frozenset[str]] = frozenset({"args"})
    slug: str
    call_id: str
    args_hash: str
    mutating: bool
    args: dict[str, object] | None = None
    server: bool = False
    """A server tool (web search, web fetch, code execution): the provider ran it within the
    model call; the event records it (its input and result are in ``model.result.content``)."""
    source: str | None = None
    """``mcp``: a tool of an MCP server (named by ``mcp_server``); None: of this node."""
    mcp_server: str | None = None


class ToolResult(Event, frozen=True):
    TYPE: ClassVar[str] = "tool.result"
    PRIVATE: ClassVar[frozenset[str]] = frozenset({"output", "content"})
    REVEALABLE: ClassVar[frozenset[str]] = frozenset({"output", "content"})
    slug: str
    call_id: str
    ok: bool
    latency_ms: int
    bytes: int
    truncated: bool = False
    trust: str = "trusted"
    uncertain: bool = False
    output: str | None = None
    refused: bool = False
    """The call was not run because a policy or a person said no: reported to the model as a
    refusal, not as an error of the tool."""
    server: bool = False
    """The result of a server tool, run by the provider (see ``tool.call.server``): not sent
    back as a ``tool_result`` (it is a block of the model's own reply)."""
    error_code: str | None = None
    """Why ``ok`` is false: ``tool_failed``, ``tool_timeout``, ``tool_error`` (the tool said it
    failed), ``tool_unavailable`` (its MCP server is down), ``tool_cancelled``."""
    content: list[dict[str, object]] | None = None
    """The result as the model reads it when it is more than text: a text block and image
    blocks (``output`` is then the text)."""
    source: str | None = None
    mcp_server: str | None = None


class ToolGated(Event, frozen=True):
    TYPE: ClassVar[str] = "tool.gated"
    slug: str
    call_id: str
    reason: str
    policy: str


class ToolRepair(Event, frozen=True):
    TYPE: ClassVar[str] = "tool.repair"
    slugs: list[str]
    errors: list[str]


class ApprovalRequested(Event, frozen=True):
    """A call waits for a person. ``args`` (private, revealable: the person deciding reads them
    with the API token) is what the call would run with; events from before it was recorded have
    none."""

    TYPE: ClassVar[str] = "approval.requested"
    PRIVATE: ClassVar[frozenset[str]] = frozenset({"args"})
    REVEALABLE: ClassVar[frozenset[str]] = frozenset({"args"})
    approval_id: str
    slug: str
    call_id: str
    mutating: bool
    reason: str
    match: str | None = None
    expires_at: str = ""
    """ISO 8601: unanswered by then, the request is resolved as denied (by ``timeout``)."""
    args: dict[str, object] | None = None


class ApprovalResolved(Event, frozen=True):
    TYPE: ClassVar[str] = "approval.resolved"
    approval_id: str
    slug: str
    granted: bool
    by: str


class TurnStopping(Event, frozen=True):
    TYPE: ClassVar[str] = "turn.stopping"
    reason: Literal["stopped", "timeout", "interrupted"] = "stopped"
    by: str | None = None


class TurnEnd(Event, frozen=True):
    """Exactly one per turn; the turn resource's ``status`` becomes ``reason``."""

    TYPE: ClassVar[str] = "turn.end"
    reason: EndReason
    steps: int
    tokens: Tokens
    duration_ms: int
    text: str = ""
    error: ErrorDetail | None = None


# --- handoffs (in the supervisor's turn stream) -------------------------------------------------

HandoffOutcome = Literal["ok", "invalid", "error", "timeout", "budget", "refused"]
"""How a handoff ended: ``ok`` (a valid artifact), ``invalid`` (no valid artifact after the
repair round), ``error`` (the member's turn failed), ``timeout`` (it ran out of time),
``budget`` (out of steps or output tokens), ``refused`` (the member's session refused it)."""


class HandoffStart(Event, frozen=True):
    """A supervisor's ``handoff`` call started a member's turn: committed before the member's
    turn is asked for, so after a crash the parent waits for that turn instead of starting
    another. The task text is the member turn's ``turn.start`` input."""

    TYPE: ClassVar[str] = "handoff.start"
    call_id: str
    member: str
    session_key: str
    """The member's own session for this handoff (``handoff:<parent turn>:<call>``)."""
    turn_id: str
    """The member's first turn (the repair round, if any, is another turn of the session)."""
    budget: Budget | None = None


class HandoffResult(Event, frozen=True):
    """What a handoff came to, with what it cost (every member turn of it, the repair round's
    included). The artifact itself is the call's ``tool.result`` output."""

    TYPE: ClassVar[str] = "handoff.result"
    call_id: str
    member: str
    session_key: str
    outcome: HandoffOutcome
    turn_ids: list[str]
    steps: int
    tokens: Tokens
    repaired: bool = False
    """A repair round ran (the first reply was not a valid artifact)."""
    error: ErrorDetail | None = None


register(
    TurnStart,
    TurnAttempt,
    ContextAssembled,
    ContextPressure,
    CompactionStage,
    ModelCall,
    ModelChunk,
    ModelRetry,
    ModelResult,
    ToolCall,
    ToolResult,
    ToolGated,
    ToolRepair,
    ApprovalRequested,
    ApprovalResolved,
    TurnStopping,
    TurnEnd,
    HandoffStart,
    HandoffResult,
)

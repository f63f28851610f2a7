"""Commands between the edges and the actors, and their replies (msgspec, JSON on NATS)."""

from __future__ import annotations

from itertools import accumulate
from typing import Any, AnyStr, Literal, Protocol

import msgspec

from actors.schedule.plan import ScheduleSpec
from eventstore.catalogue import Budget, Deliver, Sender

Policy = Literal["queue", "reject", "interrupt"]


class Submit(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """A message for an agent's session: accepted as a turn, or refused."""

    agent_id: str
    session_key: str
    text: str
    source: str = "api"
    deliver: Deliver | None = None
    concurrency: Policy | None = None
    idempotency_key: str | None = None
    sender: Sender | None = None
    turn_id: str | None = None
    """Set by the engine for a keyed message (derived from the key); otherwise minted."""
    request_hash: str | None = None
    """Set by the engine for a keyed message."""
    traceparent: str | None = None
    """The W3C trace context the message was sent in, set by the session's owner when tracing
    is on (actors/tracing.py); stored as the turn.start's ``correlation_id``."""
    budget: Budget | None = None
    """Set by a handoff (actors/handoff/): what the member's turn may spend at most, besides its
    own limits. Not part of ``request_hash``: a resumed parent asks again with less left and
    must be answered with the same turn."""


class Accepted(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    turn_id: str
    session_key: str
    replayed: bool = False
    """True when an ``Idempotency-Key`` named a turn accepted before: nothing new runs."""


class ClearSession(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """Drop a session's history from the next turns' context (appends ``session.cleared``)."""

    agent_id: str
    session_key: str
    by: str = "api"


class Cleared(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    session_key: str


class SetPhase(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """Move a session to a phase (``POST …/sessions/{key}/phase``): the session's owner appends
    ``phase.changed`` (``by: api``), fenced and ordered like its other events."""

    agent_id: str
    session_key: str
    to: str
    left: str | None = None
    """The phase it leaves, as the caller read it."""
    tools: int = 0


class PhaseMoved(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    session_key: str
    phase: str


class ForkSession(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """Start session ``(agent_id, session_key)`` from the history of another session up to and
    including one of its turns (appends ``session.forked`` to the new session's stream; the
    source is not touched). Goes to the new session's owner, which reads the source."""

    agent_id: str
    session_key: str
    source_agent_id: str
    source_session_key: str
    at_turn: str | int
    """A turn id of the source session, or the turn's 1-based index among its turns."""


class Forked(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    agent_id: str
    session_key: str
    source_agent_id: str
    source_session_key: str
    turn_id: str
    turns: int
    """How many turns' history was copied."""
    messages: int
    """How many history rows were copied."""


class Refused(msgspec.Struct, frozen=True, kw_only=True):
    code: str
    message: str
    hint: str
    field: str | None = None
    retry_after: float | None = None
    """Seconds after which the same command may succeed (a budget's reset), when known."""


HANDOFF = "handoff"
"""The source of a member's turn asked for by its supervisor's ``handoff`` call: the one way
into an agent that is not addressable. No door takes it from outside (gateways/ingress.py)."""


def not_addressable(agent_id: str, addressable: bool, source: str | None) -> Refused | None:
    """The refusal of a message to an agent that takes work only from its supervisor (a
    member of a team, runtime/teams.py, or an agent that says ``addressable: false``), from
    any door but a handoff: HTTP, WebSocket, NATS ingress, a schedule, a channel. None when
    it is taken."""
    if addressable or source == HANDOFF:
        return None
    return Refused(
        code="agent_not_addressable",
        message=f"agent {agent_id!r} is a member of a team: it takes tasks only by handoff",
        hint="send the message to its supervisor, or set addressable: true in its manifest",
    )


MAX_DEPTH = 64
"""How deeply a JSON body received at any door (HTTP, WebSocket, NATS) may nest arrays and
objects. Every door checks it with :func:`too_deep` before decoding: msgspec would recurse about
1,000 levels and then raise ``RecursionError`` (a 1.9 KB body). What we accept is a few levels
deep; tool-call arguments, the deep part of a model's output, never come from a client."""

TOO_DEEP = Refused(
    code="body_too_deep",
    message=f"the JSON nests arrays and objects more than {MAX_DEPTH} levels deep",
    hint="send a flatter body: no request of this API needs more than a few levels",
)

_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 and -1 as signed bytes
_BLOCK = 4096


def too_deep(raw: bytes | str, limit: int = MAX_DEPTH) -> bool:
    """Whether JSON text nests ``[``/``{`` deeper than ``limit`` outside its strings.

    Without decoding and with no loop over the bytes in Python: text with at most ``limit``
    brackets cannot nest deeper (the common case: a few ``find`` calls); otherwise the strings
    are cut out (their escapes first), the brackets left are mapped to +1/-1 and summed in
    blocks, stopping at the first block that goes too deep. Exact for valid JSON; for invalid
    JSON it never reports less than the depth msgspec would reach before its parse error.
    Measured (this 2-core machine): a message body, ~1 µs; 1 MB of prose, 0.03 ms; 1 MB of code
    full of brackets and escaped quotes, ~6 ms (msgspec decodes it in ~1 ms; a message's text is
    capped at 200,000 characters); 1 MB of small arrays, ~30 ms (msgspec: ~100 ms).
    """
    if isinstance(raw, str):
        if _at_most(raw, ("[", "{"), limit):
            return False
        data = raw.encode("utf-8", "surrogatepass")
    elif _at_most(raw, (b"[", b"{"), limit):
        return False
    else:
        data = raw
    if b"\\" in data:
        # Drop escaped backslashes before escaped quotes, so that `\\"` still ends a string.
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(data.split(b'"')[::2])
    steps = outside.translate(_STEPS, _NOT_BRACKETS)
    if steps.count(1) <= limit:
        return False
    signed = memoryview(steps).cast("b")
    depth = 0
    for start in range(0, len(signed), _BLOCK):
        sums = list(accumulate(signed[start : start + _BLOCK], initial=depth))
        if max(sums) > limit:
            return True
        depth = sums[-1]
    return False


def _at_most(raw: AnyStr, openers: tuple[AnyStr, AnyStr], limit: int) -> bool:
    """Whether ``raw`` holds at most ``limit`` openers (``find`` is memchr-fast; ``count`` is
    an order of magnitude slower per byte)."""
    seen = 0
    for opener in openers:
        at = raw.find(opener)
        while at >= 0:
            seen += 1
            if seen > limit:
                return False
            at = raw.find(opener, at + 1)
    return True


class StopTurn(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    turn_id: str
    by: str = "api"


class StopResult(msgspec.Struct, frozen=True, kw_only=True):
    stopping: bool
    """True when the turn was running or queued and is now stopping."""
    state: str
    """``stopping``, ``stopped`` (was queued), ``ended`` (already over) or ``unknown``."""


class Resume(msgspec.Struct, frozen=True):
    turn_ids: list[str]


class TurnFinished(msgspec.Struct, frozen=True):
    turn_id: str
    reason: str | None


class ResolveApproval(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """A person's answer to a tool call that asked for approval (or its timeout)."""

    agent_id: str
    approval_id: str
    granted: bool
    by: str = "api"
    turn_id: str | None = None
    """Filled in by the engine (from the approvals projection) for the session actor."""


class Resolved(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    approval_id: str
    granted: bool


class Reply(msgspec.Struct, frozen=True, omit_defaults=True):
    """The envelope of an answer on NATS: exactly one of the fields is set."""

    accepted: Accepted | None = None
    stop: StopResult | None = None
    cleared: Cleared | None = None
    resolved: Resolved | None = None
    forked: Forked | None = None
    phase: PhaseMoved | None = None
    error: Refused | None = None


class DefineSchedule(msgspec.Struct, frozen=True, kw_only=True):
    """Create (``expected`` = NO_STREAM) or replace a schedule; answered with a future of the
    append (see actors/schedule/actor.py)."""

    agent_id: str
    spec: ScheduleSpec
    owner: Literal["manifest", "api"]
    expected: int


class RemoveSchedule(msgspec.Struct, frozen=True, kw_only=True):
    agent_id: str
    schedule_id: str
    expected: int


class RunSchedule(msgspec.Struct, frozen=True, kw_only=True):
    """Fire a schedule now, out of band; answered with a future of Accepted | Refused."""

    agent_id: str
    schedule_id: str


# --- reading a context (GET .../context): plain data the gateway encodes as it is -------------


class _View(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    pass


class ContextThresholds(_View, frozen=True):
    """Fractions of the prompt budget at which each compaction stage starts: one field per rung
    of actors/context/rungs.py ``RUNGS``, in its order (literal for the gateways, which import
    this module without the engine; tests/test_rungs.py checks that the two agree)."""

    excerpt: float
    dedupe: float
    stub: float
    digest: float
    reset: float


class ContextBlock(_View, frozen=True):
    """One block (a slot) of the assembled request, in the order the model reads them: Dispach
    v1's ``{slot, label, tokens, pinned}``, with the block's text."""

    slot: int
    label: str
    """``tools``, the manifest's instruction labels, ``configuration``, ``reminders``,
    ``notes``, ``last error``, ``digest``, ``history``, and ``input`` when one is given."""
    pinned: bool
    """Never compacted."""
    tokens: int
    """The local estimate (about 4 bytes of JSON a token), not corrected."""
    text: str | None = None
    """The block's text: for every block but the tools and the history."""


class Compacted(_View, frozen=True):
    """How many tool results of the history are shown compacted, by mark: one field per
    marking rung (checked against the registry as ``ContextThresholds`` is)."""

    excerpt: int
    dedupe: int
    stub: int


class HistoryCounts(_View, frozen=True):
    turns: int
    """Turns kept verbatim (after the digest, if there is one)."""
    messages: int
    """Their stored messages: inputs, assistant messages and tool results."""
    compacted: Compacted


class DigestInfo(_View, frozen=True):
    """What stands for the compacted turns."""

    source: Literal["model", "mechanical"]
    turns: int
    """How many turns it covers in all."""
    requests: int
    """How many requests of the person it carries verbatim."""
    text: str


class SessionContext(_View, frozen=True):
    """The context the next turn of a session would assemble for its first model call, before
    compaction: a superset of Dispach v1's ``{slots, total, window, reserveOutput}``, with the
    figures of ``context.pressure``."""

    agent_id: str
    session_key: str | None
    """Null: no session named, the context a new session's first turn would assemble."""
    slots: list[ContextBlock]
    total: int
    """The slots' tokens, summed (local estimates)."""
    window: int
    """The model's context window, in tokens."""
    reserve_output: int
    """Tokens kept free for the reply."""
    budget: int
    """The prompt budget: the window less the reserve."""
    tokens: int
    """``total``, corrected by what the provider reported for this session's model calls."""
    pressure: float
    """``tokens / budget``: compaction runs before the call once it reaches a threshold."""
    source: Literal["corrected", "estimated"]
    """``corrected`` once the provider has reported prompt sizes for this session (while its
    actor holds it in memory); ``estimated`` otherwise."""
    thresholds: ContextThresholds
    breakpoints: int
    """Cache breakpoints of the request (without an input, the next turn's adds one on its)."""
    history: HistoryCounts
    digest: DigestInfo | None
    messages: list[dict[str, Any]] | None = None
    """With ``?messages=true``: the request's messages as the model would get them."""
    system: list[dict[str, Any]] | None = None
    """With ``?messages=true``: the request's system blocks as the model would get them."""
    phase: str | None = None
    """The phase the session is in (null: the agent declares none); ``tools`` are its."""
    tools: list[str] = msgspec.field(default_factory=list)
    """The names of the tools the model is offered (the ``tools`` slot's)."""


class ContextStep(_View, frozen=True):
    """One model call of a turn: what it was sent."""

    step: int
    """1 for the turn's first model call, and so on."""
    system: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    messages: list[dict[str, Any]]


class TurnContext(_View, frozen=True):
    turn_id: str
    steps: list[ContextStep]


class ClusterNode(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    id: str
    draining: bool = False
    partitions: list[int] = msgspec.field(default_factory=list)
    """The partitions it holds leases on."""
    age_ms: int | None = None
    """Since its heartbeat was last written."""


class ClusterLease(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    lease: str
    """``p.<n>`` for a partition, ``s.<name>`` for a singleton (``s.scheduler``, ...)."""
    partition: int | None
    node: str
    epoch: int
    """The fencing token: the bucket revision at which the holder took the lease."""
    age_ms: int | None = None
    """Since the holder last renewed it."""


class ClusterStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """What ``GET /v1/cluster`` answers: the lease bucket as the answering node reads it."""

    cluster: str
    node: str
    """The node that answered."""
    partitions: int
    ttl_s: float
    owned: list[int]
    """The partitions the answering node serves now."""
    draining: bool
    nodes: list[ClusterNode]
    leases: list[ClusterLease]


class NodeActivity(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """One node's answer to ``GET /v1/activity``'s gathering (actors/cluster/activity.py)."""

    node: str
    idle: bool
    """No turn runs here and no delivery is being sent from here."""
    turns_running: int
    turns: list[str]
    """The ids of the turns running on this node."""
    outbox_inflight: int
    """The agents' deliveries this node is sending now."""
    scheduler: bool
    """This node holds the schedule clock (one node of the cluster does)."""
    webhooks_inflight: int = 0
    """Event webhook deliveries this node is sending now (0 from a node older than them)."""


class CommandPath(Protocol):
    """The one way a command reaches a session: to the node owning its partition, in process
    or over NATS (actors/cluster/commands.py). Every door uses it."""

    async def submit(self, submit: Submit, timeout: float = 30.0) -> Accepted | Refused: ...

    async def stop(self, stop: StopTurn, timeout: float = 10.0) -> StopResult | Refused: ...

    async def clear(self, clear: ClearSession, timeout: float = 10.0) -> Cleared | Refused: ...

    async def set_phase(self, command: SetPhase, timeout: float = 10.0) -> PhaseMoved | Refused: ...

    async def resolve(
        self, resolve: ResolveApproval, timeout: float = 10.0
    ) -> Resolved | Refused: ...

    async def fork(self, fork: ForkSession, timeout: float = 10.0) -> Forked | Refused: ...

"""``GET /v1/openapi.json``: the OpenAPI 3.1 document, generated from the msgspec types the
handlers decode and encode (gateways/api/schemas.py), so it cannot drift from them."""

from __future__ import annotations

import functools
import re
import zoneinfo
from typing import Any

import msgspec
from cronsim.cronsim import SYMBOLIC_DAYS, SYMBOLIC_MONTHS

from actors.messages import ClusterStatus, SessionContext, TurnContext
from actors.schedule.plan import ScheduleSpec
from eventstore import REGISTRY, WireEvent
from gateways.api.activity import ActivityBody
from gateways.api.approvals import ApprovalList, Decision, DecisionAnswer
from gateways.api.context import MAX_INPUT
from gateways.api.fork import MAX_INDEX
from gateways.api.hooks import Taken
from gateways.api.keys import KeyBody, KeyCreated, KeyInfo, KeyList
from gateways.api.schedules import Deleted, ScheduleList, ScheduleResource
from gateways.api.schemas import (
    DELIVERY_STATUSES,
    AcceptedBody,
    AgentDetail,
    AgentInfo,
    ClearedBody,
    DeliveryList,
    EventsPage,
    ForkBody,
    ForkedBody,
    Health,
    MessageBody,
    MessagePage,
    PhaseBody,
    Ready,
    SessionSummary,
    SkillList,
    StopAnswer,
    ToolInfo,
    TurnPage,
    TurnResource,
)
from gateways.api.turns import STATUSES
from gateways.http.errors import ErrorEnvelope
from gateways.ingress import MAX_SESSION_KEY, MAX_TEXT, NOT_BLANK
from gateways.streams.sse import IssuedToken, TokenRequest
from gateways.streams.tokens import MAX_TTL_S

_TYPES: tuple[Any, ...] = (
    ActivityBody,
    KeyBody,
    KeyCreated,
    KeyInfo,
    KeyList,
    ClusterStatus,
    SessionContext,
    TurnContext,
    ApprovalList,
    Decision,
    DecisionAnswer,
    ScheduleSpec,
    ScheduleResource,
    ScheduleList,
    Deleted,
    Taken,
    AcceptedBody,
    AgentDetail,
    AgentInfo,
    ClearedBody,
    DeliveryList,
    EventsPage,
    ForkBody,
    ForkedBody,
    Health,
    MessageBody,
    MessagePage,
    PhaseBody,
    Ready,
    SessionSummary,
    SkillList,
    StopAnswer,
    ToolInfo,
    TurnPage,
    TurnResource,
    WireEvent,
    ErrorEnvelope,
    list[AgentInfo],
    list[SessionSummary],
    list[ToolInfo],
    TokenRequest,
    IssuedToken,
)
_REF = "#/components/schemas/{name}"

_ERRORS = {
    "400": "The request is malformed (code, message, hint and often field say how)",
    "401": "A bearer token is required",
    "403": "The Host or the Origin (a web page) is not one this server answers to, or a stream "
    "token does not cover this",
    "404": "No such agent, turn, session or schedule (or not visible to this token)",
    "409": "The resource is in a state that refuses this (the code says which)",
    "413": "The body is over the size cap",
    "415": "A request body must be `application/json`",
    "501": "Dispach v1 has this operation; this runtime deliberately does not (the code and "
    "hint say why and what to do instead)",
    "503": "The node is not ready (`not_ready`), or Postgres (`store_unavailable`) or NATS "
    "(`nats_unavailable`) is down: nothing was done, retry after `Retry-After` seconds",
    "504": "The session did not accept the message in time: `accepted` is `unknown` (with an "
    "Idempotency-Key a stored turn is answered as a replay instead); retry with the same key",
}
SSE = "text/event-stream"
CURSOR = "^([A-Za-z0-9_-]{22})?$"
NO_NUL = "^[^\u0000]*$"
SESSION_KEY = "^[^/\u0000]+$"
_SPACE = "[" + NOT_BLANK.removeprefix("[^")
"""What str.strip() and str.split() take for white space."""
TURN_ID = "^(t_[0-9a-z]{17})?$"
"""A turn id (actors/ids.py: ``t_`` + a base36 time and 8 random digits, or ``t_k`` + 16 digits
of a key's hash), or empty (no page bound)."""


def _cron_field(*names: str, extra: str = "") -> str:
    """One cron field: numbers and ``* , / -``, plus the names (any case) and characters it
    takes (cronsim's Field.parse)."""
    words = ["".join(f"[{c}{c.lower()}]" for c in name) for name in names]
    return "(" + "|".join([f"[0-9*,/{extra}-]", *words]) + ")+"


_CRON_NUMBER = _cron_field()
_CRON = (
    f"({_CRON_NUMBER}{_SPACE}+)?"  # seconds, when there are six fields
    + f"{_CRON_NUMBER}{_SPACE}+{_CRON_NUMBER}{_SPACE}+"  # minute, hour
    + f"{_cron_field('LW', 'L')}{_SPACE}+"  # day of month
    + f"{_cron_field(*SYMBOLIC_MONTHS)}{_SPACE}+"  # month
    + _cron_field(*SYMBOLIC_DAYS, "L", extra="#")  # day of week
)
# A schedule's expression by its kind, as actors/schedule/plan.py reads it. cron: 5 fields, or 6
# with a leading seconds field, each of what cronsim parses in it (numbers, * , / -, names of
# months and days, L, LW, #); a pattern cannot say which values are in range, nor which
# expressions never fire. every: a duration in d h m s order (the server also wants 1 s to 366
# days). at: ISO 8601 as datetime.fromisoformat reads it, which starts with a 4-digit year (the
# server also wants it at most ten years ahead).
EXPRESSIONS = {
    "cron": f"^{_SPACE}*{_CRON}{_SPACE}*$",
    "every": "^([0-9]{1,6}d([0-9]{1,7}h)?([0-9]{1,9}m)?([0-9]{1,10}s)?"
    "|[0-9]{1,7}h([0-9]{1,9}m)?([0-9]{1,10}s)?|[0-9]{1,9}m([0-9]{1,10}s)?|[0-9]{1,10}s)$",
    "at": "^[0-9]{4}[^\u0000]*$",
}
NOT_ZERO = {"every": {"not": {"pattern": "^(0+d)?(0+h)?(0+m)?(0+s)?$"}}}
"""What else a kind's expression must be: a duration is not all zeros (under a second)."""
SCHEDULE_SESSION = f"^(isolated|shared:[^/\u0000]*{NOT_BLANK[:-1]}/\u0000][^/\u0000]*)$"
"""``isolated``, or ``shared:`` and a key that is not blank and has no '/' or NUL."""


def event_types() -> str:
    """The ``types`` query parameter as the streams read it (gateways/streams/sse.py):
    comma-separated event types of the registry, each item stripped, empty items ignored."""
    name = "(" + "|".join(re.escape(t) for t in sorted(REGISTRY)) + ")"
    item = f"{_SPACE}*{name}?{_SPACE}*"
    return f"^{item}(,{item})*$"


def time_zones() -> list[str]:
    """The IANA names this node's tz database has, as the enum of a schedule's ``timezone``;
    'localtime' is refused (each host's own zone). The server takes any name ZoneInfo loads,
    which also includes the database's posix/ and right/ copies, not listed here. The empty
    name is UTC, as null is."""
    return ["", *sorted(zoneinfo.available_timezones() - {"localtime"})]


def _ref(kind: type[Any]) -> dict[str, str]:
    return {"$ref": _REF.format(name=kind.__name__)}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _param(
    name: str,
    where: str,
    description: str,
    schema: dict[str, Any] | None = None,
    required: bool | None = None,
) -> dict[str, Any]:
    return {
        "name": name,
        "in": where,
        "description": description,
        "required": where == "path" if required is None else required,
        # No NUL anywhere in a URL: the server refuses one (bad_request_url) before any route.
        "schema": schema
        or (
            {"type": "string", "minLength": 1, "pattern": NO_NUL}
            if where == "path"
            else {"type": "string", "pattern": NO_NUL}
        ),
    }


def _op(
    summary: str,
    ok: dict[str, dict[str, Any]],
    *,
    params: list[dict[str, Any]] | None = None,
    body: type[Any] | None = None,
    errors: tuple[str, ...] = ("400", "401", "404"),
    open_: bool = False,
) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "parameters": params or [], "responses": dict(ok)}
    if body is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(body)}},
        }
    # Every operation but the always-open ones (health, this document: errors=()) is refused
    # with 503 while the node is not ready (gateways/http/readiness.py).
    for status in (*errors, "503") if errors and "503" not in errors else errors:
        op["responses"][status] = _json(_ref(ErrorEnvelope), _ERRORS[status])
    op["security"] = [] if open_ else [{"bearer": []}]
    return op


AGENT = _param("agent", "path", "Agent id")
TURN = _param("turn_id", "path", "Turn id")
KEY = _param("key", "path", "Session key (URL-encoded)")
AFTER = _param(
    "after",
    "query",
    "Resume after this cursor (an event's `cursor`, an SSE `id`)",
    {"type": "string", "pattern": CURSOR},
    required=False,
)
LIMIT = _param(
    "limit", "query", "Page size", {"type": "integer", "minimum": 1, "maximum": 500}, required=False
)
EVENTS_LIMIT = _param(
    "limit", "query", "Page size", {"type": "integer", "minimum": 1, "maximum": 10_000},
    required=False,
)  # fmt: skip
# One SSE frame, as schemathesis and other tools parse them.
SSE_FRAME = {
    "type": "object",
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
    "required": ["data"],
}


def _stream_op(summary: str, ok: dict[str, dict[str, Any]], **kw: Any) -> dict[str, Any]:
    """A stream's operation: a bearer token, or a stream token as ``?st=``."""
    op = _op(summary, ok, errors=("400", "401", "403", "404"), **kw)
    op["security"] = [{"bearer": []}, {"streamToken": []}]
    return op


def _accepted(description: str) -> dict[str, Any]:
    """202/200 of POST messages: JSON, or the turn's SSE stream with ``stream: true``."""
    return {
        "description": description,
        "content": {
            "application/json": {"schema": _ref(AcceptedBody)},
            SSE: {"schema": SSE_FRAME},
        },
    }


def _paths() -> dict[str, Any]:
    stream = {
        "200": {
            "description": "SSE: `stream.replay`, then event frames (`id:` is the "
            "cursor), then `stream.ended` after `turn.end`",
            "content": {SSE: {"schema": SSE_FRAME}},
        }
    }
    agent = "/v1/agents/{agent}"
    turn = agent + "/turns/{turn_id}"
    session = agent + "/sessions/{key}"
    schedule = agent + "/schedules/{schedule}"
    sid = _param("schedule", "path", "Schedule id")
    replace_schedule = _op(
        "Replace an API-made schedule (its whole definition)",
        {"200": _json(_ref(ScheduleResource), "Replaced")},
        params=[AGENT, sid],
        body=ScheduleSpec,
        errors=("400", "401", "404", "409", "503"),
    )
    idem = _param(
        "Idempotency-Key",
        "header",
        "1-255 printable ASCII; a retry with the same key and body replays the first acceptance",
        {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[\\x20-\\x7e]+$"},
        required=False,
    )
    chunks = _param(
        "chunks", "query", "Include model.chunk text deltas", {"type": "boolean"}, required=False
    )
    reasoning = _param(
        "reasoning",
        "query",
        "Include model.chunk deltas of the model's thinking (kind `reasoning`), with or "
        "without `chunks`",
        {"type": "boolean"},
        required=False,
    )
    types = _param(
        "types",
        "query",
        "Comma-separated event types (docs/events.md lists them)",
        {"type": "string", "pattern": event_types()},
        required=False,
    )
    return {
        "/v1/health": {
            "get": _op("Liveness", {"200": _json(_ref(Health), "Alive")}, errors=(), open_=True)
        },
        "/v1/ready": {
            "get": _op(
                "Readiness", {"200": _json(_ref(Ready), "Ready")}, errors=("503",), open_=True
            )
        },
        "/v1/openapi.json": {
            "get": _op(
                "This document",
                {"200": _json({"type": "object"}, "OpenAPI 3.1")},
                errors=(),
                open_=True,
            )
        },
        "/v1/cluster": {
            "get": _op(
                "The cluster: nodes, the partitions each owns, lease epochs and ages",
                {"200": _json(_ref(ClusterStatus), "The lease bucket as this node reads it")},
                errors=("401", "503"),
            )
        },
        "/v1/activity": {
            "get": _op(
                "Whether the cluster is idle: turns running, the outbox's pending and in-flight "
                "items, the next schedule wake-up; and each node's own (admin, no agent list)",
                {"200": _json(_ref(ActivityBody), "Activity")},
                errors=("401", "403", "503"),
            )
        },
        "/v1/keys": {
            "get": _op(
                "API keys (never their secrets); admin, no agent list",
                {"200": _json(_ref(KeyList), "Keys")},
                errors=("401", "403", "503"),
            ),
            "post": _op(
                "Mint a key: label, scope (read < chat < write < admin), agents; the secret is "
                "in this answer only. The boot claim mints the first (admin) key",
                {"201": _json(_ref(KeyCreated), "Minted")},
                body=KeyBody,
                errors=("400", "401", "403", "413", "415", "503"),
            ),
        },
        "/v1/keys/{key_id}": {
            "delete": _op(
                "Revoke a key (soft: the record stays); every node refuses it within a second",
                {"200": _json(_ref(KeyInfo), "The revoked key")},
                params=[_param("key_id", "path", "Key id (`keyId`)")],
                errors=("401", "403", "404", "503"),
            )
        },
        "/v1/agents": {
            "get": _op(
                "Agents this token can reach",
                {"200": _json({"type": "array", "items": _ref(AgentInfo)}, "Agents")},
                errors=("401",),
            )
        },
        agent: {
            "get": _op("One agent", {"200": _json(_ref(AgentDetail), "The agent")}, params=[AGENT])
        },
        agent + "/tools": {
            "get": _op(
                "The agent's tools, in the order the model reads them",
                {"200": _json({"type": "array", "items": _ref(ToolInfo)}, "Tools")},
                params=[AGENT],
            )
        },
        agent + "/skills": {
            "get": _op(
                "Skills: none, this runtime has none (`supported: false`, as Dispach v1 0.1.0)",
                {"200": _json(_ref(SkillList), "No skills")},
                params=[AGENT],
            )
        },
        agent + "/reload": {
            "post": _op(
                "Reload the agent's manifest: refused (an agent is built once per node start)",
                {"501": _json(_ref(ErrorEnvelope), "`reload_not_supported`: restart the node")},
                params=[AGENT],
                errors=("401", "404", "503"),
            )
        },
        agent + "/messages": {
            "post": _op(
                "Send a message: 202 once its turn is durably accepted",
                {
                    "202": _accepted("Accepted: the turn runs without the caller"),
                    "200": _accepted("Replayed (same Idempotency-Key and body)"),
                    "409": _json(
                        _ref(ErrorEnvelope), "Idempotency key reused, or the session is busy"
                    ),
                },
                params=[AGENT, idem],
                body=MessageBody,
                errors=("400", "401", "404", "413", "503", "504"),
            )
        },
        agent + "/turns": {
            "get": _op(
                "Turns, newest first",
                {"200": _json(_ref(TurnPage), "A page")},
                params=[
                    AGENT,
                    _param("sessionKey", "query", "Only this session", required=False),
                    _param(
                        "status",
                        "query",
                        "Only this status",
                        {"type": "string", "enum": list(STATUSES)},
                        required=False,
                    ),
                    _param(
                        "before",
                        "query",
                        "nextBefore of the previous page (a turn id of this agent)",
                        {"type": "string", "pattern": TURN_ID},
                        required=False,
                    ),
                    LIMIT,
                ],
            )
        },
        turn: {
            "get": _op(
                "The turn resource",
                {"200": _json(_ref(TurnResource), "The turn")},
                params=[AGENT, TURN],
            )
        },
        turn + "/context": {
            "get": _op(
                "What each model call of the turn was sent, rebuilt from the log",
                {"200": _json(_ref(TurnContext), "One step per model call, in order")},
                params=[AGENT, TURN],
                errors=("400", "401", "404", "503"),
            )
        },
        agent + "/context": {
            "get": _op(
                "The context the session's next turn would assemble, block by block with tokens",
                {"200": _json(_ref(SessionContext), "The context (no input yet)")},
                params=[
                    AGENT,
                    _param(
                        "sessionKey",
                        "query",
                        "The session (any key: a session without turns has an empty history)",
                        {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": MAX_SESSION_KEY,
                            "pattern": SESSION_KEY,
                        },
                        required=True,
                    ),
                    _param(
                        "input",
                        "query",
                        "A message to assemble as the next turn's input (none: no input slot)",
                        {"type": "string", "maxLength": MAX_INPUT, "pattern": NO_NUL},
                        required=False,
                    ),
                    _param(
                        "messages",
                        "query",
                        "`true`: add the request's `messages` and `system` as the model gets them",
                        {"type": "boolean"},
                        required=False,
                    ),
                ],
                errors=("400", "401", "404", "503"),
            )
        },
        "/v1/turns/{turn_id}": {
            "get": _op(
                "The turn resource, by id alone",
                {"200": _json(_ref(TurnResource), "The turn")},
                params=[TURN],
            )
        },
        turn + "/stop": {
            "post": _op(
                "Stop a running turn (cooperative)",
                {
                    "202": _json(_ref(StopAnswer), "Stopping"),
                    "409": _json(_ref(ErrorEnvelope), "The turn is not running"),
                },
                params=[AGENT, TURN],
            )
        },
        turn + "/events": {
            "get": _op(
                "Stored events of a turn",
                {"200": _json(_ref(EventsPage), "Events in log order")},
                params=[
                    AGENT,
                    TURN,
                    AFTER,
                    EVENTS_LIMIT,
                    _param(
                        "private",
                        "query",
                        "`true`: tool.call events with their `args` and tool.result events with "
                        "their `output` (nothing else private); API token only, a stream token "
                        "is refused with `private_needs_token`. The streams never carry them",
                        {"type": "boolean"},
                        required=False,
                    ),
                ],
                errors=("400", "401", "403", "404"),
            )
        },
        turn + "/stream": {
            "get": _stream_op(
                "Live stream of a turn (SSE), lossless resume",
                {
                    **stream,
                    "204": {
                        "description": "A reconnect whose `Last-Event-ID` is at or past the "
                        "turn's `turn.end`: nothing more will come (an EventSource stops)"
                    },
                },
                params=[AGENT, TURN, AFTER, chunks, reasoning, types],
            )
        },
        "/v1/events": {
            "get": _stream_op(
                "Firehose (SSE)",
                {"200": {"description": "SSE", "content": {SSE: {"schema": SSE_FRAME}}}},
                params=[
                    _param("agentId", "query", "Only this agent", required=False),
                    _param("sessionKey", "query", "Only this session", required=False),
                    types,
                    AFTER,
                    chunks,
                    reasoning,
                ],
            )
        },
        "/v1/stream-tokens": {
            "post": _op(
                "A short-lived read-only token for one turn's stream, one session's, or (agentId "
                "alone) the agent's, all of its sessions: for a "
                "browser (`?st=` on the SSE streams and /v1/ws)",
                {"201": _json(_ref(IssuedToken), "Issued")},
                body=TokenRequest,
                errors=("400", "401", "404", "413", "415", "503"),
            )
        },
        agent + "/sessions": {
            "get": _op(
                "Sessions, most recently active first",
                {"200": _json({"type": "array", "items": _ref(SessionSummary)}, "Sessions")},
                params=[
                    AGENT,
                    _param(
                        "q",
                        "query",
                        "Only sessions whose key contains this (case-insensitive, literally)",
                        required=False,
                    ),
                    _param(
                        "status",
                        "query",
                        "Only sessions whose last turn has this status",
                        {"type": "string", "enum": list(STATUSES)},
                        required=False,
                    ),
                    LIMIT,
                ],
            )
        },
        # Before the session's own path: generated requests run in document order, and a
        # DELETE (a clear) would leave no turn to fork at.
        session + "/fork": {
            "post": _op(
                "Fork the session: a new session (of this agent or another) whose history is "
                "this one's up to and including a turn (appends session.forked to it)",
                {
                    "201": _json(_ref(ForkedBody), "Forked"),
                    "409": _json(
                        _ref(ErrorEnvelope),
                        "The turn still runs, or was cleared; the new session exists or is busy",
                    ),
                },
                params=[AGENT, KEY],
                body=ForkBody,
                errors=("400", "401", "404", "413", "415", "503"),
            )
        },
        session: {
            "get": _op(
                "One session",
                {"200": _json(_ref(SessionSummary), "The session")},
                params=[AGENT, KEY],
            ),
            "delete": _op(
                "Clear the session's history (appends session.cleared)",
                {
                    "200": _json(_ref(ClearedBody), "Cleared"),
                    "409": _json(_ref(ErrorEnvelope), "A turn is running"),
                },
                params=[AGENT, KEY],
            ),
        },
        agent + "/deliveries": {
            "get": _op(
                "Outbox items (one chunk of a reply to one recipient each), newest first, with "
                "their status, attempts and last error; never the reply's text",
                {"200": _json(_ref(DeliveryList), "Deliveries")},
                params=[
                    AGENT,
                    _param(
                        "status",
                        "query",
                        "Only items with this status",
                        {"type": "string", "enum": list(DELIVERY_STATUSES)},
                        required=False,
                    ),
                    _param("sessionKey", "query", "Only this session's items", required=False),
                    LIMIT,
                ],
            )
        },
        agent + "/approvals": {
            "get": _op(
                "Tool calls waiting for a person's approval, oldest first",
                {"200": _json(_ref(ApprovalList), "Pending approvals")},
                params=[
                    AGENT,
                    _param(
                        "private",
                        "query",
                        "`true`: each approval with `args`, what the call would run with (API "
                        "token only)",
                        {"type": "boolean"},
                        required=False,
                    ),
                ],
                errors=("400", "401", "403", "404"),
            )
        },
        agent + "/approvals/{approval}": {
            "post": _op(
                "Answer an approval: the turn runs on with the call, or with a refusal",
                {"200": _json(_ref(DecisionAnswer), "Answered")},
                params=[AGENT, _param("approval", "path", "Approval id")],
                body=Decision,
                errors=("400", "401", "404", "503"),
            )
        },
        agent + "/schedules": {
            "get": _op(
                "Schedules of the agent (manifest and API), with their next due time",
                {"200": _json(_ref(ScheduleList), "Schedules")},
                params=[
                    AGENT,
                    _param("enabled", "query", "`true`: only enabled ones", required=False),
                ],
            ),
            "post": _op(
                "Create a schedule (checked now: expression, time zone, delivery)",
                {"201": _json(_ref(ScheduleResource), "Created")},
                params=[AGENT],
                body=ScheduleSpec,
                errors=("400", "401", "404", "409", "503"),
            ),
        },
        # Before the schedule's own path: generated requests run in document order, and a
        # DELETE that succeeds would leave nothing to run.
        schedule + "/run": {
            "post": _op(
                "Fire the schedule now, out of band (its clock is not moved)",
                {"202": _json(_ref(AcceptedBody), "Accepted")},
                params=[AGENT, sid],
                errors=("400", "401", "404", "503"),
            )
        },
        schedule: {
            "get": _op(
                "One schedule",
                {"200": _json(_ref(ScheduleResource), "The schedule")},
                params=[AGENT, sid],
            ),
            "put": replace_schedule,
            "patch": replace_schedule,  # the same operation: a whole definition either way
            "delete": _op(
                "Delete an API-made schedule",
                {"200": _json(_ref(Deleted), "Deleted")},
                params=[AGENT, sid],
                errors=("401", "404", "409", "503"),
            ),
        },
        "/v1/channels/{channel}/webhook/{agent}": {
            "post": _op(
                "An update a chat provider pushes (Telegram webhook mode); the channel checks "
                "the provider's secret, no bearer token",
                {"200": _json(_ref(Taken), "Taken")},
                params=[_param("channel", "path", "Channel id"), AGENT],
                body=None,
                errors=("400", "401", "404", "413", "503"),
                open_=True,
            )
        },
        session + "/phase": {
            "post": _op(
                "Set the session's phase (Dispach v1): checked, then refused, since this "
                "runtime has no phases",
                {"501": _json(_ref(ErrorEnvelope), "`phases_not_supported`")},
                params=[AGENT, KEY],
                body=PhaseBody,
                errors=("400", "401", "404", "413", "415", "503"),
            )
        },
        session + "/messages": {
            "get": _op(
                "History, newest first",
                {"200": _json(_ref(MessagePage), "A page")},
                params=[
                    AGENT,
                    KEY,
                    _param(
                        "before",
                        "query",
                        "nextBefore of the previous page",
                        {"type": "integer", "minimum": 1, "maximum": 2**62},
                        required=False,
                    ),
                    LIMIT,
                ],
            ),
            "delete": _op(
                "Clear the session's history",
                {
                    "200": _json(_ref(ClearedBody), "Cleared"),
                    "409": _json(_ref(ErrorEnvelope), "A turn is running"),
                },
                params=[AGENT, KEY],
            ),
        },
    }


def _constrain(components: dict[str, Any]) -> None:
    """What the server checks beyond the types (gateways/ingress.py `check`), so generated
    requests and the server agree on what is valid. The checks are not in the msgspec types
    because v1 clients expect their own error codes (e.g. `message_text_required`)."""
    body = components["MessageBody"]["properties"]
    body["text"].update(minLength=1, maxLength=MAX_TEXT, pattern=NOT_BLANK)
    no_nul = {"pattern": NO_NUL}
    session = {"minLength": 1, "maxLength": MAX_SESSION_KEY, "pattern": SESSION_KEY,
               "allOf": [{"pattern": NOT_BLANK}]}  # fmt: skip
    body["sessionKey"].update(session)
    # A fork's turn: an index from 1, or a turn id (fork_invalid otherwise); its new session's
    # key is checked as a message's is (session_key_invalid).
    fork = components["ForkBody"]["properties"]
    fork["atTurn"]["anyOf"] = [{"type": "integer", "minimum": 1, "maximum": MAX_INDEX},
                               {"type": "string", "minLength": 1}]  # fmt: skip
    fork["newKey"]["anyOf"] = [{"type": "string", **session}, {"type": "null"}]
    for name in ("Deliver", "Sender"):
        for prop in components[name]["properties"].values():
            if prop.get("type") == "string":
                prop.update(no_nul)
    # A schedule must say where its replies go ("none" is an answer; leaving it out is refused
    # with schedule_missing_delivery). Expressions, zones and sessions are checked by the server
    # (schedule_invalid): no schema can say which cron expressions exist.
    # An approval's answer must say yes or no (missing: approval_decision_required, v1's code).
    components["Decision"]["required"] = ["granted"]
    components["Decision"]["properties"]["granted"] = {"type": "boolean"}
    spec = components["ScheduleSpec"]
    spec["required"] = sorted({*spec.get("required", []), "deliver"})
    spec["properties"]["task"].update(minLength=1, pattern=NOT_BLANK)
    # The expression by kind, the zone, the session: see EXPRESSIONS, time_zones and
    # SCHEDULE_SESSION; what no schema can say (a cron that never fires, a duration's bounds, an
    # `at` too far ahead) is still refused with schedule_invalid.
    spec["allOf"] = [
        {
            "if": {"properties": {"kind": {"const": kind}}, "required": ["kind"]},
            "then": {"properties": {"expr": {"pattern": pattern, **NOT_ZERO.get(kind, {})}}},
        }
        for kind, pattern in EXPRESSIONS.items()
    ]
    spec["properties"]["expr"]["description"] = (
        "By `kind`: cron, 5 fields (or 6, seconds first) that must fire some day; every, a "
        "duration like `1h30m` from 1 s to 366 days; at, ISO 8601 at most ten years ahead "
        "(without an offset it is read in `timezone`)"
    )
    spec["properties"]["timezone"]["anyOf"][0] = {"type": "string", "enum": time_zones()}
    spec["properties"]["timezone"]["description"] = (
        "An IANA name of the node's tz database (listed); null or empty is UTC"
    )
    # null is the type's "not given", refused like a missing delivery (schedule_missing_delivery).
    deliver = spec["properties"]["deliver"]
    deliver["anyOf"] = [kind for kind in deliver["anyOf"] if kind != {"type": "null"}]
    deliver.pop("default", None)
    spec["properties"]["session"].update(
        pattern=SCHEDULE_SESSION, maxLength=len("shared:") + MAX_SESSION_KEY
    )
    # A stream token is for one turn, one session, or (neither) the agent's whole stream; not
    # both (stream_token_target_invalid).
    token = components["TokenRequest"]
    token["properties"].update(
        agentId={"type": "string", "minLength": 1},
        turnId={"type": "string", "minLength": 1},
        sessionKey={"type": "string", **session},
        ttlS={"type": "integer", "minimum": 1, "maximum": MAX_TTL_S},
    )
    token["not"] = {"required": ["turnId", "sessionKey"]}


@functools.cache
def document() -> bytes:
    _, components = msgspec.json.schema_components(_TYPES, ref_template=_REF)
    _constrain(components)
    doc = {
        "openapi": "3.1.0",
        "info": {
            "title": "Dispach API",
            "version": "1",
            "description": "Agent runtime API v1 (wire-compatible with Dispach v1).",
        },
        "paths": _paths(),
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "streamToken": {"type": "apiKey", "in": "query", "name": "st"},
            },
        },
    }
    return msgspec.json.encode(doc)

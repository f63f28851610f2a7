"""``/v1/agents/{agent}/approvals``: tool calls waiting for a person, and the answers.

A tool whose manifest policy is ``ask`` stops its turn before it runs (``approval.requested``;
the turn's ``state`` is ``awaiting_approval`` and no thread waits for it). The answer goes to
the session actor that holds the turn, on whichever node, through NATS; the turn then runs on,
with the call or with a refusal the model reads.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response

from actors.messages import Refused, ResolveApproval
from eventstore import EventStore, StoreError
from eventstore.catalogue import ApprovalRequested
from gateways.api.common import (
    ApiError,
    agent,
    commands_of,
    decode_body,
    fetch,
    private_param,
    read_body,
    refused,
    store_error,
    store_of,
)
from gateways.http.errors import json_response
from gateways.http.operation import AGENT, Operation, answer, param


class ApprovalInfo(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    approval_id: str
    agent_id: str
    session_key: str
    turn_id: str
    call_id: str
    slug: str
    mutating: bool
    reason: str
    requested_at: datetime
    expires_at: datetime | None = None
    args: dict[str, Any] | msgspec.UnsetType | None = msgspec.UNSET
    """With ``?private=true`` (API token only): what the call would run with (null for a request
    logged before arguments were recorded)."""


_ROW = ApprovalInfo.__struct_fields__[:-1]  # the columns of sql/approvals.sql


class ApprovalList(msgspec.Struct, frozen=True):
    approvals: list[ApprovalInfo]


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    granted: bool | None = None


class DecisionAnswer(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    approval_id: str
    granted: bool


async def list_approvals(request: Request) -> Response:
    target = agent(request)
    reveal = private_param(request)
    rows = await fetch(request, "approvals", {"agent": target.id})
    found = [ApprovalInfo(**dict(zip(_ROW, r, strict=True))) for r in rows]
    if reveal and found:
        args = await _arguments(store_of(request), found)
        found = [msgspec.structs.replace(a, args=args.get(a.approval_id)) for a in found]
    return json_response(ApprovalList(found))


LIST_APPROVALS = Operation(
    "GET",
    "/v1/agents/{agent}/approvals",
    list_approvals,
    "Tool calls waiting for a person's approval, oldest first",
    {"200": answer(ApprovalList, "Pending approvals")},
    params=[
        AGENT,
        param(
            "private",
            "query",
            "`true`: each approval with `args`, what the call would run with (API token only)",
            {"type": "boolean"},
            required=False,
        ),
    ],
    errors=("400", "401", "403", "404"),
)


async def _arguments(store: EventStore, approvals: list[ApprovalInfo]) -> dict[str, Any]:
    """Each approval's call arguments, from its ``approval.requested`` (one read for all)."""
    turns = sorted({a.turn_id for a in approvals})
    try:
        events = await store.aread_turns(turns, [ApprovalRequested.TYPE])
    except StoreError as e:
        raise store_error(e) from e
    return {
        e.data.approval_id: e.data.args for e in events if isinstance(e.data, ApprovalRequested)
    }


async def decide(request: Request) -> Response:
    target = agent(request)
    decision: Decision = decode_body(await read_body(request, 10_000), Decision)
    if decision.granted is None:
        raise ApiError(400, "approval_decision_required", "the body says neither yes nor no",
                       'send {"granted": true} or {"granted": false}', "granted")  # fmt: skip
    answer = await resolve(request, target.id, request.path_params["approval"],
                           decision.granted, "api")  # fmt: skip
    if isinstance(answer, Refused):
        raise refused(answer)
    return json_response(answer)


DECIDE = Operation(
    "POST",
    "/v1/agents/{agent}/approvals/{approval}",
    decide,
    "Answer an approval: the turn runs on with the call, or with a refusal",
    {"200": answer(DecisionAnswer, "Answered")},
    params=[AGENT, param("approval", "path", "Approval id")],
    body=Decision,
    errors=("400", "401", "404", "503"),
)


async def resolve(
    conn: HTTPConnection, agent_id: str, approval_id: str, granted: bool, by: str
) -> DecisionAnswer | Refused:
    """Answer an approval (the REST route and the WebSocket's ``approve`` frame)."""
    command = ResolveApproval(agent_id=agent_id, approval_id=approval_id, granted=granted, by=by)
    result = await commands_of(conn).resolve(command)
    if isinstance(result, Refused):
        return result
    return DecisionAnswer(approval_id=result.approval_id, granted=result.granted)

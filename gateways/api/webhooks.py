"""Outbound event webhooks: ``POST/GET /v1/webhooks``, ``GET/DELETE /v1/webhooks/{webhookId}``
and ``GET /v1/webhooks/{webhookId}/deliveries``. Admin only, with no agent list (a subscription
may span every agent). A subscription is ``webhook.created`` in ``webhook-<id>`` (projected into
``webhooks``); its signing secret is in the POST's answer once and kept beside the projection,
never in an event (eventstore/webhooks.py). What it is sent: actors/webhooks/; how:
gateways/webhooks/channel.py.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from actors.messages import Refused
from actors.webhooks.plan import pattern_problem, subscribable
from eventstore import NO_STREAM, Metadata, NewEvent, StoreError, streams
from eventstore import webhooks as table
from eventstore.catalogue import WebhookCreated, WebhookDeleted
from eventstore.webhooks import WebhookRow
from gateways.api.common import (
    MAX_PAGE,
    ApiError,
    decode_body,
    fetch,
    int_param,
    read_body,
    runtime,
    store_error,
    store_of,
    unrestricted,
)
from gateways.http.errors import json_response
from gateways.http.operation import LIMIT, Operation, answer, param
from gateways.webhooks.channel import new_secret
from gateways.webhooks.target import TargetPolicy, refusal, resolve, url_problem

NEEDS_UNSCOPED = "webhooks_need_unscoped_key"
RESOLVE_S = 5.0
"""How long a subscription's host may take to resolve."""
STATUSES = ("pending", "in_flight", "delivered", "uncertain", "dead")
_Text = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
_Pattern = Annotated[str, msgspec.Meta(min_length=1, max_length=200,
                                       extra_json_schema={"enum": subscribable()})]  # fmt: skip


class WebhookBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/webhooks``."""

    url: Annotated[
        str, msgspec.Meta(min_length=1, max_length=2000, pattern="^[Hh][Tt][Tt][Pp][Ss]?://")
    ]
    """http(s); its host must resolve to a public address (or one the node allows)."""
    events: Annotated[list[_Pattern], msgspec.Meta(min_length=1, max_length=100)]
    """Event types, prefixes (``turn.*``) or ``*``; never ``model.chunk``."""
    agents: Annotated[list[_Text], msgspec.Meta(min_length=1, max_length=100)] | None = None
    """Only these agents' events; absent: every agent's (and events of no agent)."""
    description: Annotated[str, msgspec.Meta(max_length=500)] | None = None


class WebhookInfo(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    webhook_id: str
    url: str
    events: list[str]
    agents: list[str] | None
    description: str | None
    created_at: str
    deleted_at: str | None = None


class WebhookMade(WebhookInfo, frozen=True, kw_only=True, rename="camel"):
    secret: str
    """``whsec_…``: shown here once. Verify ``webhook-signature`` with it."""


class WebhookList(msgspec.Struct, frozen=True, kw_only=True):
    webhooks: list[WebhookInfo]


class WebhookDelivery(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    id: str
    """The ``webhook-id`` header of its POSTs."""
    event_id: str
    event_type: str
    cursor: str
    status: Literal["pending", "in_flight", "delivered", "uncertain", "dead"]
    attempts: int
    redelivery: bool
    """A POST went unanswered, so it was (or will be) resent flagged ``webhook-redelivery``."""
    error_code: str | None
    last_error: str | None
    created_at: str
    updated_at: str
    next_attempt_at: str | None


class DeliveryPage(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    webhook_id: str
    deliveries: list[WebhookDelivery]


def info(row: WebhookRow) -> WebhookInfo:
    return WebhookInfo(
        webhook_id=row.webhook_id, url=row.url, events=list(row.events),
        agents=None if row.agents is None else list(row.agents), description=row.description,
        created_at=row.created_at.isoformat(),
        deleted_at=None if row.deleted_at is None else row.deleted_at.isoformat(),
    )  # fmt: skip


def _refine(field: str | None, text: str) -> Refused | None:
    if field == "url":
        return Refused(code="webhook_url_invalid", field="url", message=f"url: {text}",
                       hint="send an http(s) URL")  # fmt: skip
    if field is not None and field.startswith("events"):
        return Refused(code="webhook_types_required", field="events",
                       message=f"events must list 1 to 100 event types: {text}",
                       hint='e.g. {"events": ["turn.end"]} or ["turn.*"]')  # fmt: skip
    if field is not None and field.startswith("agents"):
        return Refused(code="webhook_scope_invalid", field="agents",
                       message=f"agents is not a list of agent ids: {text}",
                       hint='send agent ids, e.g. ["support"], or leave it out')  # fmt: skip
    return None


def policy_of(request: Request) -> TargetPolicy:
    found: TargetPolicy = getattr(runtime(request), "webhook_policy", None) or TargetPolicy()
    return found


async def _check_target(request: Request, url: str) -> None:
    problem = url_problem(url)
    if problem is not None:
        raise ApiError(400, "webhook_url_invalid", problem,
                       "send an http(s) URL with a host, e.g. https://hooks.example/dispach",
                       "url")  # fmt: skip
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        async with asyncio.timeout(RESOLVE_S):
            addresses = await resolve(host, parts.port or (443 if parts.scheme == "https" else 80))
    except (OSError, ValueError, TimeoutError) as e:
        raise ApiError(400, "webhook_target_unresolved", f"{host} does not resolve: {e}",
                       "use a host name the node can resolve", "url") from e  # fmt: skip
    why = refusal(policy_of(request), host, addresses)
    if why is not None:
        raise ApiError(400, "webhook_target_refused", why,
                       "point it at a public address, or allow this one with "
                       "DISPACH_WEBHOOK_ALLOW (hosts, CIDRs) or DISPACH_WEBHOOK_ALLOW_PRIVATE=1",
                       "url")  # fmt: skip


async def create_webhook(request: Request) -> Response:
    unrestricted(request, NEEDS_UNSCOPED, "managing webhooks")
    body: WebhookBody = decode_body(await read_body(request, 20_000), WebhookBody, _refine)
    for pattern in body.events:
        problem = pattern_problem(pattern)
        if problem is not None:
            code, message = problem
            raise ApiError(400, code, message,
                           "name event types (docs/events.md) or prefixes such as turn.*; "
                           "model.chunk is never sent", "events")  # fmt: skip
    await _check_target(request, body.url)
    store = store_of(request)
    webhook_id = "wh_" + secrets.token_hex(8)
    secret = new_secret()
    agents = None if body.agents is None else sorted(set(body.agents))
    made = WebhookCreated(webhook_id=webhook_id, url=body.url, events=list(dict.fromkeys(
        body.events)), agents=agents, description=body.description)  # fmt: skip
    try:
        await table.keep_secret(store, webhook_id, secret)
        await store.aappend(streams.webhook(webhook_id), [NewEvent(event=made)], NO_STREAM)
        row = await table.get(store, webhook_id)
    except StoreError as e:
        raise store_error(e) from e
    assert row is not None  # projected inline, in the append's transaction
    shown = info(row)
    return json_response(WebhookMade(**msgspec.structs.asdict(shown), secret=secret), 201)


async def _found(request: Request) -> WebhookRow:
    webhook_id = request.path_params["webhook_id"]
    try:
        row = await table.get(store_of(request), webhook_id)
    except StoreError as e:
        raise store_error(e) from e
    if row is None or row.deleted_at is not None:
        raise ApiError(404, "webhook_not_found", f"no webhook {webhook_id!r}",
                       "GET /v1/webhooks lists the subscriptions", "webhookId")  # fmt: skip
    return row


async def list_webhooks(request: Request) -> Response:
    unrestricted(request, NEEDS_UNSCOPED, "managing webhooks")
    try:
        rows = await table.listed(store_of(request))
    except StoreError as e:
        raise store_error(e) from e
    return json_response(WebhookList(webhooks=[info(r) for r in rows]))


async def get_webhook(request: Request) -> Response:
    unrestricted(request, NEEDS_UNSCOPED, "managing webhooks")
    return json_response(info(await _found(request)))


async def delete_webhook(request: Request) -> Response:
    unrestricted(request, NEEDS_UNSCOPED, "managing webhooks")
    row = await _found(request)
    store = store_of(request)
    gone = WebhookDeleted(webhook_id=row.webhook_id)
    try:
        await store.aappend(streams.webhook(row.webhook_id), [NewEvent(event=gone,
                            metadata=Metadata())], row.version)  # fmt: skip
        after = await table.get(store, row.webhook_id)
    except StoreError as e:
        raise store_error(e) from e
    return json_response(info(after or row))


def _delivery(row: tuple[Any, ...]) -> WebhookDelivery:
    (item_id, event_id, event_type, cursor, status, attempts, uncertain, code, error, created,
     updated, next_at) = row  # fmt: skip
    return WebhookDelivery(
        id=item_id, event_id=event_id, event_type=event_type, cursor=cursor, status=status,
        attempts=attempts, redelivery=uncertain, error_code=code, last_error=error,
        created_at=created.isoformat(), updated_at=updated.isoformat(),
        next_attempt_at=None if next_at is None else next_at.isoformat(),
    )  # fmt: skip


async def list_deliveries(request: Request) -> Response:
    """``?status&limit``: newest first."""
    unrestricted(request, NEEDS_UNSCOPED, "managing webhooks")
    row = await _found(request)
    status = request.query_params.get("status")
    if status is not None and status not in STATUSES:
        raise ApiError(400, "invalid_value", f"status={status!r} is not a delivery status",
                       f"use one of: {', '.join(STATUSES)}", "status")  # fmt: skip
    limit = int_param(request, "limit", 100, 1, MAX_PAGE, "invalid_value")
    rows = await fetch(request, "webhook_deliveries",
                       {"id": row.webhook_id, "status": status, "limit": limit})  # fmt: skip
    return json_response(
        DeliveryPage(webhook_id=row.webhook_id, deliveries=[_delivery(r) for r in rows])
    )


_ID = param("webhook_id", "path", "Webhook id (`webhookId`)")
_ERRORS = ("401", "403", "404", "503")
CREATE_WEBHOOK = Operation(
    "POST",
    "/v1/webhooks",
    create_webhook,
    "Subscribe a URL to event types (or prefixes like turn.*), for some agents or all; the "
    "signing secret is in this answer only",
    {"201": answer(WebhookMade, "Subscribed")},
    body=WebhookBody,
    errors=("400", "401", "403", "413", "415", "503"),
)
LIST_WEBHOOKS = Operation(
    "GET",
    "/v1/webhooks",
    list_webhooks,
    "Webhook subscriptions (never their secrets)",
    {"200": answer(WebhookList, "Subscriptions")},
    errors=("401", "403", "503"),
)
GET_WEBHOOK = Operation(
    "GET",
    "/v1/webhooks/{webhook_id}",
    get_webhook,
    "One webhook subscription",
    {"200": answer(WebhookInfo, "The subscription")},
    params=[_ID],
    errors=_ERRORS,
)
WEBHOOK_DELIVERIES = Operation(
    "GET",
    "/v1/webhooks/{webhook_id}/deliveries",
    list_deliveries,
    "A subscription's deliveries, newest first: status, attempts, last error, redelivery",
    {"200": answer(DeliveryPage, "Deliveries")},
    params=[
        _ID,
        param(
            "status",
            "query",
            "Only deliveries with this status",
            {"type": "string", "enum": list(STATUSES)},
            required=False,
        ),
        LIMIT,
    ],
    errors=("400", *_ERRORS),
)
DELETE_WEBHOOK = Operation(
    "DELETE",
    "/v1/webhooks/{webhook_id}",
    delete_webhook,
    "Delete a subscription: nothing more is sent; what was promised and not sent goes dead",
    {"200": answer(WebhookInfo, "The deleted subscription")},
    params=[_ID],
    errors=_ERRORS,
)

"""``GET /v1/agents/{agent}/deliveries``: where the agent's promised replies stand, item by item,
read from the outbox projection (eventstore/projections/outbox.py) that the outbox actor works from.

An item is one chunk of one reply to one recipient. Its stored state (``pending``, ``inflight``,
``sent``, ``failed``, ``uncertain``) is shown as a person reads it: a pending item that has been
tried is ``retrying``, an inflight one ``sending`` (gateways/api/sql/deliveries.sql). The text of
the reply is never in the answer: the page says where a reply is, the session's history what it
said.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateways.api.common import MAX_PAGE, ApiError, agent, fetch, int_param
from gateways.api.schemas import DELIVERY_STATUSES, DeliveryError, DeliveryItem, DeliveryList
from gateways.http.errors import json_response
from gateways.http.operation import AGENT, LIMIT, Operation, answer, param

DEFAULT_PAGE = 100


async def list_deliveries(request: Request) -> Response:
    """``?status&sessionKey&limit``: newest first, at most ``limit`` (default 100, at most
    500); a status or limit out of range is ``400 invalid_value`` naming the parameter."""
    agent_id = agent(request).id
    status = request.query_params.get("status")
    if status is not None and status not in DELIVERY_STATUSES:
        raise ApiError(
            400,
            "invalid_value",
            f"status={status!r} is not a delivery status",
            f"use one of: {', '.join(DELIVERY_STATUSES)}",
            "status",
        )
    limit = int_param(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE, "invalid_value")
    rows = await fetch(
        request,
        "deliveries",
        {
            "agent_id": agent_id,
            "session_key": request.query_params.get("sessionKey"),
            "status": status,
            "limit": limit,
        },
    )
    return json_response(DeliveryList(deliveries=[delivery(row) for row in rows]))


LIST_DELIVERIES = Operation(
    "GET",
    "/v1/agents/{agent}/deliveries",
    list_deliveries,
    "Outbox items (one chunk of a reply to one recipient each), newest first, with their "
    "status, attempts and last error; never the reply's text",
    {"200": answer(DeliveryList, "Deliveries")},
    params=[
        AGENT,
        param(
            "status",
            "query",
            "Only items with this status",
            {"type": "string", "enum": list(DELIVERY_STATUSES)},
            required=False,
        ),
        param("sessionKey", "query", "Only this session's items", required=False),
        LIMIT,
    ],
)


def delivery(row: tuple[Any, ...]) -> DeliveryItem:
    """One row of deliveries.sql (its columns are in this order)."""
    (item_id, channel, to, thread, session_key, turn_id, chunk_index, chunk_total, status,
     attempts, uncertain, code, message, provider_id, created, updated, sent,
     next_attempt) = row  # fmt: skip
    failed = code is not None or message is not None
    return DeliveryItem(
        id=item_id,
        channel=channel,
        to=to,
        thread=thread,
        session_key=session_key,
        turn_id=turn_id,
        chunk_index=chunk_index,
        chunk_total=chunk_total,
        status=status,
        attempts=attempts,
        uncertain=uncertain,
        last_error=DeliveryError(code=code, message=message) if failed else None,
        provider_message_id=provider_id,
        created_at=created,
        updated_at=updated,
        sent_at=sent,
        next_attempt_at=next_attempt,
    )

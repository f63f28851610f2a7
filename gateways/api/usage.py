"""Usage and cost: ``GET /v1/usage?by&from&to`` and ``GET /v1/agents/{agent}/usage``, grouped
from the usage meter (eventstore/projections/usage.py, one row per model call) by
actors/usage.py and priced by the node's price table (actors/prices.py); and the cost of one
turn, call by call, for the turn resource.

``by`` is a comma-separated list of ``agent``, ``model``, ``session``, ``day`` (default
``agent,model``, as Dispach v1's); ``from`` is inclusive and ``to`` exclusive, ISO 8601
instants or dates (a date is its UTC midnight).
"""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import cast

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from actors.prices import Counts, PriceTable
from actors.usage import GROUPS, Group, buckets
from eventstore import StoreError
from gateways.api.common import ApiError, agent, principal, runtime, store_error, store_of
from gateways.api.schemas import CallUsage, TurnResource, UsagePage
from gateways.http.errors import json_response
from gateways.http.operation import AGENT, Operation, answer, param

DEFAULT_BY: tuple[Group, ...] = ("agent", "model")
INSTANT = r"^\d{4}-\d{2}-\d{2}([T ][0-9:.]+(Z|[+-]\d{2}:?\d{2})?)?$"
"""What ``from`` and ``to`` take (the handler's ``_instant`` says which of these are real)."""


def priced(turn: TurnResource, prices: PriceTable) -> TurnResource:
    """The turn with the cost of each call and of the whole (None, with the reasons, when a
    call's model has no price)."""
    calls = [
        msgspec.structs.replace(call, cost_usd=prices.cost(call.model, _counts(call)).usd)
        for call in turn.calls
    ]
    cost = prices.total([(call.model, _counts(call)) for call in turn.calls])
    return msgspec.structs.replace(turn, calls=calls, cost_usd=cost.usd, cost_reason=cost.reason)


def _counts(call: CallUsage) -> Counts:
    return Counts(prompt=call.prompt_tokens, output=call.output_tokens,
                  cache_read=call.cache_read_tokens, cache_write=call.cache_write_tokens,
                  server_tools=call.server_tool_requests)  # fmt: skip


def _by(request: Request, allowed: tuple[Group, ...]) -> tuple[Group, ...]:
    raw = request.query_params.get("by")
    if raw is None:
        return tuple(g for g in DEFAULT_BY if g in allowed)
    groups = raw.split(",")
    wrong = [g for g in groups if g not in allowed]
    if wrong or len(set(groups)) != len(groups):
        raise ApiError(
            400, "usage_group_invalid",
            f"by={raw!r} is not a grouping" + (f" ({wrong[0]!r} is unknown)" if wrong else
                                                " (a key is repeated)"),
            f"use a comma-separated list of: {', '.join(allowed)}", "by",
        )  # fmt: skip
    return cast("tuple[Group, ...]", tuple(groups))


def _instant(request: Request, name: str) -> datetime | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    try:
        if len(raw) == 10:
            day = date.fromisoformat(raw)
            return datetime(day.year, day.month, day.day, tzinfo=UTC)
        found = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        found = None
    if found is None or not 1970 <= found.year <= 9998:
        raise ApiError(
            400, "usage_range_invalid", f"{name}={raw!r} is not an instant",
            "write an ISO 8601 date or time, e.g. 2026-12-01 or 2026-12-01T09:00:00Z", name,
        )  # fmt: skip
    return found if found.tzinfo is not None else found.replace(tzinfo=UTC)


async def _page(request: Request, agent_id: str | None, allowed: tuple[Group, ...]) -> Response:
    by = _by(request, allowed)
    start, end = _instant(request, "from"), _instant(request, "to")
    if start is not None and end is not None and end <= start:
        raise ApiError(400, "usage_range_invalid", "to is not after from",
                       "from is inclusive and to exclusive: give a later to", "to")  # fmt: skip
    # A principal limited to some agents sees only theirs, whatever the grouping.
    seen = principal(request).agents
    agents = [agent_id] if agent_id is not None else None if seen is None else sorted(seen)
    try:
        found, truncated = await buckets(store_of(request), runtime(request).prices, by,
                                         agents=agents, start=start, end=end)  # fmt: skip
    except StoreError as e:
        raise store_error(e) from e
    return json_response(UsagePage(by=list(by), buckets=found, from_=start, to=end,
                                   truncated=truncated))  # fmt: skip


async def usage(request: Request) -> Response:
    """``GET /v1/usage``: every agent's calls."""
    return await _page(request, None, GROUPS)


async def agent_usage(request: Request) -> Response:
    """``GET /v1/agents/{agent}/usage``: one agent's calls (``by`` without ``agent``; default
    ``model``)."""
    return await _page(request, agent(request).id, tuple(g for g in GROUPS if g != "agent"))


def _by_param(groups: tuple[str, ...]) -> dict[str, object]:
    keys = "|".join(groups)
    return param(
        "by", "query", f"Comma-separated keys to group by, each once: {', '.join(groups)}",
        {"type": "string", "pattern": f"^({keys})(,({keys}))*$"}, required=False,
    )  # fmt: skip


_RANGE = [
    param(name, "query", f"{what} (ISO 8601 instant, or a date: its UTC midnight)",
          {"type": "string", "pattern": INSTANT}, required=False)
    for name, what in (("from", "From, inclusive"), ("to", "To, exclusive"))
]  # fmt: skip

AGENT_USAGE = Operation(
    "GET",
    "/v1/agents/{agent}/usage",
    agent_usage,
    "One agent's usage and cost over [from, to), grouped by model, session or day",
    {"200": answer(UsagePage, "Usage buckets")},
    params=[AGENT, _by_param(("model", "session", "day")), *_RANGE],
)
USAGE = Operation(
    "GET",
    "/v1/usage",
    usage,
    "Usage and cost of the agents' model calls over [from, to), grouped by agent, model, "
    "session or day; cost by the node's price table, null with costReason when a model has "
    "no price",
    {"200": answer(UsagePage, "Usage buckets")},
    params=[_by_param(("agent", "model", "session", "day")), *_RANGE],
    errors=("400", "401"),
)

"""Usage over a range, grouped as asked (agent, model, session, day), from the usage meter's
rows (eventstore/projections/usage.py) and priced by a :class:`PriceTable`.

The rows are always grouped by model too, whatever is asked: a price is per model, so a bucket
spanning models is the sum of each model's priced part (and its cost unknown if any part's is).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import date, datetime
from typing import Any, Literal

import msgspec

from actors.prices import Cost, Counts, PriceTable
from eventstore import EventStore

Group = Literal["agent", "model", "session", "day"]
GROUPS: tuple[Group, ...] = ("agent", "model", "session", "day")
_COLUMN: dict[str, str] = {
    "agent": "agent_id", "model": "model", "session": "session_key", "day": "day",
}  # fmt: skip
MAX_BUCKETS = 10_000


class Bucket(msgspec.Struct, kw_only=True, omit_defaults=True, rename="camel"):
    """The usage of one group: only the keys asked for are set."""

    cost_usd: float | None
    """USD by the price table; None (always shown) when a model in the bucket has no price."""
    agent_id: str | None = None
    model: str | None = None
    session_key: str | None = None
    day: date | None = None
    calls: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    server_tool_requests: dict[str, int] = msgspec.field(default_factory=dict)
    cost_reason: str | None = None

    @property
    def tokens(self) -> int:
        """Every token read and written (prompt includes the cache's)."""
        return self.prompt_tokens + self.output_tokens


def _where(
    agents: Sequence[str] | None, start: datetime | None, end: datetime | None
) -> tuple[str, list[Any]]:
    clauses: list[str] = []
    params: list[Any] = []
    if agents is not None:
        clauses.append("agent_id = ANY(%s)")
        params.append(list(agents))
    if start is not None:
        clauses.append("at >= %s")
        params.append(start)
    if end is not None:
        clauses.append("at < %s")
        params.append(end)
    return (" AND ".join(clauses) or "true"), params


async def buckets(
    store: EventStore,
    prices: PriceTable,
    by: Sequence[Group],
    *,
    agents: Sequence[str] | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
) -> tuple[list[Bucket], bool]:
    """The buckets of ``by`` over ``[start, end)`` (of one agent's calls, if given), in the
    order of their keys, at most :data:`MAX_BUCKETS` (the flag says whether more there were);
    ``agents``: only these agents' calls (None: every agent's)."""
    keys = [_COLUMN[g] for g in by]
    cols = list(dict.fromkeys([*keys, "model"]))
    where, params = _where(agents, start, end)
    group = ", ".join(cols)
    # Only the fixed column names of _COLUMN are in the text; every value is a parameter.
    sums = await store.afetch(
        f"""SELECT {group}, count(*), sum(prompt_tokens), sum(output_tokens),
                   sum(cache_read_tokens), sum(cache_write_tokens)
              FROM usage_calls WHERE {where}
             GROUP BY {group} ORDER BY {group} LIMIT %s""".encode(),  # noqa: S608
        [*params, MAX_BUCKETS * 4 + 1],
    )
    tool_rows = await store.afetch(
        f"""SELECT {group}, t.key, sum(t.value::bigint)
              FROM usage_calls, jsonb_each_text(server_tools) AS t
             WHERE server_tool_requests > 0 AND {where}
             GROUP BY {group}, t.key""".encode(),  # noqa: S608
        params,
    )
    n = len(cols)
    by_tool: dict[tuple[Any, ...], dict[str, int]] = {}
    for row in tool_rows:
        by_tool.setdefault(tuple(row[:n]), {})[row[n]] = int(row[n + 1])
    parts: dict[tuple[Any, ...], list[tuple[str | None, Counts, int]]] = {}
    for row in sums:
        group_key = tuple(row[:n])
        calls, prompt, output, cache_read, cache_write = (int(v or 0) for v in row[n:])
        tools = by_tool.get(group_key, {})
        counts = Counts(prompt=prompt, output=output, cache_read=cache_read,
                        cache_write=cache_write, server_tools=tools)  # fmt: skip
        model = row[cols.index("model")]
        parts.setdefault(tuple(row[cols.index(k)] for k in keys), []).append((model, counts, calls))
    found = [_bucket(by, key, models, prices) for key, models in parts.items()]
    return found[:MAX_BUCKETS], len(found) > MAX_BUCKETS or len(sums) > MAX_BUCKETS * 4


def _bucket(
    by: Sequence[Group], key: tuple[Any, ...], models: list[tuple[str | None, Counts, int]],
    prices: PriceTable,
) -> Bucket:  # fmt: skip
    tools: dict[str, int] = {}
    for _, counts, _ in models:
        for kind, count in counts.server_tools.items():
            tools[kind] = tools.get(kind, 0) + count
    cost = prices.total([(model, counts) for model, counts, _ in models])
    named = dict(zip(by, key, strict=True))
    return Bucket(
        agent_id=named.get("agent"), model=named.get("model"), session_key=named.get("session"),
        day=named.get("day"), calls=sum(c for _, _, c in models),
        prompt_tokens=sum(c.prompt for _, c, _ in models),
        output_tokens=sum(c.output for _, c, _ in models),
        cache_read_tokens=sum(c.cache_read for _, c, _ in models),
        cache_write_tokens=sum(c.cache_write for _, c, _ in models),
        server_tool_requests=tools, cost_usd=cost.usd, cost_reason=cost.reason,
    )  # fmt: skip


def total(found: Sequence[Bucket]) -> tuple[int, Cost]:
    """Tokens and cost of some buckets together (a cost unknown if any is)."""
    reasons = [b.cost_reason for b in found if b.cost_usd is None and b.cost_reason]
    tokens = sum(b.tokens for b in found)
    if reasons:
        return tokens, Cost(None, "; ".join(dict.fromkeys(reasons)))
    return tokens, Cost(round(sum(b.cost_usd or 0.0 for b in found), 6))

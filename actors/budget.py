"""Per-agent daily budgets (the manifest's ``limits.daily_cost_usd`` and ``limits.daily_tokens``):
once an agent's usage of the current UTC day reaches one, new turns are refused
``budget_exhausted`` (HTTP 429, with ``Retry-After`` the seconds until midnight UTC) at every
door, since every door submits through ``Commands.submit``, which asks :class:`Budgets` first.

A turn already running is not cut short: the budget is checked when a message is accepted, so a
day's usage can pass the budget by what the turns running at that moment go on to use.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import structlog

from actors.messages import Refused, Submit
from actors.prices import PriceTable
from actors.usage import Bucket, buckets, total
from eventstore import EventStore

log = structlog.get_logger("dispach.budget")

EXHAUSTED = "budget_exhausted"


@dataclass(frozen=True)
class Budget:
    daily_cost_usd: float | None = None
    daily_tokens: int | None = None

    @property
    def set(self) -> bool:
        return self.daily_cost_usd is not None or self.daily_tokens is not None


def day_bounds(now: datetime) -> tuple[datetime, datetime]:
    """The UTC day ``now`` is in: its start and the next day's."""
    start = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return start, start + timedelta(days=1)


def refusal(agent_id: str, budget: Budget, spent: list[Bucket], now: datetime) -> Refused | None:
    """``budget_exhausted`` when the day's usage ``spent`` (the agent's buckets of today) has
    reached a limit of ``budget``, else None. A cost that cannot be priced counts for nothing
    against ``daily_cost_usd`` (the price table is the operator's to complete; the node logs it)."""
    tokens, cost = total(spent)
    _, reset = day_bounds(now)
    wait = max(1, math.ceil((reset - now).total_seconds()))
    when = reset.strftime("%Y-%m-%dT%H:%M:%SZ")
    over: str | None = None
    if budget.daily_tokens is not None and tokens >= budget.daily_tokens:
        over = f"{tokens} tokens today, its limits.daily_tokens is {budget.daily_tokens}"
    elif (budget.daily_cost_usd is not None and cost.usd is not None
          and cost.usd >= budget.daily_cost_usd):  # fmt: skip
        over = f"${cost.usd:.4f} today, its limits.daily_cost_usd is ${budget.daily_cost_usd:g}"
    if over is None:
        return None
    return Refused(
        code=EXHAUSTED,
        message=f"agent {agent_id!r} has used its daily budget: {over}",
        hint=f"the budget resets at {when} (in {wait} s); raise the limit in the agent's "
        "manifest to go on today",
        retry_after=float(wait),
    )


class Budgets:
    """Asks the usage meter whether an agent with a budget may take a new turn."""

    def __init__(
        self,
        store: EventStore,
        prices: PriceTable,
        budget_of: Callable[[str], Budget | None],
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._store = store
        self._prices = prices
        self._budget_of = budget_of
        self._clock = clock
        self._unpriced: set[str] = set()

    async def admit(self, submit: Submit) -> Refused | None:
        budget = self._budget_of(submit.agent_id)
        if budget is None or not budget.set:
            return None
        now = self._clock()
        start, end = day_bounds(now)
        spent, _ = await buckets(self._store, self._prices, ("agent",), agents=[submit.agent_id],
                                 start=start, end=end)  # fmt: skip
        _, cost = total(spent)
        unpriced = budget.daily_cost_usd is not None and cost.usd is None
        if unpriced and submit.agent_id not in self._unpriced:
            self._unpriced.add(submit.agent_id)
            log.warning("budget_unpriced", agent=submit.agent_id, reason=cost.reason)
        return refusal(submit.agent_id, budget, spent, now)

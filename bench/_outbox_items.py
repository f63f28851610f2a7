"""The outbox bench's items (bench/outbox.py): ``delivery.enqueued`` events appended as a turn
would, a ``delivery.attempted`` left by a node that is gone for some; and their outbox rows read
back once every item is settled."""

from __future__ import annotations

from _report import perf

# isort: split
import asyncio
import math
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import psycopg

AGENT = "bench"
PER_TURN = 10
IN_FLIGHT = 2_000
"""Appends the bench keeps queued in its writer (its queue holds 10,000)."""
TEXT = ("The outbox drains replies to their channels; this is one chunk of one of them. " * 3)[:200]


def seed(store: Any, batch: str, items: int, in_doubt: int = 0, dead_node: str = "") -> None:
    """Append ``items`` outbox items in fake turns of session ``batch`` (one append each,
    interleaved across turn streams so the writer can group them), then a ``delivery.attempted``
    by ``dead_node`` for the first ``in_doubt`` of them: sends a node left without an answer when
    it died (recovery resends an attempt at once only when its node is surely gone)."""
    from actors.ids import turn_id
    from actors.outbox.plan import item_key
    from eventstore import NO_STREAM, Metadata, NewEvent, streams
    from eventstore.catalogue import Deliver, DeliveryAttempted, DeliveryEnqueued

    turns = [turn_id() for _ in range(math.ceil(items / PER_TURN))]
    queued: deque[Future[Any]] = deque()
    doubtful: list[tuple[str, Metadata]] = []
    for index in range(items):
        turn = turns[index % len(turns)]
        meta = Metadata(agent_id=AGENT, session_key=batch, turn_id=turn)
        deliver = Deliver(channel="hooks", to=f"r{index // len(turns)}")
        key = item_key(AGENT, batch, turn, deliver, 0)
        event = DeliveryEnqueued(channel_id="hooks", to=deliver.to, key=key, chunk_index=0,
                                 chunk_total=1, text=TEXT)  # fmt: skip
        queued.append(store.submit(streams.turn(turn), [NewEvent(event=event, metadata=meta)]))
        if len(doubtful) < in_doubt:
            doubtful.append((key, meta))
        while len(queued) >= IN_FLIGHT:
            queued.popleft().result(60)
    while queued:
        queued.popleft().result(60)
    for key, meta in doubtful:
        claim = DeliveryAttempted(channel_id="hooks", chunk_index=0, chunk_total=1, attempt=1,
                                  node=dead_node)  # fmt: skip
        queued.append(
            store.submit(streams.outbox(key), [NewEvent(event=claim, metadata=meta)], NO_STREAM)
        )
    while queued:
        queued.popleft().result(60)


@dataclass(frozen=True)
class Settled:
    """One batch's outbox rows once every item is settled (DB clock, epoch seconds)."""

    sent: int
    unsent: int
    uncertain: int
    first_enqueued: float
    last_enqueued: float
    first_sent: float
    last_sent: float
    latency_p50: float
    latency_p99: float


_SETTLED = """
SELECT count(*) FILTER (WHERE status = 'sent'), count(*) FILTER (WHERE status <> 'sent'),
       count(*) FILTER (WHERE uncertain),
       extract(epoch FROM min(created_at))::float8, extract(epoch FROM max(created_at))::float8,
       extract(epoch FROM min(updated_at) FILTER (WHERE status = 'sent'))::float8,
       extract(epoch FROM max(updated_at) FILTER (WHERE status = 'sent'))::float8,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM updated_at - created_at))
           FILTER (WHERE status = 'sent'),
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM updated_at - created_at))
           FILTER (WHERE status = 'sent')
  FROM outbox WHERE session_key = %s
"""
# The partial index outbox_due_idx holds exactly the unsettled rows: cheap to poll every 20 ms.
_UNSETTLED = "SELECT count(*) FROM outbox WHERE status IN ('pending', 'inflight')"


async def wait_settled(
    url: str, schema: str, limit: float, seeding: asyncio.Future[None] | None = None
) -> float:
    """Poll every 20 ms until the seeding (if any) is done and no item is unsettled; returns the
    perf() time it was seen."""
    async with await psycopg.AsyncConnection.connect(
        url, autocommit=True, options=f"-c search_path={schema}"
    ) as conn:
        started = perf()
        while perf() - started < limit:
            row = await (await conn.execute(_UNSETTLED)).fetchone()
            if seeding is None or seeding.done():
                if seeding is not None:
                    seeding.result()  # raise what the seeding raised
                if row is not None and row[0] == 0:
                    return perf()
            await asyncio.sleep(0.02)
    raise SystemExit(f"the outbox did not settle in {limit:.0f} s")


def settled(url: str, schema: str, batch: str) -> Settled:
    with psycopg.connect(url, autocommit=True, options=f"-c search_path={schema}") as conn:
        row = conn.execute(_SETTLED.encode(), (batch,)).fetchone()
    assert row is not None
    sent, unsent, uncertain, *times = row
    return Settled(sent, unsent, uncertain, *(math.nan if v is None else float(v) for v in times))

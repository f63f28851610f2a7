"""OutboxActor: sends due outbox items through their channels and records every step.

An item is claimed by appending ``delivery.attempted`` to its stream, expecting the version the
actor read: if anyone else got there first the append conflicts and the actor lets the item go.
The attempt is committed *before* the send, so after a crash an item whose last event is an
attempt is known to be in doubt: at start it is flagged ``delivery.uncertain`` and sent again
(exact on a channel whose provider deduplicates by key), or settled as uncertain without a resend
for a channel configured ``on_uncertain: skip``. A send whose answer never came (the connection
dropped or timed out after the request went out) is the same doubt and is recorded the same way,
by the plan, right away: nothing is ever silently dropped, nor silently sent twice.

Sends run as tasks on the event loop, at most ``channel.concurrency`` per channel; the actor
itself only wakes the drain loop (a commit added items, a send freed a slot).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from importlib import resources
from typing import Any

import structlog

from actors import faults, tracing
from actors.actor import LoopActor
from actors.outbox.channel import Channel, SendResult
from actors.outbox.metrics import DELIVERIES, DELIVERY_SECONDS, OUTBOX_DEPTH
from actors.outbox.plan import Item, outbound, settle
from eventstore import (
    AppendResult,
    EventStore,
    Metadata,
    NewEvent,
    StoreError,
    WrongExpectedVersion,
    streams,
)
from eventstore.bridge import Portal, settled
from eventstore.catalogue import DeliveryAttempted, DeliveryFailed, DeliveryUncertain
from eventstore.event import Event

log = structlog.get_logger("dispach.outbox")

KICK = "kick"
"""Tell: items may have become due (a commit enqueued some)."""
DRAIN = "drain"
"""Ask: start no more sends; the answer is a future that settles when those in flight have."""

_SEND_TIMEOUT_S = 60.0
_DRY_S = 0.1
_STALE_S = 2 * _SEND_TIMEOUT_S + 30.0
"""An attempt older than this has no live sender: it would have recorded a timeout by now."""


def _sql(name: str) -> bytes:
    return resources.files("actors.outbox").joinpath("sql", f"{name}.sql").read_bytes()


_DUE = _sql("due")
_NEXT = _sql("next_due")
_INFLIGHT = _sql("inflight")

ChannelLookup = Callable[[str, str], Channel | None]


class OutboxActor(LoopActor):
    def __init__(
        self,
        portal: Portal,
        store: EventStore,
        channels: ChannelLookup,
        node_id: str,
        alive: Callable[[str], bool] = lambda node: False,
        *,
        poll_s: float = 1.0,
        recover_every_s: float = _STALE_S / 4,
        max_in_flight: int = 256,
    ) -> None:
        super().__init__(portal.loop)
        self._portal = portal
        self._store = store
        self._channels = channels
        self._node_id = node_id
        self._alive = alive
        """Whether a node is a live member of the cluster (its lease heartbeat holds)."""
        self._recover_every_s = recover_every_s
        self._poll_s = poll_s
        self._max_in_flight = max_in_flight
        self._rng = random.Random()  # noqa: S311 - retry jitter, not a secret
        self._wake = asyncio.Event()  # touched on the loop only (this actor runs there)
        self._busy: dict[str, asyncio.Task[None]] = {}
        self._ready: deque[Item] = deque()
        self._dry_until = 0.0
        """The last read found nothing new: no other read before this (monotonic) time."""
        """Due items read ahead, not started yet (their channel had no free slot)."""
        self._slots: dict[tuple[str, str], int] = {}
        self._task: asyncio.Task[None] | None = None
        self._drainer: asyncio.Task[None] | None = None
        self.recovered = 0

    def on_start(self) -> None:
        self._task = self._loop.create_task(self._run(), name="outbox")

    def on_receive(self, message: Any) -> Any:
        if message == KICK:
            self._dry_until = 0.0
            self._wake.set()
        elif message == DRAIN:
            return self._drain_sends()
        return None

    def _drain_sends(self) -> asyncio.Task[None]:
        """Stop the drain loop and let the sends in flight finish; the answer settles once the
        loop has ended and every send has recorded its outcome."""
        if self._task is not None:
            self._task.cancel()
        tasks = [*self._busy.values(), *([self._task] if self._task is not None else [])]

        async def settle() -> None:
            if tasks:
                await asyncio.wait(tasks)

        self._drainer = self._loop.create_task(settle())
        return self._drainer

    def on_stop(self) -> None:
        # Sends in flight are cancelled: an item whose attempt is committed and whose answer is
        # not stays in doubt and is flagged at the next start (never dropped, never faked).
        if self._task is not None:
            self._task.cancel()
        for task in self._busy.values():
            task.cancel()

    # --- the drain loop -----------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                self.recovered = await self._recover()
                break
            except StoreError as e:
                log.warning("outbox_recovery_retry", error=e.message)
                await asyncio.sleep(self._poll_s)
        checked = time.monotonic()
        while True:
            self._wake.clear()
            wait = self._poll_s
            try:
                if time.monotonic() - checked > self._recover_every_s:
                    checked = time.monotonic()
                    self.recovered += await self._recover()  # another host's dead node
                started = await self._start_due()
                if started:
                    wait = 0.0
                elif not self._ready:
                    wait = await self._next_wait()
                # else: what was read waits for a slot; a finished send wakes the loop
            except StoreError as e:
                log.warning("outbox_read_failed", error=e.message)
            except Exception:  # a bug must not stop every delivery of the node: log, go on
                log.exception("outbox_loop_failed")
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(wait, self._poll_s)):
                        await self._wake.wait()

    async def _start_due(self) -> int:
        """Start what the free slots allow, from the items read ahead; read more (one query)
        when few are left. Reading ahead matters: the due query costs milliseconds with a deep
        outbox, so it runs once per batch of sends, not once per freed slot."""
        started = self._start_ready()
        now = time.monotonic()
        if len(self._ready) <= self._max_in_flight // 4 and now >= self._dry_until:
            room = self._max_in_flight - len(self._busy) - len(self._ready)
            if room > 0:
                before = len(self._ready)
                known = [*self._busy, *(item.item_id for item in self._ready)]
                held = self._held()
                full = [f"{a}/{c}" for (a, c), n in held.items() if n >= self._cap(a, c)]
                query = {"busy": known, "full": full, "limit": room}
                for row in await self._store.afetch(_DUE, query):
                    item = Item(**dict(zip(_ITEM_FIELDS, row, strict=True)))
                    slot = (item.agent_id, item.channel_id)
                    if held.get(slot, 0) < self._cap(*slot):  # the rest: at a later read
                        held[slot] = held.get(slot, 0) + 1
                        self._ready.append(item)
                # Nothing new: do not ask again for every finished send (a kick, the poll or
                # this pause ends it).
                self._dry_until = now + _DRY_S if len(self._ready) == before else 0.0
                started += self._start_ready()
        return started

    def _held(self) -> dict[tuple[str, str], int]:
        """Items in hand per (agent, channel): sending, or read ahead."""
        held: dict[tuple[str, str], int] = dict(self._slots)
        for item in self._ready:
            slot = (item.agent_id, item.channel_id)
            held[slot] = held.get(slot, 0) + 1
        return held

    def _cap(self, agent_id: str, channel_id: str) -> int:
        """How many items of a channel to hold at once (sending or read ahead): four times what
        it may send at once, so a fast channel reads ahead in large batches while a slow one's
        backlog cannot crowd the read-ahead and starve the others."""
        channel = self._channels(agent_id, channel_id)
        return 4 * channel.concurrency if channel is not None else 1

    def _start_ready(self) -> int:
        """Start the items read ahead whose channel has a free slot (in due order); the others
        wait for one."""
        started = 0
        waiting: deque[Item] = deque()
        while self._ready:
            item = self._ready.popleft()
            channel = self._channels(item.agent_id, item.channel_id)
            slot = (item.agent_id, item.channel_id)
            if channel is not None and self._slots.get(slot, 0) >= channel.concurrency:
                waiting.append(item)
                continue
            self._slots[slot] = self._slots.get(slot, 0) + 1
            task = self._loop.create_task(self._deliver(item, channel))
            self._busy[item.item_id] = task
            task.add_done_callback(functools.partial(self._freed, item.item_id, slot))
            started += 1
        self._ready = waiting
        return started

    def _freed(self, item_id: str, slot: tuple[str, str], _task: asyncio.Task[None]) -> None:
        self._busy.pop(item_id, None)
        self._slots[slot] -= 1
        self._wake.set()  # a slot is free, and the reply's next chunk may be due

    async def _next_wait(self) -> float:
        rows = await self._store.afetch(_NEXT)
        wait, depth = rows[0]
        OUTBOX_DEPTH.set(depth)
        if wait is None:
            return self._poll_s
        assert isinstance(wait, timedelta)
        return max(wait.total_seconds(), 0.0)

    # --- one item -----------------------------------------------------------------------------

    async def _deliver(self, item: Item, channel: Channel | None) -> None:
        meta = _meta(item)
        stream = streams.outbox(item.item_id)
        try:
            if channel is None:
                await self._append(stream, meta, _unknown_channel(item), item.version)
                return
            attempt = item.attempts + 1
            claim = DeliveryAttempted(
                channel_id=item.channel_id, chunk_index=item.chunk_index,
                chunk_total=item.chunk_total, attempt=attempt, node=self._node_id,
            )  # fmt: skip
            try:
                await self._append(stream, meta, claim, item.version)
            except WrongExpectedVersion:
                return  # another sender claimed it: its outcome will be recorded there
            faults.point("delivery.attempted")
            began = time.perf_counter()
            turn = await self._turn_context(item.turn_id)
            with tracing.delivery(channel.type, item.item_id, attempt, turn) as call:
                result = await self._send(channel, item, attempt)
                if not result.ok:
                    call.failed(result.code or "delivery_failed")
            faults.point("delivery.answered")
            outcome = settle(item, channel, attempt, result, self._rng)
            await self._append(stream, meta, outcome, item.version + 1)
            if isinstance(outcome, DeliveryUncertain):
                log.warning("delivery_uncertain", item=item.item_id, channel=item.channel_id,
                            code=outcome.code, resend=outcome.resend)  # fmt: skip
            DELIVERY_SECONDS.labels(channel=channel.type).observe(time.perf_counter() - began)
            DELIVERIES.labels(channel=channel.type, outcome=outcome.TYPE.split(".")[1]).inc()
        except StoreError as e:
            # The log refused or is away: the item keeps its last recorded state (pending, or
            # in doubt after a committed attempt) and is picked up again or recovered.
            log.warning("outbox_append_failed", item=item.item_id, error=e.message)
        except Exception:  # a bug: the item keeps its last recorded state, as above
            log.exception("outbox_deliver_failed", item=item.item_id)

    async def _send(self, channel: Channel, item: Item, attempt: int) -> SendResult:
        try:
            async with asyncio.timeout(_SEND_TIMEOUT_S):
                return await channel.send(outbound(item, attempt))
        except TimeoutError:  # cut mid-send: the request may have gone out
            return SendResult(ok=False, retryable=True, in_doubt=True, code="delivery_timeout",
                              error=f"the send took longer than {_SEND_TIMEOUT_S:g} s")  # fmt: skip
        except Exception as e:  # a channel bug must not take the outbox down
            # Where it raised is unknown, so whether the request went out is too.
            log.exception("channel_send_raised", channel=channel.id)
            return SendResult(ok=False, retryable=True, in_doubt=True,
                              code="delivery_transport_threw",
                              error=f"{type(e).__name__}: {e}")  # fmt: skip

    async def _turn_context(self, turn_id: str) -> str | None:
        """The traceparent the turn's last event was stored with (tracing on only: one read);
        None when it has none or the read fails (a trace is no reason to hold a delivery)."""
        if not tracing.ENABLED:
            return None
        try:
            last = await self._store.alast(streams.turn(turn_id))
        except StoreError:
            return None
        return last.metadata.correlation_id if last is not None else None

    async def _append(self, stream: str, meta: Metadata, event: Event, expected: int) -> None:
        await settled(self._store.submit(stream, [NewEvent(event=event, metadata=meta)], expected))

    # --- recovery -----------------------------------------------------------------------------

    def _dead(self, node: str | None) -> bool:
        """Whether the node that made an attempt is surely gone."""
        return not node or node == self._node_id or not self._alive(node)

    async def _recover(self) -> int:
        """Flag the items a dead node left in doubt (see the module docstring); returns how
        many. An attempt is known dead when it was this node's (an earlier life of it: nothing
        is in flight yet at start, and this node's own sends are skipped), or its node is no
        live member of the cluster: the membership lease, not a guess from process ids or
        ages, says so, so a node starting beside a live one never resends that one's items."""
        flags: list[tuple[Item, str | None, bool, asyncio.Future[AppendResult]]] = []
        for row in await self._store.afetch(_INFLIGHT):
            *fields, node, _age = row
            item = Item(**dict(zip(_ITEM_FIELDS, fields, strict=True)))
            if item.item_id in self._busy or not self._dead(node):
                continue
            channel = self._channels(item.agent_id, item.channel_id)
            meta = _meta(item)
            resend = channel is None or channel.on_uncertain == "resend"
            flag = DeliveryUncertain(
                channel_id=item.channel_id, chunk_index=item.chunk_index,
                chunk_total=item.chunk_total, attempts=item.attempts,
                idempotent_send=channel is not None and channel.idempotent, resend=resend,
                code="delivery_interrupted",
                error=f"node {node or '?'} stopped before it recorded the send's answer",
            )  # fmt: skip
            # Submitted together and awaited after: the writer commits them in a few batches.
            submitted = self._store.submit(
                streams.outbox(item.item_id), [NewEvent(event=flag, metadata=meta)], item.version
            )
            flags.append((item, node, resend, settled(submitted)))
        outcomes = await asyncio.gather(*(f for *_, f in flags), return_exceptions=True)
        flagged = 0
        for (item, node, resend, _), outcome in zip(flags, outcomes, strict=True):
            if isinstance(outcome, WrongExpectedVersion):
                continue  # its node answered after all, or another node recovered it
            if isinstance(outcome, BaseException):
                raise outcome  # the store is away: recovery is tried again
            flagged += 1
            log.warning("delivery_uncertain", item=item.item_id, channel=item.channel_id,
                        node=node, resend=resend)  # fmt: skip
        return flagged


_ITEM_FIELDS = tuple(Item.__struct_fields__)


def _meta(item: Item) -> Metadata:
    """Who an item's events are about: an event webhook's delivery is about no agent, session
    or turn (its row holds empty strings), so its events carry none."""
    return Metadata(agent_id=item.agent_id or None, session_key=item.session_key or None,
                    turn_id=item.turn_id or None)  # fmt: skip


def _unknown_channel(item: Item) -> DeliveryFailed:
    return DeliveryFailed(
        channel_id=item.channel_id, chunk_index=item.chunk_index, chunk_total=item.chunk_total,
        attempts=item.attempts, exhausted=False, code="delivery_channel_unknown",
        error=f"agent {item.agent_id!r} has no channel {item.channel_id!r} on this node",
        abandoned=item.chunk_total - item.chunk_index - 1,
    )  # fmt: skip

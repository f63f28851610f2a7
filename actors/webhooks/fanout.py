"""The webhook fan-out: reads the log from each subscription's durable cursor and promises every
event a subscription wants to the outbox, as one ``delivery.enqueued`` per event in the
subscription's ``webhookfeed-<id>`` stream. The outbox then delivers them as it delivers any
reply: claimed by one node per attempt, one at a time per subscription (ordered: an item waits
until every earlier one to the same recipient is delivered or dead), retried, flagged when in
doubt (actors/outbox/).

One node fans out at a time, under the ``webhooks`` singleton lease. Nothing is lost or promised
twice across a crash or a hand-over: the cursors are saved after the promises they cover are
committed, and a promise's event id is derived from the subscription and the event, so reading
the same events again appends nothing (plan.py). Subscriptions made or deleted while it runs
are events of the log it reads, so each starts exactly after its ``webhook.created``.

With no live subscription it reads nothing: following the whole log would have the feed read
back every commit of every turn for no one. It then looks for a subscription every
``idle_poll_s`` (a ``webhook.created`` committed on this node wakes it at once: :meth:`nudge`).
A subscription found late loses nothing, because its cursor starts at its ``webhook.created``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

from actors.webhooks import plan
from eventstore import ANY, EventStore, NewEvent, StoreError, streams
from eventstore import webhooks as table
from eventstore.bridge import settled
from eventstore.catalogue import WebhookCreated, WebhookDeleted
from eventstore.envelope import RecordedEvent
from eventstore.feed import Feed, Scope
from eventstore.webhooks import Live

log = structlog.get_logger("dispach.webhooks")

_SAVE_EVERY_S = 5.0
"""A cursor that moved with nothing promised is saved at most this often (it is a shortcut)."""


class Fanout:
    def __init__(
        self, store: EventStore, feed: Feed, *, retry_s: float = 1.0, idle_poll_s: float = 1.0
    ) -> None:
        self._store = store
        self._feed = feed
        self._retry_s = retry_s
        self._idle_poll_s = idle_poll_s
        self._nudged = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.promised = 0

    def nudge(self) -> None:
        """A subscription was made on this node: look for it now, not at the next poll."""
        self._nudged.set()

    async def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="webhook-fanout")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await self._follow()
                continue
            except StoreError as e:
                log.warning("webhook_fanout_retry", error=e.message)
            except Exception:  # a bug must not end every subscription's deliveries: go on
                log.exception("webhook_fanout_failed")
            await asyncio.sleep(self._retry_s)

    async def _follow(self) -> None:
        # The head first, then the subscriptions: one made in between is a webhook.created
        # after the head, so the read below sees it.
        head = await self._store.ahead()
        self._nudged.clear()  # before the read: a subscription made after it nudges again
        subs = {s.webhook_id: s for s in await table.live(self._store)}
        if not subs:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._nudged.wait(), self._idle_poll_s)
            return
        start = min([head, *(s.cursor for s in subs.values())])
        saved = time.monotonic()
        async with self._feed.subscribe(Scope(chunks=False), start) as feed:
            while True:
                events = await feed.read(1.0)
                if not events:
                    continue
                promised = await self._promise(subs, events)
                last = events[-1].checkpoint
                for sub in subs.values():
                    sub.cursor = max(sub.cursor, last)
                if promised or time.monotonic() - saved > _SAVE_EVERY_S:
                    await table.save_cursors(self._store, {i: s.cursor for i, s in subs.items()})
                    saved = time.monotonic()
                if not subs:  # the last one was deleted: stop reading the log
                    return

    async def _promise(self, subs: dict[str, Live], events: list[RecordedEvent]) -> int:
        """Promise a page of events, subscription changes applied in log order."""
        count, run = 0, list[RecordedEvent]()
        for event in events:
            match event.data:
                case WebhookCreated(webhook_id=wid, events=types, agents=agents):
                    count += await self._append(plan.fan(list(subs.values()), run))
                    run = []
                    if wid not in subs:
                        subs[wid] = Live(webhook_id=wid, events=tuple(types),
                                         agents=None if agents is None else frozenset(agents),
                                         cursor=event.checkpoint)  # fmt: skip
                case WebhookDeleted(webhook_id=wid):
                    count += await self._append(plan.fan(list(subs.values()), run))
                    run = []
                    subs.pop(wid, None)
            run.append(event)
        return count + await self._append(plan.fan(list(subs.values()), run))

    async def _append(self, promises: dict[str, list[NewEvent]]) -> int:
        futures = [
            settled(self._store.submit(streams.webhook_feed(wid), batch, ANY))
            for wid, batch in promises.items()
        ]
        await asyncio.gather(*futures)
        count = sum(len(b) for b in promises.values())
        self.promised += count
        return count

"""Commit hints: how a tailing reader learns, within a millisecond, that there is more to read.

A hint is only a wake-up. Readers always re-read the log from their checkpoint, and poll as a
fallback, so a lost or late hint delays an event but never loses it. After each commit the writer
publishes one small NATS message per (agent, session, turn) touched; every node subscribes and
bumps a generation counter that its waiting readers watch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import nats.aio.client
import nats.aio.msg
import nats.aio.subscription
import nats.errors
import structlog

from eventstore import subjects
from eventstore.envelope import START, Checkpoint, RecordedEvent
from eventstore.errors import InvalidCursor

log = structlog.get_logger("dispach.hints")


class Hints:
    """A generation counter with waiters; lives on one event loop."""

    def __init__(self) -> None:
        self.generation = 0
        self.latest = START
        """The newest checkpoint a hint announced as committed."""
        self._changed = asyncio.Event()

    def notify(self, committed: Checkpoint | None = None) -> None:
        if committed is not None and committed > self.latest:
            self.latest = committed
        self.generation += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait(self, generation: int, timeout: float) -> bool:
        """Wait until the generation moves past ``generation`` or ``timeout`` passes."""
        if self.generation != generation:
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)
            return True
        return False


class NatsHints:
    """Publishes hints for committed events and feeds received ones into :class:`Hints`."""

    def __init__(self, nc: nats.aio.client.Client, hints: Hints) -> None:
        self._nc = nc
        self._hints = hints
        self._sub: nats.aio.subscription.Subscription | None = None

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(subjects.events_filter(), cb=self._received)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
            self._sub = None

    async def publish(self, committed: Sequence[RecordedEvent]) -> None:
        """Publish one hint per subject touched by a commit."""
        last: dict[str, str] = {}
        for event in committed:
            meta = event.metadata
            subject = subjects.events(meta.agent_id, meta.session_key, meta.turn_id)
            last[subject] = event.checkpoint.cursor()
        try:
            for subject, cursor in last.items():
                await self._nc.publish(subject, cursor.encode())
        except nats.errors.Error as e:
            # A lost hint only delays readers until their next poll.
            log.warning("hint_publish_failed", error=str(e))

    async def _received(self, msg: nats.aio.msg.Msg) -> None:
        try:
            committed = Checkpoint.from_cursor(msg.data.decode())
        except (InvalidCursor, UnicodeDecodeError):
            committed = None  # still a wake-up, just not a position
        self._hints.notify(committed)

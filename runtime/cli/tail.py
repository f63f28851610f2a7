"""``dispach events tail``: follow the log, woken by a node's NATS hints when one is running."""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable

import nats
import nats.errors

from eventstore import REGISTRY, START, Checkpoint, EventStore, NatsHints, RecordedEvent
from runtime.config import nats_servers
from runtime.errors import ConfigError


def check_types(types: set[str]) -> None:
    for name in types:
        if name not in REGISTRY:
            close = difflib.get_close_matches(name, REGISTRY, n=1)
            raise ConfigError(
                f"unknown event type {name!r}",
                f"did you mean {close[0]!r}?" if close else "see docs/events.md for the types",
                "type",
            )


async def tail(
    store: EventStore,
    nats_url: str | None,
    after: str | None,
    from_start: bool,
    categories: set[str],
    types: set[str],
    emit: Callable[[RecordedEvent], None],
) -> None:
    check_types(types)
    if after:
        start = Checkpoint.from_cursor(after)
    elif from_start:
        start = START
    else:
        start = store.head()
    await store.apool.open()
    hints = None
    if nats_url:
        # Without a node (and its NATS) the tail still works: it polls.
        with contextlib.suppress(nats.errors.Error, OSError, TimeoutError):
            nc = await nats.connect(
                servers=nats_servers(nats_url), connect_timeout=2, max_reconnect_attempts=-1
            )
            hints = NatsHints(nc, store.hints)
            await hints.start()

    def wanted(event: RecordedEvent) -> bool:
        return (not categories or event.category in categories) and (
            not types or event.type in types
        )

    try:
        async for event in store.subscribe(start, where=wanted):
            emit(event)
    finally:
        if hints is not None:
            await hints.stop()
        await store.apool.close()

"""Appending from a test's own thread: the store's appends are futures its callers await on the
loop (``EventStore.submit`` and ``aappend``); a synchronous test waits on the future instead."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout

from eventstore import ANY, AppendResult, EventStore, NewEvent
from eventstore.errors import StoreUnavailable
from eventstore.fencing import Fence


def append(
    store: EventStore,
    stream: str,
    events: Sequence[NewEvent],
    expected_version: int = ANY,
    *,
    timeout: float = 30.0,
    fence: Fence | None = None,
) -> AppendResult:
    """Append and wait for the commit; raises what the store refuses with (WrongExpectedVersion,
    EventIdReused, Fenced, ...), or StoreUnavailable if no answer comes within ``timeout``."""
    future = store.submit(stream, events, expected_version, fence, blocking=True)
    try:
        return future.result(timeout)
    except FutureTimeout as e:
        raise StoreUnavailable(
            f"the append to {stream} was not acknowledged within {timeout:g} s",
            "the database is slow or down",
        ) from e

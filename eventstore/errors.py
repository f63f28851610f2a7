"""Errors of the event store: a stable ``code``, the facts in ``message``, and a ``hint``.

Driver exceptions (psycopg, nats) are translated here once, at the boundary, and never escape
the package (STYLE.md 5).
"""

from __future__ import annotations

from eventstore.versions import ANY, NO_STREAM


class DispachError(Exception):
    """Base of every error Dispach reports to a person: a stable ``code`` to branch on, the
    facts in ``message``, what to do in ``hint``, and the offending ``field`` when there is one.

    It lives in the lowest package so that every layer raises the same shape and the gateways
    render any of them as ``{"error": {"code", "message", "hint", "field"?}}``.
    """

    code = "error"

    def __init__(self, message: str, hint: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.field = field

    def __str__(self) -> str:
        return f"{self.code}: {self.message} ({self.hint})"


class StoreError(DispachError):
    """Base of every error the event store raises."""

    code = "store_error"


class WrongExpectedVersion(StoreError):
    """The stream is not at the version the command was decided against."""

    code = "wrong_expected_version"

    def __init__(self, stream: str, expected: int, actual: int) -> None:
        self.stream = stream
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"expected {describe_version(expected)}, stream {stream} is at {actual}",
            "another writer appended to this stream; reload it and decide the command again",
        )


class EventIdReused(StoreError):
    """An event id already stored belongs to a different stream, type or position."""

    code = "event_id_reused"

    def __init__(self, stream: str, event_id: str, detail: str) -> None:
        self.stream = stream
        self.event_id = event_id
        super().__init__(
            f"event {event_id} appended to {stream} is already stored ({detail})",
            "an append is idempotent only when retried with the same ids in the same order; "
            "use fresh ids for new events",
        )


class Fenced(StoreError):
    """The append ran under a lease epoch older than its partition's fence: another node owns
    the partition now (eventstore/fencing.py). Nothing of it is stored; it is never retried here,
    since only the new owner may append."""

    code = "session_moving"

    def __init__(self, stream: str, partition: int, epoch: int, current: int) -> None:
        self.stream = stream
        self.partition = partition
        self.epoch = epoch
        self.current = current
        super().__init__(
            f"the append to {stream} ran under epoch {epoch} of partition {partition}, "
            f"whose fence is at epoch {current} now",
            "the session's partition moved to another node; retry and its new owner answers",
        )


class InvalidAppend(StoreError):
    code = "invalid_append"


class InvalidCursor(StoreError):
    code = "invalid_cursor"

    def __init__(self, cursor: str) -> None:
        super().__init__(
            f"cursor {cursor[:64]!r} is not a cursor this server issued",
            "pass the `cursor` (SSE `id:`) of an event you received, or omit it to start at the "
            "beginning",
        )


class InvalidSchema(StoreError):
    code = "invalid_schema"

    def __init__(self, schema: str) -> None:
        super().__init__(
            f"schema name {schema!r} is not a plain lower-case identifier",
            "use lower-case letters, digits and underscores, starting with a letter (e.g. dispach)",
        )


class StoreUnavailable(StoreError):
    code = "store_unavailable"


class InvalidValue(StoreError):
    """Postgres refused a value (e.g. a NUL character in text): the caller's input, not the
    database's health."""

    code = "invalid_value"


class StoreOverloaded(StoreError):
    """The group-commit writer's bounded queue is full."""

    code = "store_overloaded"

    def __init__(self, queued: int, capacity: int) -> None:
        self.queued = queued
        self.capacity = capacity
        super().__init__(
            f"{queued} appends are waiting for the writer (capacity {capacity})",
            "the database is not keeping up; back off and retry, or raise "
            "DISPACH_WRITER_QUEUE if the database has headroom",
        )


class StoreClosed(StoreError):
    code = "store_closed"

    def __init__(self) -> None:
        super().__init__("the event store is closed", "the node is shutting down; retry on another")


class MigrationError(StoreError):
    code = "migration_failed"


def describe_version(expected: int) -> str:
    if expected == NO_STREAM:
        return "no stream"
    if expected == ANY:
        return "any version"
    return f"version {expected}"


class CursorArchived(StoreError):
    """A read would have passed over events that were archived (eventstore/archive.py): it is
    refused instead of skipping them. HTTP answers ``410``."""

    code = "cursor_archived"

    def __init__(self, archive_id: str, partition: str, first: int, last: int) -> None:
        self.archive_id = archive_id
        super().__init__(
            f"events {first} to {last} of the log (partition {partition}) are archived as "
            f"{archive_id}, and this read would pass over them",
            f"read from a cursor after position {last}, or bring them back with "
            f"`dispach log restore` of archive {archive_id}",
        )

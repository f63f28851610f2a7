"""SQL text (kept in ``sql/*.sql`` beside this module) and the decoding of event rows."""

from __future__ import annotations

import functools
import re
import uuid
from datetime import datetime
from importlib import resources
from typing import Any

import msgspec
import psycopg.types.json

from eventstore.envelope import Metadata, RecordedEvent
from eventstore.errors import InvalidSchema
from eventstore.event import decode_data

_META = msgspec.json.Decoder(Metadata)

# JSON parameters (``Jsonb``) and json/jsonb columns through msgspec instead of the standard
# library's json, psycopg's default: the projections' statements carry JSON in every append, and
# the turn resource reads two json columns per GET.
psycopg.types.json.set_json_dumps(msgspec.json.Encoder().encode)
psycopg.types.json.set_json_loads(msgspec.json.decode)
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")

# The column list every event read selects, in this order (see sql/read_*.sql).
EventRow = tuple[str, int, int, str, uuid.UUID, str, str, str, datetime]


@functools.cache
def load(name: str) -> str:
    """The text of ``sql/<name>.sql``, read once (reads call this for every query)."""
    return resources.files("eventstore").joinpath("sql", f"{name}.sql").read_text()


def decode_row(row: EventRow | tuple[Any, ...]) -> RecordedEvent:
    stream, version, position, txid_text, event_id, type_name, data_text, meta_text, at = row
    return RecordedEvent(
        stream=stream,
        version=version,
        position=position,
        txid=int(txid_text),
        event_id=event_id,
        type=type_name,
        data=decode_data(type_name, data_text),
        metadata=_META.decode(meta_text),
        recorded_at=at,
    )


def check_schema_name(schema: str) -> str:
    """Schema names are interpolated into ``search_path``; allow plain identifiers only."""
    if not _IDENTIFIER.fullmatch(schema):
        raise InvalidSchema(schema)
    return schema


STATEMENT_TIMEOUT = "60s"
"""No statement of ours runs this long (appends and reads take milliseconds): one that does is
waiting on something (a lock a rebuild holds, a hung disk) and is cancelled; the writer takes
that as a broken connection and retries its idempotent append until its deadline."""
IDLE_IN_TRANSACTION_TIMEOUT = "5s"
"""Our code never waits inside a transaction; a session of ours that does (a bug, a stuck
thread, a node paused between its append and its commit) is ended before, as an open append,
it holds every reader of the log back for long (migration 0012)."""
LOCK_TIMEOUT = "30s"
"""Waiting longer than this for a lock is a stall to report, not to sit out."""


def connect_kwargs(schema: str) -> dict[str, Any]:
    """Connection options shared by every connection of the store: its schema, its name, and
    the timeouts that bound how long one of them can wait or stall others (migrations run on a
    connection of their own without them: an index build on a large log may take longer)."""
    return {
        "options": f"-c search_path={check_schema_name(schema)}"
        f" -c statement_timeout={STATEMENT_TIMEOUT}"
        f" -c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_TIMEOUT}"
        f" -c lock_timeout={LOCK_TIMEOUT}",
        "application_name": "dispach",
    }

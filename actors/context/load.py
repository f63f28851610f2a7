"""Rehydrating a session's history from the log's read models: its snapshot (digest and marks),
the rows after the digest, its notes and how its last turn ended. Reads O(window) rows, never
the whole history."""

from __future__ import annotations

import asyncio
from importlib import resources
from typing import Any

import msgspec

from actors.context.history import Digest, History, View, entry, slim
from actors.context.rungs import SLIMMED
from actors.tools.notes import StoreNotes
from eventstore import EventStore

_SQL = resources.files("actors.context").joinpath("sql")
_HISTORY = _SQL.joinpath("history.sql").read_text().encode()
_ARTIFACT = _SQL.joinpath("artifact.sql").read_text().encode()
_PHASE = _SQL.joinpath("phase.sql").read_text().encode()
_JSON = msgspec.json.Decoder(Any)
_VIEW, _LAST_END = 0, 1
"""The kinds of sql/history.sql's rows besides the history's own (2)."""
_BADLY = {"max_steps", "timeout", "output_limit", "truncated", "error"}


async def load(
    store: EventStore, agent_id: str, session_key: str, before: int | None = None
) -> History:
    """The history a turn of the session that started at log position ``before`` reads (None:
    the next turn's)."""
    key = {"agent_id": agent_id, "session_key": session_key, "before": before}
    # Two reads side by side on the pool: the session's view, rows and last end in one
    # statement (sql/history.sql), its notes from its stream.
    reads = await asyncio.gather(
        store.afetch(_HISTORY, key),
        StoreNotes(store, agent_id, session_key, "").read(),
        return_exceptions=True,  # both end before one's error is raised
    )
    for failed in reads:
        if isinstance(failed, BaseException):
            raise failed
    rows, notes = reads
    view, last_error, entries = View(), None, []
    for kind, start, _, a, b, c in rows:
        if kind == _VIEW:
            digest = msgspec.json.decode(a, type=Digest) if a else None
            view = View(digest=digest, marks=_JSON.decode(b))
        elif kind == _LAST_END:
            last_error = last_error_line(a, b, c)
        else:
            entries.append(entry(a, start, b, _JSON.decode(c)))
    # The bodies of results shown as stubs are not kept (the view never shows them again).
    entries = [slim(e) if view.marks.get(e.obs_id or "") in SLIMMED else e for e in entries]
    present = {e.obs_id for e in entries if e.obs_id is not None}
    if any(k not in present for k in view.marks):
        view = View(digest=view.digest, marks={k: v for k, v in view.marks.items() if k in present})
    return History(entries=entries, view=view, notes=tuple(notes), last_error=last_error)


def last_error_line(reason: str, code: str | None, message: str | None) -> str | None:
    """What the model is told about a previous turn that ended badly (None if it did not)."""
    if reason not in _BADLY:
        return None
    why = f" ({code}): {message}" if message else ""
    return (f"The previous turn of this conversation ended early with {reason}{why}. If the "
            "person asks to go on, pick up from where it stopped.")  # fmt: skip


async def artifact(store: EventStore, agent_id: str, session_key: str, obs_id: str) -> str | None:
    """The whole body of one of the session's tool results, as stored."""
    rows = await store.afetch(_ARTIFACT, {"agent_id": agent_id, "session_key": session_key,
                                          "id": obs_id})  # fmt: skip
    for (text,) in rows:
        body = _JSON.decode(text).get("content")
        return body if isinstance(body, str) else msgspec.json.encode(body).decode()
    return None


async def phase(store: EventStore, agent_id: str, session_key: str) -> str | None:
    """The phase the session is in (None: the entry phase). Read when a turn of a phased agent
    begins, not held with the history: ``POST …/phase`` changes it between turns."""
    rows = await store.afetch(_PHASE, {"agent_id": agent_id, "session_key": session_key})
    for (name,) in rows:
        return name  # type: ignore[no-any-return]
    return None

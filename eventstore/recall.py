"""Full-text ranking for a turn's recall: an agent's skills (indexed in the ``skills`` table,
migration 0016) and a session's notes (ranked on the fly), both with Postgres text search
(``websearch_to_tsquery`` over the English configuration, ``ts_rank_cd``), so the two rank
the same way. No other service: the log's database is the index.

The query is the turn's words joined by ``or``: a skill applies when it shares *some* words
with what the person said, not all of them (``websearch_to_tsquery`` alone would AND them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import psycopg

from eventstore._sql import load
from eventstore.errors import StoreUnavailable
from eventstore.store import EventStore

MAX_WORDS = 64
"""Words of a query at most (the input's first, then the previous reply's): enough to say what
a turn is about, and a bound on the query's cost however long the message."""

_WORD = re.compile(r"\w+")


class IndexedSkill(NamedTuple):
    """One version of one skill, as the index keeps it."""

    skill_id: str
    digest: str
    title: str
    description: str
    body: str
    tokens: int


class Ranked(NamedTuple):
    key: str
    """A skill's id, or a note's index (from 0) as text."""
    rank: float


def query_text(*texts: str) -> str:
    """The words of ``texts`` (first ones first, each once, at most :data:`MAX_WORDS`) joined
    by ``or``, as ``websearch_to_tsquery`` reads a query: any of them may match. Only word
    characters survive, so nothing in a message is read as the query language's quotes or
    ``-``; an ``or`` of the message itself is dropped (it would be read as the operator)."""
    words: dict[str, None] = {}
    for text in texts:
        for word in _WORD.findall(text.lower()):
            if word != "or" and len(words) < MAX_WORDS:
                words.setdefault(word)
    return " or ".join(words)


async def aindex_skills(store: EventStore, agent_id: str, skills: Sequence[IndexedSkill]) -> None:
    """Write the versions of ``agent_id``'s skills this node loaded, and prune the versions no
    node loaded for a week."""
    keys = {"agent_id": agent_id, "ids": [s.skill_id for s in skills],
            "digests": [s.digest for s in skills]}  # fmt: skip
    rows = {**keys, "titles": [s.title for s in skills],
            "descriptions": [s.description for s in skills],
            "bodies": [s.body for s in skills], "tokens": [s.tokens for s in skills]}  # fmt: skip
    try:
        async with store.apool.connection() as conn:
            if skills:
                await conn.execute(load("skills_index").encode(), rows)
            await conn.execute(load("skills_prune").encode(), keys)
    except psycopg.Error as e:
        raise _unavailable("index the skills of", agent_id, e) from e


async def asearch_skills(
    store: EventStore,
    agent_id: str,
    versions: Sequence[tuple[str, str]],
    query: str,
    limit: int,
) -> list[Ranked]:
    """The skills among ``versions`` (id, digest) that share a word with ``query``
    (:func:`query_text`), best first, at most ``limit``."""
    if not versions or not query or limit <= 0:
        return []
    params = {"agent_id": agent_id, "ids": [v[0] for v in versions],
              "digests": [v[1] for v in versions], "query": query, "limit": limit}  # fmt: skip
    rows = await _fetch(store, "skills_search", params)
    return [Ranked(str(skill_id), float(rank)) for skill_id, rank in rows]


async def arank_notes(
    store: EventStore, agent_id: str, notes: Sequence[str], query: str, limit: int
) -> list[Ranked]:
    """The notes that share a word with ``query``, best first (keys: their index from 0)."""
    if not notes or not query or limit <= 0:
        return []
    params = {"notes": list(notes), "query": query, "limit": limit}
    rows = await _fetch(store, "notes_rank", params)
    return [Ranked(str(index), float(rank)) for index, rank in rows]


async def askill_version(
    store: EventStore, agent_id: str, skill_id: str, digest: str
) -> tuple[str, str, int] | None:
    """The title, body and tokens of one version of a skill, if the index has it."""
    params = {"agent_id": agent_id, "skill_id": skill_id, "digest": digest}
    rows = await _fetch(store, "skills_version", params)
    if not rows:
        return None
    title, body, tokens = rows[0]
    return str(title), str(body), int(tokens)


async def _fetch(
    store: EventStore, name: str, params: Mapping[str, object]
) -> list[tuple[Any, ...]]:
    return await store.afetch(load(name).encode(), params)  # driver errors: StoreUnavailable


def _unavailable(what: str, agent_id: str, e: Exception) -> StoreUnavailable:
    return StoreUnavailable(
        f"cannot {what} agent {agent_id!r}: {e}".strip(),
        "the database is down or overloaded; the next turn (or the next start) tries again",
    )

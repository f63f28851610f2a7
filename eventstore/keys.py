"""API keys at rest: the ``api_keys`` table (migrations/0020_api_keys.sql), read and written on
the event loop. Only a salted digest of each secret is here; minting, verifying and caching keys
is the gateway's (gateways/http/keys.py). Driver errors leave as ``StoreUnavailable``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec
import psycopg

from eventstore._sql import load
from eventstore.store import EventStore, unavailable_for


class KeyRow(msgspec.Struct, frozen=True, kw_only=True):
    key_id: str
    label: str
    scope: str
    agents: tuple[str, ...] | None
    salt: bytes
    digest: bytes
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


class KeyState(msgspec.Struct, frozen=True):
    ever: bool
    """Some key was minted (revoked or not)."""
    live_admin: bool
    """A live admin key with no agent list exists."""


def _row(raw: tuple[Any, ...]) -> KeyRow:
    key_id, label, scope, agents, salt, digest, created, used, revoked = raw
    return KeyRow(
        key_id=key_id, label=label, scope=scope,
        agents=None if agents is None else tuple(agents),
        salt=bytes(salt), digest=bytes(digest),
        created_at=created, last_used_at=used, revoked_at=revoked,
    )  # fmt: skip


async def get(store: EventStore, key_id: str) -> KeyRow | None:
    rows = await _run(store, "keys_get", {"id": key_id})
    return _row(rows[0]) if rows else None


async def listed(store: EventStore) -> list[KeyRow]:
    return [_row(r) for r in await _run(store, "keys_list", {})]


def _params(row: KeyRow) -> dict[str, object]:
    return {
        "id": row.key_id, "label": row.label, "scope": row.scope,
        "agents": None if row.agents is None else list(row.agents),
        "salt": row.salt, "digest": row.digest,
    }  # fmt: skip


async def insert(store: EventStore, row: KeyRow) -> KeyRow:
    return _row((await _run(store, "keys_insert", _params(row)))[0])


async def insert_first(store: EventStore, row: KeyRow) -> KeyRow | None:
    """Insert ``row`` only if no key exists yet (a boot claim's one key); None if one does."""
    try:
        async with store.apool.connection() as conn, conn.transaction():
            await conn.execute(load("keys_lock").encode())
            cur = await conn.execute(load("keys_insert_first").encode(), _params(row))
            found = await cur.fetchall()
    except psycopg.Error as e:
        raise unavailable_for("the API keys", e) from e
    return _row(found[0]) if found else None


async def revoke(store: EventStore, key_id: str) -> KeyRow | None:
    rows = await _run(store, "keys_revoke", {"id": key_id})
    return _row(rows[0]) if rows else None


async def touch(store: EventStore, key_id: str, at: datetime) -> None:
    await _run(store, "keys_touch", {"id": key_id, "at": at})


async def state(store: EventStore) -> KeyState:
    ever, live_admin = (await _run(store, "keys_state", {}))[0]
    return KeyState(bool(ever), bool(live_admin))


async def _run(store: EventStore, name: str, params: dict[str, object]) -> list[tuple[Any, ...]]:
    return await store.astatement(load(name).encode(), params, what="the API keys")

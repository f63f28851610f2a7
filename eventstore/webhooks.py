"""Webhook subscriptions at rest: the ``webhooks`` projection, the signing secrets beside it and
the fan-out's cursors (migrations/0021_webhooks.sql), read and written on the event loop.
Driver errors leave as ``StoreUnavailable``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec

from eventstore._sql import load
from eventstore.envelope import Checkpoint
from eventstore.store import EventStore


class WebhookRow(msgspec.Struct, frozen=True, kw_only=True):
    webhook_id: str
    url: str
    events: tuple[str, ...]
    agents: tuple[str, ...] | None
    description: str | None
    created_at: datetime
    deleted_at: datetime | None
    version: int


class Live(msgspec.Struct, kw_only=True):
    """A live subscription as the fan-out follows it."""

    webhook_id: str
    events: tuple[str, ...]
    agents: frozenset[str] | None
    cursor: Checkpoint


class Target(msgspec.Struct, frozen=True):
    url: str
    secret: str
    deleted: bool


def _row(raw: tuple[Any, ...]) -> WebhookRow:
    webhook_id, url, events, agents, description, created, deleted, version = raw
    return WebhookRow(
        webhook_id=webhook_id, url=url, events=tuple(events),
        agents=None if agents is None else tuple(agents), description=description,
        created_at=created, deleted_at=deleted, version=version,
    )  # fmt: skip


async def keep_secret(store: EventStore, webhook_id: str, secret: str) -> None:
    await _run(store, "webhooks_secret", {"id": webhook_id, "secret": secret})


async def get(store: EventStore, webhook_id: str) -> WebhookRow | None:
    rows = await _run(store, "webhooks_get", {"id": webhook_id})
    return _row(rows[0]) if rows else None


async def listed(store: EventStore) -> list[WebhookRow]:
    return [_row(r) for r in await _run(store, "webhooks_list", {})]


async def target(store: EventStore, webhook_id: str) -> Target | None:
    rows = await _run(store, "webhooks_target", {"id": webhook_id})
    return Target(*rows[0]) if rows else None


async def live(store: EventStore) -> list[Live]:
    return [
        Live(webhook_id=w, events=tuple(events),
             agents=None if agents is None else frozenset(agents), cursor=Checkpoint(tx, pos))
        for w, events, agents, tx, pos in await _run(store, "webhooks_live", {})
    ]  # fmt: skip


async def save_cursors(store: EventStore, cursors: dict[str, Checkpoint]) -> None:
    if cursors:
        ids = list(cursors)
        await _run(store, "webhooks_cursors", {
            "ids": ids, "txids": [cursors[i].txid for i in ids],
            "positions": [cursors[i].position for i in ids],
        })  # fmt: skip


async def _run(store: EventStore, name: str, params: dict[str, object]) -> list[tuple[Any, ...]]:
    return await store.astatement(load(name).encode(), params, what="the webhooks")

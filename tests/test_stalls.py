"""Bounded stalls. A transaction that holds an xid and stays open (an idle ``psql`` after a
write) holds every live stream of the log back: the node's health probe finds it, names it by
pid and age in its log line, the ``dispach_postgres_horizon_age_seconds`` gauge and ``GET
/v1/ready``, and says when it is gone; and every connection of ours bounds its statements, lock
waits and idle transactions. Real Postgres, a real node behind uvicorn."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import psycopg
import pytest
from prometheus_client import REGISTRY

from eventstore import EventStore, health
from tests.conftest import ApiFactory, Servers


async def ready(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url) as client:
        answer = await client.get("/v1/ready")
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


async def until(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := await predicate():
            return found
        await asyncio.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {what}")


@pytest.mark.asyncio
async def test_an_open_transaction_with_an_xid_is_named_until_it_ends(
    api_factory: ApiFactory, servers: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(health, "HORIZON_WARN_S", 1.0)
    api = await api_factory.start()
    assert (await ready(api.url)).get("warnings", []) == []

    stray = await psycopg.AsyncConnection.connect(servers.database_url,
                                                  application_name="stray-psql")  # fmt: skip
    try:
        # A write's xid without a table of ours: what an idle psql after an INSERT holds.
        await stray.execute("SELECT pg_current_xact_id()")
        pid = stray.info.backend_pid

        async def named() -> list[str]:
            warnings: list[str] = (await ready(api.url)).get("warnings", [])
            return [w for w in warnings if f"pid {pid}" in w]

        [warning] = await until(named, 15, "the open transaction in /v1/ready")
        assert "stray-psql" in warning and "live streams" in warning
        holder = api.node.store.health.holder if api.node.store is not None else None
        assert holder is not None and holder.pid == pid and holder.age_s >= 1
        gauge = REGISTRY.get_sample_value("dispach_postgres_horizon_age_seconds")
        assert gauge is not None and gauge >= 1
    finally:
        await stray.rollback()
        await stray.close()

    async def cleared() -> bool:
        return not (await ready(api.url)).get("warnings", [])

    await until(cleared, 15, "the warning gone once the transaction ended")


@pytest.mark.asyncio
async def test_a_read_only_transaction_holds_nothing_back(
    api_factory: ApiFactory, servers: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(health, "HORIZON_WARN_S", 0.5)
    api = await api_factory.start()
    reader = await psycopg.AsyncConnection.connect(servers.database_url)
    try:
        await reader.execute("SELECT 1")  # in a transaction, but no xid: no horizon held
        await asyncio.sleep(2.5)  # two probes past the threshold
        holder = api.node.store.health.holder if api.node.store is not None else None
        assert holder is None or holder.pid != reader.info.backend_pid
        assert not [w for w in (await ready(api.url)).get("warnings", [])
                    if f"pid {reader.info.backend_pid}" in w]  # fmt: skip
    finally:
        await reader.rollback()
        await reader.close()


def test_every_connection_of_the_store_bounds_its_statements_locks_and_idle_transactions(
    store: EventStore,
) -> None:
    wanted = {"statement_timeout": "1min", "idle_in_transaction_session_timeout": "1min",
              "lock_timeout": "30s"}  # fmt: skip
    with store.pool.connection() as conn:
        for name, value in wanted.items():
            assert conn.execute(f"SHOW {name}").fetchone() == (value,)
    # The loop's pool and the writer connect with the same options (eventstore/_sql.py).
    assert store.apool.kwargs == store.pool.kwargs

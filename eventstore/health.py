"""What this process knows of Postgres right now: up, or down since when and why.

The gateway answers ``503 store_unavailable`` at once while Postgres is known down, instead of
letting each request wait out the pool's or the writer's 30 s. Two witnesses keep the state,
neither adding work per request:

- the group-commit writer, which sees every append: a reconnection that fails marks Postgres
  down, a commit marks it up;
- :meth:`PostgresHealth.probe`, a ``SELECT 1`` once a second on a connection of its own (not
  one of the pools'), bounded by a timeout, which also covers a node that is idle or only reads.

The latest observation wins. The state is one tuple assigned whole, so the writer thread and the
event loop can both write it and readers see either the old or the new one, never a mix.

The probe's query also finds the oldest transaction of the whole cluster that holds an xid
(``sql/horizon.sql``). Every reader of the log stops below the oldest running xid (a position
becomes visible only once nothing older can still commit), so such a transaction, ours or
anyone's (an idle ``psql`` left in ``BEGIN`` after a write, another database's migration),
delays every live stream by its age. That age is the ``dispach_postgres_horizon_age_seconds``
gauge; past :data:`HORIZON_WARN_S` the holder is logged by pid, age, state, database and
application (never its query), and ``GET /v1/ready`` names it among its warnings.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import psycopg
import structlog

from eventstore._sql import load
from eventstore.metrics import HORIZON_AGE

log = structlog.get_logger("dispach.postgres")
_HORIZON = load("horizon").encode()

HORIZON_WARN_S = 10.0
"""A transaction this old holds the streams back noticeably: logged and shown by /v1/ready."""
PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 3.0
"""A probe unanswered this long is a hung server; generous, as a busy loop on a loaded machine
can delay the answer of a healthy one (a stopped server refuses the connection at once)."""


class Holder(NamedTuple):
    """The oldest transaction holding an xid, as the last probe found it."""

    pid: int
    age_s: float
    state: str
    database: str
    application: str

    def describe(self) -> str:
        who = f"{self.application} " if self.application else ""
        return (f"transaction of pid {self.pid} ({who}on {self.database or '?'}, "
                f"{self.state or 'unknown state'}) open for {self.age_s:.0f} s")  # fmt: skip


class PostgresHealth:
    def __init__(self, conninfo: str) -> None:
        self._conninfo = conninfo
        self._state: tuple[bool, float, str] = (True, time.monotonic(), "")
        self.outages = 0
        """How many times Postgres went down, as seen here."""
        self.holder: Holder | None = None
        """The oldest transaction holding an xid at the last probe (None: none)."""
        self._reported: int | None = None

    @property
    def up(self) -> bool:
        return self._state[0]

    @property
    def held(self) -> Holder | None:
        """The transaction holding the streams back past :data:`HORIZON_WARN_S`, if one is."""
        holder = self.holder
        return holder if holder is not None and holder.age_s >= HORIZON_WARN_S else None

    def horizon(self, holder: Holder | None) -> None:
        """Record what the probe found of the horizon; log a holder once, and its release."""
        self.holder = holder
        HORIZON_AGE.set(holder.age_s if holder is not None else 0.0)
        held = self.held
        if held is not None and held.pid != self._reported:
            self._reported = held.pid
            log.warning("postgres_horizon_held", pid=held.pid, age_s=round(held.age_s, 1),
                        state=held.state, database=held.database,
                        application=held.application,
                        hint="live streams wait for this transaction to end; end it (or "
                             "pg_terminate_backend its pid) if it is a stray one")  # fmt: skip
        elif held is None and self._reported is not None:
            log.info("postgres_horizon_released", pid=self._reported)
            self._reported = None

    @property
    def reason(self) -> str:
        """Why Postgres is down ("" while it is up)."""
        return self._state[2]

    def observe(self, up: bool, reason: str = "") -> None:
        """Record what a witness saw (any thread). Only a change is logged."""
        was = self._state[0]
        if up and was:
            return
        self._state = (up, time.monotonic(), "" if up else reason)
        if up:
            log.info("postgres_up")
        elif was:
            self.outages += 1
            log.warning("postgres_down", reason=reason)

    async def probe(
        self,
        after_outage: Callable[[], Awaitable[None]] | None = None,
        *,
        interval: float = PROBE_INTERVAL_S,
        timeout: float = PROBE_TIMEOUT_S,
    ) -> None:
        """Probe until cancelled (the node runs this as a task). ``after_outage`` runs at the
        first good probe after an outage (the store renews its pools' connections there)."""
        conn: psycopg.AsyncConnection[Any] | None = None
        check: asyncio.Future[psycopg.AsyncConnection[Any]] | None = None
        seen = self.outages
        try:
            while True:
                check = asyncio.ensure_future(self._check(conn))
                # Waited on, not timed out: a cancelled query first asks the server to cancel
                # it (psycopg allows that 10 s), and a hung server would hold the verdict back.
                await asyncio.wait({check}, timeout=timeout)
                if not check.done():
                    self.observe(False, f"no answer to a probe within {timeout:g} s")
                    check.cancel()
                    await asyncio.wait({check})
                    await _discard(conn)
                    conn = None
                elif (error := check.exception()) is not None:
                    self.observe(False, str(error).strip() or type(error).__name__)
                    await _discard(conn)
                    conn = None
                else:
                    conn = check.result()
                    self.observe(True)
                    if seen != self.outages and after_outage is not None:
                        seen = self.outages
                        await after_outage()
                await asyncio.sleep(interval)
        finally:
            # Cancelled (the node stops) with a check in flight, or one that just finished: its
            # connection is closed too, not left to the garbage collector.
            if check is not None:
                check.cancel()
                await asyncio.wait({check})
                if not check.cancelled() and check.exception() is None:
                    await _discard(check.result())
            await _discard(conn)

    async def _check(
        self, conn: psycopg.AsyncConnection[Any] | None
    ) -> psycopg.AsyncConnection[Any]:
        if conn is None or conn.closed:
            conn = await psycopg.AsyncConnection.connect(
                self._conninfo,
                autocommit=True,
                connect_timeout=2,
                application_name="dispach-probe",
                options=f"-c statement_timeout={int(PROBE_TIMEOUT_S * 1000)}",
            )
        try:
            cur = await conn.execute(_HORIZON)
            row = await cur.fetchone()
        except BaseException:
            await _discard(conn)
            raise
        self.horizon(Holder(*row) if row is not None else None)
        return conn


async def _discard(conn: psycopg.AsyncConnection[Any] | None) -> None:
    if conn is not None:
        with contextlib.suppress(psycopg.Error, OSError):
            await conn.close()

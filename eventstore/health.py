"""What this process knows of Postgres right now: up, or down since when and why.

The gateway answers ``503 store_unavailable`` at once while Postgres is known down, instead of
letting each request wait out the pool's or the writer's 30 s. Two witnesses keep the state,
neither adding work per request:

- the group-commit writer, which sees every append: a reconnection that fails marks Postgres
  down, a commit marks it up;
- :meth:`PostgresHealth.probe`, a ``SELECT 1`` once a second on a connection of its own (not
  one of the pools'), bounded by a timeout, which also covers a node that is idle or only reads.

The latest observation wins, but for a probe's good answer to a question asked before the
last down was seen. The state is one tuple assigned whole, so the writer thread and the
event loop can both write it and readers see either the old or the new one, never a mix.

The probe's query also finds what can hold the log back (``sql/horizon.sql``):

- the oldest open append (a transaction holding the append lock of migration 0012). Every
  reader of the log stops below it; an append of ours is open for milliseconds, so one that
  stays open (a paused node between its insert and its commit, a stray ``INSERT`` left open in
  ``psql``) makes every live stream wait. Past :data:`APPEND_WARN_S` it is named; its age is
  ``dispach_log_append_lock_age_seconds``.
- the cluster's oldest transaction holding an xid, ours or anyone's (an idle ``psql`` left in
  ``BEGIN`` after a write, another database's migration). Readers of the log do not wait for
  it (it cannot append: see migration 0012), but vacuum cannot reclaim the projections' dead rows
  behind it. Its age is ``dispach_postgres_horizon_age_seconds``; past :data:`HORIZON_WARN_S` it
  is named.

A named holder is logged once by pid, age, state, database and application (never its query),
and ``GET /v1/ready`` lists it among its warnings until it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import psycopg
import structlog

from eventstore._sql import check_schema_name, load
from eventstore.metrics import APPEND_LOCK_AGE, HORIZON_AGE

log = structlog.get_logger("dispach.postgres")
_HORIZON = load("horizon").encode()

APPEND_WARN_S = 5.0
"""An append open this long holds every live stream back: logged, shown by /v1/ready. No append
of ours is open for more than a few milliseconds, and our connections end a transaction left
idle after 5 s (eventstore/_sql.py), so this names a stuck or foreign one."""
HORIZON_WARN_S = 60.0
"""A transaction this old holds vacuum back noticeably: logged and shown by /v1/ready."""
PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 3.0
"""A probe unanswered this long is a hung server; generous, as a busy loop on a loaded machine
can delay the answer of a healthy one (a stopped server refuses the connection at once)."""


class Holder(NamedTuple):
    """A transaction the last probe found holding the log back (see the module's docstring)."""

    pid: int
    age_s: float
    state: str
    database: str
    application: str
    appending: bool
    """It is an open append (readers wait), rather than only the oldest xid."""

    @property
    def threshold_s(self) -> float:
        return APPEND_WARN_S if self.appending else HORIZON_WARN_S

    @property
    def effect(self) -> str:
        return ("live streams deliver nothing newer until it ends" if self.appending
                else "vacuum cannot reclaim dead rows until it ends")  # fmt: skip

    def describe(self) -> str:
        who = f"{self.application} " if self.application else ""
        return (f"transaction of pid {self.pid} ({who}on {self.database or '?'}, "
                f"{self.state or 'unknown state'}) open for {self.age_s:.0f} s")  # fmt: skip


class PostgresHealth:
    def __init__(self, conninfo: str, schema: str = "dispach") -> None:
        self._conninfo = conninfo
        self._events = f'"{check_schema_name(schema)}".events'
        self._state: tuple[bool, float, str] = (True, time.monotonic(), "")
        self.outages = 0
        """How many times Postgres went down, as seen here."""
        self.holder: Holder | None = None
        """The oldest transaction holding an xid at the last probe (None: none)."""
        self.appender: Holder | None = None
        """The oldest open append at the last probe (None: none)."""
        self._reported: int | None = None

    @property
    def up(self) -> bool:
        return self._state[0]

    @property
    def held(self) -> list[Holder]:
        """The transactions holding the log back past their threshold, the appender first."""
        found = [h for h in (self.appender, self.holder) if h is not None]
        return [h for h in found if h.age_s >= h.threshold_s]

    def horizon(self, found: list[Holder]) -> None:
        """Record what the probe found; log the first named holder once, and its release."""
        self.appender = next((h for h in found if h.appending), None)
        self.holder = next((h for h in found if not h.appending), None)
        HORIZON_AGE.set(self.holder.age_s if self.holder is not None else 0.0)
        APPEND_LOCK_AGE.set(self.appender.age_s if self.appender is not None else 0.0)
        held = self.held
        if held and held[0].pid != self._reported:
            first = held[0]
            self._reported = first.pid
            log.warning("postgres_transaction_holds_log", pid=first.pid,
                        age_s=round(first.age_s, 1), state=first.state, database=first.database,
                        application=first.application, appending=first.appending,
                        hint=f"{first.effect}; end it (or pg_terminate_backend its pid) if it is "
                             "a stray one")  # fmt: skip
        elif not held and self._reported is not None:
            log.info("postgres_transaction_released", pid=self._reported)
            self._reported = None

    @property
    def reason(self) -> str:
        """Why Postgres is down ("" while it is up)."""
        return self._state[2]

    def observe(self, up: bool, reason: str = "", *, since: float | None = None) -> None:
        """Record what a witness saw (any thread). Only a change is logged. ``since``: when the
        witness began to look (monotonic): a good answer to a question asked before Postgres
        was last seen down says nothing of it now (a probe sent just before a stop, answered
        after the writer saw the stop), and is not taken."""
        was, at, _ = self._state
        if up and (was or (since is not None and since < at)):
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
                asked = time.monotonic()
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
                    self.observe(True, since=asked)
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
            cur = await conn.execute(_HORIZON, {"events": self._events})
            rows = await cur.fetchall()
        except BaseException:
            await _discard(conn)
            raise
        self.horizon([Holder(*row) for row in rows])
        return conn


async def _discard(conn: psycopg.AsyncConnection[Any] | None) -> None:
    if conn is not None:
        with contextlib.suppress(psycopg.Error, OSError):
            await conn.close()

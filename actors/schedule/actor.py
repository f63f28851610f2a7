"""SchedulerActor: fires schedules as inbound messages and keeps their streams.

Firing is the same door as any message (the command path to the session's owner) with the
Idempotency-Key
``schedule:<id>:<due time>``: two nodes firing the same tick, or a node that fired and crashed
before recording it, make one turn. The message is submitted first and ``schedule.fired``
recorded after it (expecting the stream version the actor read), so a crash between the two
fires the same tick again at the next start, which the key turns into a replay. Ticks missed while
no node ran are not made up in a burst: they are counted in one ``schedule.skipped``.

Every node runs the actor (definitions from the API come through the node that took them), but
only the node holding the ``scheduler`` lease runs the clock (``CLOCK_ON``): one clock per
cluster. The actor is the only writer of ``schedule-<agent>-<id>`` streams: definitions from
manifests (reconciled at start) and from the API come through it.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from actors.actor import LoopActor
from actors.messages import (
    Accepted,
    CommandPath,
    DefineSchedule,
    Refused,
    RemoveSchedule,
    RunSchedule,
    Submit,
)
from actors.schedule import plan
from actors.schedule.plan import ScheduleSpec
from eventstore import (
    NO_STREAM,
    AppendResult,
    Metadata,
    NewEvent,
    StoreError,
    WrongExpectedVersion,
    streams,
)
from eventstore.bridge import settled
from eventstore.catalogue import ScheduleDefined, ScheduleFired, ScheduleRemoved, ScheduleSkipped
from eventstore.event import Event

if TYPE_CHECKING:
    from actors.session.directory import SessionDirectory

log = structlog.get_logger("dispach.scheduler")

KICK = "kick"
DRAIN = "drain"
CLOCK_ON = "clock-on"
"""Start the clock: this node holds the scheduler's lease (one clock per cluster). ``DRAIN``
stops it again (the lease is handed over, or the node stops)."""
"""Ask: stop the clock; the answer is a future that settles once its task has ended."""
_HORIZON_S = 30.0
"""The longest sleep: each wake re-reads the clock, so a clock step or a suspend is noticed."""
_SQL = resources.files("actors.schedule").joinpath("sql", "schedules.sql").read_bytes()


@dataclass(frozen=True)
class Row:
    agent_id: str
    spec: ScheduleSpec
    owner: str
    created_at: datetime
    last_due: datetime | None
    version: int


class SchedulerActor(LoopActor):
    def __init__(
        self,
        engine: SessionDirectory,
        commands: CommandPath,
        *,
        grace: timedelta = timedelta(seconds=60),
    ) -> None:
        super().__init__(engine.portal.loop)
        self._engine = engine
        self._commands = commands
        self._manifests = {a.id: list(a.schedules) for a in engine.agents.values()}
        self._grace = grace
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closer: asyncio.Task[None] | None = None

    def on_stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _stopping(self) -> asyncio.Task[None]:
        """Cancel the clock; the answer settles once its task has unwound (a firing in progress
        is cancelled: its key makes the next start's firing of the same tick a replay)."""
        task = self._task

        async def unwound() -> None:
            if task is not None:
                task.cancel()
                await asyncio.wait([task])

        self._closer = self._loop.create_task(unwound())
        return self._closer

    def on_receive(self, message: Any) -> Any:
        match message:
            case "kick":
                self._wake.set()
            case "clock-on":
                if self._task is None or self._task.done():
                    self._task = self._loop.create_task(self._run(), name="scheduler")
            case "drain":
                return self._stopping()
            case DefineSchedule() | RemoveSchedule() as change:
                return self._loop.create_task(self._change(change))
            case RunSchedule(agent_id=agent_id, schedule_id=sid):
                return self._loop.create_task(self._run_now(agent_id, sid))
        return None

    # --- the clock ----------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                await self._reconcile()
                break
            except StoreError as e:
                log.warning("schedules_reconcile_retry", error=e.message)
                await asyncio.sleep(1.0)
        while True:
            self._wake.clear()
            wait = _HORIZON_S
            try:
                wait = await self._tick(datetime.now(UTC))
            except StoreError as e:
                log.warning("scheduler_tick_failed", error=e.message)
                wait = 1.0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, min(wait, _HORIZON_S))):
                    await self._wake.wait()

    async def _tick(self, now: datetime) -> float:
        """Fire what is due, record what was missed; returns seconds until the next due.

        An append refused because the stream moved (another node recorded the tick, or the
        schedule was replaced) makes the next tick come at once: it reads the schedule again and
        either finds the tick recorded or fires it again, which its key turns into a replay.
        Waiting for the next due instead would leave the tick unrecorded, counted as missed."""
        soonest = _HORIZON_S
        for row in await self._rows():
            spec = row.spec
            if not spec.enabled:
                continue
            try:
                catch = plan.catch_up(spec, row.last_due, now, anchor=row.created_at,
                                      grace=self._grace)  # fmt: skip
            except ValueError as e:  # validated when written; one bad row must not stop the rest
                log.warning("schedule_unusable", agent=row.agent_id, schedule=spec.id, error=str(e))
                continue
            version = row.version
            if catch.missed:
                skipped = ScheduleSkipped(
                    schedule_id=spec.id, kind=spec.kind, reason="downtime", missed=catch.missed,
                    missed_at_least=catch.missed_at_least, up_to=_missed_up_to(catch, row, now),
                )  # fmt: skip
                if not await self._append(row.agent_id, spec.id, skipped, version):
                    soonest = 0.0
                    continue
                version += 1
            fire = catch.fire
            if fire is not None and not await self._fire(row.agent_id, spec, fire, now, version):
                soonest = 0.0
            if catch.next is not None:
                soonest = min(soonest, (catch.next - now).total_seconds())
        return soonest

    async def _fire(
        self, agent_id: str, spec: ScheduleSpec, due: datetime, now: datetime, version: int
    ) -> bool:
        """Submit the tick's turn and record it; False if the record lost to another writer."""
        accepted = await self._submit(agent_id, spec, due)
        if not isinstance(accepted, Accepted):
            log.warning("schedule_not_accepted", agent=agent_id, schedule=spec.id,
                        code=accepted.code, error=accepted.message)  # fmt: skip
            # On the record with the refusal's code (a busy shared session, a channel gone), not
            # left for the next tick to count as downtime.
            refused = ScheduleSkipped(schedule_id=spec.id, kind=spec.kind, reason=accepted.code,
                                      missed=1, up_to=due.isoformat())  # fmt: skip
            return await self._append(agent_id, spec.id, refused, version)
        drift = int((now - due).total_seconds() * 1000)
        fired = ScheduleFired(
            schedule_id=spec.id, kind=spec.kind, drift_ms=max(drift, 0),
            late=drift > self._grace.total_seconds() * 1000, due=due.isoformat(),
            turn_id=accepted.turn_id, session_key=accepted.session_key,
        )  # fmt: skip
        recorded = await self._append(agent_id, spec.id, fired, version)
        log.info("schedule_fired", agent=agent_id, schedule=spec.id, turn=accepted.turn_id,
                 drift_ms=drift, replayed=accepted.replayed, recorded=recorded)  # fmt: skip
        return recorded

    async def _submit(self, agent_id: str, spec: ScheduleSpec, due: datetime) -> Accepted | Refused:
        return await self._commands.submit(
            Submit(
                agent_id=agent_id,
                session_key=plan.session_key(spec, due),
                text=spec.task,
                source="schedule",
                deliver=None if spec.deliver in (None, "none") else spec.deliver,  # type: ignore[arg-type]
                idempotency_key=plan.idempotency_key(spec, due),
            )
        )

    async def _run_now(self, agent_id: str, schedule_id: str) -> Accepted | Refused:
        """Fire out of band (``POST …/schedules/{id}/run``): a turn now, the clock untouched."""
        row = await self._row(agent_id, schedule_id)
        if row is None:
            return Refused(code="schedule_not_found", message=f"no schedule {schedule_id!r}",
                           hint=f"GET /v1/agents/{agent_id}/schedules lists them")  # fmt: skip
        now = datetime.now(UTC)
        result = await self._submit(agent_id, row.spec, now)
        if isinstance(result, Accepted):
            fired = ScheduleFired(
                schedule_id=schedule_id, kind=row.spec.kind, drift_ms=0, due=now.isoformat(),
                turn_id=result.turn_id, session_key=result.session_key, manual=True,
            )  # fmt: skip
            # The turn runs whatever happens here; its record must not be lost to a tick of the
            # clock appending at the same moment, so a refused append is retried on a fresh read
            # (not with ANY: a schedule removed meanwhile must keep schedule.removed last).
            for _ in range(3):
                if row is None or await self._append(agent_id, schedule_id, fired, row.version):
                    break
                row = await self._row(agent_id, schedule_id)
        return result

    # --- definitions --------------------------------------------------------------------------

    async def _reconcile(self) -> None:
        """Make the stored schedules match the manifests: create or replace what a manifest
        declares, remove what a manifest declared and no longer does. API-made schedules are
        left alone (unless a manifest now declares the same id: the manifest wins)."""
        rows = {(r.agent_id, r.spec.id): r for r in await self._rows()}
        for agent_id, specs in self._manifests.items():
            declared = {s.id for s in specs}
            for spec in specs:
                row = rows.get((agent_id, spec.id))
                if row is not None and row.owner == "manifest" and row.spec == spec:
                    continue
                expected = row.version if row is not None else NO_STREAM
                expected = await self._creatable(agent_id, spec.id, expected)
                await self._append(agent_id, spec.id, _defined(spec, "manifest"), expected)
            for (agent, sid), row in rows.items():
                if agent == agent_id and row.owner == "manifest" and sid not in declared:
                    await self._append(agent_id, sid, ScheduleRemoved(schedule_id=sid),
                                       row.version)  # fmt: skip

    async def _change(self, change: DefineSchedule | RemoveSchedule) -> AppendResult:
        """Append a definition or a removal, then wake the clock: a new rhythm counts now.

        Runs on the loop (not as a callback of the store's future, which resolves on the writer
        thread, where setting an asyncio.Event never wakes its waiter)."""
        try:
            if isinstance(change, DefineSchedule):
                event: Event = _defined(change.spec, change.owner)
                sid = change.spec.id
                expected = await self._creatable(change.agent_id, sid, change.expected)
            else:
                event, sid = ScheduleRemoved(schedule_id=change.schedule_id), change.schedule_id
                expected = change.expected
            meta = Metadata(agent_id=change.agent_id)
            return await settled(self._engine.store.submit(
                streams.schedule(change.agent_id, sid), [NewEvent(event=event, metadata=meta)],
                expected,
            ))  # fmt: skip
        finally:
            self._wake.set()

    async def _creatable(self, agent_id: str, sid: str, expected: int) -> int:
        """The version a create expects. Streams are never deleted: a schedule removed earlier
        left its stream behind, ending in ``schedule.removed``, and creating the id again
        continues that stream (expecting NO_STREAM there would refuse it forever)."""
        if expected != NO_STREAM:
            return expected
        last = await self._engine.store.alast(streams.schedule(agent_id, sid))
        if last is not None and isinstance(last.data, ScheduleRemoved):
            return last.version
        return expected

    async def _append(self, agent_id: str, sid: str, event: Event, expected: int) -> bool:
        meta = Metadata(agent_id=agent_id)
        try:
            await settled(self._engine.store.submit(
                streams.schedule(agent_id, sid), [NewEvent(event=event, metadata=meta)], expected
            ))  # fmt: skip
        except WrongExpectedVersion:
            return False
        return True

    async def _row(self, agent_id: str, schedule_id: str) -> Row | None:
        rows = {(r.agent_id, r.spec.id): r for r in await self._rows()}
        return rows.get((agent_id, schedule_id))

    async def _rows(self) -> list[Row]:
        found = await self._engine.store.afetch(_SQL, {"agents": sorted(self._engine.agents)})
        rows = []
        for agent_id, _sid, spec, owner, _enabled, created_at, last_due, version in found:
            try:
                decoded = msgspec.json.decode(spec, type=ScheduleSpec)
            except msgspec.ValidationError as e:  # a definition older code wrote: skip it
                log.exception("schedule_unreadable", agent=agent_id, schedule=_sid, error=str(e))
                continue
            rows.append(Row(agent_id, decoded, owner, created_at, last_due, version))
        return rows


def _defined(spec: ScheduleSpec, owner: str) -> ScheduleDefined:
    return ScheduleDefined(
        schedule_id=spec.id,
        spec=msgspec.to_builtins(spec),
        owner=owner,  # type: ignore[arg-type]
    )


def _missed_up_to(catch: plan.Catchup, row: Row, now: datetime) -> str:
    """The last missed due time: just before the one that fires, else just before now."""
    edge = catch.fire if catch.fire is not None else now
    return (edge - timedelta(microseconds=1)).isoformat()

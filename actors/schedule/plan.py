"""When a schedule is due, what a tick after downtime does, and the keys a firing derives.

Pure: no I/O and no clock. ``now`` is always an argument, every datetime passed in must be aware,
and every datetime returned is in UTC, so two nodes given the same facts decide the same thing.

Cron and daylight saving time. A cron expression is read on the wall clock of the schedule's
zone, and the two DST edges follow Vixie/Debian cron's split between kinds of job:

- a *fixed-time* job (its minute and hour fields do not start with ``*``, e.g. ``30 2 * * *``)
  names wall-clock times: one whose time falls in the spring-forward gap is **skipped** that day
  (cronsim would run it at the end of the gap, 03:00; we place wall times ourselves so the job does
  not run at an hour nobody asked for), and one whose time repeats at fall-back fires **once**, on
  the first pass (cronsim's 6-field mode would fire it twice);
- a *wildcard* job (``*/15 * * * *``, ``0 * * * *``) follows elapsed time, as cronsim does: it fires
  in both passes of the repeated hour and has nothing to fire in the gap, so an hourly job runs 25
  times on the autumn day and 23 times on the spring one.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import msgspec
from cronsim import CronSim, CronSimError

from eventstore.catalogue import Deliver, ErrorDetail

_ID = r"^[a-z0-9][a-z0-9_-]{0,62}$"
MIN_INTERVAL = timedelta(seconds=1)
MAX_INTERVAL = timedelta(days=366)
MAX_AHEAD = timedelta(days=3653)
"""How far ahead an ``at`` may be (ten years): further is almost surely a typo in the year."""
MAX_SESSION_KEY = 512
"""The gateways' limit on a session key (gateways.ingress.MAX_SESSION_KEY; actors may not import
gateways), so a shared session a schedule names is one a message could name too."""

_DURATION = re.compile(r"(?:(\d{1,6})d)?(?:(\d{1,7})h)?(?:(\d{1,9})m)?(?:(\d{1,10})s)?")
_EVERY_HINT = 'write a duration like "30s", "15m", "2h", "1d" or "1h30m" (units in that order)'
_CRON_HINT = (
    'five fields "minute hour day-of-month month day-of-week", e.g. "0 9 * * 1-5" is 09:00 on '
    'weekdays and "*/15 * * * *" every 15 minutes (an extra leading field gives seconds)'
)


class ScheduleSpec(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, rename="camel"
):
    """A schedule as written: when (``kind`` + ``expr``), what to ask, where the reply goes."""

    id: Annotated[str, msgspec.Meta(pattern=_ID)]
    kind: Literal["cron", "every", "at"]
    expr: str
    timezone: str | None = None
    """An IANA name; None is UTC. Cron fields and a naive ``at`` are read in it."""
    task: str
    deliver: Deliver | Literal["none"] | None = None
    """Where the reply goes; ``"none"`` keeps it in the log only. None is refused at write time."""
    session: str = "isolated"
    """``isolated`` (a fresh session per firing) or ``shared:<key>`` (one ongoing session)."""
    enabled: bool = True


class Catchup(msgspec.Struct, frozen=True):
    """What one scheduler tick does (see ``catch_up``)."""

    fire: datetime | None
    missed: int
    missed_at_least: bool
    next: datetime | None


# --- write-time validation ------------------------------------------------------------------------


def problems(spec: ScheduleSpec, *, now: datetime) -> ErrorDetail | None:
    """The first reason ``spec`` may not be saved, or None. ``now`` is the write time: an ``at``
    more than ten years after it is refused. An ``at`` already past is accepted (it fires once, at
    the next tick): refusing it would make a saved schedule invalid later, when re-checked."""
    now = _utc(now, "now")
    if not re.fullmatch(_ID, spec.id):
        return _invalid(f"the schedule id {spec.id!r} is not valid",
                        "use 1-63 of a-z, 0-9, '_' and '-', starting with a letter or digit",
                        "id")  # fmt: skip
    try:
        zone(spec)
    except ValueError as e:
        return _invalid(str(e), "use an IANA time zone name like Europe/Berlin or UTC",
                        "timezone")  # fmt: skip
    when = _when_problem(spec, now)
    if when is not None:
        return when
    if not spec.task.strip():
        return _invalid("the task is blank", "write the prompt the agent runs each time", "task")
    if "\x00" in spec.task:
        return _invalid("the task contains a NUL character", "remove the \\u0000 characters",
                        "task")  # fmt: skip
    session = _session_problem(spec.session)
    if session is not None:
        return _invalid(f"the session {spec.session!r} {session}",
                        'use "isolated" or "shared:<key>", e.g. "shared:daily-digest"',
                        "session")  # fmt: skip
    return _deliver_problem(spec.deliver)


def _when_problem(spec: ScheduleSpec, now: datetime) -> ErrorDetail | None:
    try:
        match spec.kind:
            case "cron":
                if next_due(spec, now) is None:
                    return _invalid(f"the cron expression {spec.expr!r} never fires",
                                    _CRON_HINT, "expr")  # fmt: skip
            case "every":
                interval(spec.expr)
            case "at":
                at = instant(spec)
                if at > now + MAX_AHEAD:
                    return _invalid(f"the time {spec.expr!r} is more than ten years ahead",
                                    "check the year", "expr")  # fmt: skip
    except ValueError as e:
        hint = {"cron": _CRON_HINT, "every": _EVERY_HINT}.get(
            spec.kind,
            'write ISO 8601, e.g. "2030-01-31T09:00:00Z" or "2030-01-31T09:00" (read in the '
            "schedule's timezone)",
        )
        return _invalid(str(e), hint, "expr")
    return None


def _session_problem(session: str) -> str | None:
    if session == "isolated":
        return None
    kind, colon, key = session.partition(":")
    if kind != "shared" or not colon:
        return 'is neither "isolated" nor "shared:<key>"'
    if not key.strip():
        return "has a blank key"
    if "/" in key or "\x00" in key:
        return "has a key containing '/' or NUL (keys are path segments in the API)"
    if len(key) > MAX_SESSION_KEY:
        return f"has a key of {len(key)} characters (at most {MAX_SESSION_KEY})"
    return None


def _deliver_problem(deliver: Deliver | Literal["none"] | None) -> ErrorDetail | None:
    if deliver is None:
        # A reply that silently goes nowhere is the classic scheduled-job surprise: make it a
        # decision the writer states.
        return ErrorDetail(
            code="schedule_missing_delivery",
            message="the schedule does not say where its replies go",
            hint='give deliver: {channel, to}, or deliver: "none" to keep replies in the log only',
            field="deliver",
        )
    if deliver != "none" and not (deliver.channel.strip() and deliver.to.strip()):
        return _invalid("deliver has a blank channel or recipient",
                        "give both, e.g. {channel: telegram, to: '12345'}", "deliver")  # fmt: skip
    return None


def _invalid(message: str, hint: str, field: str) -> ErrorDetail:
    return ErrorDetail(code="schedule_invalid", message=message, hint=hint, field=field)


# --- reading a spec (ValueError for what problems() refuses) -------------------------------------


def zone(spec: ScheduleSpec) -> ZoneInfo:
    name = spec.timezone or "UTC"
    if name == "localtime":
        # Each host's own zone: two nodes could disagree about when the schedule is due.
        raise ValueError("the timezone 'localtime' means each node's own zone")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as e:
        raise ValueError(f"the timezone {name!r} is unknown") from e


def interval(expr: str) -> timedelta:
    """The duration of an ``every`` schedule: ``30s``, ``15m``, ``2h``, ``1d``, ``1h30m``..."""
    found = _DURATION.fullmatch(expr)
    if not expr or found is None:
        raise ValueError(f"the duration {expr!r} is not valid: {_EVERY_HINT}")
    days, hours, minutes, seconds = (int(g) if g else 0 for g in found.groups())
    span = timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    if span < MIN_INTERVAL:
        raise ValueError(f"the duration {expr!r} is shorter than one second")
    if span > MAX_INTERVAL:
        raise ValueError(f"the duration {expr!r} is longer than {MAX_INTERVAL.days} days "
                         "(use cron for anything rarer)")  # fmt: skip
    return span


def instant(spec: ScheduleSpec) -> datetime:
    """The moment of an ``at`` schedule, in UTC. A time without an offset is read in the
    schedule's zone; one that falls in a spring-forward gap does not exist and is refused, one
    that repeats at fall-back is its first pass."""
    try:
        parsed = datetime.fromisoformat(spec.expr)
    except ValueError as e:
        raise ValueError(f"the time {spec.expr!r} is not ISO 8601") from e
    if parsed.tzinfo is not None:
        return parsed.astimezone(UTC)
    placed = _place(parsed, zone(spec))
    if placed is None:
        raise ValueError(f"the time {spec.expr!r} does not exist in {zone(spec).key} "
                         "(the clocks skip it)")  # fmt: skip
    return placed


# --- occurrences ----------------------------------------------------------------------------------


def next_due(
    spec: ScheduleSpec, after: datetime, *, anchor: datetime | None = None
) -> datetime | None:
    """The first occurrence strictly after ``after``, or None if there is none.

    ``every``: the occurrences are ``anchor + k * interval`` for k >= 1, where ``anchor`` is the
    schedule's creation time, so the rhythm survives restarts and never drifts with late ticks.
    ``at``: the instant, if it is after ``after``. ``cron``: see the module docstring for DST.
    """
    after = _utc(after, "after")
    match spec.kind:
        case "at":
            at = instant(spec)
            return at if at > after else None
        case "every":
            return _every_after(interval(spec.expr), _anchor(anchor), after)
        case "cron":
            return next(_cron_times(spec.expr, zone(spec), after), None)


def catch_up(
    spec: ScheduleSpec,
    last_due: datetime | None,
    now: datetime,
    *,
    anchor: datetime,
    grace: timedelta = timedelta(seconds=60),
    cap: int = 1000,
) -> Catchup:
    """What to do at a tick, on time or after downtime. The rules:

    - The *due* occurrences are those after ``last_due`` (after ``anchor``, the creation time,
      when the schedule never fired) and at or before ``now``.
    - The latest due occurrence fires if it is at most ``grace`` old; every other due occurrence is
      missed. So a tick fires at most once: downtime never turns into a burst of turns.
    - ``missed`` counts the missed occurrences up to ``cap``; ``missed_at_least`` says the true
      count may be larger. Cron counts by stepping (at most ``cap`` + 1 steps, plus the
      occurrences inside ``grace``); ``every`` counts by arithmetic.
    - ``at`` fires once, however late (a one-off reminder is still wanted), and is never missed.
    - ``next`` is the first occurrence after ``now`` (and after ``last_due``).

    The caller then records ``fire`` (or ``now`` when nothing fired) as the new ``last_due``:
    either way every occurrence up to ``now`` has been fired or counted. ``enabled`` is the
    caller's to check.
    """
    now = _utc(now, "now")
    anchor = _anchor(anchor)
    start = anchor if last_due is None else _utc(last_due, "last_due")
    match spec.kind:
        case "at":
            at = instant(spec)
            if last_due is not None and start >= at:
                return Catchup(None, 0, False, None)  # fired already
            return Catchup(at, 0, False, None) if at <= now else Catchup(None, 0, False, at)
        case "every":
            return _every_catch_up(interval(spec.expr), anchor, start, now, grace, cap)
        case "cron":
            return _cron_catch_up(spec, start, now, grace, cap)


def _every_catch_up(
    step: timedelta, anchor: datetime, start: datetime, now: datetime, grace: timedelta, cap: int
) -> Catchup:
    first = max(1, (start - anchor) // step + 1)
    last = (now - anchor) // step
    due = max(0, last - first + 1)
    latest = anchor + last * step
    fire = latest if due and now - latest <= grace else None
    missed = due - (fire is not None)
    return Catchup(fire, min(missed, cap), missed > cap, anchor + max(first, last + 1) * step)


def _cron_catch_up(
    spec: ScheduleSpec, start: datetime, now: datetime, grace: timedelta, cap: int
) -> Catchup:
    times = _cron_times(spec.expr, zone(spec), start)
    due, latest, following = 0, None, None
    for t in times:
        if t > now:
            following = t
            break
        due, latest = due + 1, t
        if due > cap:
            break
    if due > cap:
        # Stepped far enough to know the count is capped; find the latest due time and the next
        # one from the start of the grace window instead of stepping through the whole gap.
        window = max(start, now - grace - timedelta(microseconds=1))
        for t in _cron_times(spec.expr, zone(spec), window):
            if t > now:
                following = t
                break
            latest = t
    fire = latest if latest is not None and now - latest <= grace else None
    missed = due - (fire is not None)
    return Catchup(fire, min(missed, cap), due > cap, following)


def _every_after(step: timedelta, anchor: datetime, after: datetime) -> datetime:
    return anchor + max(1, (after - anchor) // step + 1) * step


def _cron_times(expr: str, tz: ZoneInfo, after: datetime) -> Iterator[datetime]:
    """The occurrences strictly after ``after``, in UTC and increasing (ValueError if invalid)."""
    local = after.astimezone(tz)
    try:
        if _wall_clock(expr):
            # Naive: cronsim then walks the wall clock and knows nothing of DST; _place decides
            # what each wall time means (the gap skips, a repeated time takes its first pass).
            cron = CronSim(expr, local.replace(tzinfo=None))
            times: Iterator[datetime | None] = (_place(t, tz) for t in cron)
        else:
            # Aware: cronsim steps through real instants, so both passes of a repeated hour fire.
            times = (t.astimezone(UTC) for t in CronSim(expr, local))
    except CronSimError as e:
        raise ValueError(f"the cron expression {expr!r} is invalid: {e}") from e
    last = after
    for t in times:
        # A first pass placed before ``after`` (we start inside the repeated hour) is not next.
        if t is not None and t > last:
            last = t
            yield t


def _wall_clock(expr: str) -> bool:
    """Whether a cron expression names fixed wall-clock times (Debian cron's test)."""
    parts = expr.split()
    return len(parts) >= 5 and not parts[-5].startswith("*") and not parts[-4].startswith("*")


def _place(wall: datetime, tz: ZoneInfo) -> datetime | None:
    """The UTC instant of a wall-clock time in ``tz``: its first pass if it repeats, None if the
    clocks skip it."""
    instant = wall.replace(tzinfo=tz, fold=0).astimezone(UTC)
    if instant.astimezone(tz).replace(tzinfo=None) != wall:
        return None
    return instant


# --- keys -----------------------------------------------------------------------------------------


def session_key(spec: ScheduleSpec, due: datetime) -> str:
    """``isolated``: a session of its own per firing; ``shared:<key>``: that key."""
    if spec.session.startswith("shared:"):
        return spec.session.removeprefix("shared:")
    return f"schedule:{spec.id}:{_utc(due, 'due'):%Y%m%dT%H%M%SZ}"


def idempotency_key(spec: ScheduleSpec, due: datetime) -> str:
    """The turn's ``Idempotency-Key``: derived from the schedule and the due time alone, so two
    nodes firing the same tick submit the same turn (at most 101 characters for a valid id)."""
    return f"schedule:{spec.id}:{utc_iso(due)}"


def utc_iso(moment: datetime) -> str:
    """``2026-11-30T09:15:00Z`` (fractional seconds only when there are some)."""
    return _utc(moment, "moment").isoformat().replace("+00:00", "Z")


def _anchor(anchor: datetime | None) -> datetime:
    if anchor is None:
        raise ValueError("an every schedule counts from its anchor (creation time): pass anchor=")
    return _utc(anchor, "anchor")


def _utc(moment: datetime, name: str) -> datetime:
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError(f"{name} must be timezone-aware, got {moment.isoformat()}")
    return moment.astimezone(UTC)

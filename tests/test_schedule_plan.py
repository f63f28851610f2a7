"""The schedule core, table-driven: validation, occurrences (DST included), catch-up and keys."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import msgspec
import pytest

from actors.idempotency import key_problem
from actors.schedule.plan import (
    Catchup,
    ScheduleSpec,
    catch_up,
    idempotency_key,
    interval,
    next_due,
    problems,
    session_key,
)
from eventstore.catalogue import Deliver

BERLIN = ZoneInfo("Europe/Berlin")
NOW = datetime(2026, 5, 4, 12, 0, tzinfo=UTC)  # a Monday
NONE: Any = None


def spec(**fields: Any) -> ScheduleSpec:
    base: dict[str, Any] = {"id": "digest", "kind": "cron", "expr": "0 9 * * *", "task": "Sum up",
                            "deliver": "none"}  # fmt: skip
    return ScheduleSpec(**{**base, **fields})


def utc(y: int, mo: int, d: int, h: int = 0, mi: int = 0, s: int = 0, us: int = 0) -> datetime:
    return datetime(y, mo, d, h, mi, s, us, tzinfo=UTC)


def berlin(y: int, mo: int, d: int, h: int = 0, mi: int = 0, *, fold: int = 0) -> datetime:
    return datetime(y, mo, d, h, mi, tzinfo=BERLIN, fold=fold)


def walk(s: ScheduleSpec, after: datetime, n: int, anchor: datetime | None = None) -> list[str]:
    """The next ``n`` occurrences, as local ISO strings in the spec's zone."""
    out: list[str] = []
    zone = ZoneInfo(s.timezone or "UTC")
    for _ in range(n):
        found = next_due(s, after, anchor=anchor)
        assert found is not None
        assert found > after
        assert found.tzinfo is UTC
        out.append(found.astimezone(zone).isoformat())
        after = found
    return out


# --- the wire shape -------------------------------------------------------------------------------


def test_a_spec_decodes_from_json_and_refuses_unknown_fields() -> None:
    raw = (b'{"id":"d","kind":"every","expr":"15m","task":"t","deliver":{"channel":"telegram",'
           b'"to":"42"},"session":"shared:news"}')  # fmt: skip
    decoded = msgspec.json.decode(raw, type=ScheduleSpec)
    assert decoded.deliver == Deliver(channel="telegram", to="42")
    assert decoded.enabled
    assert msgspec.json.decode(b'{"id":"d","kind":"at","expr":"x","task":"t","deliver":"none"}',
                               type=ScheduleSpec).deliver == "none"  # fmt: skip
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.json.decode(raw[:-1] + b',"every":"1h"}', type=ScheduleSpec)
    with pytest.raises(msgspec.ValidationError, match="id"):
        msgspec.json.decode(raw.replace(b'"d"', b'"Bad Id"'), type=ScheduleSpec)


# --- problems() -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"expr": "0 9 * * 1-5", "timezone": "Europe/Berlin"},
        {"expr": "30 */5 9-17 * * MON-FRI"},  # a leading seconds field
        {"expr": "0 0 L * *"},
        {"kind": "every", "expr": "30s"},
        {"kind": "every", "expr": "1h30m"},
        {"kind": "every", "expr": "1d"},
        {"kind": "at", "expr": "2026-06-01T09:00:00Z"},
        {"kind": "at", "expr": "2026-06-01T09:00", "timezone": "America/New_York"},
        {"kind": "at", "expr": "2026-05-04T11:59:00+00:00"},  # just past: fires at the next tick
        {"deliver": Deliver(channel="telegram", to="42")},
        {"session": "shared:daily"},
    ],
)
def test_valid_specs_have_no_problems(fields: dict[str, Any]) -> None:
    assert problems(spec(**fields), now=NOW) is None


@pytest.mark.parametrize(
    ("fields", "code", "field", "words"),
    [
        ({"deliver": None}, "schedule_missing_delivery", "deliver", '"none"'),
        ({"deliver": Deliver(channel="telegram", to=" ")}, "schedule_invalid", "deliver", "blank"),
        ({"id": "Digest!"}, "schedule_invalid", "id", "Digest!"),
        ({"id": "x" * 64}, "schedule_invalid", "id", "not valid"),
        ({"expr": "61 9 * * *"}, "schedule_invalid", "expr", "Bad minute"),
        ({"expr": "0 9 * *"}, "schedule_invalid", "expr", "Wrong number of fields"),
        ({"expr": "@daily"}, "schedule_invalid", "expr", "'@daily'"),
        ({"expr": "0 0 30 2 *"}, "schedule_invalid", "expr", "Bad day-of-month"),
        ({"kind": "every", "expr": "15"}, "schedule_invalid", "expr", "'15'"),
        ({"kind": "every", "expr": "1.5h"}, "schedule_invalid", "expr", "not valid"),
        ({"kind": "every", "expr": "30m1h"}, "schedule_invalid", "expr", "not valid"),
        ({"kind": "every", "expr": ""}, "schedule_invalid", "expr", "not valid"),
        ({"kind": "every", "expr": "0s"}, "schedule_invalid", "expr", "shorter than one second"),
        ({"kind": "every", "expr": "400d"}, "schedule_invalid", "expr", "longer than"),
        ({"kind": "at", "expr": "tomorrow"}, "schedule_invalid", "expr", "ISO 8601"),
        ({"kind": "at", "expr": "2037-01-01T00:00Z"}, "schedule_invalid", "expr", "ten years"),
        (
            {"kind": "at", "expr": "2027-03-28T02:30", "timezone": "Europe/Berlin"},
            "schedule_invalid",
            "expr",
            "does not exist",  # the spring-forward gap
        ),
        ({"timezone": "Mars/Olympus"}, "schedule_invalid", "timezone", "Mars/Olympus"),
        ({"timezone": "../etc/passwd"}, "schedule_invalid", "timezone", "unknown"),
        ({"timezone": "localtime"}, "schedule_invalid", "timezone", "each node"),
        ({"task": "  \n"}, "schedule_invalid", "task", "blank"),
        ({"task": "a\x00b"}, "schedule_invalid", "task", "NUL"),
        ({"session": "private"}, "schedule_invalid", "session", "neither"),
        ({"session": "shared:"}, "schedule_invalid", "session", "blank key"),
        ({"session": "shared: "}, "schedule_invalid", "session", "blank key"),
        ({"session": "shared:a/b"}, "schedule_invalid", "session", "'/'"),
        ({"session": "shared:a\x00"}, "schedule_invalid", "session", "NUL"),
        ({"session": "shared:" + "k" * 513}, "schedule_invalid", "session", "513"),
    ],
)
def test_problems_name_the_field_and_say_what_to_do(
    fields: dict[str, Any], code: str, field: str, words: str
) -> None:
    found = problems(spec(**fields), now=NOW)
    assert found is not None
    assert (found.code, found.field) == (code, field)
    assert words in found.message + found.hint
    assert found.hint


def test_the_hints_show_examples() -> None:
    cron = problems(spec(expr="nope"), now=NOW)
    every = problems(spec(kind="every", expr="soon"), now=NOW)
    zone = problems(spec(timezone="Berlin"), now=NOW)
    assert cron is not None and "0 9 * * 1-5" in cron.hint
    assert every is not None and "1h30m" in every.hint
    assert zone is not None and "Europe/Berlin" in zone.hint


def test_problems_needs_an_aware_now() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        problems(spec(), now=datetime(2026, 1, 1))


@pytest.mark.parametrize(
    ("expr", "seconds"),
    [("1s", 1), ("30s", 30), ("15m", 900), ("2h", 7200), ("1d", 86400), ("1h30m", 5400),
     ("1d2h3m4s", 93784), ("90m", 5400)],
)  # fmt: skip
def test_interval(expr: str, seconds: int) -> None:
    assert interval(expr) == timedelta(seconds=seconds)


@pytest.mark.parametrize("expr", ["", "0m", "1 h", "1H", "h", "-5m", "1w", "99999999999s"])
def test_interval_refuses(expr: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        interval(expr)


# --- next_due -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "after", "expected"),
    [
        ({"expr": "0 9 * * *"}, utc(2026, 5, 4, 8, 59), utc(2026, 5, 4, 9)),
        ({"expr": "0 9 * * *"}, utc(2026, 5, 4, 9), utc(2026, 5, 5, 9)),  # strictly after
        ({"expr": "0 9 * * *"}, utc(2026, 5, 4, 8, 59, 59, 999999), utc(2026, 5, 4, 9)),
        ({"expr": "0 9 * * 1-5"}, utc(2026, 5, 8, 10), utc(2026, 5, 11, 9)),  # Fri -> Mon
        ({"expr": "0 9 * * *", "timezone": "Europe/Berlin"}, utc(2026, 5, 4), utc(2026, 5, 4, 7)),
        ({"expr": "0 9 * * *", "timezone": "Asia/Kolkata"}, utc(2026, 5, 4),
         utc(2026, 5, 4, 3, 30)),
        ({"expr": "15 * * * * *"}, utc(2026, 5, 4, 9), utc(2026, 5, 4, 9, 0, 15)),  # seconds
        ({"kind": "at", "expr": "2026-06-01T09:00:00+02:00"}, NOW, utc(2026, 6, 1, 7)),
        ({"kind": "at", "expr": "2026-06-01T09:00", "timezone": "Europe/Berlin"}, NOW,
         utc(2026, 6, 1, 7)),
        ({"kind": "at", "expr": "2026-06-01T09:00"}, NOW, utc(2026, 6, 1, 9)),  # UTC default
        ({"kind": "at", "expr": "2026-06-01T09:00Z"}, utc(2026, 6, 1, 9), None),
        ({"kind": "at", "expr": "2026-05-01T09:00Z"}, NOW, None),
    ],
)  # fmt: skip
def test_next_due(fields: dict[str, Any], after: datetime, expected: datetime | None) -> None:
    assert next_due(spec(**fields), after) == expected


def test_next_due_accepts_any_aware_time_and_answers_in_utc() -> None:
    found = next_due(spec(), berlin(2026, 5, 4, 10, 59))  # 08:59 UTC
    assert found == utc(2026, 5, 4, 9)
    assert found is not None and found.tzinfo is UTC
    with pytest.raises(ValueError, match="timezone-aware"):
        next_due(spec(), datetime(2026, 5, 4))


def test_every_counts_from_its_anchor_not_from_the_last_tick() -> None:
    every = spec(kind="every", expr="15m")
    anchor = utc(2026, 5, 4, 9, 7, 30)
    assert next_due(every, anchor, anchor=anchor) == utc(2026, 5, 4, 9, 22, 30)
    assert next_due(every, utc(2026, 5, 4, 9, 22, 30), anchor=anchor) == utc(2026, 5, 4, 9, 37, 30)
    # A late tick does not shift the rhythm.
    assert next_due(every, utc(2026, 5, 4, 9, 41), anchor=anchor) == utc(2026, 5, 4, 9, 52, 30)
    # The creation time itself is not an occurrence, nor is anything before it.
    assert next_due(every, utc(2026, 1, 1), anchor=anchor) == utc(2026, 5, 4, 9, 22, 30)
    # Elapsed time, not wall-clock: 24 h across the spring-forward night is 24 real hours.
    daily = spec(kind="every", expr="1d", timezone="Europe/Berlin")
    start = berlin(2026, 3, 28, 9)
    assert next_due(daily, start, anchor=start) == berlin(2026, 3, 29, 10)
    with pytest.raises(ValueError, match="anchor"):
        next_due(every, anchor)


# --- cron across DST (Europe/Berlin: 2026-03-29 02:00 -> 03:00, 2026-10-25 03:00 -> 02:00) ---


def test_a_fixed_time_in_the_spring_forward_gap_is_skipped_that_day() -> None:
    # cronsim alone runs it at 03:00 (Debian cron); we skip it, and the next day is normal.
    nightly = spec(expr="30 2 * * *", timezone="Europe/Berlin")
    assert walk(nightly, utc(2026, 3, 27), 3) == [
        "2026-03-27T02:30:00+01:00", "2026-03-28T02:30:00+01:00", "2026-03-30T02:30:00+02:00",
    ]  # fmt: skip
    both = spec(expr="0,30 2,3 * * *", timezone="Europe/Berlin")
    assert walk(both, utc(2026, 3, 28, 12), 3) == [
        "2026-03-29T03:00:00+02:00", "2026-03-29T03:30:00+02:00", "2026-03-30T02:00:00+02:00",
    ]  # fmt: skip
    seconds = spec(expr="0 30 2 * * *", timezone="Europe/Berlin")  # 6 fields: same rule
    assert walk(seconds, utc(2026, 3, 28, 12), 1) == ["2026-03-30T02:30:00+02:00"]


def test_a_fixed_time_in_the_repeated_hour_fires_once_on_the_first_pass() -> None:
    nightly = spec(expr="30 2 * * *", timezone="Europe/Berlin")
    assert walk(nightly, utc(2026, 10, 24, 12), 2) == [
        "2026-10-25T02:30:00+02:00", "2026-10-26T02:30:00+01:00",
    ]  # fmt: skip
    # Asked from inside the second pass, the first pass is behind us: tomorrow is next.
    assert walk(nightly, berlin(2026, 10, 25, 2, 10, fold=1), 1) == ["2026-10-26T02:30:00+01:00"]
    # cronsim's own 6-field mode would fire twice here; ours fires once.
    seconds = spec(expr="0 30 2 * * *", timezone="Europe/Berlin")
    assert walk(seconds, utc(2026, 10, 24, 12), 2) == [
        "2026-10-25T02:30:00+02:00", "2026-10-26T02:30:00+01:00",
    ]  # fmt: skip


def test_wildcard_jobs_follow_elapsed_time_across_both_edges() -> None:
    hourly = spec(expr="0 * * * *", timezone="Europe/Berlin")
    assert walk(hourly, berlin(2026, 3, 29, 0, 30), 3) == [
        "2026-03-29T01:00:00+01:00", "2026-03-29T03:00:00+02:00", "2026-03-29T04:00:00+02:00",
    ]  # fmt: skip
    assert walk(hourly, berlin(2026, 10, 25, 1, 30), 3) == [
        "2026-10-25T02:00:00+02:00", "2026-10-25T02:00:00+01:00", "2026-10-25T03:00:00+01:00",
    ]  # fmt: skip
    day = [utc(2026, 10, 24, 22)]  # local midnight
    while (n := next_due(hourly, day[-1])) is not None and n < utc(2026, 10, 25, 23):
        day.append(n)
    assert len(day) == 25


# --- catch_up -------------------------------------------------------------------------------------

ANCHOR = utc(2026, 1, 1)


@pytest.mark.parametrize(
    ("fields", "last_due", "now", "expected"),
    [
        # on time: the due occurrence fires, nothing is missed
        ({}, utc(2026, 5, 3, 9), utc(2026, 5, 4, 9, 0, 2),
         Catchup(utc(2026, 5, 4, 9), 0, False, utc(2026, 5, 5, 9))),
        # nothing due yet
        ({}, utc(2026, 5, 4, 9), utc(2026, 5, 4, 10),
         Catchup(None, 0, False, utc(2026, 5, 5, 9))),
        # late beyond grace: missed, not fired
        ({}, utc(2026, 5, 3, 9), utc(2026, 5, 4, 9, 1, 1),
         Catchup(None, 1, False, utc(2026, 5, 5, 9))),
        # exactly at the grace boundary still fires
        ({}, utc(2026, 5, 3, 9), utc(2026, 5, 4, 9, 1),
         Catchup(utc(2026, 5, 4, 9), 0, False, utc(2026, 5, 5, 9))),
        # three days down, back just after 09:00: the latest fires, two are missed
        ({}, utc(2026, 5, 1, 9), utc(2026, 5, 4, 9, 0, 30),
         Catchup(utc(2026, 5, 4, 9), 2, False, utc(2026, 5, 5, 9))),
        # never fired: counted from the anchor
        ({"expr": "0 * * * *"}, None, utc(2026, 1, 1, 3, 30),
         Catchup(None, 3, False, utc(2026, 1, 1, 4))),
        # every: the same rules, by arithmetic
        ({"kind": "every", "expr": "1h"}, None, utc(2026, 1, 1, 5, 0, 10),
         Catchup(utc(2026, 1, 1, 5), 4, False, utc(2026, 1, 1, 6))),
        ({"kind": "every", "expr": "1h"}, utc(2026, 1, 1, 5), utc(2026, 1, 1, 5, 30),
         Catchup(None, 0, False, utc(2026, 1, 1, 6))),
        ({"kind": "every", "expr": "1h"}, utc(2026, 1, 1, 2), utc(2026, 1, 1, 5, 2),
         Catchup(None, 3, False, utc(2026, 1, 1, 6))),
        ({"kind": "every", "expr": "1h"}, None, utc(2025, 12, 31),  # before the anchor
         Catchup(None, 0, False, utc(2026, 1, 1, 1))),
        # at: fires once, however late, never missed
        ({"kind": "at", "expr": "2026-05-01T09:00Z"}, None, NOW,
         Catchup(utc(2026, 5, 1, 9), 0, False, None)),
        ({"kind": "at", "expr": "2026-05-01T09:00Z"}, utc(2026, 5, 1, 9), NOW,
         Catchup(None, 0, False, None)),
        ({"kind": "at", "expr": "2026-06-01T09:00Z"}, None, NOW,
         Catchup(None, 0, False, utc(2026, 6, 1, 9))),
    ],
)  # fmt: skip
def test_catch_up(
    fields: dict[str, Any], last_due: datetime | None, now: datetime, expected: Catchup
) -> None:
    assert catch_up(spec(**fields), last_due, now, anchor=ANCHOR) == expected


def test_a_long_downtime_is_capped_and_quick() -> None:
    every_second = spec(expr="* * * * * *")  # a year of per-second ticks: 31 million due
    started = time.perf_counter()
    got = catch_up(every_second, utc(2025, 5, 4), NOW, anchor=ANCHOR, cap=1000)
    assert got == Catchup(NOW, 1000, True, NOW + timedelta(seconds=1))
    missed = catch_up(every_second, utc(2025, 5, 4), NOW + timedelta(microseconds=1),
                      anchor=ANCHOR, grace=timedelta(0))  # fmt: skip
    assert (missed.fire, missed.missed, missed.missed_at_least) == (None, 1000, True)
    assert time.perf_counter() - started < 1.0
    every = spec(kind="every", expr="1s")
    got = catch_up(every, None, NOW, anchor=utc(2016, 5, 4, 12), cap=10**9)
    assert got == Catchup(NOW, 315_532_799, False, NOW + timedelta(seconds=1))
    assert catch_up(every, None, NOW, anchor=utc(2016, 5, 4, 12)).missed_at_least


def test_catch_up_never_bursts() -> None:
    """Ticking after any downtime, then recording ``fire or now``, fires at most once per tick
    and fires or counts each occurrence exactly once."""
    hourly = spec(expr="0 * * * *")
    last: datetime | None = None
    fired: list[datetime] = []
    counted = 0
    for now in [utc(2026, 1, 1, 0, 30), utc(2026, 1, 1, 5, 0, 20), utc(2026, 1, 1, 5, 10),
                utc(2026, 1, 1, 6), utc(2026, 1, 1, 9, 30)]:  # fmt: skip
        got = catch_up(hourly, last, now, anchor=ANCHOR)
        if got.fire is not None:
            fired.append(got.fire)
        counted += got.missed
        last = got.fire or now
    assert fired == [utc(2026, 1, 1, 5), utc(2026, 1, 1, 6)]
    assert counted + len(fired) == 9  # 01:00 .. 09:00


def test_catch_up_across_the_repeated_hour_counts_a_fixed_job_once() -> None:
    nightly = spec(expr="30 2 * * *", timezone="Europe/Berlin")
    got = catch_up(nightly, berlin(2026, 10, 24, 2, 30), berlin(2026, 10, 25, 2, 30, fold=1),
                   anchor=ANCHOR)  # fmt: skip
    assert got == Catchup(None, 1, False, berlin(2026, 10, 26, 2, 30))


# --- keys -----------------------------------------------------------------------------------------


def test_session_and_idempotency_keys() -> None:
    due = berlin(2026, 11, 30, 10, 15)
    assert session_key(spec(), due) == "schedule:digest:20261130T091500Z"
    assert session_key(spec(session="shared:news"), due) == "news"
    assert idempotency_key(spec(), due) == "schedule:digest:2026-11-30T09:15:00Z"
    assert idempotency_key(spec(), due) == idempotency_key(spec(), due.astimezone(UTC))
    longest = idempotency_key(spec(id="x" * 63), utc(9999, 12, 31, 23, 59, 59, 999999))
    assert len(longest) <= 255
    assert key_problem(longest) is None  # a valid Idempotency-Key as the engine checks it


def test_what_cronsim_alone_does_at_the_edges() -> None:
    """Why next_due places wall times itself: pinned so a cronsim upgrade that changes this is
    noticed (cronsim==2.8)."""
    from cronsim import CronSim

    gap = next(CronSim("30 2 * * *", berlin(2026, 3, 29)))
    assert gap.isoformat() == "2026-03-29T03:00:00+02:00"  # run at the gap's end, not skipped
    repeated = CronSim("0 30 2 * * *", berlin(2026, 10, 25))
    assert [next(repeated).isoformat() for _ in range(2)] == [
        "2026-10-25T02:30:00+02:00", "2026-10-25T02:30:00+01:00",  # 6 fields: both passes
    ]  # fmt: skip
    start = berlin(2026, 10, 25, 2, 10, fold=1)
    before = next(CronSim("30 2 * * *", start)).astimezone(UTC)
    assert before < start.astimezone(UTC)  # an "occurrence" before the start

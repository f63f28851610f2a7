"""What the server checks of a request's strings beyond their types, as JSON Schema patterns, so
requests generated from the OpenAPI document and the server agree on what is valid: the path and
query parameters' (gateways/http/operation.py), the bodies' (gateways/http/openapi.py
``_constrain``)."""

from __future__ import annotations

import re
import zoneinfo

from cronsim.cronsim import SYMBOLIC_DAYS, SYMBOLIC_MONTHS

from eventstore import REGISTRY
from gateways.ingress import NOT_BLANK

CURSOR = "^([A-Za-z0-9_-]{22})?$"
NO_NUL = "^[^\u0000]*$"
SESSION_KEY = "^[^/\u0000]+$"
_SPACE = "[" + NOT_BLANK.removeprefix("[^")
"""What str.strip() and str.split() take for white space."""
TURN_ID = "^(t_[0-9a-z]{17})?$"
"""A turn id (actors/ids.py: ``t_`` + a base36 time and 8 random digits, or ``t_k`` + 16 digits
of a key's hash), or empty (no page bound)."""


def _cron_field(*names: str, extra: str = "") -> str:
    """One cron field: numbers and ``* , / -``, plus the names (any case) and characters it
    takes (cronsim's Field.parse)."""
    words = ["".join(f"[{c}{c.lower()}]" for c in name) for name in names]
    return "(" + "|".join([f"[0-9*,/{extra}-]", *words]) + ")+"


_CRON_NUMBER = _cron_field()
_CRON = (
    f"({_CRON_NUMBER}{_SPACE}+)?"  # seconds, when there are six fields
    + f"{_CRON_NUMBER}{_SPACE}+{_CRON_NUMBER}{_SPACE}+"  # minute, hour
    + f"{_cron_field('LW', 'L')}{_SPACE}+"  # day of month
    + f"{_cron_field(*SYMBOLIC_MONTHS)}{_SPACE}+"  # month
    + _cron_field(*SYMBOLIC_DAYS, "L", extra="#")  # day of week
)
# A schedule's expression by its kind, as actors/schedule/plan.py reads it. cron: 5 fields, or 6
# with a leading seconds field, each of what cronsim parses in it (numbers, * , / -, names of
# months and days, L, LW, #); a pattern cannot say which values are in range, nor which
# expressions never fire. every: a duration in d h m s order (the server also wants 1 s to 366
# days). at: ISO 8601 as datetime.fromisoformat reads it, which starts with a 4-digit year (the
# server also wants it at most ten years ahead).
EXPRESSIONS = {
    "cron": f"^{_SPACE}*{_CRON}{_SPACE}*$",
    "every": "^([0-9]{1,6}d([0-9]{1,7}h)?([0-9]{1,9}m)?([0-9]{1,10}s)?"
    "|[0-9]{1,7}h([0-9]{1,9}m)?([0-9]{1,10}s)?|[0-9]{1,9}m([0-9]{1,10}s)?|[0-9]{1,10}s)$",
    "at": "^[0-9]{4}[^\u0000]*$",
}
NOT_ZERO = {"every": {"not": {"pattern": "^(0+d)?(0+h)?(0+m)?(0+s)?$"}}}
"""What else a kind's expression must be: a duration is not all zeros (under a second)."""
SCHEDULE_SESSION = f"^(isolated|shared:[^/\u0000]*{NOT_BLANK[:-1]}/\u0000][^/\u0000]*)$"
"""``isolated``, or ``shared:`` and a key that is not blank and has no '/' or NUL."""


def event_types() -> str:
    """The ``types`` query parameter as the streams read it (gateways/streams/sse.py):
    comma-separated event types of the registry, each item stripped, empty items ignored."""
    name = "(" + "|".join(re.escape(t) for t in sorted(REGISTRY)) + ")"
    item = f"{_SPACE}*{name}?{_SPACE}*"
    return f"^{item}(,{item})*$"


def time_zones() -> list[str]:
    """The IANA names this node's tz database has, as the enum of a schedule's ``timezone``;
    'localtime' is refused (each host's own zone). The server takes any name ZoneInfo loads,
    which also includes the database's posix/ and right/ copies, not listed here. The empty
    name is UTC, as null is."""
    return ["", *sorted(zoneinfo.available_timezones() - {"localtime"})]

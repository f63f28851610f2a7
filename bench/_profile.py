"""Reading a cProfile of the event-loop thread: own time by area (a library, or a package of
ours) and the top functions, per unit of work (a turn, an outbox item)."""

from __future__ import annotations

import pstats
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

Raw = dict[tuple[str, int, str], tuple[int, int, float, float, Any]]
"""pstats' table: (file, line, function) -> (primitive calls, calls, own s, cumulative s,
callers)."""

_ROOT = f"{Path(__file__).resolve().parent.parent}/"


def raw_stats(stats: pstats.Stats) -> Raw:
    raw: Raw = stats.stats  # type: ignore[attr-defined]
    return raw


def short(filename: str) -> str:
    """A profiled file's path from its package on: site-packages, this repository, the stdlib."""
    for marker in ("site-packages/", _ROOT, "/work/main/", "lib/python3.11/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


_AREAS = (
    ("psycopg", ("/psycopg/", "/psycopg_pool/", "/psycopg_binary/")),
    ("nats-py", ("/nats/",)),
    ("eventstore", ("/eventstore/",)),
    ("actors", ("/actors/",)),
    ("gateways", ("/gateways/",)),
    ("runtime", ("/runtime/",)),
    ("msgspec", ("/msgspec/",)),
    ("structlog", ("/structlog/",)),
    ("pykka", ("/pykka/",)),
    ("bench client", ("/bench/",)),
    ("asyncio / uvloop", ("/asyncio/", "/uvloop/")),
    ("concurrent.futures / threading", ("/concurrent/", "threading.py", "queue.py")),
)


def library_area(filename: str) -> str:
    """The library (or layer of ours, or the bench client) a profiled function's file is in."""
    for name, needles in _AREAS:
        if any(n in filename for n in needles):
            return name
    if filename == "~":
        return "builtins (C functions)"
    return "other"


def package_area(filename: str) -> str:
    """A package (or our top-level directory) for a profiled function's file; actors/ and
    gateways/ by their subpackage (actors/outbox, gateways/channels)."""
    if filename == "~":
        return "builtins (C)"
    name = short(filename)
    if name == filename:
        return "other"
    parts = name.split("/")
    if parts[0] in ("actors", "gateways") and len(parts) > 2:
        return f"{parts[0]}/{parts[1]}"
    return parts[0].removesuffix(".py")


def total_time(raw: Raw) -> float:
    """Seconds of profiled own time in all."""
    return sum(v[2] for v in raw.values())


def print_areas(
    raw: Raw, area: Callable[[str], str], title: str, per: int, unit: str, most: int | None = None
) -> None:
    """Own time by ``area``, largest first (``most`` of them): its share, and ms per ``unit``."""
    total = total_time(raw)
    by_area: dict[str, float] = defaultdict(float)
    for (filename, _, _), (_, _, tt, _, _) in raw.items():
        by_area[area(filename)] += tt
    print(f"\n{title}")
    for name, tt in sorted(by_area.items(), key=lambda kv: -kv[1])[:most]:
        print(f"  {name:<34} {tt / total * 100:5.1f} %  {tt / max(1, per) * 1000:6.3f} ms/{unit}")


def print_top(
    raw: Raw, key: int, title: str, count: int, per: int, unit: str, *, digits: int = 3,
    skip: Callable[[str], bool] = lambda filename: False,
) -> None:  # fmt: skip
    """The ``count`` functions with the most own (``key`` 2) or cumulative (3) time, per
    ``unit``, leaving out those whose file ``skip`` names."""
    n = max(1, per)
    print(f"\ntop {count} by {title}:")
    print(f"  {f'calls/{unit}':>10} {f'own ms/{unit}':>11} {f'cum ms/{unit}':>11}  function")
    ranked = [kv for kv in sorted(raw.items(), key=lambda kv: -kv[1][key]) if not skip(kv[0][0])]
    for (filename, lineno, func), (_, nc, tt, ct, _) in ranked[:count]:
        where = f"{short(filename)}:{lineno}({func})" if filename != "~" else func
        print(f"  {nc / n:>10.2f} {tt / n * 1000:>11.{digits}f} {ct / n * 1000:>11.{digits}f}"
              f"  {where}")  # fmt: skip

"""The figures of bench/cluster.py's throughput rounds (read from each round's loadgen results)
and the table of their medians, 1 process against 2 (and against a baseline commit), with the
goals it can judge."""

from __future__ import annotations

from _report import RawSingle, print_rows, rate

# isort: split
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Figure:
    key: str
    label: str
    show: Callable[[float], str]
    read: Callable[[dict[str, dict[str, Any]]], float | None]


def _wall(run: str) -> Callable[[dict[str, dict[str, Any]]], float | None]:
    return lambda r: r[run]["burst"]["turns_per_s_wall"]


def _accept(q: str) -> Callable[[dict[str, dict[str, Any]]], float | None]:
    return lambda r: r["main"]["seq_e2e"]["accept_ms"][q]


def _ms(x: float) -> str:
    return f"{x:.2f} ms"


THROUGHPUT = (
    Figure("plain16", "plain burst turns/s, 16 sessions", rate, _wall("main")),
    Figure("plain128", "plain burst turns/s, 128 sessions", rate, _wall("burst128")),
    Figure("tool16", "one-tool burst turns/s, 16 sessions", rate, _wall("tool16")),
    Figure("tool128", "one-tool burst turns/s, 128 sessions", rate, _wall("tool128")),
)
LATENCY = (
    Figure("accept50", "accept p50 (seq, idle)", _ms, _accept("p50")),
    Figure("accept99", "accept p99 (seq, idle)", _ms, _accept("p99")),
)


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def figures(runs: list[dict[str, dict[str, Any]]], figure: Figure) -> list[float]:
    return [v for r in runs if (v := figure.read(r)) is not None]


def node_figures(runs: list[dict[str, dict[str, Any]]], run: str, key: str) -> list[float]:
    return [float(r[run]["node"][key]) for r in runs]


def print_results(
    measured: dict[str, list[dict[str, dict[str, Any]]]], raw: RawSingle, baseline: str | None
) -> list[tuple[str, str, str]]:
    """The medians table of the rounds of ``w1``, ``w2`` and (named ``baseline``) ``base``;
    returns the goal lines it can judge: (goal, measured, met?)."""
    one, two = measured.get("w1", []), measured.get("w2", [])
    base = measured.get("base", [])
    goals: list[tuple[str, str, str]] = []
    table = []

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or not b else f"{a / b:.2f}x"

    def spread(values: list[float]) -> str:
        return "/".join(f"{v:.0f}" if v >= 100 else f"{v:.2f}" for v in values) or "-"

    for f in THROUGHPUT + LATENCY:
        a, b = median(figures(one, f)), median(figures(two, f))
        rows = [f.label, "-" if a is None else f.show(a), "-" if b is None else f.show(b),
                ratio(b, a)]  # fmt: skip
        if baseline is not None:
            c = median(figures(base, f))
            rows += ["-" if c is None else f.show(c), ratio(a, c)]
        against = raw.rate if f in THROUGHPUT else raw.p50 * 1000
        rows += [f.show(against), ratio(a, against), ratio(b, against),
                 f"{spread(figures(one, f))} | {spread(figures(two, f))}"]  # fmt: skip
        table.append(rows)
        if f in THROUGHPUT:
            met = "-" if a is None or b is None else ("yes" if b >= 1.3 * a else "NO")
            goals.append((f"2 processes >= 1.3x 1 process: {f.label}", ratio(b, a), met))
    for label, run, key, show in (
        ("node CPU per plain turn (128-session burst)", "burst128", "cpu_ms_per_turn", _ms),
        ("node CPU per one-tool turn (128-session burst)", "tool128", "cpu_ms_per_turn", _ms),
        ("machine busy during the plain 128-session burst", "burst128", "busy",
         lambda x: f"{x:.0%}"),
    ):  # fmt: skip
        a, b = median(node_figures(one, run, key)), median(node_figures(two, run, key))
        rows = [label, "-" if a is None else show(a), "-" if b is None else show(b), ratio(b, a)]
        if baseline is not None:
            c = median(node_figures(base, run, key))
            rows += ["-" if c is None else show(c), ratio(a, c)]
        rows += ["-", "-", "-", ""]
        table.append(rows)

    def stops(runs: list[dict[str, dict[str, Any]]]) -> str:
        done = [r["stop"] for r in runs if "stop" in r]
        return ", ".join(f"{x['status']} in {x['seconds']:.1f} s" for x in done) or "-"

    rows = ["SIGTERM -> exit status, per round", stops(one), stops(two), "-"]
    if baseline is not None:
        rows += [stops(base), "-"]
    table.append([*rows, "-", "-", "-", ""])
    header = ["figure", "1 process", "2 processes", "2 / 1"]
    if baseline is not None:
        header += [baseline, "1 / baseline"]
    header += ["raw baseline", "1 / raw", "2 / raw", "rounds (1 | 2)"]
    print_rows(header, table, set(range(1, len(header) - 1)))
    if baseline is not None:
        plain = THROUGHPUT[0]
        a, c = median(figures(one, plain)), median(figures(base, plain))
        met = "-" if a is None or c is None else ("yes" if a >= 0.95 * c else "NO")
        goals.append((f"ownership costs <= 5 % (1 process / {baseline}, plain 16)",
                      ratio(a, c), met))  # fmt: skip
        accept = LATENCY[0]
        a, c = median(figures(one, accept)), median(figures(base, accept))
        added = "-" if a is None or c is None else f"{a - c:+.2f} ms"
        met = "-" if a is None or c is None else ("yes" if a - c <= 0.1 else "NO")
        goals.append((f"ownership adds <= 0.1 ms to accept p50 (vs {baseline})",
                      added, met))  # fmt: skip
        print(
            f"baseline rounds ({baseline}): "
            + "; ".join(f"{f.key} {spread(figures(base, f))}" for f in THROUGHPUT + LATENCY)
        )
    return goals

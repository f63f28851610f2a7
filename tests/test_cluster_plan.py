"""The ownership decisions (actors/cluster/plan.py and partitions.py), by table: pure functions,
so every node that reads the same bucket decides the same."""

from __future__ import annotations

from collections import Counter

import pytest

from actors.cluster.partitions import (
    partition_name,
    partition_number,
    partition_of,
    preferred,
)
from actors.cluster.plan import Plan, View, plan

PARTS = frozenset(partition_name(p) for p in range(64))


def view(**overrides: object) -> View:
    base: dict[str, object] = {
        "me": "a",
        "members": frozenset({"a"}),
        "holders": {},
        "wanted": PARTS,
        "held": frozenset(),
        "releasing": frozenset(),
        "orphans": frozenset(),
        "draining": False,
    }
    base.update(overrides)
    return View(**base)  # type: ignore[arg-type]


def test_partition_of_is_stable_and_spreads() -> None:
    assert partition_of("assistant", "api:default", 64) == partition_of(
        "assistant", "api:default", 64
    )
    # Known value: it must never change for a deployment (sessions would change owner).
    assert partition_of("assistant", "api:default", 64) == 40
    counts = Counter(partition_of("a", f"s{i}", 16) for i in range(16_000))
    assert len(counts) == 16 and max(counts.values()) < 1.15 * 1000


def test_partition_names_round_trip() -> None:
    assert partition_number(partition_name(17)) == 17
    assert partition_number("s.scheduler") is None
    assert partition_number("p.x") is None


def test_preferred_moves_only_the_leases_a_joining_node_wins() -> None:
    names = [partition_name(p) for p in range(64)]
    before = {n: preferred(n, ["a", "b"]) for n in names}
    after = {n: preferred(n, ["a", "b", "c"]) for n in names}
    moved = [n for n in names if before[n] != after[n]]
    assert all(after[n] == "c" for n in moved)
    assert 10 <= len(moved) <= 32
    assert preferred("p.1", []) is None


@pytest.mark.parametrize(
    ("case", "overrides", "expected"),
    [
        ("alone, a node takes every free partition", {}, Plan(PARTS, frozenset())),
        (
            "what is held is not taken again",
            {"held": PARTS, "holders": dict.fromkeys(PARTS, "a")},
            Plan(frozenset(), frozenset()),
        ),
        (
            "a partition another node holds is left alone",
            {"holders": dict.fromkeys(PARTS, "b"), "members": frozenset({"a", "b"})},
            Plan(frozenset(), frozenset()),
        ),
        (
            "draining hands over everything not already being handed over",
            {"held": frozenset({"p.1", "p.2"}), "releasing": frozenset({"p.2"}),
             "holders": {"p.1": "a", "p.2": "a"}, "draining": True},
            Plan(frozenset(), frozenset({"p.1"})),
        ),
        (
            "a singleton is never moved while its holder lives",
            {"wanted": frozenset({"s.scheduler"}), "held": frozenset({"s.scheduler"}),
             "holders": {"s.scheduler": "a"}, "members": frozenset({"a", "b", "c", "d"})},
            Plan(frozenset(), frozenset()),
        ),
    ],
)  # fmt: skip
def test_plan(case: str, overrides: dict[str, object], expected: Plan) -> None:
    assert plan(view(**overrides)) == expected, case


def test_two_nodes_split_the_partitions_and_agree() -> None:
    members = frozenset({"a", "b"})
    mine = plan(view(me="a", members=members)).acquire
    theirs = plan(view(me="b", members=members)).acquire
    assert mine | theirs == PARTS and not mine & theirs
    assert 20 <= len(mine) <= 44


def test_a_joining_node_gets_its_share_handed_over() -> None:
    members = frozenset({"a", "b"})
    held = PARTS
    decided = plan(view(members=members, held=held, holders=dict.fromkeys(PARTS, "a")))
    assert decided.acquire == frozenset()
    assert decided.release == {n for n in PARTS if preferred(n, members) == "b"}
    # being handed over already: not released twice
    again = plan(
        view(members=members, held=held, holders=dict.fromkeys(PARTS, "a"),
             releasing=decided.release)
    )  # fmt: skip
    assert again.release == frozenset()


def test_an_orphan_is_taken_by_a_node_it_does_not_prefer() -> None:
    members = frozenset({"a", "b"})
    theirs = next(n for n in sorted(PARTS) if preferred(n, members) == "b")
    holders = {n: ("a" if preferred(n, members) == "a" else "b") for n in PARTS if n != theirs}
    held = frozenset(n for n, h in holders.items() if h == "a")
    assert plan(view(members=members, holders=holders, held=held)).acquire == frozenset()
    orphaned = plan(view(members=members, holders=holders, held=held, orphans=frozenset({theirs})))
    assert orphaned.acquire == {theirs}

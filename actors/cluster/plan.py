"""What a node does with the leases it sees: a pure decision, tested by table.

Every node runs the same function over the same bucket, so they agree on who should hold what
without talking: a free partition is taken by the live node it prefers (rendezvous hashing),
or by anyone once it has stayed free too long (its preferred node may be stuck); a partition
that prefers another live node is handed over to it; a draining node hands everything over.
Singletons (a bot's long poll, the scheduler's clock) are taken the same way but never moved
while their holder lives: moving them buys nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from actors.cluster.partitions import partition_number, preferred


@dataclass(frozen=True)
class View:
    me: str
    members: frozenset[str]
    """Live nodes that take leases (heartbeating, not draining)."""
    holders: Mapping[str, str]
    """Lease name -> the node holding it, as the bucket says."""
    wanted: frozenset[str]
    """The leases this node can hold: every partition, and the singletons it runs."""
    held: frozenset[str]
    """The leases this node holds (it acquired them and renews them)."""
    releasing: frozenset[str]
    """Held leases being handed over (between turns)."""
    orphans: frozenset[str]
    """Free leases that their preferred node has not taken for a while."""
    draining: bool


@dataclass(frozen=True)
class Plan:
    acquire: frozenset[str]
    release: frozenset[str]


def plan(view: View) -> Plan:
    if view.draining:
        return Plan(frozenset(), view.held - view.releasing)
    acquire: set[str] = set()
    release: set[str] = set()
    for name in view.wanted:
        holder = view.holders.get(name)
        if holder == view.me and name not in view.held:  # an earlier life of this node's
            acquire.add(name)
        elif holder is None:
            if name not in view.held and (
                preferred(name, view.members) == view.me or name in view.orphans
            ):
                acquire.add(name)
        elif holder == view.me and name in view.held and name not in view.releasing:
            want = preferred(name, view.members)
            if partition_number(name) is not None and want is not None and want != view.me:
                release.add(name)
    return Plan(frozenset(acquire), frozenset(release))

"""Partition fences: a node that lost a partition's lease cannot append for it any more.

Each lease of a partition has an epoch, larger for every later lease (cluster.md). A fenced
append carries the epoch its node holds; the store inserts it only while no fence of that
partition is greater (sql/append.sql). A node that acquires a partition raises the fence to its
own epoch (:meth:`EventStore.araise_fences`) *before* it serves the partition: the raise waits
for the appends in flight under the old epoch, and every append after it sees the new one.

The raise is also what creates the partition's fence row. Until a partition has one, nothing
refuses its appends and nothing makes a raise wait for them; a new owner therefore raises before
its first fenced append (raising its own epoch is harmless: greatest wins).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from eventstore.envelope import Metadata


class Fence(msgspec.Struct, frozen=True):
    """The partition an append belongs to and the lease epoch its writer holds."""

    partition: int
    epoch: int


FencingHook = Callable[[str, Metadata], Fence | None]
"""``(stream name, metadata of the command's first event) -> Fence | None``: which fence an
append runs under when its caller passes none (the node answers for its owned partitions)."""

OnFenced = Callable[[int], None]
"""Told the partition of each append the fence refused (in the writer's thread): the node has
lost it and should stop serving it."""

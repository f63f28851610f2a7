"""A lease given back while its renewal is on the way (actors/cluster/ownership.py
``_renew_one``), on the node's real lease bucket in NATS.

A node renews every lease it holds each tick, while handovers run beside the ticks (a drain
hands every partition over). When a handover gives a lease back after the renewal was sent and
before its answer came, NATS takes the renewal first and refuses the delete of the revision it
replaced: the lease stayed taken, by a node that no longer served it, until it expired. A node
started after a drain then waited a lease's lifetime (10 s) for those partitions, and every
command to their sessions with it (seen as 8 of 64 partitions after a drain under load).
"""

from __future__ import annotations

import asyncio

import pytest

from actors.cluster.partitions import partition_name
from tests.conftest import ApiServer


@pytest.mark.asyncio
async def test_a_lease_given_back_while_its_renewal_is_on_the_way_is_not_left_taken(
    api: ApiServer,
) -> None:
    ownership = api.node.ownership
    assert ownership is not None and ownership._task is not None
    # The node's own ticks renew every lease too: one in flight would replace the revision this
    # renewal is sent at. Stop the loop after its tick in hand, and start it again at the end.
    ownership._stopping = True
    ownership._wake.set()
    await ownership._task
    name = partition_name(ownership.partition("assistant", "leases"))
    held = ownership._held[name]

    renewing = asyncio.create_task(ownership._renew_one(name))  # its update is on the way
    await asyncio.sleep(0)
    # What _release does once the partition is handed over: forget the lease, delete it at
    # the revision it holds. The renewal was sent first, so this delete is refused.
    assert ownership._held.pop(name) is held
    await ownership.bucket.release(name, held.revision)
    assert await renewing is True

    entries = await ownership.bucket.snapshot()
    assert name not in entries, entries.get(name)

    ownership._stopping = False
    ownership._task = asyncio.create_task(ownership._run(), name="ownership")

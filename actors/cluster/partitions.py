"""Which partition a session belongs to, and which live node a partition prefers.

Both are pure and stable across processes and restarts (sha256/blake2b, never ``hash()``), so
every node computes the same answers from the same inputs.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable


@functools.lru_cache(maxsize=8192)
def partition_of(agent_id: str, session_key: str, count: int) -> int:
    """The partition of a session: fixed for the life of a deployment (``count`` is too).
    Asked for every command and every append of a session's streams: the live sessions' are
    remembered."""
    digest = hashlib.sha256(f"{agent_id}\x00{session_key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % count


def partition_name(partition: int) -> str:
    """The lease key of a partition."""
    return f"p.{partition}"


def partition_number(name: str) -> int | None:
    """The partition a lease key names, or None for another kind of lease."""
    if not name.startswith("p."):
        return None
    tail = name[2:]
    return int(tail) if tail.isdigit() else None


def preferred(name: str, nodes: Iterable[str]) -> str | None:
    """The node a lease prefers among ``nodes`` (rendezvous hashing): each node scores every
    lease, the highest score wins. When a node joins or leaves, only the leases it wins or
    held move (about 1/N of them), and all nodes agree without talking to each other."""
    best: tuple[int, str] | None = None
    for node in nodes:
        digest = hashlib.blake2b(f"{node}\x00{name}".encode(), digest_size=8).digest()
        score = (int.from_bytes(digest, "big"), node)
        if best is None or score > best:
            best = score
    return None if best is None else best[1]

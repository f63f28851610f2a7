"""Retention: the node holding the ``retention`` singleton lease (one per deployment, see
actors/cluster/ownership.py) archives, now and then, every partition of the log that
:func:`eventstore.archive.refusal` lets go under the deployment's ``retention`` settings.

Retention is per deployment, not per agent: a partition is a range of positions holding every
agent's events of its time, and it is archived whole or not at all.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import psycopg
import structlog

from eventstore.archive import ArchiveError, Retention, archive, connect, eligible
from eventstore.bridge import blocking

log = structlog.get_logger("dispach.retention")

EVERY_S = 3600.0
"""How often retention looks: partitions age by days, a look costs a few queries."""


def archive_eligible(
    conninfo: str, schema: str, retention: Retention, directory: Path
) -> list[str]:
    """Archive what retention lets go now (blocking: run it in a thread); the archive ids."""
    done = []
    with connect(conninfo, schema) as conn:
        for name in eligible(conn, retention):
            try:
                manifest = archive(conn, name, directory, retention=retention)
            except ArchiveError as e:  # became ineligible meanwhile (a turn resumed, …)
                log.info("retention_skipped", partition=name, reason=e.message)
                continue
            log.info("retention_archived", partition=name, archive=manifest["archiveId"],
                     events=manifest["events"], bytes=manifest["bytes"])  # fmt: skip
            done.append(str(manifest["archiveId"]))
    return done


async def run(conninfo: str, schema: str, retention: Retention, directory: Path,
              every_s: float = EVERY_S) -> None:  # fmt: skip
    """Apply retention every ``every_s`` until cancelled; a failed look is logged and retried
    at the next."""
    while True:
        try:
            await blocking(archive_eligible, conninfo, schema, retention, directory)
        except (psycopg.Error, OSError) as e:
            log.warning("retention_failed", error=str(e))
        await asyncio.sleep(every_s)


class RetentionTask:
    """:func:`run` as a singleton's start and stop (runtime/node.py)."""

    def __init__(self, conninfo: str, schema: str, retention: Retention, directory: Path) -> None:
        self._args = (conninfo, schema, retention, directory)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(run(*self._args), name="retention")

    async def stop(self) -> None:
        """Stop looking. An archive under way in its thread finishes there (every step of it
        is safe to be cut short, and it is not): only the next look is cancelled."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

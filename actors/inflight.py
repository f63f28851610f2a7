"""Handling NATS requests concurrently, boundedly (the ingress and the node's command path)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

log = structlog.get_logger("dispach.inflight")


class InFlight:
    """Handle NATS requests concurrently, boundedly. nats-py runs one subscription's callbacks
    one after another; wrapped, each request becomes a task of its own, at most ``limit`` at a
    time (then the callback waits, and NATS's own bounded buffer pushes back)."""

    def __init__(self, limit: int = 1024) -> None:
        self._slots = asyncio.Semaphore(limit)
        self._tasks: set[asyncio.Task[Any]] = set()

    def wrap(self, handler: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
        async def callback(msg: Any) -> None:
            await self._slots.acquire()
            task = asyncio.create_task(self._run(handler, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        return callback

    async def _run(self, handler: Callable[[Any], Awaitable[None]], msg: Any) -> None:
        try:
            await handler(msg)
        except Exception:
            log.exception("request_failed", subject=getattr(msg, "subject", None))
        finally:
            self._slots.release()

    async def drain(self, timeout: float) -> None:
        """Wait for the requests being handled (new ones have stopped arriving)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

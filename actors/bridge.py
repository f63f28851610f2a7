"""The one bridge between actor threads and the event loop (NATS, Starlette, psycopg async).

pykka futures must never be awaited on the loop (their ``__await__`` blocks it), and the loop's
coroutines must never be run from a thread without the loop. Everything that crosses goes through
:class:`Portal`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pykka

T = TypeVar("T")


class Portal:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """From a thread: run ``coro`` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """From a thread: start ``coro`` on the loop without waiting."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """From a thread: run a plain callable on the loop."""
        self.loop.call_soon_threadsafe(fn, *args)

    @staticmethod
    async def wait(future: pykka.Future[T], timeout: float) -> T:
        """On the loop: wait for a pykka future without blocking the loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, lambda: future.get(timeout=timeout))

"""The one bridge between threads and the event loop.

A node runs on one event loop (uvloop): NATS, Starlette, psycopg's async side and every actor.
Threads remain only where code blocks: the group-commit writer (eventstore/writer.py), plain
tool functions, the archive's export, the MCP server's blocking client, and start-up and
shutdown work (embedded services, manifests, joining actors). Every crossing between the two
goes through this module, in the bottom layer so that the log's writer uses it too; a test
(tests/test_layers.py) refuses the primitives anywhere else.

Loop to thread: :func:`blocking` (start-up and shutdown work, on the default executor),
:func:`abandonable` (a call that may never return: a daemon thread the process does not wait
for), :func:`start_thread` (a long-lived thread of its own), and the anyio forms the MCP SDK's
threads need (:func:`anyio_blocking`, :func:`anyio_from_thread`).

Thread to loop: :func:`soon` (run a callable on the loop), :func:`settled` (await a future
answered on any thread), :class:`Portal` (start a coroutine on the loop from a thread).

``Lock`` and ``Event`` are the thread-safe primitives the few shared structures use.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, ParamSpec, TypeVar

import anyio.from_thread
import anyio.to_thread

T = TypeVar("T")
P = ParamSpec("P")

Lock = threading.Lock
Event = threading.Event
Thread = threading.Thread

_running_loop = asyncio.events._get_running_loop
"""The loop running in this thread, or None (asyncio's own C-level check, no exception)."""


# --- thread to loop ----------------------------------------------------------------------------


def on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """Is this code running on ``loop`` (not on another thread)?"""
    return _running_loop() is loop


def soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """From any thread: run ``fn`` on ``loop`` soon (never inline), through the loop's wake-up
    pipe only when called from another thread. A closed loop drops it (nobody waits)."""
    if _running_loop() is loop:
        loop.call_soon(fn, *args)
    else:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(fn, *args)


def settled(source: Future[T]) -> asyncio.Future[T]:
    """On the loop: an awaitable for a future answered anywhere (an append's outcome).

    ``asyncio.wrap_future`` hands every answer over with ``call_soon_threadsafe``, a write to
    the loop's wake-up pipe, even when the answer is given on the loop itself. Most answers are:
    the writer delivers each batch's answers to the loop in one hop (eventstore/writer.py).
    Those are copied at once; only an answer from another thread pays the hop. Cancelling the
    awaitable cancels ``source`` (an append still commits; its caller stopped waiting)."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[T] = loop.create_future()

    def copy(done: Future[T]) -> None:
        if waiter.done():
            return  # the waiter was cancelled
        if done.cancelled():
            waiter.cancel()
        elif (error := done.exception()) is not None:
            waiter.set_exception(error)
        else:
            waiter.set_result(done.result())

    def arrived(done: Future[T]) -> None:
        if _running_loop() is loop:
            copy(done)
        else:
            soon(loop, copy, done)

    def abandoned(waiting: asyncio.Future[T]) -> None:
        if waiting.cancelled():
            source.cancel()

    waiter.add_done_callback(abandoned)
    source.add_done_callback(arrived)
    return waiter


def deliver(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> bool:
    """From another thread: run ``fn`` on ``loop`` (one wake-up for a whole batch of answers);
    False when the loop is closed, and the caller answers instead."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True


class Portal:
    """The node's loop, as threads see it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def spawn(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """From a thread: start ``coro`` on the loop without waiting."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """From any thread: run a plain callable on the loop (see :func:`soon`)."""
        soon(self.loop, fn, *args)


# --- loop to thread ----------------------------------------------------------------------------


async def blocking(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """On the loop: run blocking start-up or shutdown work (open a pool, read manifests, stop
    the embedded services) on the default executor and await it. Not for calls that may hang:
    the default executor's threads are joined at exit (see :func:`abandonable`)."""
    return await asyncio.to_thread(fn, *args, **kwargs)


def start_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """Start a long-lived daemon thread of its own (the writer, the archive's reader)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


class _DaemonWorkers:
    """Daemon threads for calls that may never return, kept for reuse (a thread start per call
    was a third of a tool step's runtime overhead in the turn bench).

    Every job gets a worker at once: an idle one if there is one, else a new thread, so a call
    never waits behind another and a stuck call only costs its own thread. At most ``keep`` idle
    threads wait for work; the others end.
    """

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1  # that worker is now promised to this job
        self._jobs.put(job)
        if spawn:
            start_thread(self._work, "dispach-worker")

    def _work(self) -> None:
        while True:
            self._jobs.get()()
            with self._lock:
                if self._idle >= self._keep:
                    return
                self._idle += 1


_WORKERS = _DaemonWorkers()


async def abandonable(fn: Callable[..., T], *args: object) -> T:
    """On the loop: run a plain function that may never return (a tool) on a daemon thread that
    cannot hold the process up, and await it.

    A thread cannot be cancelled: a stopped or timed-out call is abandoned, and its thread runs
    on. The default executor's threads would then be joined at shutdown, so one stuck tool could
    keep a draining node from ever exiting; a daemon thread does not.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(value: T | None, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(value)  # type: ignore[arg-type]  # set when error is None

    def work() -> None:
        value: T | None = None
        error: BaseException | None = None
        try:
            value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            error = e
        # The node may have stopped while an abandoned call ran on: nobody is waiting then.
        soon(loop, settle, value, error)

    _WORKERS.submit(work)
    return await done


# --- anyio (the MCP SDK's server and stdio transport run on anyio) ------------------------------


async def anyio_blocking(
    fn: Callable[..., T],
    *args: object,
    abandon_on_cancel: bool = False,
    limiter: anyio.CapacityLimiter | None = None,
) -> T:
    """In an anyio task: run ``fn`` on anyio's worker threads and await it."""
    return await anyio.to_thread.run_sync(
        fn, *args, abandon_on_cancel=abandon_on_cancel, limiter=limiter
    )


def anyio_from_thread(fn: Callable[..., Coroutine[Any, Any, T]], *args: object) -> T:
    """On one of anyio's worker threads: run ``fn(*args)`` in its event loop and wait for it."""
    return anyio.from_thread.run(fn, *args)

"""The one bridge between actor threads and the event loop (NATS, Starlette, psycopg async).

pykka futures must never be awaited on the loop (their ``__await__`` blocks it), and the loop's
coroutines must never be run from a thread without the loop. Everything that crosses goes through
:class:`Portal`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import sys
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import pykka
import structlog

log = structlog.get_logger("dispach.bridge")

T = TypeVar("T")

_running_loop = asyncio.events._get_running_loop
"""The loop running in this thread, or None (asyncio's own C-level check, no exception)."""


def soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """From any thread: run ``fn`` on ``loop`` soon (never inline), through the loop's wake-up
    pipe only when called from another thread."""
    if _running_loop() is loop:
        loop.call_soon(fn, *args)
    else:
        loop.call_soon_threadsafe(fn, *args)


def settled(source: concurrent.futures.Future[T]) -> asyncio.Future[T]:
    """On the loop: an awaitable for a future answered anywhere (an actor's reply, an append).

    ``asyncio.wrap_future`` hands every answer over with ``call_soon_threadsafe``, a write to
    the loop's wake-up pipe, even when the answer is given on the loop itself. Most answers are:
    actors run on the loop, and the writer delivers each batch's answers to it in one hop
    (eventstore/writer.py). Those are copied at once; only an answer from another thread pays
    the hop. Cancelling the awaitable cancels ``source`` (an append still commits; its caller
    stopped waiting)."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[T] = loop.create_future()

    def copy(done: concurrent.futures.Future[T]) -> None:
        if waiter.done():
            return  # the waiter was cancelled
        if done.cancelled():
            waiter.cancel()
        elif (error := done.exception()) is not None:
            waiter.set_exception(error)
        else:
            waiter.set_result(done.result())

    def arrived(done: concurrent.futures.Future[T]) -> None:
        if _running_loop() is loop:
            copy(done)
        else:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(copy, done)

    def abandoned(waiting: asyncio.Future[T]) -> None:
        if waiting.cancelled():
            source.cancel()

    waiter.add_done_callback(abandoned)
    source.add_done_callback(arrived)
    return waiter


@dataclass(frozen=True)
class Ask:
    """A message that wants an answer, delivered to the asker's future."""

    message: object
    reply: concurrent.futures.Future[Any]


def answer(ask: Ask, handle: Callable[[object], object]) -> None:
    """In the actor: handle the asked message and resolve the asker's future."""
    if not ask.reply.set_running_or_notify_cancel():
        return  # the asker gave up
    try:
        ask.reply.set_result(handle(ask.message))
    except Exception as e:  # noqa: BLE001 - the asker gets it
        ask.reply.set_exception(e)


def refuse_pending(actor: pykka.Actor) -> None:
    """In a stopping actor (``on_stop``): fail the asks still in its inbox with ActorDeadError,
    so their askers retry at once instead of waiting out their timeout (pykka answers only its
    own asks when an actor stops, and an :class:`Ask` travels as a plain message)."""
    inbox = actor.actor_inbox
    while not inbox.empty():  # this thread is the inbox's only reader: get() cannot block here
        message = inbox.get().message
        if isinstance(message, Ask) and message.reply.set_running_or_notify_cancel():
            message.reply.set_exception(pykka.ActorDeadError(f"{actor} stopped"))


class Portal:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """From a thread: start ``coro`` on the loop without waiting."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """From any thread: run a plain callable on the loop (see :func:`soon`)."""
        soon(self.loop, fn, *args)

    @staticmethod
    async def ask(ref: pykka.ActorRef[Any], message: object, timeout: float) -> Any:
        """On the loop: send ``message`` to an actor and await its answer, without a thread.

        The actor receives an :class:`Ask` and answers through its future (see
        :func:`answer`); pykka's own ``ask`` would need a thread blocked on ``get()``.
        """
        reply: concurrent.futures.Future[Any] = concurrent.futures.Future()
        ref.tell(Ask(message, reply))
        return await asyncio.wait_for(settled(reply), timeout)


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


class _LoopInbox:
    """An actor inbox whose ``put`` (from any thread) schedules the actor's turn on the loop.

    A put on the loop itself (the usual case: every actor runs there) schedules one turn for
    however many messages arrive before it runs, without touching the loop's wake-up pipe; a
    put from another thread wakes the loop as it must."""

    def __init__(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:
        self._items: collections.deque[Any] = collections.deque()
        self._loop = loop
        self._wake = wake
        self._due = False  # a turn is scheduled by a put on the loop (read on the loop only)

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        self._items.append(item)
        if _running_loop() is not self._loop:
            self._loop.call_soon_threadsafe(self._wake)
        elif not self._due:
            self._due = True
            self._loop.call_soon(self._turn)

    def _turn(self) -> None:
        self._due = False
        self._wake()

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def close(self) -> None:
        """The actor has stopped: a late ``put`` no longer wakes it. This also lets go of the
        actor (``wake`` is its bound method), so a stopped actor is freed by its reference
        count, not left as a cycle for a full collection to find."""
        self._wake = _ignore


def _ignore() -> None:
    return None


class LoopActor(pykka.Actor):
    """A pykka actor that handles its messages on the event loop, without a thread of its own.

    pykka runs an actor wherever its subclass says (``_create_actor_inbox``,
    ``_start_actor_loop``); ``ThreadingActor`` starts a thread per actor. An actor whose work is
    on the loop anyway (a TurnActor: its turn's coroutine runs there) would only relay between
    that thread and the loop, at the price of a thread start and two GIL hand-offs per message.
    This one is the same actor to everyone else (tell, ask, stop, the registry) and processes its
    inbox in loop callbacks, one message at a time, in order. Its handlers must not block, and it
    must never be stopped with ``block=True`` from the loop itself (that would wait on itself).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._begun = False
        super().__init__()

    def _create_actor_inbox(self) -> Any:  # type: ignore[override]  # an instance needs its loop
        return _LoopInbox(self._loop, self._drain)

    @staticmethod
    def _create_future() -> pykka.Future[Any]:
        return pykka.ThreadingFuture()

    def _start_actor_loop(self) -> None:
        soon(self._loop, self._begin)

    def _begin(self) -> None:
        self._begun = True
        self._actor_loop_setup()
        self._drain()

    def _drain(self) -> None:
        """Handle what is in the inbox (pykka's ``_actor_loop_running``, one pass)."""
        if not self._begun:
            return  # on_start runs first; _begin drains what arrived meanwhile
        inbox = cast(_LoopInbox, self.actor_inbox)  # made by _create_actor_inbox
        while not self.actor_stopped.is_set() and not inbox.empty():
            envelope = inbox.get()
            try:
                response = self._handle_receive(envelope.message)
                if envelope.reply_to is not None:
                    envelope.reply_to.set(response)
            except Exception:  # noqa: BLE001 - the asker (or the failure hook) gets it
                if envelope.reply_to is not None:
                    envelope.reply_to.set_exception()
                else:
                    self._handle_failure(*sys.exc_info())
                    try:
                        self.on_failure(*sys.exc_info())
                    except Exception:  # noqa: BLE001 - pykka's own policy: log it
                        self._handle_failure(*sys.exc_info())
        if self.actor_stopped.is_set():
            self._actor_loop_teardown()
            inbox.close()

"""The one actor kind of a node: a pykka actor that handles its messages on the event loop.

pykka runs an actor wherever its subclass says, through its documented hooks for implementors of
new actor types (``_create_actor_inbox``, ``_create_future``, ``_start_actor_loop``);
``ThreadingActor`` starts a thread per actor. Every actor here works on the loop anyway (a turn's
coroutine, the outbox's sends, the scheduler's clock), so a thread would only relay between
itself and the loop, at the price of a thread start and two GIL hand-offs per message. A
:class:`LoopActor` is the same actor to everyone else (tell, ask, stop, the registry) and
handles its mailbox in loop callbacks, one message at a time, in order. Its handlers must not
block, and it must never be stopped with ``block=True`` from the loop itself.

On the loop, an actor is asked with :func:`ask`: the answer comes back on an asyncio future,
with a timeout, and no thread waits for it. pykka's own ``ref.ask`` (from a thread) works too.

The mailbox is bounded (:data:`MAILBOX`): a message beyond it is refused with
:class:`MailboxFull` at the sender, instead of growing a backlog the actor can never catch up on.
"""

from __future__ import annotations

import asyncio
import collections
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import pykka
import structlog

from eventstore import bridge

log = structlog.get_logger("dispach.actor")

MAILBOX = 10_000
"""Messages an actor's mailbox holds before a sender is refused."""


class MailboxFull(RuntimeError):
    """The actor has :data:`MAILBOX` messages waiting: this one is refused, nothing was sent."""


@dataclass(frozen=True)
class Ask:
    """A message that wants an answer, delivered to the asker's future (on the loop)."""

    message: object
    reply: asyncio.Future[Any]


async def ask(ref: pykka.ActorRef[Any], message: object, timeout: float) -> Any:
    """On the loop: send ``message`` to an actor and await its answer, for ``timeout`` seconds
    at most (``TimeoutError``). A dead actor raises ``pykka.ActorDeadError``, a full one
    :class:`MailboxFull`."""
    reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    ref.tell(Ask(message, reply))
    async with asyncio.timeout(timeout):
        return await reply


def tell(ref: pykka.ActorRef[Any], message: object) -> bool:
    """Send ``message`` if the actor is alive; False if it is not (a stopped actor's news is
    nobody's)."""
    try:
        ref.tell(message)
    except pykka.ActorDeadError:
        return False
    return True


class _Mailbox:
    """An actor's inbox whose ``put`` (from any thread) schedules the actor's turn on the loop.

    A put on the loop itself (the usual case: every actor runs there) schedules one turn for
    however many messages arrive before it runs, without touching the loop's wake-up pipe; a
    put from another thread wakes the loop as it must."""

    def __init__(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:
        self._items: collections.deque[Any] = collections.deque()
        self._loop = loop
        self._wake = wake
        self._due = False  # a turn is scheduled by a put on the loop (read on the loop only)

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if len(self._items) >= MAILBOX:
            raise MailboxFull(f"the actor has {MAILBOX} messages waiting")
        self._items.append(item)
        if not bridge.on_loop(self._loop):
            bridge.soon(self._loop, self._wake)
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
    """An actor on the event loop (see the module). Subclasses implement pykka's public hooks:
    ``on_start``, ``on_receive``, ``on_stop``, ``on_failure``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._mailbox_begun = False
        super().__init__()

    # --- pykka's hooks for implementors of actor types -----------------------------------------

    def _create_actor_inbox(self) -> Any:  # type: ignore[override]  # an instance needs its loop
        return _Mailbox(self._loop, self._mailbox_drain)

    @staticmethod
    def _create_future() -> pykka.Future[Any]:
        return pykka.ThreadingFuture()  # pykka's own asks may come from a thread

    def _start_actor_loop(self) -> None:
        bridge.soon(self._loop, self._mailbox_begin)

    # --- the actor's life ----------------------------------------------------------------------

    def _mailbox_begin(self) -> None:
        self._mailbox_begun = True
        try:
            self.on_start()
        except Exception:  # noqa: BLE001 - pykka's policy: log it and stop
            self._mailbox_failed()
        self._mailbox_drain()

    def _mailbox_drain(self) -> None:
        """Handle what is in the mailbox, in order, until it is empty or the actor stopped."""
        if not self._mailbox_begun:
            return  # on_start runs first; _begin drains what arrived meanwhile
        mailbox = cast(_Mailbox, self.actor_inbox)  # made by _create_actor_inbox
        while not self.actor_stopped.is_set() and not mailbox.empty():
            envelope = mailbox.get()
            message = envelope.message
            if isinstance(message, Ask):
                self._mailbox_answer(message)
                continue
            try:
                # pykka's own messages (stop, and its asks from threads) are dispatched by
                # pykka; everything else arrives in on_receive.
                response = self._handle_receive(message)
                if envelope.reply_to is not None:
                    envelope.reply_to.set(response)
            except Exception:  # noqa: BLE001 - the asker (or the failure hook) gets it
                if envelope.reply_to is not None:
                    envelope.reply_to.set_exception()
                else:
                    self._mailbox_failed()
        if self.actor_stopped.is_set():
            self._mailbox_refuse(mailbox)
            mailbox.close()

    def _mailbox_answer(self, ask: Ask) -> None:
        if ask.reply.done():
            return  # the asker gave up
        try:
            ask.reply.set_result(self.on_receive(ask.message))
        except Exception as e:  # noqa: BLE001 - the asker gets it
            ask.reply.set_exception(e)

    def _mailbox_failed(self) -> None:
        """An unhandled exception: log it, unregister and stop, then ``on_failure``."""
        exc_info = sys.exc_info()
        log.error("actor_failed", actor=str(self), exc_info=exc_info)
        pykka.ActorRegistry.unregister(self.actor_ref)
        self.actor_stopped.set()
        try:
            self.on_failure(*exc_info)
        except Exception:
            log.exception("actor_on_failure_failed", actor=str(self))

    def _mailbox_refuse(self, mailbox: _Mailbox) -> None:
        """Fail what is still in the mailbox with ActorDeadError, so askers retry at once
        instead of waiting out their timeout."""
        while not mailbox.empty():
            envelope = mailbox.get()
            dead = pykka.ActorDeadError(f"{self.actor_ref} stopped before handling the message")
            if isinstance(envelope.message, Ask):
                if not envelope.message.reply.done():
                    envelope.message.reply.set_exception(dead)
            elif envelope.reply_to is not None:
                envelope.reply_to.set_exception(exc_info=(type(dead), dead, None))

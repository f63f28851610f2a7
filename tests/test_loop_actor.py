"""LoopActor: a pykka actor whose messages are handled on the event loop, in order, with pykka's
tell / ask / stop semantics, and no thread of its own."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pykka
import pytest

from actors.actor import MAILBOX, Ask, LoopActor, MailboxFull, ask


class Recorder(LoopActor):
    def __init__(self, loop: asyncio.AbstractEventLoop, seen: list[Any]) -> None:
        super().__init__(loop)
        self.seen = seen

    def on_start(self) -> None:
        self.seen.append(("start", threading.current_thread().name))

    def on_receive(self, message: Any) -> Any:
        if message == "boom":
            raise ValueError("boom")
        self.seen.append((message, threading.current_thread().name))
        return f"got {message}"

    def on_stop(self) -> None:
        self.seen.append(("stop", threading.current_thread().name))


@pytest.mark.asyncio
async def test_messages_are_handled_on_the_loop_in_order_without_a_thread() -> None:
    loop = asyncio.get_running_loop()
    seen: list[Any] = []
    threads = threading.active_count()
    ref = Recorder.start(loop, seen)
    assert threading.active_count() == threads
    for n in range(5):
        ref.tell(n)

    def from_a_thread() -> tuple[str, str]:
        answer = str(ref.ask("asked", timeout=5))
        with pytest.raises(ValueError, match="boom"):
            ref.ask("boom", timeout=5)
        ref.stop(block=True, timeout=5)
        return answer, threading.current_thread().name

    answer, asker = await asyncio.to_thread(from_a_thread)
    assert answer == "got asked"
    loop_thread = threading.current_thread().name
    assert seen == [("start", loop_thread), *((n, loop_thread) for n in range(5)),
                    ("asked", loop_thread), ("stop", loop_thread)]  # fmt: skip
    assert asker != loop_thread
    assert not ref.is_alive()
    with pytest.raises(pykka.ActorDeadError):
        ref.tell("late")


class Echo(LoopActor):
    def on_receive(self, message: Any) -> Any:
        if message == "fail":
            raise RuntimeError("refused")
        return message


@pytest.mark.asyncio
async def test_an_ask_on_the_loop_is_answered_on_an_asyncio_future_or_raises_its_error() -> None:
    ref = Echo.start(asyncio.get_running_loop())
    assert await ask(ref, "echo", timeout=5) == "echo"
    with pytest.raises(RuntimeError, match="refused"):
        await ask(ref, "fail", timeout=5)
    assert ref.is_alive()  # an asker's error does not stop the actor
    ref.stop(block=False)
    while ref.is_alive():
        await asyncio.sleep(0)
    with pytest.raises(pykka.ActorDeadError):
        await ask(ref, "echo", timeout=5)


@pytest.mark.asyncio
async def test_a_full_mailbox_refuses_the_next_message_and_asks_behind_a_stop_fail() -> None:
    loop = asyncio.get_running_loop()
    ref = Echo.start(loop)
    await ask(ref, "started", timeout=5)
    # Nothing is handled until this coroutine yields: the mailbox fills, then refuses.
    before: asyncio.Future[Any] = loop.create_future()
    ref.tell(Ask("before", before))
    for _ in range(MAILBOX - 3):
        ref.tell("filler")
    ref.stop(block=False)
    behind: asyncio.Future[Any] = loop.create_future()
    ref.tell(Ask("behind", behind))  # the last place in the mailbox
    with pytest.raises(MailboxFull):
        ref.tell("one too many")
    assert await asyncio.wait_for(before, 5) == "before"
    with pytest.raises(pykka.ActorDeadError):
        await asyncio.wait_for(behind, 5)  # refused at once when the actor stopped
    assert not ref.is_alive()

"""LoopActor: a pykka actor whose messages are handled on the event loop, in order, with pykka's
tell / ask / stop semantics, and no thread of its own."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pykka
import pytest

from actors.actor import LoopActor


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

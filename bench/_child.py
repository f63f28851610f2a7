"""A fake server of the test suite (tests/fakes) in a process of its own, so that it shares no
GIL with the node or the bench, spoken to over a pipe.

The child is ``target(conn, *args)``, run in a spawned process: it sends its URL first, then
answers each message on ``conn`` until it receives ``"stop"``."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable
from typing import Any


class Child:
    def __init__(self, target: Callable[..., None], *args: Any, name: str) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=target, args=(child, *args), name=name,
                                        daemon=True)  # fmt: skip
        self._process.start()
        child.close()
        self.url: str = self._conn.recv()

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    def ask(self, message: Any) -> Any:
        """Send ``message``; the child's answer."""
        self._conn.send(message)
        return self._conn.recv()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send("stop")
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()

"""TurnActor: owns one running turn. Its step loop runs on the event loop (see runner.py); the
actor is the turn's mailbox: stop requests, and the news that the loop ended."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog

from actors.actor import LoopActor, tell
from actors.messages import StopTurn, TurnFinished
from actors.turn.runner import TurnRunner

log = structlog.get_logger("dispach.turn")


class TurnActor(LoopActor):
    """Its messages are handled on the event loop, where its turn runs (see LoopActor)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        runner: TurnRunner,
        on_finished: Callable[[TurnFinished], None],
        running: set[asyncio.Task[Any]],
    ) -> None:
        super().__init__(loop)
        self._running = running
        self._runner: TurnRunner | None = runner
        self._turn_id = runner.turn_id
        self._on_finished = on_finished
        self._task: asyncio.Task[str | None] | None = None
        self._turn_begun = False  # the task has begun to run the turn

    def on_start(self) -> None:
        self._task = self._loop.create_task(self._run(), name=f"turn {self._turn_id}")
        self._running.add(self._task)
        self._task.add_done_callback(self._done)

    async def _run(self) -> str | None:
        runner = self._runner
        assert runner is not None
        self._turn_begun = True
        return await runner.run()

    def _cancel(self) -> None:
        """Cancel the runner's task. The task ends only once it has appended the turn's end, so
        the next turn of the session never overlaps it. A task that has not begun yet is left
        to begin when the turn was asked to stop: the runner then ends it as stopped at once (a
        task cancelled before it begins would not run at all)."""
        runner = self._runner
        if self._task is None or (not self._turn_begun and runner is not None
                                  and runner.stop_requested is not None):  # fmt: skip
            return
        self._task.cancel()

    def _done(self, task: asyncio.Task[str | None]) -> None:
        self._running.discard(task)
        reason: str | None = None
        if task.cancelled():
            reason = None
        elif (error := task.exception()) is not None:
            log.error("turn_failed", turn=self._turn_id, exc_info=error)
        else:
            reason = task.result()
        # If the actor is gone the node is draining; the turn is resumed at the next start.
        tell(self.actor_ref, TurnFinished(self._turn_id, reason))

    def on_receive(self, message: Any) -> Any:
        match message:
            case StopTurn(by=by):
                if self._runner is None:
                    return False
                self._runner.request_stop(by)
                self._loop.call_soon(self._cancel)
                return True
            case TurnFinished() as finished:
                self._on_finished(finished)
                # The session has what it keeps of the turn; a stopped actor's ref may outlive
                # it (the host prunes now and then), its runner and history must not. Nor its
                # task: it keeps its callbacks (our bound ``_done``), a cycle only a full
                # collection would free.
                self._runner = None
                self._task = None
                self.stop()
        return None

    def on_stop(self) -> None:
        # Draining: cancel without a stop request, so the turn stays unfinished and resumes.
        if self._task is not None and not self._task.done():
            self._loop.call_soon(self._cancel)

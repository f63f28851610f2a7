"""TurnActor: owns one running turn. Its step loop runs on the event loop (see runner.py); the
actor is the turn's mailbox: stop requests, and the news that the loop ended."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable
from typing import Any

import pykka
import structlog

from actors.bridge import LoopActor, Portal
from actors.messages import StopTurn, TurnFinished
from actors.turn.runner import TurnRunner

log = structlog.get_logger("dispach.turn")


class TurnActor(LoopActor):
    """Its messages are handled on the event loop, where its turn runs (see LoopActor)."""

    def __init__(
        self,
        portal: Portal,
        runner: TurnRunner,
        on_finished: Callable[[TurnFinished], None],
        running: set[asyncio.Task[Any]],
    ) -> None:
        super().__init__(portal.loop)
        self._running = running
        self._portal = portal
        self._runner: TurnRunner | None = runner
        self._turn_id = runner.turn_id
        self._on_finished = on_finished
        self._future: concurrent.futures.Future[Any] | None = None
        self._task: asyncio.Task[Any] | None = None  # touched on the event loop only
        self._cancel_first = False

    def on_start(self) -> None:
        self._future = self._portal.spawn(self._run())
        self._future.add_done_callback(self._done)

    async def _run(self) -> str | None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._running.add(task)
        runner = self._runner
        assert runner is not None
        try:
            if self._cancel_first and runner.stop_requested is None:
                raise asyncio.CancelledError  # drained before it began: resumed at next start
            return await runner.run()
        finally:
            self._running.discard(task)

    def _cancel(self) -> None:
        """On the event loop: cancel the runner's task. Its future completes only once the task
        has appended the turn's end, so the next turn of the session never overlaps it."""
        if self._task is None:
            self._cancel_first = True
        else:
            self._task.cancel()

    def _done(self, future: concurrent.futures.Future[Any]) -> None:
        reason: str | None = None
        if future.cancelled():
            reason = None
        elif (error := future.exception()) is not None:
            log.error("turn_failed", turn=self._turn_id, exc_info=error)
        else:
            reason = future.result()
        # If the actor is gone the node is draining; the turn is resumed at the next start.
        with contextlib.suppress(pykka.ActorDeadError):
            self.actor_ref.tell(TurnFinished(self._turn_id, reason))

    def on_receive(self, message: Any) -> Any:
        match message:
            case StopTurn(by=by):
                if self._runner is None:
                    return False
                self._runner.request_stop(by)
                self._portal.call_soon(self._cancel)
                return True
            case TurnFinished() as finished:
                self._on_finished(finished)
                # The session has what it keeps of the turn; a stopped actor's ref may outlive
                # it (the host prunes now and then), its runner and history must not. Nor its
                # task and future: the future keeps its callbacks (our bound ``_done``), a cycle
                # only a full collection would free.
                self._runner = None
                self._future = self._task = None
                self.stop()
        return None

    def on_stop(self) -> None:
        # Draining: cancel without a stop request, so the turn stays unfinished and resumes.
        if self._future is not None and not self._future.done():
            self._portal.call_soon(self._cancel)

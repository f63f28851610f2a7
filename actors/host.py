"""The actor system host of a node: starts pykka actors and stops them all when it drains."""

from __future__ import annotations

from typing import Any

import pykka
import structlog

log = structlog.get_logger("dispach.actors")


class ActorHost:
    def __init__(self) -> None:
        self._refs: list[pykka.ActorRef[Any]] = []
        self._prune_at = 64
        """The list's length at which stopped actors are forgotten."""
        self.stopping = False

    def start(
        self, actor_class: type[pykka.Actor], *args: Any, **kwargs: Any
    ) -> pykka.ActorRef[Any]:
        if self.stopping:
            raise RuntimeError("the actor host is stopping; no new actors")
        ref: pykka.ActorRef[Any] = actor_class.start(*args, **kwargs)
        self._refs.append(ref)
        if len(self._refs) >= self._prune_at:
            # A turn starts an actor: forget the stopped ones, or the list grows by one per turn.
            # At most 64 stopped ones are held (each holds its actor, through its inbox, and
            # all the actor kept: at twice the live count, a node with a thousand live
            # sessions held up to a thousand finished turns).
            self._refs = [r for r in self._refs if r.is_alive()]
            self._prune_at = len(self._refs) + 64
        return ref

    @property
    def running(self) -> int:
        return sum(1 for ref in self._refs if ref.is_alive())

    def stop(self, timeout: float) -> None:
        """Stop every actor, newest first; each finishes the message it is handling."""
        self.stopping = True
        for ref in reversed(self._refs):
            if ref.is_alive():
                try:
                    ref.stop(block=True, timeout=timeout)
                except pykka.Timeout:
                    log.warning("actor_stop_timeout", actor=ref.actor_class.__name__)
        self._refs.clear()

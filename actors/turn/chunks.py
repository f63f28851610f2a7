"""A model call's text deltas, coalesced into ``model.chunk`` events: one per 50 ms or 512
characters at most, and one whenever the kind changes (the answer's text, the model's
reasoning). The live stream and the replay carry exactly these. Pure: the runner appends
what :meth:`Chunks.add` and :meth:`Chunks.take` return."""

from __future__ import annotations

from typing import Literal

from eventstore.catalogue import ModelChunk

CHARS = 512
SECONDS = 0.05

Kind = Literal["text", "reasoning"]


class Chunks:
    def __init__(self) -> None:
        self.partial: list[str] = []
        """The answer's text of the call so far (never its reasoning): what a stopped turn
        keeps of a reply cut short."""
        self._unflushed: list[str] = []
        self._size = 0
        self._kind: Kind = "text"
        self._last = 0.0

    def begin(self, now: float) -> None:
        """A new model call starts (at ``now``, in seconds of a monotonic clock)."""
        self.partial, self._unflushed, self._size, self._kind = [], [], 0, "text"
        self._last = now

    def add(self, text: str, kind: Kind, now: float) -> list[ModelChunk]:
        """One delta of the reply; the chunks it completes, to append now."""
        out = self.take() if kind != self._kind else []
        self._kind = kind
        if kind == "text":
            self.partial.append(text)
        self._unflushed.append(text)
        self._size += len(text)
        if self._size >= CHARS or now - self._last >= SECONDS:
            out += self.take()
            self._last = now
        return out

    def take(self) -> list[ModelChunk]:
        """What has not been sent yet, as one chunk (none if nothing is left)."""
        if not self._unflushed:
            return []
        chunk = ModelChunk(delta="".join(self._unflushed), kind=self._kind)
        self._unflushed, self._size = [], 0
        return [chunk]

    def drop(self) -> None:
        """Forget what has not been sent (the run is read again from the log)."""
        self._unflushed, self._size = [], 0

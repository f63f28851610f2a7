"""Running the ladder before a model call: measure, compact one rung at a time, measure again.

This is the one place that awaits (a compactor model writes digests); the decisions are in
:mod:`actors.context.ladder`, the rungs it climbs in :mod:`actors.context.rungs`. The history it
is given is the turn's own copy: the session keeps the result only when the turn ends.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import structlog

from actors.context import ladder
from actors.context.assemble import Assembly, Pinned, assemble, total
from actors.context.history import Digest, Entry, History
from actors.context.policy import ContextPolicy
from actors.context.rungs import RUNGS
from actors.model import Completed, Model, ModelError, ModelRequest, TextDelta
from actors.recall import NOTHING, Recalled
from eventstore.catalogue import CompactionStage, ContextPressure
from eventstore.event import Event

log = structlog.get_logger("dispach.context")

DIGEST_INSTRUCTION = (
    "You compact the earlier part of a conversation between a person and an AI assistant, so "
    "the assistant can go on without it. Write notes to yourself, not a reply: what the person "
    "wants and why, decisions made, facts learned (numbers, names, results of tools), what is "
    "still open. Keep it under 300 words. The person's requests are kept verbatim elsewhere: do "
    "not repeat them word for word. End with one line saying what this summary leaves out."
)
_DIGEST_MAX_CHARS = 4000
Counter = Callable[[Assembly], Awaitable[int | None]]
"""Counts a request's prompt tokens with the provider (count_tokens), or None if it cannot."""


class Digester:
    """Writes the digest that stands for compacted turns: with the agent's compactor model when
    one is configured, else (or when it fails) mechanically from what the turns contain."""

    def __init__(self, model: Model | None = None, model_id: str = "", max_tokens: int = 1024):
        self.model = model
        self.model_id = model_id
        self.max_tokens = max_tokens

    async def __call__(
        self, previous: Digest | None, covered: Sequence[Entry], dropped: Sequence[str] = ()
    ) -> tuple[str, Literal["model", "mechanical"], str | None]:
        """The digest's text, where it came from, and why a configured model was not used.
        ``dropped``: earlier requests of the person no longer listed verbatim."""
        if self.model is None:
            return mechanical(previous, covered, dropped), "mechanical", None
        try:
            text = await self._ask(previous, covered, dropped)
        except ModelError as e:
            log.warning("compactor_fell_back", error=e.code, message=str(e))
            return mechanical(previous, covered, dropped), "mechanical", f"{e.code}: {e}"
        if not text.strip():
            fallback = "the compactor replied nothing"
            return mechanical(previous, covered, dropped), "mechanical", fallback
        return text.strip()[:_DIGEST_MAX_CHARS], "model", None

    async def _ask(self, previous: Digest | None, covered: Sequence[Entry],
                   dropped: Sequence[str]) -> str:  # fmt: skip
        assert self.model is not None
        body = ladder.render(covered)
        if previous is not None:
            body = f"Summary of what came before:\n{previous.text}\n\nThen:\n{body}"
        if dropped:
            listed = "\n".join(f"- {r[:300]}" for r in dropped)
            body = (f"These earlier requests of the person will no longer be listed word for "
                    f"word; keep what matters of them:\n{listed}\n\n{body}")  # fmt: skip
        request = ModelRequest(
            model=self.model_id, system=[{"type": "text", "text": DIGEST_INSTRUCTION}],
            messages=[{"role": "user", "content": [{"type": "text", "text": body}]}],
            tools=[], max_tokens=self.max_tokens,
        )  # fmt: skip
        parts: list[str] = []
        async for event in self.model.stream(request):
            if isinstance(event, TextDelta):
                parts.append(event.text)
            elif isinstance(event, Completed):
                parts = [b.get("text", "") for b in event.content if b.get("type") == "text"]
        return "".join(parts)


_ASK = "If something important from then is missing, ask the person."


def mechanical(
    previous: Digest | None, covered: Sequence[Entry], dropped: Sequence[str] = ()
) -> str:
    """A digest written without a model: what the turns contained, and where to read more."""
    count = len(ladder.turns(covered))
    asked = len(ladder.requests(covered))
    lines = [
        f"{count} turns are summarised here without a model. The person made {asked} requests "
        "in them (listed below, verbatim); the replies themselves are not kept here."
    ]
    used = ladder.tools_used(covered)
    if used:
        lines.append("Tools used: " + ", ".join(f"{n} ({len(ids)})" for n, ids in used.items())
                     + ".")  # fmt: skip
        newest = [(cid, name) for name, ids in used.items() for cid in ids][-5:]
        lines.append(
            "Their results stay in the log; read one in full with artifact_read(id), e.g. "
            + ", ".join(f'"{cid}" ({name})' for cid, name in newest)
            + "."
        )
    if dropped:
        lines.append(
            f"{len(dropped)} of the person's earliest requests are no longer listed word for "
            "word (the list outgrew its share of the context window); they stay in the log."
        )
    if previous is not None:
        text = previous.text.removesuffix(_ASK).rstrip()
        earlier = text if len(text) <= 1000 else text[:1000] + " [...]"
        lines.append(f"Before those turns: {earlier}")
    lines.append(_ASK)
    return "\n".join(lines)


@dataclass
class Prepared:
    """A request ready to send, and what its preparation appends to the log."""

    assembly: Assembly
    events: list[Event]
    tokens: int
    """The prompt's size as the pressure figure counts it."""
    over: bool
    """Even the last rung left it over the budget: it must not be sent."""


async def prepare(
    pinned: Pinned,
    history: History,
    text: str,
    transcript: Sequence[dict[str, Any]],
    policy: ContextPolicy,
    digester: Digester,
    counter: Counter | None = None,
    recalled: Recalled = NOTHING,
) -> Prepared:
    """Assemble the request, compacting ``history`` (in place) when its pressure calls for it."""
    assembly = assemble(pinned, history, text, transcript, policy.excerpt_keep, recalled)
    budget, ratio = policy.budget, history.ratio
    source: Literal["reported", "corrected", "estimated"] = (
        "corrected" if history.calibrated else "estimated"
    )
    tokens = history.corrected(assembly.total)
    if counter is not None:
        exact = await counter(assembly)
        if exact:
            tokens, source = exact, "reported"
            ratio = exact / max(1, assembly.total)
    events: list[Event] = []
    peak: float | None = None
    stage = ladder.deepest(tokens / budget, policy.thresholds)
    if stage is not None:
        peak = round(tokens / budget, 4)
        goal = ladder.target(stage, policy.thresholds) * budget
        for index in range(stage + 1):
            if tokens <= goal:
                break
            rung = RUNGS[index]
            before = tokens
            need = math.ceil((tokens - goal) / ratio)
            event = await rung.apply(history, policy, need, digester)
            if not event["changed"]:
                continue  # nothing of its kind to compact: the next rung may have something
            tokens = math.ceil(
                total(pinned, history, text, transcript, policy.excerpt_keep, recalled) * ratio
            )
            events.append(CompactionStage(**{**event, "stage": rung.name, "before": before,
                                             "after": tokens}))  # fmt: skip
        if source == "reported":
            source = "corrected"  # the count was of the request before compaction
        if events:
            assembly = assemble(pinned, history, text, transcript, policy.excerpt_keep, recalled)
    events.append(ContextPressure(fraction=round(tokens / budget, 4), tokens=tokens,
                                  budget=budget, source=source, peak=peak))  # fmt: skip
    return Prepared(assembly, events, tokens, over=tokens > budget)

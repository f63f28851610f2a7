"""What the next turn of a session would read, as the context endpoint shows it."""

from __future__ import annotations

from typing import Any

from actors.agent import Agent
from actors.context import ladder
from actors.context.assemble import assemble
from actors.context.history import History
from actors.context.rungs import MARKS, STAGES
from actors.messages import (
    Compacted,
    ContextBlock,
    ContextThresholds,
    DigestInfo,
    HistoryCounts,
    SessionContext,
)
from actors.recall import NOTHING, Recalled


def session_context(
    agent: Agent,
    session_key: str | None,
    history: History,
    phase: str | None,
    text: str = "",
    messages: bool = False,
    recalled: Recalled = NOTHING,
) -> SessionContext:
    """The first request of the session's next turn for the input ``text``, before compaction,
    as blocks with their tokens and texts, with the tools of the session's ``phase`` (None:
    the entry phase) and the skills and notes ``recalled`` for it. Without an input (``""``)
    the input slot and block are left out; without a session (``session_key`` None),
    ``history`` is empty: a new session's first turn."""
    policy = agent.context
    view = agent.view(phase)
    built = assemble(view.pinned, history, text, (), policy.excerpt_keep, recalled)
    digest = history.view.digest
    slots = [
        ContextBlock(slot=s.slot, label=s.label, pinned=s.pinned, tokens=s.tokens, text=shown)
        for s, shown in zip(built.slots, built.texts, strict=True)
        if text or s.label != "input"
    ]
    total = sum(s.tokens for s in slots)
    tokens = history.corrected(total)
    shown = {e.obs_id for e in history.entries if e.obs_id is not None}
    marks = [mark for obs_id, mark in history.view.marks.items() if obs_id in shown]
    sent = built.messages if text else _without_input(built.messages)
    return SessionContext(
        agent_id=agent.id, session_key=session_key, slots=slots, total=total,
        window=policy.window, reserve_output=policy.reserve_output, budget=policy.budget,
        tokens=tokens, pressure=round(tokens / policy.budget, 4),
        source="corrected" if history.calibrated else "estimated",
        thresholds=ContextThresholds(**dict(zip(STAGES, policy.thresholds, strict=True))),
        breakpoints=built.breakpoints if text else built.breakpoints - 1,  # the input's
        history=HistoryCounts(
            turns=len(ladder.turns(history.entries)), messages=len(history.entries),
            compacted=Compacted(**{name: marks.count(name) for name in MARKS}),
        ),
        digest=None if digest is None else DigestInfo(
            source=digest.source, turns=digest.turns, requests=len(digest.requests),
            text=digest.text,
        ),
        messages=sent if messages else None,
        system=built.system if messages else None,
        phase=view.name or None,
        tools=view.tools.names,
    )  # fmt: skip


def _without_input(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The assembled messages less the (empty) input block, the last block of the last one."""
    *earlier, last = messages
    content = last["content"][:-1]
    return [*earlier, {"role": last["role"], "content": content}] if content else earlier

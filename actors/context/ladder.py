"""The compaction ladder's decisions, pure: which rungs run (the rungs themselves are
:mod:`actors.context.rungs`), and what a digest reads of the turns it covers.

Pressure is the prompt's (corrected) size over the prompt budget. When it crosses a stage's
threshold, the stages run in order from the first, one at a time, until the prompt is back under
the threshold of the rung *below* the deepest one crossed (below the first: its threshold less
:data:`FLOOR_MARGIN`). That gap is the hysteresis: after a compaction the next few turns fit
without one, and the prefix the provider cached stays valid until the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from actors.context.history import Entry, readable, text_tokens

FLOOR_MARGIN = 0.05
"""Below the first rung's threshold, the first rung compacts down to this much less."""


def deepest(fraction: float, thresholds: tuple[float, ...]) -> int | None:
    """The index of the deepest stage whose threshold ``fraction`` is over, if any."""
    crossed = [i for i, t in enumerate(thresholds) if fraction > t]
    return crossed[-1] if crossed else None


def target(stage: int, thresholds: tuple[float, ...]) -> float:
    """Where compaction that reached ``stage`` brings the pressure back to."""
    return thresholds[stage - 1] if stage > 0 else max(0.0, thresholds[0] - FLOOR_MARGIN)


# --- what the digest rungs read of the turns they cover ----------------------------------------


def turns(entries: Sequence[Entry]) -> list[int]:
    """The ``turn.start`` positions of the turns in ``entries``, oldest first."""
    starts: list[int] = []
    for item in entries:
        if not starts or starts[-1] != item.start:
            starts.append(item.start)
    return starts


def split(entries: Sequence[Entry], keep_turns: int) -> int:
    """How many of ``entries`` (oldest first) a digest that keeps the newest ``keep_turns``
    turns verbatim covers (0: nothing to cover)."""
    starts = turns(entries)
    if len(starts) <= keep_turns:
        return 0
    if keep_turns == 0:
        return len(entries)
    first_kept = starts[-keep_turns]
    return next(i for i, e in enumerate(entries) if e.start >= first_kept)


def requests(entries: Sequence[Entry]) -> list[str]:
    """The person's requests among ``entries``, verbatim."""
    found = []
    for item in entries:
        if item.role == "user" and isinstance(item.content, dict):
            found.append(str(item.content.get("text", "")))
    return found


def over_share(listed: list[str], share: int) -> int:
    """How many of the earliest of ``listed`` to leave out so the rest fit in ``share`` tokens
    (the newest are kept)."""
    total = sum(text_tokens(r) + 2 for r in listed)
    cut = 0
    while cut < len(listed) and total > share:
        total -= text_tokens(listed[cut]) + 2
        cut += 1
    return cut


def tools_used(entries: Sequence[Entry]) -> dict[str, list[str]]:
    """Tool name -> the call ids, in ``entries``."""
    used: dict[str, list[str]] = {}
    for item in entries:
        if item.role == "assistant":
            for block in item.content:
                if isinstance(block, dict) and block.get("type") == "tool_use":
                    used.setdefault(str(block["name"]), []).append(str(block["id"]))
    return used


def render(entries: Sequence[Entry], limit: int = 60_000) -> str:
    """The covered turns as plain text for a compactor model (tool results cut short)."""
    lines: list[str] = []
    for item in entries:
        content: Any = item.content
        if item.role == "user":
            lines.append(f"Person: {content.get('text', '')}")
        elif item.role == "tool":
            text = readable(content.get("content"))
            short = text if len(text) <= 600 else f"{text[:400]} [...] {text[-150:]}"
            lines.append(f"Tool result {content.get('tool_use_id')}: {short}")
        else:
            for block in content:
                if block.get("type") == "text" and block.get("text"):
                    lines.append(f"Assistant: {block['text']}")
                elif block.get("type") == "tool_use":
                    args = str(block.get("input"))
                    lines.append(f"Assistant calls {block['name']}({args[:300]})")
    text = "\n".join(lines)
    if len(text) > limit:
        text = f"{text[: limit // 3]}\n[...]\n{text[-(limit - limit // 3) :]}"
    return text

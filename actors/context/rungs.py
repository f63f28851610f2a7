"""The compaction ladder's rungs, each declared once in :data:`RUNGS`, in the order they run
(least information lost first): its name, its default threshold, how it compacts a history, and
how a replay re-applies the ``compaction.stage`` it recorded. Everything else is derived from
that list: the policy's default thresholds, the manifest's ``context.thresholds``, the order the
ladder climbs, the marks a view may hold and how each shows a tool result.

Two kinds of rung:

- a **marking** rung (:func:`marking`) marks tool results, oldest first, until it saved what was
  asked; its event's ``ids`` are the results it marked. Its function says which results it may
  mark, and how a result under its mark reads. A mark never weakens: a later rung's is stronger.
- a **digest** rung writes a digest that stands for the older turns and drops them from the
  history; its event carries the digest.

A new rung is one entry in :data:`RUNGS` plus its function. Two literals stay apart, each checked
against this list by a test: the API's view of the thresholds and marks
(``actors/messages.py``: ``ContextThresholds``, ``Compacted``), msgspec types that gateways
import without the engine.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from actors.context import ladder
from actors.context.history import (
    BYTES_PER_TOKEN,
    Digest,
    Entry,
    History,
    View,
    estimate,
    readable,
    slim,
)
from actors.tools import args_hash
from eventstore.catalogue import CompactionStage

if TYPE_CHECKING:
    from actors.context.compact import Digester
    from actors.context.policy import ContextPolicy

_ENCODE = msgspec.json.Encoder().encode

Apply = Callable[["History", "ContextPolicy", int, "Digester"], Awaitable[dict[str, Any]]]
"""Compacts a turn's history (in place) by about ``need`` tokens if it can: the fields of its
``compaction.stage`` event (``changed`` False: it found nothing of its kind)."""
Replay = Callable[["History", CompactionStage], None]
"""Folds a recorded ``compaction.stage`` of the rung into a history, as the live rung left it."""
Eligible = Callable[["History", "ContextPolicy"], Callable[[Entry], bool]]
"""Which tool results of the history a marking rung may mark."""
Show = Callable[[Entry, str, str, int], "str | None"]
"""A tool result under the mark: ``(entry, its text, the artifact_read call that reads it whole,
the policy's excerpt_keep)`` -> what the model reads instead (None: the result as it is)."""


@dataclass(frozen=True)
class Marking:
    """What a marking rung does to the tool results it marks."""

    eligible: Eligible
    show: Show
    keeps_body: bool = False
    """The live history keeps a marked result's body (an excerpt shows part of it); otherwise
    the body is dropped from memory, never shown again (``artifact_read`` reads the log)."""


@dataclass(frozen=True)
class Rung:
    name: str
    """``compaction.stage``'s ``stage``, the key of ``context.thresholds`` and of its mark."""
    threshold: float
    """Its default threshold, a fraction of the prompt budget: past it, the ladder climbs to it."""
    apply: Apply
    replay: Replay
    marking: Marking | None = None
    """Set for a marking rung: its events' ``ids`` are marks, which the session_context
    projection merges into the session's (a digest rung's event replaces them)."""

    @property
    def marks(self) -> bool:
        return self.marking is not None


# --- marking rungs ------------------------------------------------------------------------------


def marking(name: str, threshold: float, eligible: Eligible, show: Show,
            keeps_body: bool = False) -> Rung:  # fmt: skip
    """A marking rung: it marks results ``eligible`` allows, oldest first, as ``show`` renders."""
    kind = Marking(eligible, show, keeps_body)

    async def apply(history: History, policy: ContextPolicy, need: int,
                    digester: Digester) -> dict[str, Any]:  # fmt: skip
        view, ids = mark(name, history, policy, need)
        history.view = view
        if not keeps_body and ids:  # their bodies are never shown again: not kept in memory
            gone = set(ids)
            history.entries = [slim(e) if e.obs_id in gone else e for e in history.entries]
        return {"changed": bool(ids), "ids": ids}

    return Rung(name, threshold, apply, _replay_marks, kind)


def _replay_marks(history: History, event: CompactionStage) -> None:
    if event.ids:
        view = history.view
        marks = {**view.marks, **dict.fromkeys(event.ids, event.stage)}
        history.view = View(digest=view.digest, marks=marks)


def mark(name: str, history: History, policy: ContextPolicy, need: int) -> tuple[View, list[str]]:
    """The marking rung ``name``'s decision, pure: the view with results marked (oldest first,
    those its rung may mark and a weaker mark holds) until ``need`` tokens are saved, and their
    ids. The history is not changed; nothing to mark gives back its very view."""
    kind = BY_NAME[name].marking
    assert kind is not None, f"{name} is not a marking rung"
    allowed = kind.eligible(history, policy)
    marks = dict(history.view.marks)
    ids: list[str] = []
    saved = 0
    for item, current in _observations(history):
        if saved >= need:
            break
        if _STRENGTH[current] >= _STRENGTH[name] or not allowed(item):
            continue
        gain = _shown_tokens(item, current, policy) - _shown_tokens(item, name, policy)
        if gain <= 0:
            continue
        marks[item.obs_id] = name  # type: ignore[index]  # a tool result's, never None
        ids.append(item.obs_id)  # type: ignore[arg-type]
        saved += gain
    if not ids:
        return history.view, []
    return View(digest=history.view.digest, marks=marks), ids


def _observations(history: History) -> Iterator[tuple[Entry, str | None]]:
    marks = history.view.marks
    for item in history.entries:
        if item.role == "tool":
            yield item, marks.get(item.obs_id)  # type: ignore[arg-type]


def _shown_tokens(item: Entry, mark: str | None, policy: ContextPolicy) -> int:
    return item.tokens if mark is None else estimate(marked(item, mark, policy.excerpt_keep))


def marked(entry: Entry, mark: str | None, keep_tokens: int) -> Any:
    """The wire form of ``entry`` under ``mark`` (a marking rung's name), pointing at the whole
    body with ``artifact_read``."""
    content = entry.content
    if mark is None or entry.role != "tool":
        return content
    kind = BY_NAME[mark].marking
    assert kind is not None, f"{mark} is not a mark"
    ref = f'artifact_read("{content["tool_use_id"]}")'
    shown = kind.show(entry, readable(content.get("content")), ref, keep_tokens)
    return content if shown is None else {**content, "content": shown}


def marked_raw(entry: Entry, mark: str | None, keep_tokens: int) -> bytes:
    """:func:`marked` as JSON (the entry's own bytes when the mark does not change it)."""
    if mark is None or entry.role != "tool":
        return entry.raw
    return _ENCODE(marked(entry, mark, keep_tokens))


def _oversized(history: History, policy: ContextPolicy) -> Callable[[Entry], bool]:
    return lambda item: item.tokens > policy.excerpt_over


def _show_excerpt(entry: Entry, text: str, ref: str, keep_tokens: int) -> str | None:
    keep = keep_tokens * BYTES_PER_TOKEN
    if len(text) <= keep:
        return None
    head, tail = text[: keep * 2 // 3], text[len(text) - keep // 3 :]
    cut = len(text) - len(head) - len(tail)
    return (f"{head}\n[... {cut} characters cut by compaction; the whole result is readable "
            f"with {ref} ...]\n{tail}")  # fmt: skip


def superseded(history: History) -> set[str]:
    """Tool results made stale by a later call of the same tool with the same input."""
    calls: dict[str, tuple[str, str]] = {}
    for item in history.entries:
        if item.role == "assistant":
            for block in item.content:
                if isinstance(block, dict) and block.get("type") == "tool_use":
                    calls[block["id"]] = (block["name"], args_hash(block.get("input") or {}))
    latest: dict[tuple[str, str], str] = {}
    stale: set[str] = set()
    for item in history.entries:
        obs = item.obs_id
        key = calls.get(obs) if obs is not None else None
        if key is None:
            continue
        if key in latest:
            stale.add(latest[key])
        latest[key] = obs  # type: ignore[assignment]
    return stale


def _superseded(history: History, policy: ContextPolicy) -> Callable[[Entry], bool]:
    stale = superseded(history)
    return lambda item: item.obs_id in stale


def _show_superseded(entry: Entry, text: str, ref: str, keep_tokens: int) -> str:
    return (f"[superseded: the same call with the same input ran again later; this older result "
            f"is readable with {ref}]")  # fmt: skip


def _any(history: History, policy: ContextPolicy) -> Callable[[Entry], bool]:
    return lambda item: True


def _show_stub(entry: Entry, text: str, ref: str, keep_tokens: int) -> str:
    return f"[compacted tool result of {entry.tokens} tokens; read it in full with {ref}]"


# --- digest rungs -------------------------------------------------------------------------------


def _digesting(keep_turns: Callable[[ContextPolicy], int]) -> Apply:
    """A digest rung keeping ``keep_turns(policy)`` of the newest turns verbatim."""

    async def apply(history: History, policy: ContextPolicy, need: int,
                    digester: Digester) -> dict[str, Any]:  # fmt: skip
        covered_count = ladder.split(history.entries, keep_turns(policy))
        if covered_count == 0:
            return {"changed": False}
        covered, kept = history.entries[:covered_count], history.entries[covered_count:]
        previous = history.view.digest
        listed = [*(previous.requests if previous else ()), *ladder.requests(covered)]
        archived = previous.archived if previous else 0
        cut = ladder.over_share(listed, int(policy.budget * policy.requests_share))
        listed, dropped = listed[cut:], listed[:cut]
        text, source, fallback = await digester(previous, covered, dropped)
        digest = Digest(
            text=text, source=source, through=covered[-1].start,
            turns=(previous.turns if previous else 0) + len(ladder.turns(covered)),
            requests=tuple(listed), archived=archived + cut,
        )  # fmt: skip
        kept_ids = {e.obs_id for e in kept if e.obs_id is not None}
        marks = {k: v for k, v in history.view.marks.items() if k in kept_ids}
        history.view = View(digest=digest, marks=marks)
        history.entries = kept
        return {"changed": True, "digest": source, "through": digest.through,
                "turns": digest.turns, "text": text, "requests": list(digest.requests),
                "archived": digest.archived, "kept": marks, "fallback": fallback}  # fmt: skip

    return apply


def digest_of(event: CompactionStage) -> Digest | None:
    """The digest a recorded digest rung's stage wrote, if it wrote one."""
    rung = BY_NAME.get(event.stage)
    if rung is None or rung.marks or not event.changed or event.text is None:
        return None
    return Digest(text=event.text, source=event.digest or "mechanical", through=event.through or 0,
                  turns=event.turns, requests=tuple(event.requests or ()),
                  archived=event.archived)  # fmt: skip


def _replay_digest(history: History, event: CompactionStage) -> None:
    digest = digest_of(event)
    if digest is not None:
        history.view = View(digest=digest, marks=dict(event.kept or {}))
        history.entries = [e for e in history.entries if e.start > digest.through]


# --- the ladder ---------------------------------------------------------------------------------

RUNGS: tuple[Rung, ...] = (
    # (a) oversized tool results (over excerpt_over tokens): a head and a tail stay
    marking("excerpt", 0.60, _oversized, _show_excerpt, keeps_body=True),
    # (b) superseded tool results give way to the newest of their kind
    marking("dedupe", 0.70, _superseded, _show_superseded),
    # (c) old tool results become a one-line stub with a pointer
    marking("stub", 0.80, _any, _show_stub),
    # (d) the turns before the newest keep_turns become a digest
    Rung("digest", 0.88, _digesting(lambda policy: policy.keep_turns), _replay_digest),
    # (e) every turn becomes a digest
    Rung("reset", 0.95, _digesting(lambda policy: 0), _replay_digest),
)

BY_NAME: dict[str, Rung] = {rung.name: rung for rung in RUNGS}
STAGES: tuple[str, ...] = tuple(BY_NAME)
"""The rungs' names, in the order they run."""
DEFAULT_THRESHOLDS: tuple[float, ...] = tuple(rung.threshold for rung in RUNGS)
MARKS: tuple[str, ...] = tuple(rung.name for rung in RUNGS if rung.marks)
"""The marks a view may hold, weakest first."""
SLIMMED: frozenset[str] = frozenset(
    rung.name for rung in RUNGS if rung.marking is not None and not rung.marking.keeps_body
)
"""Marks whose results' bodies the live history does not keep."""
_STRENGTH: dict[str | None, int] = {None: 0, **{m: i for i, m in enumerate(MARKS, 1)}}


def replay(history: History, event: CompactionStage) -> None:
    """Fold a recorded ``compaction.stage`` into ``history`` (a stage of no rung known here
    changes nothing)."""
    rung = BY_NAME.get(event.stage)
    if rung is not None:
        rung.replay(history, event)

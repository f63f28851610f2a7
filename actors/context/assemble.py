"""Assembling one model call: ordered blocks, each costed in tokens.

The order is fixed, and everything that does not change between turns comes first, so the
provider can cache the prefix::

    tools                    pinned   the catalogue (sent as JSON Schema); a phased agent's
                                      has a breakpoint after the tools every phase shows
                                      (actors/phases.py)
    system: instructions     pinned   one block per manifest instruction (identity, rules, ...)
    system: configuration    pinned   the agent's own setup, rendered once at load
    system: reminders        pinned   re-asserted rules
    system: skills (pinned)  pinned   the skills the manifest pins   <- cache breakpoint 1
    system: notes                     the session's notes, as they were when the turn began
                                      (left out when memory.recall picks among them)
    system: last error       pinned   how the previous turn ended, when it ended badly
    messages: digest                  what stands for the compacted turns, + every request
    messages: history                 the turns since the digest (marks applied)
                                                                     <- cache breakpoint 2
    messages: skills                  the skills this turn selected  } in the input's
    messages: memory                  the notes this turn recalled   } message, before it
    messages: input          pinned   the person's message
    messages: this turn               the turn's own steps so far    <- cache breakpoint 3

Pinned blocks are never compacted; only digest and history are. The person's own requests are
never dropped either: the digest carries every one it covers, verbatim. A turn's recall
(actors/recall.py) changes from turn to turn, so it sits after the history's breakpoint, with
the input: choosing another skill costs the input's message, not the history's cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from actors.context.history import (
    History,
    estimate,
    json_tokens,
    text_tokens,
    wire,
)
from actors.context.rungs import marked_raw
from actors.model import joined
from actors.recall import NOTHING, Recalled
from eventstore.catalogue import ContextSlot

_BREAKPOINT = {"type": "ephemeral"}
_ENCODE = msgspec.json.Encoder().encode
_DECODE = msgspec.json.Decoder().decode
DIGEST_HEADER = (
    "[Summary of the {turns} earlier turns of this conversation, compacted to fit the context "
    "window]"
)
REQUESTS_HEADER = (
    "Earlier requests of the person, verbatim (what happened in response is summarised above):"
)


@dataclass(frozen=True)
class Block:
    label: str
    text: str
    pinned: bool = True


@dataclass(frozen=True)
class Pinned:
    """An agent's pinned blocks, rendered once when it is loaded (byte-stable across turns)."""

    system: tuple[Block, ...]
    """Instructions, configuration and reminders, in that order."""
    tools: list[dict[str, Any]]
    _tokens: tuple[int, ...] = field(init=False, repr=False)
    _tools_tokens: int = field(init=False, repr=False)
    _tools_breakpoints: int = field(init=False, repr=False)
    """Cache breakpoints inside the tools (a phased agent's, actors/phases.py)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_tokens", tuple(text_tokens(b.text) for b in self.system))
        object.__setattr__(self, "_tools_tokens", estimate(self.tools) if self.tools else 0)
        marked = sum(1 for t in self.tools if "cache_control" in t)
        object.__setattr__(self, "_tools_breakpoints", marked)


class Assembly(msgspec.Struct, frozen=True, kw_only=True):
    system: list[dict[str, Any]]
    history: bytes
    """The messages before ``tail``, as JSON array items joined by commas, not decoded: a model
    call hands them on as they are (see ``ModelRequest.history``), so a turn does not build
    objects for the whole window to send it (b"" when there are none)."""
    tail: list[dict[str, Any]]
    """The messages from the history's last one on (marked), the input and this turn's."""
    slots: list[ContextSlot]
    texts: list[str | None]
    """Each slot's text, where it has one (not the tools, the history or this turn)."""
    total: int
    """The local estimate of the whole prompt (tools, system, messages)."""
    compactable: int
    """The part of ``total`` that compaction can shrink: digest and history."""
    breakpoints: int

    @property
    def messages(self) -> list[dict[str, Any]]:
        """Every message, decoded: new objects on every call, the caller may change them."""
        return joined(self.history, self.tail)


def digest_text(history: History) -> str | None:
    digest = history.view.digest
    if digest is None:
        return None
    parts = [DIGEST_HEADER.format(turns=digest.turns), digest.text]
    if digest.requests or digest.archived:
        first = digest.archived + 1
        lines = [f"{i}. {r}" for i, r in enumerate(digest.requests, first)]
        if digest.archived:
            lines.insert(0, f"(requests 1-{digest.archived} are summarised above, not listed)")
        parts.append(REQUESTS_HEADER + "\n" + "\n".join(lines))
    return "\n\n".join(parts)


class Rendered(msgspec.Struct, frozen=True, gc=False):
    """A history rendered as messages, held as JSON (see :class:`Entry`: a session's actor keeps
    it between turns, and decoded it would be objects for the collector to walk)."""

    closed: bytes
    """The messages before the last, as JSON array items joined by commas."""
    role: str
    """The last message's role ('' when there is none)."""
    blocks: bytes
    """The last message's blocks, joined by commas (a next entry of the same role joins it)."""
    digest: str | None
    """The digest block's text (None without a digest)."""
    digest_tokens: int
    tokens: int

    def last(self) -> list[dict[str, Any]]:
        """The last message alone, decoded (a new object); [] when there is none. The others
        are :attr:`closed`."""
        return [_DECODE(self._last_json())] if self.role else []

    def messages(self) -> list[dict[str, Any]]:
        """The messages, decoded: new objects on every call, the caller may change them."""
        return joined(self.closed, self.last())

    def _last_json(self) -> bytes:
        return b'{"role":"%s","content":[%s]}' % (self.role.encode(), self.blocks)


def render(history: History, keep_tokens: int) -> Rendered:
    """The digest and the entries as messages (tool results under their marks). Consecutive
    entries of one role share a message (the API would merge them; merging here keeps tool
    results first in a user message).

    Memoised on the history: every step of a turn reads the same history unless a stage ran,
    and a warm session's next turn only adds its predecessor's entries (entries are appended,
    never changed in place; a stage that changes them replaces the view), so only those are
    rendered: a turn's assembly costs what is new, not the whole window."""
    memo = history._memo
    view, entries = history.view, history.entries
    if memo is not None and memo[1] is view and memo[2] == keep_tokens and memo[0] <= len(entries):
        done, rendered = memo[0], memo[3]
        if done == len(entries):
            return rendered  # type: ignore[no-any-return]
        closed, role = rendered.closed, rendered.role
        blocks = [rendered.blocks] if rendered.blocks else []
        digest, digest_tokens, tokens = rendered.digest, rendered.digest_tokens, rendered.tokens
    else:
        done, closed, role, blocks, tokens, digest_tokens = 0, b"", "", [], 0, 0
        digest = digest_text(history)
        if digest is not None:
            role, blocks = "user", [_ENCODE({"type": "text", "text": digest})]
            digest_tokens = text_tokens(digest)
    parts = [closed] if closed else []
    marks = view.marks
    for item in entries[done:]:
        mark = marks.get(item.obs_id) if item.obs_id is not None else None
        raw = marked_raw(item, mark, keep_tokens)
        tokens += item.tokens if mark is None else json_tokens(raw)
        said = "assistant" if item.role == "assistant" else "user"
        if raw[:1] == b"[":
            raw = raw[1:-1]  # a list of blocks (an assistant's): its items join the message's
            if not raw:
                continue  # nothing the API would take back (no empty message is ever sent)
        if said != role and role:
            parts.append(b'{"role":"%s","content":[%s]}' % (role.encode(), b",".join(blocks)))
            blocks = []
        role = said
        if raw:
            blocks.append(raw)
    rendered = Rendered(b",".join(parts), role, b",".join(blocks), digest, digest_tokens, tokens)
    history._memo = (len(entries), view, keep_tokens, rendered)
    return rendered


def _append(messages: list[dict[str, Any]], role: str, blocks: Iterable[Any]) -> None:
    """Add blocks as a message, merging with the previous one when it has the same role (the API
    would merge them too; merging here keeps tool results first in a user message). Messages
    already in the list are replaced, never changed in place (they may be memoised)."""
    if messages and messages[-1]["role"] == role:
        messages[-1] = {"role": role, "content": [*messages[-1]["content"], *blocks]}
    else:
        messages.append({"role": role, "content": list(blocks)})


def assemble(
    pinned: Pinned,
    history: History,
    text: str,
    transcript: Sequence[dict[str, Any]],
    keep_tokens: int = 300,
    recalled: Recalled = NOTHING,
) -> Assembly:
    """The request for one model call: ``text`` is the person's input, ``transcript`` the
    turn's own messages after it, ``recalled`` the turn's skills and notes."""
    slots: list[ContextSlot] = []
    texts: list[str | None] = []

    def slot(label: str, tokens: int, pinned_: bool, text: str | None = None) -> None:
        slots.append(ContextSlot(slot=len(slots), label=label, tokens=tokens, pinned=pinned_))
        texts.append(text)

    slot("tools", pinned._tools_tokens, True)
    system: list[dict[str, Any]] = [{"type": "text", "text": b.text} for b in pinned.system]
    for block, tokens in zip(pinned.system, pinned._tokens, strict=True):
        slot(block.label, tokens, True, block.text)
    stable = len(system)
    notes = None if recalled.replaces_notes else notes_text(history)
    if notes is not None:
        system.append({"type": "text", "text": notes})
        slot("notes", text_tokens(notes), False, notes)
    if history.last_error:
        system.append({"type": "text", "text": history.last_error})
        slot("last error", text_tokens(history.last_error), True, history.last_error)
    breakpoints = pinned._tools_breakpoints
    if stable:
        system[stable - 1] = {**system[stable - 1], "cache_control": _BREAKPOINT}
        breakpoints += 1

    rendered = render(history, keep_tokens)
    if rendered.digest is not None:
        slot("digest", rendered.digest_tokens, False, rendered.digest)
    slot("history", rendered.tokens, False)
    messages = rendered.last()  # the closed messages before it are sent as they are stored
    if messages and _mark_last(messages):
        breakpoints += 1
    before: list[dict[str, Any]] = []
    for label, said in (("skills", recalled.skills), ("memory", recalled.memory)):
        if said is not None:
            before.append({"type": "text", "text": said})
            slot(label, text_tokens(said), False, said)
    _append(messages, "user", [*before, {"type": "text", "text": text}])
    slot("input", text_tokens(text), True, text)
    for message in transcript:
        content = wire(message["content"])  # the turn's own blocks, as the API takes them back
        if content:
            _append(messages, message["role"], content)
    if transcript:
        slot("this turn", turn_tokens(transcript), False)
    if _mark_last(messages):
        breakpoints += 1
    total = sum(s.tokens for s in slots)
    return Assembly(system=system, history=rendered.closed, tail=messages, slots=slots,
                    texts=texts, total=total,
                    compactable=rendered.digest_tokens + rendered.tokens,
                    breakpoints=breakpoints)  # fmt: skip


def total(
    pinned: Pinned,
    history: History,
    text: str,
    transcript: Sequence[dict[str, Any]],
    keep_tokens: int = 300,
    recalled: Recalled = NOTHING,
) -> int:
    """``assemble(...).total`` without building the request: what the ladder checks after each
    rung (the request itself is built once, when the ladder is done)."""
    rendered = render(history, keep_tokens)
    notes = None if recalled.replaces_notes else notes_text(history)
    blocks = (recalled.skills, recalled.memory)
    return (
        pinned._tools_tokens
        + sum(pinned._tokens)
        + (text_tokens(notes) if notes is not None else 0)
        + (text_tokens(history.last_error) if history.last_error else 0)
        + rendered.digest_tokens
        + rendered.tokens
        + sum(text_tokens(b) for b in blocks if b is not None)
        + text_tokens(text)
        + turn_tokens(transcript)
    )


def notes_text(history: History) -> str | None:
    if not history.notes:
        return None
    listed = "\n".join(f"{i}. {n}" for i, n in enumerate(history.notes, 1))
    return "Your notes for this session (session_notes):\n" + listed


def turn_tokens(transcript: Sequence[dict[str, Any]]) -> int:
    return sum(estimate(message["content"]) for message in transcript)


def _mark_last(messages: list[dict[str, Any]]) -> bool:
    """Put a cache breakpoint on the last block of the last message (a copy of it)."""
    last = messages[-1]
    content = list(last["content"])
    if not content or not isinstance(content[-1], dict):
        return False
    content[-1] = {**content[-1], "cache_control": _BREAKPOINT}
    messages[-1] = {"role": last["role"], "content": content}
    return True

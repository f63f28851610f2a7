"""A session's history as context assembly reads it.

The log keeps every message; what the model reads is a *view* of it: the newest digest (if one
was written) standing for every turn it covers, then the entries after it, some of whose tool
observations are marked by a marking rung (excerpted, superseded or stubbed: see
:mod:`actors.context.rungs`, which also says how each mark shows a result). Marks are sticky:
once an observation is stubbed it stays stubbed, so the prompt prefix stays byte-identical from
turn to turn until the next compaction (which is what prompt caching needs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

Role = Literal["user", "assistant", "tool"]
Mark = str
"""The name of the marking rung that marked a tool result (actors/context/rungs.py)."""
_ENCODE = msgspec.json.Encoder().encode
_DECODE = msgspec.json.Decoder().decode
BYTES_PER_TOKEN = 4


def estimate(value: object) -> int:
    """A local token estimate (about 4 bytes of JSON per token); the provider's reported figure
    corrects it (see :class:`History.ratio`)."""
    return json_tokens(_ENCODE(value))


def json_tokens(raw: bytes) -> int:
    """:func:`estimate` of a value already encoded."""
    return max(1, len(raw) // BYTES_PER_TOKEN)


def text_tokens(text: str) -> int:
    return max(1, len(text.encode()) // BYTES_PER_TOKEN)


class Entry(msgspec.Struct, frozen=True, gc=False):
    """One stored history row: the person's input, an assistant message, or a tool result.

    Held as its JSON, not as decoded blocks: a node keeps up to ``DISPACH_MAX_SESSIONS``
    sessions' histories in memory between turns, and every decoded block is a dict or list the
    garbage collector walks in each full collection, a pause of the whole event loop (about five
    tracked objects per entry; 140 ms at 1,024 sessions of 40 turns). An entry is bytes, ints and
    strings: nothing to walk (``gc=False``: it can hold no reference cycle)."""

    turn_id: str
    start: int
    """The log position of its turn's ``turn.start``: turns are ordered by it."""
    role: Role
    raw: bytes
    """Its content in the form the API accepts (see :func:`wire`), as JSON. user: one text
    block; assistant: the list of blocks the model sent; tool: one ``tool_result`` block."""
    tokens: int
    obs_id: str | None = None
    """The tool_use id a tool result answers (None for other roles)."""

    @property
    def content(self) -> Any:
        """The content, decoded (a new object on each read: change it freely)."""
        return _DECODE(self.raw)


def entry(turn_id: str, start: int, role: str, content: Any) -> Entry:
    role = role if role in ("user", "assistant") else "tool"
    raw = _ENCODE(wire(content))
    obs_id = content.get("tool_use_id") if role == "tool" else None
    tokens = json_tokens(raw)
    if role == "tool" and isinstance(content.get("content"), list):
        tokens = _with_images(content["content"], tokens)
    return Entry(turn_id, start, role, raw, tokens, obs_id)  # type: ignore[arg-type]


IMAGE_TOKENS = 1600
"""What an image in a tool result costs the model, about (Anthropic: width x height / 750,
and it scales a large one down to about 1.15 megapixels), instead of its base64 read as text."""


def _with_images(blocks: list[Any], tokens: int) -> int:
    for block in blocks:
        if isinstance(block, dict) and block.get("type") == "image":
            data = str((block.get("source") or {}).get("data", ""))
            tokens += IMAGE_TOKENS - len(data) // BYTES_PER_TOKEN
    return max(1, tokens)


def slim(item: Entry) -> Entry:
    """``item`` without the body of its tool result, for one the view shows as a stub or as
    superseded (never shown again; ``artifact_read`` reads it from the log). Keeps its tokens."""
    if item.role != "tool":
        return item
    content = item.content
    if not content.get("content"):
        return item
    return msgspec.structs.replace(item, raw=_ENCODE({**content, "content": ""}))


def wire(content: Any) -> Any:
    """A stored block (or list of blocks) as the API accepts it back: every block as the model
    sent it (thinking with its signature, compaction and server tool results whole), less what
    the API would refuse: our own annotations (``invalid_json`` on a tool_use whose input did
    not parse), empty text blocks (a refusal can leave one), and thinking that never got its
    signature (another provider's reasoning, or a reply cut short) — it stays in the log."""
    if isinstance(content, list):
        return [wire(block) for block in content if _sendable(block)]
    if isinstance(content, dict) and content.get("type") == "tool_use":
        return {k: content[k] for k in ("type", "id", "name", "input") if k in content}
    return content


def _sendable(block: Any) -> bool:
    if not isinstance(block, dict):
        return True
    kind = block.get("type")
    if kind == "text":
        return bool(block.get("text")) or bool(block.get("citations"))
    if kind == "thinking":
        return bool(block.get("signature"))
    return True


class Digest(msgspec.Struct, frozen=True, kw_only=True):
    """What stands for the turns a digest or reset stage covered."""

    text: str
    source: Literal["model", "mechanical"]
    through: int
    """The ``turn.start`` position of the last turn it covers."""
    turns: int
    requests: tuple[str, ...]
    """The person's requests in the covered turns, verbatim, newest last."""
    archived: int = 0
    """How many of the earliest requests are no longer listed (the digest summarises them):
    only when the list alone would outgrow its share of the budget."""


class View(msgspec.Struct, frozen=True, kw_only=True):
    """The sticky compaction state of a session: its digest and the marks after it."""

    digest: Digest | None = None
    marks: dict[str, Mark] = msgspec.field(default_factory=dict)


@dataclass
class History:
    """What the next turn of a session reads besides its own input: held by the session's actor
    between turns, rebuilt from the session's snapshot when the actor is activated."""

    entries: Sequence[Entry] = ()
    """A tuple while a session's actor holds it between turns: a tuple of untracked entries is
    itself untracked by the collector after its first pass (a list would be walked, entry by
    entry, in every full collection); a turn's copy may be a list."""
    view: View = field(default_factory=View)
    notes: tuple[str, ...] = ()
    last_error: str | None = None
    """One line about the previous turn when it ended badly (shown to the model, pinned)."""
    ratio: float = 1.0
    """Reported prompt tokens / local estimate, smoothed over this session's model calls."""
    calibrated: bool = False
    _memo: tuple[int, View, int, Any] | None = field(default=None, repr=False)

    def copy(self) -> History:
        """A copy the caller may change (entries and view are replaced, never changed in place,
        so the rendered history is shared until one of them is)."""
        return History(list(self.entries), self.view, self.notes, self.last_error, self.ratio,
                       self.calibrated, self._memo)  # fmt: skip

    def calibrate(self, estimated: int, reported: int) -> None:
        """Fold one model call's reported prompt size into the correction ratio (an exponential
        average; a figure off by more than 2x either way is ignored as an outlier)."""
        if estimated <= 0 or reported <= 0:
            return
        ratio = reported / estimated
        if not 0.5 <= ratio <= 2.0:
            return
        self.ratio = ratio if not self.calibrated else 0.6 * ratio + 0.4 * self.ratio
        self.calibrated = True

    def corrected(self, tokens: int) -> int:
        return int(tokens * self.ratio + 0.999)


def readable(body: Any) -> str:
    """A tool result's content as the text an excerpt, a stub or a digest keeps: a string as
    it is; of content blocks, the text of each, and a note for the others (an image's data is
    not text)."""
    if isinstance(body, str):
        return body
    if not isinstance(body, list):
        return _ENCODE(body).decode()
    return "\n".join(
        str(b.get("text", "")) if b.get("type") == "text" else f"[{b.get('type')} block]"
        for b in body
        if isinstance(b, dict)
    )

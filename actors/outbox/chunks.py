"""A reply cut into the messages a channel can hold.

``limit`` is counted by ``measure``: Python's ``len`` (code points) by default, ``utf16_len`` for
Telegram, which counts UTF-16 code units (an emoji outside the Basic Multilingual Plane is two).
``measure`` must be monotonic (a longer string never measures less) and count every character as
at least one.

Where a chunk ends, best first: a paragraph break, a line break, other whitespace, anywhere. A
break that would leave a chunk under 60% of the limit is passed over for a later one, so a short
first paragraph does not cost a whole message; if no break reaches 60%, the latest break wins, and
with no whitespace at all the text is cut at the limit. A cut never separates what draws as one
character, as far as we can tell without a grapheme library: a base and its combining marks, an
emoji and its modifiers, variation selectors, tags or ZWJ partners, the two halves of a flag
(rarer clusters, such as conjoining Hangul jamo, may still be cut).

The whitespace at a break is dropped, except the indentation of the line after a line break (it is
code, often). A chunk that ends inside a ``` or ~~~ fence is closed at its end and the fence is
reopened, with its info string, at the start of the next chunk; room is kept for both (unless
they would take over a quarter of the limit: then a tiny limit goes to the text instead). So the
chunks, minus those repairs and the whitespace at the breaks, are the text (``spans`` says
exactly where each comes from). No chunk is empty or blank; a blank text is no chunks.
"""

from __future__ import annotations

import bisect
import re
import unicodedata
from collections.abc import Callable
from typing import Literal, NamedTuple

import msgspec

MIN_FILL = 0.6
"""A break leaving a chunk shorter than this share of the limit is taken only as a last resort."""

_RUN = re.compile(r"\s+")
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})(.*)")
_GLUE = frozenset("\u200d\u200c\ufe0e\ufe0f")
_ZWJ = "\u200d"


def utf16_len(text: str) -> int:
    """Telegram's length of ``text``: UTF-16 code units."""
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


class Span(msgspec.Struct, frozen=True):
    """One chunk: ``head + text[start:end] + tail``, where ``head`` reopens a fence the previous
    chunk left open and ``tail`` closes one this chunk leaves open."""

    start: int
    end: int
    head: str = ""
    tail: str = ""


def split(text: str, limit: int, measure: Callable[[str], int] = len) -> list[str]:
    """The chunks of ``text``, each at most ``limit`` by ``measure``, in order."""
    return [s.head + text[s.start : s.end] + s.tail for s in spans(text, limit, measure)]


def spans(text: str, limit: int, measure: Callable[[str], int] = len) -> list[Span]:
    """Where each chunk of ``split`` comes from. ValueError if a single character does not fit
    in ``limit``."""
    if limit < 1:
        raise ValueError(f"a chunk limit must be at least 1, got {limit}")
    return _Splitter(text, limit, measure).spans()


class _Fence(NamedTuple):
    marker: str
    info: str


class _Line(NamedTuple):
    start: int
    kind: Literal["open", "close", ""]
    after: _Fence | None
    """The fence open once this line has been read."""


class _Splitter:
    def __init__(self, text: str, limit: int, measure: Callable[[str], int]) -> None:
        self.text, self.limit, self.measure = text, limit, measure
        self.stop = len(text.rstrip())
        self.lines = _lines(text)
        self.starts = [line.start for line in self.lines]

    def spans(self) -> list[Span]:
        text, out = self.text, list[Span]()
        p = _resume(text, 0)
        while p < self.stop:
            p = self._skip_long_indent(p)
            head = self._repair(_reopen(self._fence_at(p)))
            # (Every character measures at least 1: a rest longer than the limit cannot fit.)
            if self.stop - p <= self.limit and self._fits(head + text[p : self.stop]):
                out.append(Span(p, self.stop, head))
                break
            cut = self._cut(p, head, "")
            if cut is None and head:
                head = ""  # not one character fits beside the repair: give it up
                cut = self._cut(p, head, "")
            if cut is None:
                raise ValueError(f"a chunk limit of {self.limit} cannot hold {text[p]!r}")
            b, nxt = cut
            tail = self._repair(_close(self._fence_at(b)), head)
            if tail and not self._fits(head + text[p:b] + tail):
                # Cut again with room kept for the closing fence.
                cut = self._cut(p, head, tail) or cut
                b, nxt = cut
                tail = _close(self._fence_at(b))
                if not self._fits(head + text[p:b] + tail):
                    tail = ""  # a longer fence than the one reserved for: left unclosed
            out.append(Span(p, b, head, tail))
            p = nxt
        return out

    def _cut(self, p: int, head: str, tail: str) -> tuple[int, int] | None:
        """Where the chunk starting at ``p`` ends and where the next begins, or None if not even
        one character fits beside the repairs."""
        text = self.text
        end = self._window(p, head, tail)
        if end == p:
            return None
        best: dict[int, tuple[int, int]] = {}
        latest = stranding = None
        for found in _RUN.finditer(text, p, end + 1):
            s = found.start()
            if s == p:
                continue
            # The window's end may cut the last run short: read it whole.
            run = found if found.end() <= end else (_RUN.match(text, s) or found)
            newlines = run.group().count("\n")
            nxt = s + run.group().rfind("\n") + 1 if newlines else run.end()
            if self._strands_a_fence_line(s, nxt, newlines):
                stranding = (s, nxt)  # still better than a cut through a word or a fence line
                continue
            rank = 0 if newlines >= 2 else 1 if newlines else 2
            best[rank] = latest = (s, nxt)
        for rank in (0, 1, 2):
            if rank in best and self._full_enough(head + text[p : best[rank][0]]):
                return best[rank]
        if latest is not None or stranding is not None:
            return latest or stranding
        start = _RUN.match(text, p)
        b = _grapheme_floor(text, p if start is None else start.end(), end)
        return b, b

    def _window(self, p: int, head: str, tail: str) -> int:
        """The largest ``end`` with ``head + text[p:end] + tail`` within the limit."""
        lo, hi = p, min(self.stop, p + self.limit)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._fits(head + self.text[p:mid] + tail):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _strands_a_fence_line(self, s: int, nxt: int, newlines: int) -> bool:
        """A break that would strand a fence line: inside one, just after an opening one (an
        empty block), or just before a closing one (an empty block in the next chunk)."""
        before = self.lines[bisect.bisect_right(self.starts, s) - 1]
        if not newlines:
            return before.kind != ""
        after = self.lines[bisect.bisect_right(self.starts, nxt) - 1]
        return before.kind == "open" or (after.start == nxt and after.kind == "close")

    def _skip_long_indent(self, p: int) -> int:
        """Drop leading whitespace at ``p`` that would take a large part of a chunk."""
        q = _RUN.match(self.text, p)
        if q is not None and self.measure(q.group()) > self.limit // 4:
            return q.end()
        return p

    def _fence_at(self, position: int) -> _Fence | None:
        """The fence open at ``position``: after every line that starts before it."""
        index = bisect.bisect_left(self.starts, position) - 1
        return self.lines[index].after if index >= 0 else None

    def _repair(self, repair: str, other: str = "") -> str:
        # Repairs may take at most a quarter of a chunk: past that, a small limit is better spent
        # on the text itself (and a drawn character of a dozen code units still fits).
        return repair if self.measure(repair + other) <= self.limit // 4 else ""

    def _fits(self, chunk: str) -> bool:
        return self.measure(chunk) <= self.limit

    def _full_enough(self, chunk: str) -> bool:
        return self.measure(chunk) >= MIN_FILL * self.limit


def _lines(text: str) -> list[_Line]:
    """Every line with the fence it opens or closes (CommonMark's rules, simplified)."""
    out: list[_Line] = []
    fence: _Fence | None = None
    start = 0
    for line in text.split("\n"):
        kind: Literal["open", "close", ""] = ""
        found = _FENCE.fullmatch(line)
        if found is not None:
            marker, rest = found.group(1), found.group(2).strip()
            if fence is None and not (marker[0] == "`" and "`" in rest):
                fence, kind = _Fence(marker, rest), "open"
            elif (fence is not None and marker[0] == fence.marker[0]
                  and len(marker) >= len(fence.marker) and not rest):  # fmt: skip
                fence, kind = None, "close"
        out.append(_Line(start, kind, fence))
        start += len(line) + 1
    return out


def _reopen(fence: _Fence | None) -> str:
    return "" if fence is None else f"{fence.marker}{fence.info}\n"


def _close(fence: _Fence | None) -> str:
    return "" if fence is None else f"\n{fence.marker}"


def _resume(text: str, p: int) -> int:
    """Where text resumes after the whitespace at ``p``: the start of the first non-blank line."""
    run = _RUN.match(text, p)
    if run is None:
        return p
    return p + run.group().rfind("\n") + 1


def _grapheme_floor(text: str, first: int, end: int) -> int:
    """``end``, moved back so the cut does not split a character as drawn, but not to or before
    ``first`` (the chunk's first visible character): a window that is one drawn character is
    cut through it."""
    b = end
    while b > first and _glued(text, b):
        b -= 1
    return b if b > first else end


def _glued(text: str, i: int) -> bool:
    """Whether ``text[i]`` draws together with ``text[i - 1]``."""
    if i >= len(text) or i == 0:
        return False
    here, before = text[i], text[i - 1]
    if before == _ZWJ or here in _GLUE or (before == "\r" and here == "\n"):
        return True
    if unicodedata.category(here) in ("Mn", "Me", "Mc"):
        return True
    code = ord(here)
    if 0x1F3FB <= code <= 0x1F3FF or 0xE0020 <= code <= 0xE007F:  # skin tones, tag characters
        return True
    if _regional(here) and _regional(before):
        # Flags are pairs of regional indicators: glued if ``before`` opens a pair.
        count = 0
        while i - count - 1 >= 0 and _regional(text[i - count - 1]):
            count += 1
        return count % 2 == 1
    return False


def _regional(char: str) -> bool:
    return 0x1F1E6 <= ord(char) <= 0x1F1FF

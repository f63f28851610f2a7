"""Chunking replies for channels: table tests, then the invariants over random texts."""

from __future__ import annotations

import itertools
import os
import random
import re
import unicodedata
from collections.abc import Callable

import pytest

from actors.outbox.chunks import Span, spans, split, utf16_len

FAMILY = "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466"  # one drawn character
THUMB = "\U0001f44d\U0001f3fd"
FLAG = "\U0001f1e9\U0001f1ea"
GRIN = "\U0001f600"


@pytest.mark.parametrize("text", ["", " ", "\n\n\t  \n"])
def test_a_blank_text_is_no_chunks(text: str) -> None:
    assert split(text, 100) == []


@pytest.mark.parametrize(
    ("text", "limit", "chunks"),
    [
        ("hello", 100, ["hello"]),
        ("\n\n  hello  \n\n", 100, ["  hello"]),  # blank lines dropped, indentation kept
        ("a" * 100, 100, ["a" * 100]),  # exactly the limit
        # a paragraph break wins over a later line break
        ("a" * 70 + "\n\n" + "b" * 20 + "\nc" + "c" * 30, 100,
         ["a" * 70, "b" * 20 + "\nc" + "c" * 30]),
        # a paragraph break under 60% is passed over for a later line break
        ("a" * 30 + "\n\n" + "b" * 60 + "\n" + "c" * 50, 100,
         ["a" * 30 + "\n\n" + "b" * 60, "c" * 50]),
        # ... and for later whitespace
        ("a" * 30 + "\n" + "b " * 40 + "c" * 50, 100,
         ["a" * 30 + "\n" + "b " * 34 + "b", "b " * 5 + "c" * 50]),
        # under 60% everywhere: the latest break, not a cut through the word
        ("short\n\n" + "x" * 150, 100, ["short", "x" * 100, "x" * 50]),
        # no whitespace at all: cut at the limit
        ("x" * 250, 100, ["x" * 100, "x" * 100, "x" * 50]),
        # whitespace at a break is dropped
        ("a" * 90 + "   \n\n\n   " + "b" * 20, 100, ["a" * 90, "   " + "b" * 20]),
        ("a" * 90 + "      " + "b" * 20, 100, ["a" * 90, "b" * 20]),
    ],
)  # fmt: skip
def test_where_chunks_break(text: str, limit: int, chunks: list[str]) -> None:
    assert split(text, limit) == chunks


def test_a_cut_keeps_drawn_characters_whole() -> None:
    accented = "e\u0301" * 30  # 60 code points, 30 drawn characters
    assert [len(c) for c in split(accented, 25)] == [24, 24, 12]
    for cluster in (FAMILY, THUMB, FLAG, "\u2764\ufe0f"):
        text = cluster * 40
        for limit in range(len(cluster), len(cluster) * 3 + 1):
            assert all(len(c) % len(cluster) == 0 for c in split(text, limit)), (cluster, limit)


def test_telegram_counts_utf16_code_units() -> None:
    assert utf16_len(GRIN) == 2
    assert utf16_len("a\u00e9\u4e2d" + FAMILY) == 3 + 11
    text = GRIN * 3000
    chunks = split(text, 4096, utf16_len)
    assert [len(c) for c in chunks] == [2048, 952]
    assert max(utf16_len(c) for c in chunks) <= 4096
    assert len(split(text, 4096)) == 1  # by code points it all fits


def test_a_code_fence_is_closed_and_reopened() -> None:
    code = "\n".join(f"    line_{i} = {i}" for i in range(12))
    text = f"Here:\n\n```python\n{code}\n```\n\nDone."
    chunks = split(text, 120)
    assert chunks[0].endswith("\n```")
    assert chunks[1].startswith("```python\n    line_")  # reopened, indentation kept
    assert chunks[-1].endswith("```\n\nDone.") or chunks[-1] == "Done."
    assert all(len(c) <= 120 for c in chunks)
    assert all(_open_fence(c) is None for c in chunks)


def test_no_chunk_ends_right_after_a_fence_opens_or_starts_with_its_close() -> None:
    text = "a" * 80 + "\n```\n" + "b" * 30 + "\n```\n" + "c" * 10
    for chunk in split(text, 100):
        assert not chunk.endswith("```\n```")
        assert not re.match(r"```\n```", chunk)


def test_tildes_and_longer_fences() -> None:
    text = "~~~~ sh\n" + "echo hi\n" * 30 + "~~~\nstill inside\n~~~~\nafter"
    chunks = split(text, 100)
    assert chunks[0].startswith("~~~~ sh\n") and chunks[0].endswith("\n~~~~")
    assert all(c.startswith("~~~~sh\n") for c in chunks[1:-1])
    assert all(_open_fence(c) is None for c in chunks[:-1])


def test_impossible_limits() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        split("hi", 0)
    with pytest.raises(ValueError, match="cannot hold"):
        split(GRIN, 1, utf16_len)
    # A fence repair that would take more than half a tiny chunk is left out instead.
    assert all(len(c) <= 12 for c in split("```python\n" + "x = 1\n" * 10 + "```", 12))


# --- invariants over random texts -----------------------------------------------------------------


def test_invariants_over_random_texts() -> None:
    seed = int(os.environ.get("DISPACH_SEED") or random.randrange(2**32))
    print(f"DISPACH_SEED={seed}")
    rng = random.Random(seed)
    for case in range(250):
        text = _random_text(rng)
        limit = rng.choice([8, 20, 37, 64, 100, 160, 500, 4096])
        measure: Callable[[str], int] = rng.choice([len, utf16_len])
        context = f"DISPACH_SEED={seed} case={case} limit={limit} measure={measure.__name__}"
        _check(text, limit, measure, context)


def _check(text: str, limit: int, measure: Callable[[str], int], context: str) -> None:
    found = spans(text, limit, measure)
    chunks = split(text, limit, measure)
    assert chunks == [s.head + text[s.start : s.end] + s.tail for s in found], context
    if not text.strip():
        assert chunks == [], context
        return
    assert chunks, context
    for chunk in chunks:
        assert measure(chunk) <= limit, (context, chunk)
        assert chunk.strip(), (context, chunk)
    # The text is the chunks' sources with only whitespace between them.
    edges = [0, *(p for s in found for p in (s.start, s.end)), len(text)]
    for gap_start, gap_end in zip(edges[::2], edges[1::2], strict=True):
        assert not text[gap_start:gap_end].strip(), (context, text[gap_start:gap_end])
    for before, after in itertools.pairwise(found):
        assert before.end <= after.start, context
        if before.end == after.start and limit >= 16:
            # A cut, not a break: never inside a drawn character (that fits in a chunk).
            assert not _starts_glued(text, after.start), (context, text[after.start - 2 :][:4])
    if limit >= 100:
        # Room for repairs: every chunk but the last leaves no fence open, and each repair
        # reopens the fence that was open.
        for span, chunk in zip(found[:-1], chunks, strict=False):
            assert _open_fence(chunk) is None, (context, chunk)
            assert span.tail == "" or span.tail.startswith("\n"), context
        for span in found:
            assert span.head == "" or re.fullmatch(r"(`{3,}|~{3,})[^\n]*\n", span.head), context


def _starts_glued(text: str, i: int) -> bool:
    return (
        unicodedata.category(text[i]) in ("Mn", "Me", "Mc")
        or text[i] in "\u200d\ufe0f"
        or text[i - 1] == "\u200d"
        or 0x1F3FB <= ord(text[i]) <= 0x1F3FF
    )


def _open_fence(chunk: str) -> str | None:
    """The marker of a fence ``chunk`` leaves open, or None."""
    fence: str | None = None
    for line in chunk.split("\n"):
        found = re.fullmatch(r" {0,3}(`{3,}|~{3,})(.*)", line)
        if found is None:
            continue
        marker, rest = found.group(1), found.group(2).strip()
        if fence is None and not (marker[0] == "`" and "`" in rest):
            fence = marker
        elif fence and marker[0] == fence[0] and len(marker) >= len(fence) and not rest:
            fence = None
    return fence


CLUSTERS = [GRIN, FAMILY, THUMB, FLAG, "\u2764\ufe0f", "e\u0301", "\u4e2d\u6587", "n\u0303a\u0301"]


def _random_text(rng: random.Random) -> str:
    def word() -> str:
        roll = rng.random()
        if roll < 0.05:
            return rng.randbytes(rng.randint(20, 300)).hex()  # a long word
        if roll < 0.15:
            return rng.choice(CLUSTERS) * rng.randint(1, 30)
        return rng.randbytes(8).hex()[: rng.randint(1, 12)]

    def paragraph() -> str:
        words = [word() for _ in range(rng.randint(1, 60))]
        return "".join(w + rng.choice([" ", " ", " ", "  ", "\n", "\t"]) for w in words).strip()

    def fence() -> str:
        marker = rng.choice(["```", "```", "~~~", "````"])
        info = rng.choice(["", "python", " sh", "json title"])
        lines = [rng.choice(["", "    ", "        "]) + paragraph()[:120]
                 for _ in range(rng.randint(0, 20))]  # fmt: skip
        return "\n".join([marker + info, *lines, marker])

    blocks = [fence() if rng.random() < 0.25 else paragraph() for _ in range(rng.randint(0, 6))]
    seps = ["\n\n", "\n", "\n\n\n", " \n \n", "\r\n\r\n"]
    return rng.choice(["", "\n", "  "]) + "".join(b + rng.choice(seps) for b in blocks)


def test_spans_are_what_split_renders() -> None:
    text = "```\n" + "x\n" * 80 + "```"
    found = spans(text, 50)
    assert isinstance(found[0], Span)
    assert found[0].head == "" and found[0].tail == "\n```"
    assert found[1].head == "```\n"

"""The pure core of context assembly: blocks and cache breakpoints, marks, the ladder's decisions,
and ``prepare`` run end to end with the mechanical digester (no model, no store).

Folding the ``compaction.stage`` events ``prepare`` records over the history it started from
must give the very view it left behind: that is what replaying a past turn relies on.
"""

from __future__ import annotations

import gc
import itertools
from typing import Any, cast

import msgspec
import pytest

from actors.context import ladder, rungs
from actors.context.assemble import (
    DIGEST_HEADER,
    REQUESTS_HEADER,
    Assembly,
    Block,
    Pinned,
    assemble,
    digest_text,
    render,
    total,
)
from actors.context.compact import Digester, Prepared, mechanical, prepare
from actors.context.history import (
    BYTES_PER_TOKEN,
    IMAGE_TOKENS,
    Digest,
    Entry,
    History,
    View,
    entry,
    estimate,
    slim,
    text_tokens,
)
from actors.context.ladder import FLOOR_MARGIN
from actors.context.policy import ContextPolicy
from actors.context.rungs import DEFAULT_THRESHOLDS, STAGES, marked
from eventstore.catalogue import CompactionStage, ContextPressure
from eventstore.event import decode_data, encode_data

BREAKPOINT = {"type": "ephemeral"}
TOOL = {
    "name": "lookup",
    "description": "Look a thing up.",
    "input_schema": {"type": "object", "properties": {"q": {"type": "integer"}}},
}
PINNED = Pinned(
    system=(
        Block("instructions", "You are a careful assistant."),
        Block("configuration", "About you, as configured: agent 'x'."),
        Block("reminders", "Never promise what a tool did not confirm."),
    ),
    tools=[TOOL],
)
PINNED_LABELS = ["instructions", "configuration", "reminders"]


# --- building histories ----------------------------------------------------------------------


def user(turn: str, start: int, text: str) -> Entry:
    return entry(turn, start, "user", {"type": "text", "text": text})


def call(turn: str, start: int, call_id: str, args: dict[str, Any], name: str = "lookup",
         text: str = "Looking.") -> Entry:  # fmt: skip
    blocks = [{"type": "text", "text": text},
              {"type": "tool_use", "id": call_id, "name": name, "input": args}]  # fmt: skip
    return entry(turn, start, "assistant", blocks)


def result(turn: str, start: int, call_id: str, body: Any) -> Entry:
    content = {"type": "tool_result", "tool_use_id": call_id, "content": body, "is_error": False}
    return entry(turn, start, "tool", content)


def reply(turn: str, start: int, text: str) -> Entry:
    return entry(turn, start, "assistant", [{"type": "text", "text": text}])


def turn(i: int, size: int = 400, args: dict[str, Any] | None = None, talk: int = 20,
         request: str | None = None) -> list[Entry]:  # fmt: skip
    """Turn ``i`` (its turn.start at position 10*i): a request, one lookup call ``c<i>`` whose
    result is ``size`` characters, and a reply ``talk`` characters long."""
    t, start = f"t{i}", i * 10
    return [
        user(t, start, request if request is not None else f"request {i}"),
        call(t, start, f"c{i}", args if args is not None else {"q": i}),
        result(t, start, f"c{i}", str(i % 10) * size),
        reply(t, start, f"answer {i} " + "y" * talk),
    ]


def dump(value: object) -> bytes:
    return msgspec.json.encode(value)


def cache_marks(assembly: Assembly) -> list[tuple[str, int, int]]:
    """Where the cache breakpoints are: ("system", block) or ("messages", message, block)."""
    found = [("system", i, -1) for i, b in enumerate(assembly.system) if "cache_control" in b]
    for m, message in enumerate(assembly.messages):
        for b, block in enumerate(message["content"]):
            if isinstance(block, dict) and "cache_control" in block:
                found.append(("messages", m, b))
    return found


def person_requests(history: History) -> list[str]:
    """Every request of the person the history still holds: the digest's, then the entries'."""
    digest = history.view.digest
    return [*(digest.requests if digest else ()), *ladder.requests(history.entries)]


# --- assemble: blocks, slots, breakpoints ----------------------------------------------------


def full_history() -> History:
    digest = Digest(text="They asked about lookups.", source="mechanical", through=0, turns=1,
                    requests=("request 0",))  # fmt: skip
    return History(
        entries=[*turn(1), *turn(2)],
        view=View(digest=digest, marks={"c1": "stub"}),
        notes=("likes tea", "lives in Berlin"),
        last_error="The previous turn of this conversation ended early with timeout.",
    )


def test_slots_follow_the_documented_block_order_with_their_pinned_flags() -> None:
    transcript = [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c9", "name": "lookup",
                                           "input": {"q": 9}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c9",
                                      "content": "nine", "is_error": False}]},
    ]  # fmt: skip
    built = assemble(PINNED, full_history(), "What now?", transcript)
    assert [(s.label, s.pinned) for s in built.slots] == [
        ("tools", True),
        ("instructions", True),
        ("configuration", True),
        ("reminders", True),
        ("notes", False),
        ("last error", True),
        ("digest", False),
        ("history", False),
        ("input", True),
        ("this turn", False),
    ]
    assert [s.slot for s in built.slots] == list(range(len(built.slots)))
    assert all(s.tokens > 0 for s in built.slots)
    assert built.total == sum(s.tokens for s in built.slots)
    by_label = {s.label: s.tokens for s in built.slots}
    assert built.compactable == by_label["digest"] + by_label["history"]


def test_without_notes_error_digest_or_transcript_only_their_slots_go() -> None:
    built = assemble(PINNED, History(), "Hello", [])
    assert [s.label for s in built.slots] == ["tools", *PINNED_LABELS, "history", "input"]
    assert {s.label: s.tokens for s in built.slots}["history"] == 0
    assert built.compactable == 0
    hello = {"type": "text", "text": "Hello", "cache_control": BREAKPOINT}
    assert built.messages == [{"role": "user", "content": [hello]}]


def test_system_blocks_are_the_pinned_texts_then_the_notes_then_the_last_error() -> None:
    history = full_history()
    built = assemble(PINNED, history, "What now?", [])
    texts = [b["text"] for b in built.system]
    assert texts[:3] == [b.text for b in PINNED.system]
    assert texts[3].startswith("Your notes for this session (session_notes):\n")
    assert "1. likes tea\n2. lives in Berlin" in texts[3]
    assert texts[4] == history.last_error
    assert len(texts) == 5


def test_messages_are_digest_then_history_with_marks_then_input_then_this_turn() -> None:
    history = full_history()
    transcript = [{"role": "assistant", "content": [{"type": "text", "text": "Thinking."}]}]
    built = assemble(PINNED, history, "What now?", transcript)
    # The digest and t1's request share a user message: the roles alternate, as the API wants.
    assert [m["role"] for m in built.messages] == ["user", "assistant"] * 5
    first = built.messages[0]["content"]
    assert first[0]["text"].startswith("[Summary of the 1 earlier turns")
    assert first[1]["text"] == "request 1"
    stubbed = built.messages[2]["content"][0]
    assert stubbed["tool_use_id"] == "c1" and stubbed["content"].startswith("[compacted tool")
    assert built.messages[4]["content"] == [{"type": "text", "text": "request 2"}]
    assert built.messages[6]["content"][0]["content"] == "2" * 400  # unmarked
    assert built.messages[8]["content"] == [{"type": "text", "text": "What now?"}]
    assert built.messages[9]["content"][0]["text"] == "Thinking."


@pytest.mark.parametrize("with_history", [False, True])
@pytest.mark.parametrize("with_transcript", [False, True])
@pytest.mark.parametrize("with_extras", [False, True])
def test_cache_breakpoints_sit_on_the_stable_prefix_the_history_end_and_the_last_block(
    with_history: bool, with_transcript: bool, with_extras: bool
) -> None:
    history = History(entries=[*turn(1), *turn(2)] if with_history else [])
    if with_extras:
        history.notes = ("a note",)
        history.last_error = "The previous turn ended early."
    transcript = (
        [{"role": "assistant", "content": [{"type": "text", "text": "Partial."}]}]
        if with_transcript else []
    )  # fmt: skip
    built = assemble(PINNED, history, "Go on", transcript)
    marks = cache_marks(built)
    assert len(marks) <= 4  # the Messages API allows four
    assert built.breakpoints == len(marks)
    # the last stable system block: never the notes or the last error after it
    assert [m for m in marks if m[0] == "system"] == [("system", len(PINNED.system) - 1, -1)]
    last = built.messages[-1]["content"]
    assert last[-1]["cache_control"] == BREAKPOINT
    if with_history:
        # the end of the history: the last history message is t2's final reply
        end = built.messages[7]
        assert end["role"] == "assistant" and end["content"][-1]["text"].startswith("answer 2")
        assert end["content"][-1]["cache_control"] == BREAKPOINT
        assert built.breakpoints == 3
    else:
        assert built.breakpoints == 2


def test_a_history_that_ends_on_a_tool_result_keeps_its_breakpoint_before_the_input() -> None:
    history = History(entries=[user("t1", 0, "look"), call("t1", 0, "c1", {"q": 1}),
                               result("t1", 0, "c1", "found")])  # fmt: skip
    built = assemble(PINNED, history, "and then?", [])
    last = built.messages[-1]
    assert last["role"] == "user"
    assert [b["type"] for b in last["content"]] == ["tool_result", "text"]
    assert last["content"][0]["cache_control"] == BREAKPOINT
    assert last["content"][1]["cache_control"] == BREAKPOINT
    assert built.breakpoints == 3


def test_no_pinned_system_blocks_means_no_system_breakpoint() -> None:
    bare = Pinned(system=(), tools=[])
    built = assemble(bare, History(entries=turn(1)), "hi", [])
    assert built.system == []
    assert [m[0] for m in cache_marks(built)] == ["messages", "messages"]
    assert built.slots[0].label == "tools" and built.slots[0].tokens == 0


def test_system_and_tools_are_byte_identical_across_calls() -> None:
    tools_before = dump(PINNED.tools)
    calls = [
        assemble(PINNED, History(), "first", []),
        assemble(PINNED, History(entries=turn(1), notes=("n",)), "second", []),
        assemble(PINNED, full_history(), "third",
                 [{"role": "assistant", "content": [{"type": "text", "text": "x"}]}]),
        assemble(PINNED, History(entries=[*turn(1), *turn(2), *turn(3)],
                                 view=View(marks={"c2": "excerpt"})), "fourth", []),
    ]  # fmt: skip
    stable = {dump(c.system[: len(PINNED.system)]) for c in calls}
    assert len(stable) == 1
    assert {tuple(s.tokens for s in c.slots[:4]) for c in calls} == {
        tuple(s.tokens for s in calls[0].slots[:4])
    }
    assert dump(PINNED.tools) == tools_before


def test_assembling_twice_mutates_neither_the_memo_nor_the_earlier_request() -> None:
    history = History(entries=[*turn(1), *turn(2)], view=View(marks={"c1": "stub"}))
    first = assemble(PINNED, history, "first input", [])
    memo = history._memo
    assert memo is not None
    memo_bytes, first_bytes = dump(memo[2]), dump(first.messages)
    assert b"cache_control" not in memo_bytes
    transcript = [
        {"role": "assistant", "content": [{"type": "text", "text": "Let me see."}]},
        {"role": "user", "content": [{"type": "text", "text": "(an interjection)"}]},
    ]
    second = assemble(PINNED, history, "second input", transcript)
    third = assemble(PINNED, history, "third input", [])
    assert history._memo is memo  # the same history: read from the memo, not rebuilt
    assert dump(memo[2]) == memo_bytes
    assert dump(first.messages) == first_bytes
    assert second.messages[-1]["content"][-1]["text"] == "(an interjection)"
    assert third.messages == [
        *first.messages[:-1],
        {"role": "user", "content": [{"type": "text", "text": "third input",
                                      "cache_control": BREAKPOINT}]},
    ]  # fmt: skip


def test_a_new_view_or_a_new_entry_is_read_afresh_not_from_the_memo() -> None:
    history = History(entries=turn(1))
    before = assemble(PINNED, history, "x", [])
    history.view = View(marks={"c1": "stub"})
    stubbed = assemble(PINNED, history, "x", [])
    assert b"[compacted tool result" not in dump(before.messages)
    assert b"[compacted tool result" in dump(stubbed.messages)
    history.entries = [*history.entries, *turn(2)]
    grown = assemble(PINNED, history, "x", [])
    assert b"answer 2" in dump(grown.messages)
    assert grown.total > stubbed.total


def test_the_digest_block_carries_every_request_verbatim() -> None:
    asked = ("Book a table for 4 at 8pm", 'Actually:\n  make it *5*, "window" seat', "Danke!")
    digest = Digest(text="Restaurant booking in progress.", source="model", through=30, turns=3,
                    requests=asked)  # fmt: skip
    built = assemble(PINNED, History(view=View(digest=digest)), "status?", [])
    text = built.messages[0]["content"][0]["text"]
    assert text.startswith(DIGEST_HEADER.format(turns=3))
    assert "Restaurant booking in progress." in text
    assert REQUESTS_HEADER in text
    for number, request in enumerate(asked, 1):
        assert f"{number}. {request}" in text
    assert [s.label for s in built.slots if s.label == "digest"] == ["digest"]


# --- history: marks, calibration, the fold ---------------------------------------------------


def test_an_excerpt_keeps_a_head_and_a_tail_and_points_at_the_whole() -> None:
    body = "H" * 2000 + "M" * 6000 + "T" * 2000
    item = result("t1", 0, "toolu_01", body)
    shown = marked(item, "excerpt", keep_tokens=300)
    keep = 300 * BYTES_PER_TOKEN
    head, tail = keep * 2 // 3, keep // 3
    text = shown["content"]
    assert text.startswith("H" * head + "\n[")
    assert text.endswith("]\n" + "T" * tail)
    assert f"[... {len(body) - head - tail} characters cut by compaction" in text
    assert 'artifact_read("toolu_01")' in text
    assert "M" not in text
    assert {k: v for k, v in shown.items() if k != "content"} == {
        "type": "tool_result", "tool_use_id": "toolu_01", "is_error": False,
    }  # fmt: skip
    assert item.content["content"] == body  # the entry itself is never changed


def test_an_excerpt_of_a_short_result_is_the_result_and_blocks_are_read_as_text() -> None:
    short = result("t1", 0, "c1", "x" * 100)
    assert marked(short, "excerpt", keep_tokens=300) == short.content
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "Q" * 40_000}}  # fmt: skip
    blocks = [{"type": "text", "text": "y" * 3000}, image]
    shown = marked(result("t1", 0, "c2", blocks), "excerpt", keep_tokens=100)
    assert shown["content"].startswith("yyy")
    assert shown["content"].endswith("[image block]")  # an image's data is never cut into text
    assert "Q" not in shown["content"]
    assert 'artifact_read("c2")' in shown["content"]


def test_an_image_in_a_tool_result_counts_as_an_image_not_as_its_base64() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "Q" * 400_000}}  # fmt: skip
    with_image = result("t1", 0, "c3", [{"type": "text", "text": "a chart"}, image])
    assert IMAGE_TOKENS <= with_image.tokens < IMAGE_TOKENS + 100


def test_dedupe_and_stub_replace_the_body_with_a_pointer() -> None:
    item = result("t1", 0, "toolu_07", "z" * 4000)
    deduped = marked(item, "dedupe", keep_tokens=300)["content"]
    assert deduped.startswith("[superseded: the same call with the same input ran again later")
    assert 'artifact_read("toolu_07")' in deduped
    stubbed = marked(item, "stub", keep_tokens=300)["content"]
    assert stubbed == (f"[compacted tool result of {item.tokens} tokens; read it in full with "
                       'artifact_read("toolu_07")]')  # fmt: skip


def test_marks_touch_only_tool_results_and_entries_hold_the_wire_form() -> None:
    asked = user("t1", 0, "hi")
    assert marked(asked, "stub", 300) == asked.content == {"type": "text", "text": "hi"}
    blocks = [{"type": "tool_use", "id": "c1", "name": "lookup", "input": {}, "invalid_json": "{"}]
    annotated = entry("t1", 0, "assistant", blocks)
    wire_form = [{"type": "tool_use", "id": "c1", "name": "lookup", "input": {}}]
    assert marked(annotated, None, 300) == annotated.content == wire_form
    assert blocks[0]["invalid_json"] == "{"  # what the log holds is not changed
    assert entry("t1", 0, "tool_result", {"tool_use_id": "c"}).role == "tool"
    assert asked.obs_id is None and result("t1", 0, "c9", "r").obs_id == "c9"


def test_history_state_gives_the_collector_nothing_to_walk() -> None:
    history = History(entries=tuple(e for i in range(3) for e in turn(i, size=50)))
    assemble(PINNED, history, "next", [])
    gc.collect()  # a tuple of untracked items is untracked by the collector's first look at it
    assert not gc.is_tracked(history.entries)
    assert history._memo is not None
    rendered = history._memo[3]
    assert not any(gc.is_tracked(item) for item in history.entries)
    assert not gc.is_tracked(rendered)
    # decoded afresh on each read: a caller that changes what it got changes nothing held
    first = rendered.messages()
    first[0]["content"].clear()
    assert render(history, 300).messages()[0]["content"]


def test_the_ladders_check_between_rungs_costs_what_the_request_would() -> None:
    digest = Digest(text="earlier", source="mechanical", through=5, turns=2, requests=("a",))
    view = View(digest=digest, marks={"c1": "stub", "c2": "excerpt"})
    history = History(entries=[e for i in range(1, 4) for e in turn(i, size=80)], view=view,
                      notes=("likes tea",), last_error="The previous turn ended.")  # fmt: skip
    steps = [{"role": "assistant", "content": [{"type": "text", "text": "thinking"}]}]
    for transcript in ([], steps):
        built = assemble(PINNED, history, "next", transcript, 20)
        assert total(PINNED, history, "next", transcript, 20) == built.total


def test_calibration_is_an_exponential_average_that_ignores_outliers() -> None:
    history = History()
    assert history.corrected(1000) == 1000
    history.calibrate(estimated=1000, reported=3000)  # 3x: an outlier, ignored
    history.calibrate(estimated=1000, reported=400)  # 0.4x: an outlier too
    history.calibrate(estimated=0, reported=100)
    history.calibrate(estimated=100, reported=0)
    assert (history.ratio, history.calibrated) == (1.0, False)
    history.calibrate(estimated=1000, reported=1500)  # the first figure is taken as it is
    assert (history.ratio, history.calibrated) == (1.5, True)
    history.calibrate(estimated=1000, reported=1000)
    assert history.ratio == pytest.approx(0.6 * 1.0 + 0.4 * 1.5)
    history.calibrate(estimated=1000, reported=2500)  # outlier: the average stays
    assert history.ratio == pytest.approx(1.2)
    assert history.corrected(1000) == 1200
    assert history.corrected(1001) == 1202  # rounded up
    copied = history.copy()
    assert (copied.ratio, copied.calibrated, copied._memo) == (history.ratio, True, None)


def stage(name: str, ids: tuple[str, ...] = (), digest: Digest | None = None,
          kept: dict[str, str] | None = None) -> CompactionStage:  # fmt: skip
    """A recorded ``compaction.stage`` of the rung ``name``."""
    if digest is None:
        return CompactionStage(stage=name, before=2, after=1, changed=bool(ids), ids=list(ids))
    return CompactionStage(stage=name, before=2, after=1, digest=digest.source,
                           through=digest.through, turns=digest.turns, text=digest.text,
                           requests=list(digest.requests), kept=kept)  # fmt: skip


def folded(view: View, event: CompactionStage) -> View:
    history = History(view=view)
    rungs.replay(history, event)
    return history.view


def test_replay_folds_marks_and_digests() -> None:
    start = View(marks={"c1": "excerpt"})
    assert folded(start, stage("excerpt")) is start
    stubbed = folded(start, stage("stub", ("c1", "c2")))
    assert stubbed == View(marks={"c1": "stub", "c2": "stub"})
    assert start.marks == {"c1": "excerpt"}
    assert folded(stubbed, stage("digest")) is stubbed  # changed nothing
    digest = Digest(text="d", source="mechanical", through=20, turns=3, requests=("a",))
    assert folded(stubbed, stage("digest", digest=digest, kept={"c2": "stub"})) == View(
        digest=digest, marks={"c2": "stub"})  # fmt: skip
    assert folded(stubbed, stage("reset", digest=digest)) == View(digest=digest, marks={})
    assert folded(stubbed, stage("no-such-rung", ("c3",))) is stubbed
    entries = [*turn(1), *turn(2), *turn(3)]
    history = History(entries=entries)
    rungs.replay(history, stage("digest", digest=digest))  # through 20: turns 1 and 2
    assert history.entries == entries[8:]


# --- ladder: the pure decisions --------------------------------------------------------------


@pytest.mark.parametrize(
    ("fraction", "stage"),
    [(0.0, None), (0.60, None), (0.6001, 0), (0.70, 0), (0.75, 1), (0.85, 2), (0.90, 3),
     (0.95, 3), (0.96, 4), (3.0, 4)],
)  # fmt: skip
def test_deepest_is_the_last_threshold_strictly_crossed(fraction: float, stage: int | None) -> None:
    assert ladder.deepest(fraction, DEFAULT_THRESHOLDS) == stage


@pytest.mark.parametrize(
    ("stage", "goal"),
    [(0, DEFAULT_THRESHOLDS[0] - FLOOR_MARGIN), (1, 0.60), (2, 0.70), (3, 0.80), (4, 0.88)],
)
def test_the_target_is_the_threshold_of_the_rung_below(stage: int, goal: float) -> None:
    assert ladder.target(stage, DEFAULT_THRESHOLDS) == pytest.approx(goal)
    assert ladder.target(0, (0.03, 0.5, 0.6, 0.7, 0.8)) == 0.0


POLICY = ContextPolicy(window=10_000, reserve_output=1000, excerpt_over=800, excerpt_keep=200)


def test_excerpt_marks_only_results_over_excerpt_over() -> None:
    history = History(entries=[*turn(1, size=3000), *turn(2, size=8000), *turn(3, size=3300),
                               *turn(4, size=20_000)])  # fmt: skip
    assert history.entries[2].tokens <= POLICY.excerpt_over  # c1: not over, never excerpted
    view, ids = rungs.mark("excerpt", history, POLICY, need=10**9)
    assert ids == ["c2", "c3", "c4"]
    assert view.marks == dict.fromkeys(ids, "excerpt")
    assert history.view == View()  # decided, not applied


def test_dedupe_marks_only_superseded_results_of_the_same_tool_and_input() -> None:
    t = "t1"
    history = History(entries=[
        call(t, 0, "a1", {"q": 1, "lang": "en"}), result(t, 0, "a1", "r" * 400),
        call(t, 0, "b1", {"q": 2}), result(t, 0, "b1", "r" * 400),
        call(t, 0, "other", {"q": 1, "lang": "en"}, name="search"),
        result(t, 0, "other", "r" * 400),
        call(t, 0, "a2", {"lang": "en", "q": 1}), result(t, 0, "a2", "r" * 400),
        call(t, 0, "a3", {"q": 1, "lang": "en"}), result(t, 0, "a3", "r" * 400),
    ])  # fmt: skip
    assert rungs.superseded(history) == {"a1", "a2"}
    view, ids = rungs.mark("dedupe", history, POLICY, need=10**9)
    assert ids == ["a1", "a2"]
    assert "a3" not in view.marks and "b1" not in view.marks and "other" not in view.marks


def test_stub_marks_oldest_first_until_the_need_is_met() -> None:
    history = History(entries=[*turn(1, 2000), *turn(2, 2000), *turn(3, 2000)])
    _, ids = rungs.mark("stub", history, POLICY, need=1)
    assert ids == ["c1"]
    one = history.entries[2].tokens - len(marked(history.entries[2], "stub", 200)["content"]) // 4
    _, ids = rungs.mark("stub", history, POLICY, need=one + 50)
    assert ids == ["c1", "c2"]
    view, ids = rungs.mark("stub", history, POLICY, need=10**9)
    assert ids == ["c1", "c2", "c3"]
    assert view.marks == dict.fromkeys(ids, "stub")


def test_marks_never_weaken_but_may_strengthen() -> None:
    entries = [*turn(1, 8000), *turn(2, 8000), *turn(3, 8000)]
    history = History(entries=entries, view=View(marks={"c1": "stub", "c2": "excerpt"}))
    view, ids = rungs.mark("excerpt", history, POLICY, need=10**9)
    assert ids == ["c3"]
    assert view.marks == {"c1": "stub", "c2": "excerpt", "c3": "excerpt"}
    view, ids = rungs.mark("stub", history, POLICY, need=10**9)
    assert ids == ["c2", "c3"]
    assert view.marks == {"c1": "stub", "c2": "stub", "c3": "stub"}
    # With a one-token excerpt, excerpting a superseded result would save tokens: it still may
    # not, since an excerpt is a weaker mark than dedupe.
    tiny = ContextPolicy(excerpt_over=800, excerpt_keep=1)
    superseded = History(entries=entries, view=View(marks={"c1": "dedupe"}))
    c1 = entries[2]
    assert estimate(marked(c1, "excerpt", 1)) < estimate(marked(c1, "dedupe", 1))
    _, ids = rungs.mark("excerpt", superseded, tiny, need=10**9)
    assert ids == ["c2", "c3"]
    done = History(entries=entries, view=view)
    same, none = rungs.mark("stub", done, POLICY, need=10**9)
    assert (same, none) == (done.view, [])
    assert same is done.view  # nothing to mark: the very same view (the memo stays valid)


@pytest.mark.parametrize(("keep", "covered"), [(0, 12), (1, 8), (2, 4), (3, 0), (5, 0)])
def test_split_keeps_the_newest_turns_verbatim(keep: int, covered: int) -> None:
    entries = [*turn(1), *turn(2), *turn(3)]
    assert ladder.turns(entries) == [10, 20, 30]
    assert ladder.split(entries, keep) == covered


def test_requests_are_the_persons_texts_verbatim_in_order() -> None:
    entries = [*turn(1, request="first\n  with  spaces"), *turn(2, request="second")]
    assert ladder.requests(entries) == ["first\n  with  spaces", "second"]
    assert ladder.tools_used(entries) == {"lookup": ["c1", "c2"]}


# --- mechanical digests ----------------------------------------------------------------------


def test_a_mechanical_digest_says_what_the_turns_held_and_where_to_read_more() -> None:
    covered = [*(e for i in range(1, 8) for e in turn(i)),
               call("t8", 80, "s1", {"q": "x"}, name="search")]  # fmt: skip
    text = mechanical(None, covered)
    assert text.startswith("8 turns are summarised here without a model. The person made 7 "
                           "requests")  # fmt: skip
    assert "Tools used: lookup (7), search (1)." in text
    assert "artifact_read(id)" in text
    assert '"c5" (lookup), "c6" (lookup), "c7" (lookup), "s1" (search)' in text
    assert '"c3"' not in text  # only the newest five are named
    assert "Before those turns" not in text
    assert text.endswith("If something important from then is missing, ask the person.")
    previous = Digest(text="P" * 1500, source="model", through=0, turns=2, requests=())
    chained = mechanical(previous, turn(9))
    assert f"Before those turns: {'P' * 1000} [...]" in chained
    assert "P" * 1001 not in chained
    assert "Tools" not in mechanical(None, [user("t1", 0, "only talk")])


# --- prepare: the ladder end to end ----------------------------------------------------------


def replayed(start: History, events: list[Any]) -> History:
    """``start`` with the recorded compaction stages folded over it, as replay does (each event
    through the log's codec first)."""
    history = start.copy()
    for event in events:
        if not isinstance(event, CompactionStage):
            continue
        stored = decode_data(CompactionStage.TYPE, encode_data(event))
        assert isinstance(stored, CompactionStage)
        rungs.replay(history, stored)
    return history


def check_run(prepared: Prepared, policy: ContextPolicy) -> list[CompactionStage]:
    """The invariants of one ``prepare``: the stages that changed something, in ladder order,
    each measured from where the last left off and shrinking the prompt, then one pressure
    event (a rung with nothing of its kind to compact is not recorded)."""
    *stages, pressure = prepared.events
    assert isinstance(pressure, ContextPressure)
    assert all(isinstance(s, CompactionStage) for s in stages)
    run = cast("list[CompactionStage]", stages)
    names = [s.stage for s in run]
    assert names == sorted(names, key=STAGES.index) and len(set(names)) == len(names)
    budget = policy.budget
    assert pressure.budget == budget and pressure.tokens == prepared.tokens
    assert pressure.fraction == round(prepared.tokens / budget, 4)
    assert prepared.over == (prepared.tokens > budget)
    if pressure.peak is None:
        assert run == []
        assert prepared.tokens / budget <= policy.thresholds[0]
        return run
    deepest = ladder.deepest(pressure.peak, policy.thresholds)
    assert deepest is not None
    assert all(STAGES.index(n) <= deepest for n in names)
    for s in run:
        assert s.changed and s.before > s.after
    for a, b in itertools.pairwise(run):
        assert a.after == b.before
    if run:
        assert run[-1].after == prepared.tokens
        assert pressure.peak == round(run[0].before / budget, 4)
        goal = ladder.target(deepest, policy.thresholds) * budget
        # the ladder stops at the goal; short of it only when no rung it may use had more
        assert all(s.before > goal for s in run)
    return run


@pytest.mark.asyncio
async def test_below_the_first_threshold_nothing_runs_and_pressure_is_recorded() -> None:
    history = History(entries=[*turn(1), *turn(2)])
    view = history.view
    prepared = await prepare(PINNED, history, "hi", [], POLICY, Digester())
    assert check_run(prepared, POLICY) == []
    assert len(prepared.events) == 1
    pressure = prepared.events[0]
    assert isinstance(pressure, ContextPressure)
    assert pressure.source == "estimated" and pressure.peak is None
    assert pressure.tokens == prepared.assembly.total
    assert history.view is view and len(history.entries) == 8
    assert not prepared.over


@pytest.mark.asyncio
async def test_a_growing_session_climbs_the_ladder_in_order_and_replays_to_the_same_view() -> None:
    policy = POLICY
    history = History()
    seen: dict[str, int] = dict.fromkeys(STAGES, 0)
    asked: list[str] = []
    for i in range(34):
        # Big results now and then (for excerpt), repeated lookups early on (for dedupe), long
        # replies (so stubbing alone cannot hold the line and a digest comes).
        args = {"q": i % 3} if i < 12 else {"q": i}
        history.entries = [*history.entries,
                           *turn(i, 4000 if i % 4 == 0 else 1200, args, talk=600)]  # fmt: skip
        asked.append(f"request {i}")
        start = history.copy()
        prepared = await prepare(PINNED, history, f"input {i}", [], policy, Digester())
        run = check_run(prepared, policy)
        for s in run:
            seen[s.stage] += s.changed
        folded = replayed(start, prepared.events)
        assert folded.view == history.view
        # The live history no longer holds the bodies of stubbed results; the view is the same.
        assert [slim(e) for e in folded.entries] == [slim(e) for e in history.entries]
        again = assemble(PINNED, folded, f"input {i}", [], policy.excerpt_keep)
        assert again.messages == prepared.assembly.messages
        assert again.system == prepared.assembly.system
        assert person_requests(history) == asked
    assert seen["excerpt"] and seen["dedupe"] and seen["stub"] and seen["digest"]
    assert history.view.digest is not None


def deep_history() -> History:
    """Six short turns, then two whose replies are so long that only a reset makes room."""
    return History(entries=[*(e for i in range(6) for e in turn(i)),
                            *turn(6, talk=16_000), *turn(7, talk=16_000)])  # fmt: skip


@pytest.mark.asyncio
async def test_every_rung_runs_when_needed_and_the_pressure_ends_at_the_target() -> None:
    history = deep_history()
    start = history.copy()
    prepared = await prepare(PINNED, history, "Where were we?", [], POLICY, Digester())
    run = check_run(prepared, POLICY)
    # The results are small: excerpt and dedupe find nothing to do and are not recorded.
    assert [s.stage for s in run] == ["stub", "digest", "reset"]
    goal = ladder.target(4, POLICY.thresholds) * POLICY.budget
    assert prepared.tokens <= goal and not prepared.over
    digest, reset = run[1], run[2]
    assert digest.changed and digest.turns == 6 and digest.through == 50
    assert digest.kept == {"c6": "stub", "c7": "stub"}  # the marks of the two turns it kept
    assert reset.changed and reset.turns == 8 and reset.through == 70 and reset.kept == {}
    assert reset.digest == "mechanical" and reset.fallback is None
    assert history.entries == []
    assert person_requests(history) == [f"request {i}" for i in range(8)]
    built = prepared.assembly
    assert [b["text"] for b in built.system] == [b.text for b in PINNED.system]
    assert built.messages[-1]["content"][-1]["text"] == "Where were we?"
    pinned_slots = [(s.label, s.tokens) for s in built.slots if s.pinned]
    first = assemble(PINNED, start, "Where were we?", [], POLICY.excerpt_keep)
    assert pinned_slots == [(s.label, s.tokens) for s in first.slots if s.pinned]
    assert replayed(start, prepared.events).view == history.view


@pytest.mark.asyncio
async def test_a_digest_keeps_the_newest_turns_verbatim_with_their_marks() -> None:
    policy = ContextPolicy(window=10_000, reserve_output=1000, excerpt_over=800,
                           excerpt_keep=200, keep_turns=3,
                           thresholds=(0.10, 0.20, 0.30, 0.40, 0.99))  # fmt: skip
    history = History(entries=[*(e for i in range(10) for e in turn(i, talk=1200))])
    prepared = await prepare(PINNED, history, "next", [], policy, Digester())
    run = check_run(prepared, policy)
    assert [s.stage for s in run] == ["stub", "digest"]
    assert ladder.turns(history.entries) == [70, 80, 90]
    assert history.view.digest is not None and history.view.digest.turns == 7
    assert set(history.view.marks) <= {"c7", "c8", "c9"}
    assert person_requests(history) == [f"request {i}" for i in range(10)]
    text = prepared.assembly.messages[0]["content"][0]["text"]
    for i in range(7):
        assert f"{i + 1}. request {i}" in text


@pytest.mark.asyncio
async def test_over_when_even_a_reset_cannot_make_room() -> None:
    history = History(entries=[*turn(0), *turn(1)])
    start = history.copy()
    huge = "z" * (POLICY.budget * BYTES_PER_TOKEN * 2)
    prepared = await prepare(PINNED, history, huge, [], POLICY, Digester())
    run = check_run(prepared, POLICY)
    assert [s.stage for s in run] == ["stub", "reset"]
    assert prepared.over and prepared.tokens > POLICY.budget
    assert run[-1].changed and history.entries == []
    assert person_requests(history) == ["request 0", "request 1"]
    assert prepared.assembly.messages[-1]["content"][-1]["text"] == huge
    assert replayed(start, prepared.events).view == history.view


@pytest.mark.asyncio
async def test_an_empty_history_with_a_huge_input_changes_nothing_and_is_over() -> None:
    history = History()
    huge = "z" * (POLICY.budget * BYTES_PER_TOKEN * 2)
    prepared = await prepare(PINNED, history, huge, [], POLICY, Digester())
    run = check_run(prepared, POLICY)
    assert run == []  # every rung was tried; none had anything to compact
    assert prepared.over and history.view == View()


@pytest.mark.asyncio
async def test_a_provider_count_is_reported_then_corrected_after_compaction() -> None:
    history = History(entries=[*turn(1), *turn(2)])
    counted: list[int] = []

    async def count(assembly: Assembly) -> int | None:
        counted.append(assembly.total)
        return assembly.total * 3 // 2

    prepared = await prepare(PINNED, history, "hi", [], POLICY, Digester(), count)
    pressure = prepared.events[-1]
    assert isinstance(pressure, ContextPressure)
    assert (pressure.source, pressure.tokens) == ("reported", counted[0] * 3 // 2)

    async def nothing(assembly: Assembly) -> int | None:
        return None

    history.calibrate(estimated=1000, reported=1250)
    prepared = await prepare(PINNED, history, "hi", [], POLICY, Digester(), nothing)
    pressure = prepared.events[-1]
    assert isinstance(pressure, ContextPressure)
    assert pressure.source == "corrected"
    assert pressure.tokens == history.corrected(prepared.assembly.total)

    deep = deep_history()

    async def high(assembly: Assembly) -> int | None:
        return int(assembly.total * 1.2)

    prepared = await prepare(PINNED, deep, "hi", [], POLICY, Digester(), high)
    pressure = prepared.events[-1]
    assert isinstance(pressure, ContextPressure)
    assert len(prepared.events) > 1
    assert pressure.source == "corrected"  # the count was of the request before compaction


@pytest.mark.asyncio
async def test_the_request_list_keeps_to_its_share_and_says_what_it_summarised() -> None:
    """A session of very many turns: the verbatim requests may take ``requests_share`` of the
    budget; past it the earliest are summarised (counted, and named as left out), the newest
    stay word for word, and the fold of the recorded stages gives the same view."""
    policy = ContextPolicy(window=6000, reserve_output=1000, keep_turns=1, requests_share=0.1)
    long_request = "please look this up again, with every detail you can find " * 2
    history = History()
    archived = 0
    for i in range(60):
        history.entries = [*history.entries, *turn(i, request=f"{i}: {long_request}")]
        start = history.copy()
        prepared = await prepare(PINNED, history, "next", [], policy, Digester())
        check_run(prepared, policy)
        assert not prepared.over
        assert replayed(start, prepared.events).view == history.view
        digest = history.view.digest
        if digest is not None:
            assert digest.archived >= archived  # never un-summarised
            archived = digest.archived
            listed = sum(text_tokens(r) + 2 for r in digest.requests)
            assert listed <= policy.budget * policy.requests_share
            assert digest.archived + len(digest.requests) == digest.turns
    digest = history.view.digest
    assert digest is not None and digest.archived > 0
    assert digest.requests[-1].startswith(f"{digest.turns - 1}: ")  # the newest kept verbatim
    text = digest_text(history)
    assert text is not None
    assert f"(requests 1-{digest.archived} are summarised above, not listed)" in text
    assert f"{digest.archived + 1}. {digest.requests[0]}" in text
    assert "no longer listed word for word" in digest.text

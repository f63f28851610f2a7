"""Long sessions against a small context window (issue 6): what must hold after hundreds of turns.

One session of 300 turns, with tool results of several KB, runs against the fake Anthropic
server given the agent's own window (the fake refuses a request that does not fit, as the real
API does), on real Postgres and NATS. The compaction ladder has to keep every request inside the
window, climbing its rungs in order as the pressure grows, while the pinned blocks and every
request of the person stay in what the model reads, consecutive turns share a byte-identical
prefix (so the provider's cache reads it), the log replays exactly what each call was sent, and
``artifact_read`` still returns a compacted result whole. A second test restarts the node in the
middle of a compacted session: the new node rehydrates the same view (digest and marks) from the
session's snapshot and the messages after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import re
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import pytest

from actors.context.assemble import DIGEST_HEADER, REQUESTS_HEADER
from actors.context.load import load
from actors.context.replay import replay
from actors.context.rungs import STAGES
from actors.messages import SessionContext
from actors.tools.builtins import ARTIFACT_PAGE
from actors.turn.actor import TurnActor
from actors.turn.runner import TurnRunner
from eventstore import Checkpoint, EventStore, RecordedEvent, streams
from eventstore.catalogue import CompactionStage, ModelCall, ModelResult, Pressure, TurnEnd
from runtime.node import Node
from tests import fakes
from tests.conftest import NodeFactory
from tests.fakes import FakeAnthropic, Item, Reply, ToolUse
from tests.fakes.anthropic_server import MESSAGES_PATH, without_cache_control
from tests.turns import send, store_of

fake_anthropic = fakes.fake_anthropic

AGENT = "longrun"
SESSION = "api:long"
KEY_ENV = "DISPACH_TEST_ANTHROPIC_KEY"
WINDOW = 16_000
MAX_OUTPUT = 512
TOPICS = ("alpha", "beta", "gamma", "delta", "epsilon")
"""Fetched in turn: the same call comes back every ten turns, so older results are superseded."""
ARCHIVE = "archive"
"""A report longer than one artifact_read page."""
INSTRUCTIONS = [  # long enough for the pinned prefix to reach the cache's minimum (1024 tokens)
    {
        "label": "identity",
        "text": (
            "You are Longrun, an analyst that reads reports for one person over a long "
            "conversation. Fetch a report with fetch_report when the person asks for one, and "
            "answer from what the reports say. "
        )
        * 9,
    },
    {
        "label": "rules",
        "text": (
            "Quote every figure exactly as the report gives it. Say which report a figure comes "
            "from. When a report was shortened by compaction and you need more of it, read it "
            "whole with artifact_read before you answer. "
        )
        * 9,
    },
]
REMINDERS = ["Quote figures exactly.", "Never invent a report that was not fetched."]


def report(topic: str) -> str:
    """What fetch_report returns for ``topic``: the same text every time (about 6 KB, or 14 KB
    for the archive), made of lines that differ from each other and from other topics'."""
    seed = sum(ord(c) * 31**i for i, c in enumerate(topic)) % 100_003
    size = 14_000 if topic == ARCHIVE else 6_000
    lines = (
        f"{topic} row {row:03d}: reading {(seed * 7919 + row * 104_729) % 1_000_000:>7} units, "
        "status ok, checked"
        for row in itertools.count()
    )
    text = ""
    while len(text) < size:
        text += next(lines) + "\n"
    return text[:size]


def fetch_report(args: dict[str, Any], ctx: object) -> str:
    """The agent's custom tool (``tests.test_context_long:fetch_report``)."""
    return report(str(args["topic"]))


def manifest(fake: FakeAnthropic) -> str:
    """The agent's manifest (JSON is YAML)."""
    return json.dumps({
        "id": AGENT,
        "model": {"provider": "anthropic", "id": "claude-sonnet-5", "base_url": fake.url,
                  "api_key_env": KEY_ENV, "max_output_tokens": MAX_OUTPUT,
                  "context_window": WINDOW, "max_retries": 0},
        "instructions": INSTRUCTIONS,
        "reminders": REMINDERS,
        "tools": [{
            "name": "fetch_report", "module": "tests.test_context_long:fetch_report",
            "description": "Fetch the newest report on a topic.",
            "input_schema": {"type": "object", "properties": {"topic": {"type": "string"}},
                             "required": ["topic"]},
        }],
        "limits": {"max_steps": 6, "turn_timeout_s": 30},
    })  # fmt: skip


# --- the fake model's side of the conversation -----------------------------------------------


@dataclass(frozen=True)
class Action:
    """What the person asks for in one turn, and so what the fake model does: talk (one reply),
    fetch a report (a tool call, then a reply), or read a compacted result back (``pages``
    calls of artifact_read, then a reply)."""

    kind: Literal["talk", "fetch", "read"]
    topic: str = ""
    obs_id: str = ""
    pages: int = 1

    def text(self, index: int) -> str:
        match self.kind:
            case "fetch":
                return f"r{index:03d}: fetch the {self.topic} report, please."
            case "read":
                return f"r{index:03d}: read {self.obs_id} back to me in full."
        return f"r{index:03d}: what stands out in the reports so far?"


class Scripted:
    """The fake's responder: answers each model call of the turn in progress from its action
    (the turns run one at a time, so the calls of a turn arrive in order)."""

    def __init__(self) -> None:
        self.index = 0
        self.action = Action("talk")
        self.calls = 0

    def begin(self, index: int, action: Action) -> None:
        self.index, self.action, self.calls = index, action, 0

    def __call__(self, body: dict[str, Any]) -> Item:
        step, self.calls = self.calls, self.calls + 1
        action, call_id = self.action, f"toolu_{self.index:03d}_{step}"
        if action.kind == "fetch" and step == 0:
            use = ToolUse("fetch_report", {"topic": action.topic}, id=call_id)
            return Reply(text=f"Fetching the {action.topic} report.", tool_uses=[use],
                         chunk_size=256)  # fmt: skip
        if action.kind == "read" and step < action.pages:
            args: dict[str, Any] = {"id": action.obs_id}
            if step:
                args["offset"] = step * ARTIFACT_PAGE
            return Reply(tool_uses=[ToolUse("artifact_read", args, id=call_id)])
        return Reply(text=f"Answer {self.index}: noted, nothing else changed.", chunk_size=256)


# --- driving one session ----------------------------------------------------------------------


@dataclass
class Turn:
    index: int
    action: Action
    text: str
    turn_id: str
    events: list[RecordedEvent]
    sent: list[str]
    """What the fake received for each of the turn's model calls, in order, as JSON (parsed
    when read: 300 turns of parsed requests make the garbage collector pause the event loop
    for a second at a time)."""

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(body) for body in self.sent]

    @property
    def end(self) -> TurnEnd:
        end = self.events[-1].data
        assert isinstance(end, TurnEnd), f"turn {self.index} has no turn.end last"
        return end

    def stages(self) -> list[CompactionStage]:
        return [e.data for e in self.events if isinstance(e.data, CompactionStage)]

    def stages_before_first_call(self) -> list[CompactionStage]:
        found: list[CompactionStage] = []
        for event in self.events:
            if event.type == "model.call":
                break
            if isinstance(event.data, CompactionStage):
                found.append(event.data)
        return found

    def calls(self) -> list[list[RecordedEvent]]:
        """The turn's events, one list per model call: those after the call before it, up to
        its ``model.call`` (so its stages, and the call with its context and pressure)."""
        cuts: list[list[RecordedEvent]] = []
        current: list[RecordedEvent] = []
        for event in self.events:
            current.append(event)
            if event.type == "model.call":
                cuts.append(current)
                current = []
        return cuts


class Ends:
    """Every ``turn.end`` of a node, from one subscription owned by the conversation."""

    def __init__(self) -> None:
        self._ended: dict[str, asyncio.Future[None]] = {}

    def _future(self, turn_id: str) -> asyncio.Future[None]:
        if turn_id not in self._ended:
            self._ended[turn_id] = asyncio.get_running_loop().create_future()
        return self._ended[turn_id]

    async def watch(self, store: EventStore, after: Checkpoint) -> None:
        async for event in store.subscribe(after, types=("turn.end",)):
            turn_id = event.metadata.turn_id
            if turn_id is not None and not self._future(turn_id).done():
                self._future(turn_id).set_result(None)

    async def wait(self, turn_id: str, timeout: float = 30.0) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self._future(turn_id)), timeout)
        finally:
            del self._ended[turn_id]


@dataclass
class Conversation:
    """One session of the agent, driven a turn at a time."""

    node: Node
    fake: FakeAnthropic
    model: Scripted
    turns: list[Turn] = field(default_factory=list)
    marks: dict[str, str] = field(default_factory=dict)
    """The marks of the session's view, as its compaction stages recorded them."""
    _ends: Ends = field(default_factory=Ends)
    _watcher: asyncio.Task[None] | None = None

    @contextlib.asynccontextmanager
    async def on(self, node: Node) -> AsyncIterator[Conversation]:
        """Drive the session through ``node`` inside the block."""
        self.node, self._ends = node, Ends()
        store = store_of(node)
        head = await store.ahead()  # before the first message: no turn.end is missed
        self._watcher = asyncio.create_task(self._ends.watch(store, head), name="turn-ends")
        try:
            yield self
        finally:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher

    async def turn(self, action: Action) -> Turn:
        index = len(self.turns)
        text = action.text(index)
        self.model.begin(index, action)
        accepted = await send(self.node, AGENT, text, SESSION)
        await self._ends.wait(accepted.turn_id)
        events = await store_of(self.node).aread_stream(streams.turn(accepted.turn_id))
        sent = [json.dumps(r.body) for r in self.fake.take_requests() if r.path == MESSAGES_PATH]
        turn = Turn(index, action, text, accepted.turn_id, events, sent)
        self.turns.append(turn)
        for stage in turn.stages():
            if stage.stage in ("digest", "reset") and stage.changed:
                self.marks = dict(stage.kept or {})
            self.marks.update(dict.fromkeys(stage.ids, stage.stage))
        return turn


async def started(node_factory: NodeFactory, fake: FakeAnthropic,
                  monkeypatch: pytest.MonkeyPatch) -> tuple[Node, Conversation]:  # fmt: skip
    monkeypatch.setenv(KEY_ENV, "test-key")
    node_factory.write_agent(AGENT, manifest(fake))
    fake.context_window = WINDOW
    model = Scripted()
    fake.responder = model
    node = await node_factory.start()
    return node, Conversation(node, fake, model)


def planned(index: int) -> Action:
    """The plan of the long session: every other turn fetches a report (the topics in turn)."""
    if index % 2 == 1:
        return Action("fetch", topic=TOPICS[(index // 2) % len(TOPICS)])
    return Action("talk")


# --- reading the requests -----------------------------------------------------------------------


def segments(body: dict[str, Any]) -> list[str]:
    """A request as the provider's cache sees it: tools, system blocks, then every message
    block with its message's index and role, each as canonical JSON without cache markers."""

    def canonical(value: object) -> str:
        return json.dumps(without_cache_control(value), sort_keys=True, ensure_ascii=False)

    out = [canonical(["tool", tool]) for tool in body.get("tools", [])]
    out += [canonical(["system", block]) for block in body.get("system", [])]
    for index, message in enumerate(body["messages"]):
        out += [canonical(["message", index, message["role"], b]) for b in message["content"]]
    return out


def positions(body: dict[str, Any], wanted: Callable[[dict[str, Any]], bool]) -> list[int]:
    """The segments (see :func:`segments`) of the message blocks of ``body`` that are
    ``wanted``."""
    before = len(body.get("tools", [])) + len(body.get("system", []))
    blocks = [without_cache_control(b) for m in body["messages"] for b in m["content"]]
    return [before + i for i, block in enumerate(blocks) if wanted(block)]


def input_at(body: dict[str, Any], text: str) -> int:
    """The segment of ``body`` that is the person's input ``text``."""
    found = positions(body, lambda b: b == {"type": "text", "text": text})
    assert len(found) == 1, f"the input {text!r} is in the request {len(found)} times"
    return found[0]


def first_result(body: dict[str, Any], ids: set[str]) -> int:
    """The segment of ``body`` that is the first tool result of one of ``ids``."""
    found = positions(body, lambda b: b.get("tool_use_id") in ids)
    assert found, f"none of {sorted(ids)} is in the request"
    return found[0]


def requests_read(body: dict[str, Any]) -> list[str]:
    """The person's requests a model call reads, in order: those the digest lists verbatim,
    then the inputs of the turns after it (and the turn's own)."""
    found: list[str] = []
    for message in body["messages"]:
        if message["role"] != "user":
            continue
        for block in message["content"]:
            if block.get("type") != "text":
                continue
            text = block["text"]
            if text.startswith(DIGEST_HEADER.split("{", 1)[0]):
                listed = text.split(REQUESTS_HEADER, 1)[1] if REQUESTS_HEADER in text else ""
                found += re.findall(r"^\d+\. (.*)$", listed, re.MULTILINE)
            else:
                found.append(text)
    return found


def texts(blocks: list[dict[str, Any]]) -> list[str]:
    return [b["text"] for b in blocks]


def jsonable(value: object) -> Any:
    return json.loads(json.dumps(value))


def first_changes(turns: list[Turn]) -> dict[str, int]:
    """Each stage's first run that changed the view: the index of its turn."""
    first: dict[str, int] = {}
    for turn in turns:
        for stage in turn.stages():
            if stage.changed:
                first.setdefault(stage.stage, turn.index)
    return first


def tool_results(body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for message in body["messages"]:
        for block in message["content"]:
            if block.get("type") == "tool_result":
                yield block


# --- what must hold (issue 6) -------------------------------------------------------------------

TURNS = 300
READ_AT = 150
"""The turn that reads an excerpted result back (by then most results have been marked)."""
ARCHIVE_AT = 200
"""The turn that fetches the archive, read back in two pages a few turns later."""
ARCHIVE_READ_AT = 206
CACHE_READS = b"""SELECT turn_id, cache_read_tokens FROM turns
                   WHERE agent_id = %(agent_id)s AND session_key = %(session_key)s"""


def pressure_of(event: RecordedEvent) -> Pressure | None:
    """The pressure a model call was sent at (catalogue v2: a field of its ``model.call``)."""
    return event.data.pressure if isinstance(event.data, ModelCall) else None


def check_window(turns: list[Turn], fake: FakeAnthropic, budget: int) -> None:
    """No request was refused or over the window: every turn ended ``final``, each model call
    the node recorded is one the fake answered, and the largest prompt left the reply room."""
    assert [(t.index, t.end.reason, t.end.error) for t in turns if t.end.reason != "final"] == []
    assert [t.index for t in turns if len(t.sent) != len(t.calls())] == []
    assert fake.largest_prompt + MAX_OUTPUT <= WINDOW
    pressures = [pressure_of(e) for t in turns for e in t.events if pressure_of(e) is not None]
    assert pressures and max(p.tokens for p in pressures if p is not None) <= budget


def check_ladder(turns: list[Turn], thresholds: tuple[float, ...], budget: int) -> None:
    """Each call's stages are rungs of the ladder in its order (a rung that found nothing to
    compact is not recorded), run because the pressure had crossed the deepest one's threshold,
    each one shrinking the prompt; across the run each rung first changes the view only after
    the rungs before it did, as the pressure grows."""
    for turn in turns:
        for call in turn.calls():
            stages = [e.data for e in call if isinstance(e.data, CompactionStage)]
            (pressure,) = [p for e in call if (p := pressure_of(e)) is not None]
            if not stages:
                continue
            rungs = [STAGES.index(s.stage) for s in stages]
            assert rungs == sorted(set(rungs)), (turn.index, stages)
            assert pressure.peak is not None
            assert pressure.peak == round(stages[0].before / budget, 4)
            assert pressure.peak > thresholds[rungs[-1]], (turn.index, stages)
            assert all(s.changed and s.after < s.before for s in stages), (turn.index, stages)
            assert all(a.after == b.before for a, b in itertools.pairwise(stages))
            assert pressure.tokens == stages[-1].after
    first = first_changes(turns)
    assert {"excerpt", "dedupe", "stub", "digest"} <= set(first), first
    ran = [name for name in STAGES if name in first]
    assert sorted(ran, key=lambda name: (first[name], STAGES.index(name))) == ran, first
    assert first["excerpt"] < first["stub"] < first["digest"], first
    digests = [s for t in turns for s in t.stages() if s.stage == "digest" and s.changed]
    assert len(digests) >= 2 and all(s.digest == "mechanical" for s in digests)


def check_last_request(turns: list[Turn], pinned: list[str]) -> None:
    """The last request holds every pinned block, and every request of the person of all the
    turns, verbatim and in order (in the digest's list or as the inputs after it)."""
    last = turns[-1].bodies[-1]
    system = texts(last["system"])
    assert system[: len(pinned)] == pinned
    assert system[:2] == [i["text"] for i in INSTRUCTIONS]
    assert f"context window {WINDOW} tokens" in system[2]
    assert system[3] == "\n".join(REMINDERS)
    assert requests_read(last) == [t.text for t in turns]


def check_prefixes(turns: list[Turn]) -> None:
    """Consecutive turns share a byte-identical prefix (what the provider's cache reads): the
    whole of the earlier turn's last request, unless the later turn compacted before its first
    call; a rung that only marks results keeps it up to the first result it marked."""
    unchanged = marked_only = 0
    for before, after in itertools.pairwise(turns):
        earlier_body, later_body = json.loads(before.sent[-1]), json.loads(after.sent[0])
        earlier, later = segments(earlier_body), segments(later_body)
        pair = f"turns {before.index} and {after.index}"
        changed = [s for s in after.stages_before_first_call() if s.changed]
        if not changed:
            cut = input_at(earlier_body, before.text)
            assert later[:cut] == earlier[:cut], pair
            assert later[: len(earlier)] == earlier, pair
            unchanged += 1
        elif all(s.stage in ("excerpt", "dedupe", "stub") for s in changed):
            cut = first_result(earlier_body, {i for s in changed for i in s.ids})
            assert cut > len(earlier_body["tools"]) + len(earlier_body["system"]), pair
            assert later[:cut] == earlier[:cut], pair
            assert later[cut] != earlier[cut], pair
            marked_only += 1
    assert unchanged >= TURNS // 2 and marked_only >= TURNS // 10, (unchanged, marked_only)


def check_cache(turns: list[Turn]) -> None:
    """The provider's cache is read on every turn after the first: the pinned prefix at least,
    whatever compaction did to the messages."""
    reads = [
        [e.data.cache_read_tokens for e in t.events if isinstance(e.data, ModelResult)]
        for t in turns
    ]
    assert reads[0][0] == 0
    assert [t.index for t, r in zip(turns, reads, strict=True) if r[0] == 0] == [0]
    assert all(t.end.tokens.cache_read == sum(r) for t, r in zip(turns, reads, strict=True))


def check_artifacts(turns: list[Turn], read_id: str, archive_id: str) -> None:
    """artifact_read gives back the whole of an excerpted result, and a long one in pages."""
    read = turns[READ_AT]
    bodies = read.bodies
    assert len(bodies) == 2
    shown = [r for r in tool_results(bodies[0]) if r["tool_use_id"] == read_id]
    topic = next(t.action.topic for t in turns if f"toolu_{t.index:03d}_0" == read_id)
    whole = report(topic)
    assert shown == [] or len(shown[0]["content"]) < len(whole) // 2  # digested, or excerpted
    (result,) = [r for r in tool_results(bodies[1])
                 if r["tool_use_id"] == f"toolu_{READ_AT:03d}_0"]  # fmt: skip
    assert result["content"] == f"[{read_id}: characters 0-{len(whole)} of {len(whole)}]\n{whole}"
    assert result["is_error"] is False

    archived = turns[ARCHIVE_READ_AT].bodies
    assert len(archived) == 3
    whole = report(ARCHIVE)
    assert len(whole) > ARTIFACT_PAGE
    pages = [
        next(r["content"] for r in tool_results(archived[step + 1])
             if r["tool_use_id"] == f"toolu_{ARCHIVE_READ_AT:03d}_{step}")
        for step in range(2)
    ]  # fmt: skip
    rest = len(whole) - ARTIFACT_PAGE
    assert pages[0] == (
        f"[{archive_id}: characters 0-{ARTIFACT_PAGE} of {len(whole)}; {rest} more: call again "
        f"with offset {ARTIFACT_PAGE}]\n{whole[:ARTIFACT_PAGE]}"
    )
    assert pages[1] == (
        f"[{archive_id}: characters {ARTIFACT_PAGE}-{len(whole)} of {len(whole)}]\n"
        f"{whole[ARTIFACT_PAGE:]}"
    )


def to_replay(turns: list[Turn]) -> list[Turn]:
    """Turns worth replaying: the first and last, every turn where a rung first changed the
    view or a digest was written, some of the others that compacted, and the multi-step ones
    that read artifacts."""
    chosen = {0, READ_AT, ARCHIVE_AT, ARCHIVE_READ_AT, TURNS - 1}
    chosen |= set(first_changes(turns).values())
    chosen |= {t.index for t in turns if any(s.stage == "digest" for s in t.stages())}
    compacted = [t.index for t in turns if any(s.changed for s in t.stages())]
    chosen |= set(compacted[:: max(1, len(compacted) // 8)])
    return [turns[i] for i in sorted(chosen)]


@pytest.mark.asyncio
async def test_a_300_turn_session_stays_in_its_window(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    node, conversation = await started(node_factory, fake_anthropic, monkeypatch)
    agent = node.agents[AGENT]
    policy = agent.context
    read_id = archive_id = ""
    async with conversation.on(node):
        for index in range(TURNS):
            action = planned(index)
            if index == READ_AT:
                excerpted = [k for k, mark in conversation.marks.items() if mark == "excerpt"]
                assert excerpted, f"nothing is excerpted after {READ_AT} turns"
                read_id = excerpted[-1]
                action = Action("read", obs_id=read_id)
            elif index == ARCHIVE_AT:
                action = Action("fetch", topic=ARCHIVE)
                archive_id = f"toolu_{index:03d}_0"
            elif index == ARCHIVE_READ_AT:
                action = Action("read", obs_id=archive_id, pages=2)
            await conversation.turn(action)
    turns = conversation.turns

    # The checks parse hundreds of requests: off the event loop.
    await asyncio.to_thread(check_window, turns, fake_anthropic, policy.budget)
    await asyncio.to_thread(check_ladder, turns, policy.thresholds, policy.budget)
    await asyncio.to_thread(check_last_request, turns, [b.text for b in agent.pinned.system])
    await asyncio.to_thread(check_prefixes, turns)
    await asyncio.to_thread(check_cache, turns)
    await asyncio.to_thread(check_artifacts, turns, read_id, archive_id)

    # The turns' resource reports the cache reads the fake reported.
    store = store_of(node)
    rows = await store.afetch(CACHE_READS, {"agent_id": AGENT, "session_key": SESSION})
    assert dict(rows) == {t.turn_id: t.end.tokens.cache_read for t in turns}

    # Replay: the log alone gives back what each model call of a turn was sent.
    for turn in to_replay(turns):
        replayed = await replay(store, agent, turn.turn_id)
        sent = [{k: body[k] for k in ("system", "tools", "messages")} for body in turn.bodies]
        assert jsonable(replayed) == sent, f"turn {turn.index} replays differently"


def view_of(context: SessionContext) -> dict[str, Any]:
    """What a session's next turn reads, less the figures that depend on the correction ratio
    the live actor learnt (the only part of a history that is not in the log)."""
    return {k: v for k, v in jsonable(msgspec.to_builtins(context)).items()
            if k not in ("tokens", "pressure", "source")}  # fmt: skip


def quiet_after_digest(conversation: Conversation, turn: Turn) -> bool:
    """Whether ``turn`` is a talk turn that compacted nothing, after a digest, with results of
    the turns since marked: a point where the next turn's first call compacts nothing either."""
    if turn.action.kind != "talk" or turn.stages() or not conversation.marks:
        return False
    return "digest" in first_changes(conversation.turns)


async def held_context(node: Node) -> SessionContext:
    """The session's context as its live actor holds it (``corrected``: with what the provider
    reported). The actor takes the turn's history when it hears that the turn finished, just
    after its turn.end is stored; until then the engine reads the log, so ask again."""
    assert node.engine is not None
    for _ in range(200):
        context = await node.engine.context(AGENT, SESSION, messages=True)
        assert isinstance(context, SessionContext)
        if context.source == "corrected":
            return context
        await asyncio.sleep(0.01)
    pytest.fail("the session actor never held the session's history")


@pytest.mark.asyncio
async def test_a_restarted_node_continues_from_the_snapshot(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, conversation = await started(node_factory, fake_anthropic, monkeypatch)
    async with conversation.on(first):
        for index in range(160):
            if quiet_after_digest(conversation, await conversation.turn(planned(index))):
                break
        else:
            pytest.fail("no quiet turn after a digest, with results marked, in 160 turns")
    live = await held_context(first)
    assert live.digest is not None
    assert msgspec.structs.astuple(live.history.compacted) != (0, 0, 0)
    before = conversation.turns[-1]

    await first.stop()
    node_factory.started.remove(first)
    second = await node_factory.start()
    assert second.engine is not None
    loaded = await second.engine.context(AGENT, SESSION, messages=True)
    assert isinstance(loaded, SessionContext)
    assert view_of(loaded) == view_of(live)
    history = await load(store_of(second), AGENT, SESSION)
    digests = [s for t in conversation.turns for s in t.stages() if s.stage == "digest"]
    assert history.view.digest is not None and history.view.digest.text == digests[-1].text
    present = {e.obs_id for e in history.entries if e.obs_id is not None}
    assert history.view.marks == {k: v for k, v in conversation.marks.items() if k in present}
    assert history.view.marks

    async with conversation.on(second):
        after = await conversation.turn(Action("talk"))
    assert after.end.reason == "final" and after.stages() == []
    body = after.bodies[0]
    assert body["system"] == jsonable(live.system)
    *earlier, last = body["messages"]
    assert last["content"][-1] == {"type": "text", "text": after.text,
                                   "cache_control": {"type": "ephemeral"}}  # fmt: skip
    rest = [*earlier, {**last, "content": last["content"][:-1]}] if last["content"][1:] else earlier
    assert rest == jsonable(live.messages)
    old, new = segments(json.loads(before.sent[-1])), segments(body)
    assert new[: len(old)] == old
    assert after.end.tokens.cache_read > 0


@pytest.mark.asyncio
async def test_ended_turns_are_not_kept_in_memory(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    node, conversation = await started(node_factory, fake_anthropic, monkeypatch)
    async with conversation.on(node):
        for index in range(30):
            await conversation.turn(planned(index))

    # Weak references, then a collection of what the test allocated (the rest is frozen):
    # what is still referenced afterwards is kept by something.
    runners = [weakref.ref(o) for o in gc.get_objects() if isinstance(o, TurnRunner)]
    gc.collect()
    assert sum(1 for runner in runners if runner() is not None) <= 1


@pytest.mark.asyncio
async def test_a_finished_turn_is_freed_without_waiting_for_a_full_collection(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn's actor and what it held go when the turn ends, by reference counting: left in
    reference cycles they would wait for a full collection, which stalls the event loop for as
    long as it walks everything (bench/sessions.py: 72 ms under load, with ~37,000 such objects
    freed per pass)."""
    node, conversation = await started(node_factory, fake_anthropic, monkeypatch)
    gc.collect()
    gc.disable()  # only reference counting frees anything from here on
    try:
        async with conversation.on(node):
            for index in range(8):
                await conversation.turn(planned(index))
        await asyncio.sleep(0.05)  # the last turn's actor stops after its turn.end
        kept = [o for o in gc.get_objects() if isinstance(o, (TurnActor, TurnRunner))]
    finally:
        gc.enable()
    assert len(kept) <= 2, f"{len(kept)} finished turns' actors and runners are still held"

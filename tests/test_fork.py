"""Forking a session (``POST /v1/agents/{agent}/sessions/{key}/fork``) against a real node: the
new session's next model request carries exactly the source's history up to the turn (as the
fake Anthropic server received it), the source is untouched, both are listed, a fork may go to
another agent, the replay of the new session's turn is what the model got, a restart keeps the
forked history, the projections rebuild to the same rows, and every refusal has its code."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import nats
import pytest

from actors.cluster.partitions import partition_of
from actors.messages import Forked, ForkSession, Refused
from actors.messages import Reply as Answer
from actors.session.core import (
    Append,
    Decision,
    Fork,
    OnceStored,
    ReloadHistory,
    decide,
)
from actors.session.state import (
    Queued,
    SessionState,
    evolve,
)
from eventstore import (
    INLINE,
    NO_STREAM,
    START,
    EventStore,
    Metadata,
    encode_wire,
    streams,
    subjects,
)
from eventstore.catalogue import ForkedMessage, SessionForked
from eventstore.rebuild import rebuild
from tests import fakes
from tests.conftest import ApiFactory, ApiServer, ConnectFactory, Servers
from tests.fakes import FakeAnthropic, Reply, ToolUse
from tests.test_history import bare, said
from tests.test_turns_anthropic import KEY_ENV, manifest
from tests.turns import send, stop, store_of, wait_end

fake_anthropic = fakes.fake_anthropic

Json = dict[str, Any]
TEXTS = ("one", "calculate 6*7", "three", "four", "five")


def reply(body: Json) -> Reply:
    """``re: <text>``; a calculator call for "calculate ..."; a slow answer for "slow ..."."""
    last = body["messages"][-1]["content"][-1]
    text = last.get("text", "") if last.get("type") == "text" else ""
    if text.startswith("calculate"):
        return Reply(text="Counting.", tool_uses=[ToolUse("calculator", {"expression": "6*7"})])
    if text.startswith("slow"):
        return Reply(text="z" * 40, chunk_size=1, event_delay=0.1)
    return Reply(text=f"re: {text or '?'}")


async def start(
    api_factory: ApiFactory, fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> ApiServer:
    """A node with two agents on the fake: ``helper``, and ``critic`` (the same manifest under
    another id and with another instruction, as a changed manifest loaded beside it)."""
    monkeypatch.setenv(KEY_ENV, "test-key")
    fake.responder = reply
    text = manifest(fake)
    api_factory.write_agent("helper", text)
    critic = text.replace("id: helper", "id: critic")
    api_factory.write_agent("critic", critic.replace("a careful", "a critical"))
    return await api_factory.start()


@asynccontextmanager
async def client(api: ApiServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=api.url, headers=api.headers, timeout=30) as http:
        yield http


def fork_path(agent: str, key: str) -> str:
    return f"/v1/agents/{agent}/sessions/{key}/fork"


async def run(
    api: ApiServer, fake: FakeAnthropic, agent: str, key: str, text: str
) -> tuple[str, Json]:
    """Run one turn to its end: its id, and the first model request it made."""
    seen = len(fake.message_requests())
    accepted = await send(api.node, agent, text, key)
    await wait_end(api.node, accepted.turn_id)
    return accepted.turn_id, fake.message_requests()[seen].body


async def session_events(store: EventStore, agent: str, key: str) -> list[str]:
    """The ids of every event about a session (its turns' streams and its own)."""
    events = await store.aread_scoped(START, 10_000, agent_id=agent, session_key=key)
    return [str(e.event_id) for e in events]


async def sessions(http: httpx.AsyncClient, agent: str) -> dict[str, Json]:
    answer = await http.get(f"/v1/agents/{agent}/sessions")
    assert answer.status_code == 200, answer.text
    return {s["sessionKey"]: s for s in answer.json()}


async def rows(http: httpx.AsyncClient, agent: str, key: str) -> list[tuple[Any, ...]]:
    """A session's history rows, oldest first: (position, turn, role, content)."""
    answer = await http.get(f"/v1/agents/{agent}/sessions/{key}/messages", params={"limit": 500})
    assert answer.status_code == 200, answer.text
    page = answer.json()["messages"]
    return [(m["id"], m["turnId"], m["role"], m["content"]) for m in reversed(page)]


# ---- the fork reads turns 1..N, the source stays as it was ---------------------------------


@pytest.mark.asyncio
async def test_a_fork_at_turn_three_reads_exactly_turns_one_to_three(
    api_factory: ApiFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = await start(api_factory, fake_anthropic, monkeypatch)
    store = store_of(api.node)
    turns, firsts = [], []
    for text in TEXTS:
        turn_id, first = await run(api, fake_anthropic, "helper", "s", text)
        turns.append(turn_id)
        firsts.append(first)
    untouched = await session_events(store, "helper", "s")
    origin = {"agentId": "helper", "sessionKey": "s", "turnId": turns[2]}
    async with client(api) as http:
        source_rows = await rows(http, "helper", "s")
        by_id = await http.post(fork_path("helper", "s"), json={"atTurn": turns[2],
                                                                "newKey": "s.alt"})  # fmt: skip
        by_index = await http.post(fork_path("helper", "s"), json={"atTurn": 3})
        assert by_id.status_code == 201, by_id.text
        assert by_index.status_code == 201, by_index.text
        # Turn 1: input and answer; 2: input, tool call, result, answer; 3: input and answer.
        assert by_id.json() == {"agentId": "helper", "sessionKey": "s.alt",
                                "forkedFrom": {**origin, "turns": 3}, "messages": 8}  # fmt: skip
        generated = by_index.json()["sessionKey"]
        assert re.fullmatch(r"s\.fork-[0-9a-f]{6}", generated), generated
        assert {**by_index.json(), "sessionKey": "s.alt"} == by_id.json()
        # Both are listed at once, with where they came from; the source came from nowhere.
        listed = await sessions(http, "helper")
        for key in ("s.alt", generated):
            assert listed[key]["forkedFrom"] == origin
            assert (listed[key]["turns"], listed[key]["messages"]) == (0, 8)
        assert listed["s"]["forkedFrom"] is None
        one = await http.get("/v1/agents/helper/sessions/s.alt")
        assert one.status_code == 200 and one.json()["forkedFrom"] == origin
        # The fork's history is the source's rows of turns 1-3, at their source positions.
        assert await rows(http, "helper", "s.alt") == [r for r in source_rows
                                                        if r[1] in turns[:3]]  # fmt: skip
        assert len(await rows(http, "helper", generated)) == 8

        # The fork's next turn reads turns 1-3 and its own input: what turn 4 read before "four".
        six, asked = await run(api, fake_anthropic, "helper", "s.alt", "six")
        assert bare(asked["messages"][:-1]) == bare(firsts[3]["messages"][:-1])
        assert said({"messages": asked["messages"][-1:]}) == [("user", "six")]
        assert asked["system"] == firsts[3]["system"]
        # The replay of that turn is what the model was sent.
        replayed = await http.get(f"/v1/agents/helper/turns/{six}/context")
        assert replayed.status_code == 200, replayed.text
        step = replayed.json()["steps"][0]
        assert (step["messages"], step["system"]) == (asked["messages"], asked["system"])

        # A fork of the fork, at its own first turn: turns 1-3 of the source, then "six".
        again = await http.post(
            fork_path("helper", "s.alt"), json={"atTurn": 1, "newKey": "s.alt2"}
        )
        assert again.status_code == 201, again.text
        assert again.json()["forkedFrom"] == {"agentId": "helper", "sessionKey": "s.alt",
                                              "turnId": six, "turns": 4}  # fmt: skip
        assert again.json()["messages"] == 10
        _, deeper = await run(api, fake_anthropic, "helper", "s.alt2", "eight")
        assert said(deeper) == [*said(asked), ("assistant", "re: six"), ("user", "eight")]

    # The source has no event more than before, and its next turn reads all five turns.
    assert await session_events(store, "helper", "s") == untouched
    _, seventh = await run(api, fake_anthropic, "helper", "s", "seven")
    assert said(seventh) == [*said(firsts[4]), ("assistant", "re: five"), ("user", "seven")]
    assert [text for role, text in said(seventh) if role == "user"] == [
        "one", "calculate 6*7", "[tool_result]", "three", "four", "five", "seven",
    ]  # fmt: skip

    # The new session's stream starts with session.forked; its rows stay off public streams.
    (forked,) = await store.aread_stream(streams.session("helper", "s.alt"))
    assert isinstance(forked.data, SessionForked) and forked.data.turns == turns[:3]
    assert len(forked.data.messages) == 8
    wire = msgspec.json.decode(encode_wire(forked))
    assert wire["type"] == "session.forked" and "messages" not in wire["data"]
    assert wire["data"] == {"sourceAgentId": "helper", "sourceSessionKey": "s",
                            "atTurnId": turns[2], "turns": turns[:3]}  # fmt: skip


# ---- another agent; a restart; a rebuild -----------------------------------------------------


def table(connect: ConnectFactory, name: str, order: str) -> list[tuple[Any, ...]]:
    with connect(autocommit=True) as conn:
        return conn.execute(f"SELECT * FROM {name} ORDER BY {order}").fetchall()


@pytest.mark.asyncio
async def test_a_fork_into_another_agent_survives_a_restart_and_a_rebuild(
    api_factory: ApiFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    connect: ConnectFactory,
    store: EventStore,
) -> None:
    api = await start(api_factory, fake_anthropic, monkeypatch)
    turns, firsts = [], []
    for text in TEXTS[:3]:
        turn_id, first = await run(api, fake_anthropic, "helper", "s", text)
        turns.append(turn_id)
        firsts.append(first)
    async with client(api) as http:
        other = await http.post(fork_path("helper", "s"), json={"atTurn": 2, "agent": "critic",
                                                                "newKey": "c"})  # fmt: skip
        cold = await http.post(fork_path("helper", "s"), json={"atTurn": 3, "newKey": "cold"})
        assert other.status_code == 201, other.text
        assert other.json() == {
            "agentId": "critic", "sessionKey": "c", "messages": 6,
            "forkedFrom": {"agentId": "helper", "sessionKey": "s", "turnId": turns[1],
                           "turns": 2},
        }  # fmt: skip
        assert cold.status_code == 201, cold.text
        assert (await sessions(http, "critic"))["c"]["forkedFrom"] == {
            "agentId": "helper",
            "sessionKey": "s",
            "turnId": turns[1],
        }
        assert "c" not in await sessions(http, "helper")
    # The critic reads turns 1-2 under its own instructions.
    _, hi = await run(api, fake_anthropic, "critic", "c", "hi")
    assert bare(hi["messages"][:-1]) == bare(firsts[2]["messages"][:-1])
    assert "a critical test agent" in str(hi["system"])
    assert "a critical test agent" not in str(firsts[2]["system"])

    # Rebuilt from the log, the history and the sessions are the same rows.
    await api.stop()
    await api.node.stop()
    api_factory.started.remove(api)
    api_factory.nodes.started.remove(api.node)
    live = {name: table(connect, name, order) for name, order in (
        ("messages", "agent_id, session_key, position"), ("sessions", "agent_id, session_key"),
    )}  # fmt: skip

    def rebuild_history() -> None:
        for projection in INLINE:
            if projection.name in ("messages", "sessions"):
                rebuild(store, projection, inline=True)

    await asyncio.to_thread(rebuild_history)
    assert {name: table(connect, name, order) for name, order in (
        ("messages", "agent_id, session_key, position"), ("sessions", "agent_id, session_key"),
    )} == live  # fmt: skip

    # A new node (no session in memory) gives both forks the same history.
    api = await api_factory.start()
    _, more = await run(api, fake_anthropic, "critic", "c", "more")
    assert said(more) == [*said(hi), ("assistant", "re: hi"), ("user", "more")]
    _, woken = await run(api, fake_anthropic, "helper", "cold", "again")
    assert said(woken) == [*said(firsts[2]), ("assistant", "re: three"), ("user", "again")]


# ---- refusals --------------------------------------------------------------------------------


def problem(answer: httpx.Response) -> tuple[int, str, str | None]:
    error = answer.json()["error"]
    assert error["message"] and error["hint"], error
    return answer.status_code, error["code"], error.get("field")


@pytest.mark.asyncio
async def test_every_refusal_has_its_code(
    api_factory: ApiFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = await start(api_factory, fake_anthropic, monkeypatch)
    first, _ = await run(api, fake_anthropic, "helper", "s", "one")
    await run(api, fake_anthropic, "helper", "s", "two")
    await run(api, fake_anthropic, "helper", "s", "three")
    await run(api, fake_anthropic, "helper", "gone", "before the clear")
    path = fork_path("helper", "s")
    async with client(api) as http:
        cleared = await http.delete("/v1/agents/helper/sessions/gone")
        assert cleared.status_code == 200, cleared.text
        after_clear, _ = await run(api, fake_anthropic, "helper", "gone", "after the clear")
        made = await http.post(path, json={"atTurn": 1, "newKey": "taken"})
        assert made.status_code == 201, made.text
        cases: list[tuple[str, Any, tuple[int, str, str | None]]] = [
            (path, {}, (400, "fork_invalid", "atTurn")),
            (path, {"atTurn": 0}, (400, "fork_invalid", "atTurn")),
            (path, {"atTurn": -2}, (400, "fork_invalid", "atTurn")),
            (path, {"atTurn": True}, (400, "fork_invalid", "atTurn")),
            (path, {"atTurn": 1.5}, (400, "fork_invalid", "atTurn")),
            (path, {"atTurn": 4.0}, (404, "turn_not_found", "atTurn")),  # JSON Schema's integer
            (path, {"atTurn": None}, (400, "fork_invalid", "atTurn")),
            (path, {"atTurn": ""}, (400, "fork_invalid", "atTurn")),
            (path, {"atTurn": [1]}, (400, "fork_invalid", "atTurn")),
            (path, {"atTurn": 2**70}, (400, "fork_invalid", "atTurn")),
            (path, {"atTurn": 1, "newKey": "a/b"}, (400, "session_key_invalid", "newKey")),
            (path, {"atTurn": 1, "newKey": " "}, (400, "session_key_invalid", "newKey")),
            (path, {"atTurn": 1, "newKey": ""}, (400, "session_key_invalid", "newKey")),
            (path, {"atTurn": 1, "newKey": "x" * 513}, (400, "session_key_invalid", "newKey")),
            (path, {"atTurn": 1, "newKey": 7}, (400, "session_key_invalid", "newKey")),
            (path, {"atTurn": 1, "newKey": "a\u0000b"}, (400, "session_key_invalid", "newKey")),
            (path, [1], (400, "request_body_invalid", None)),
            (fork_path("nobody", "s"), {"atTurn": 1}, (404, "agent_not_found", None)),
            (path, {"atTurn": 1, "agent": "nobody"}, (404, "agent_not_found", "agent")),
            (fork_path("helper", "nope"), {"atTurn": 1}, (404, "session_not_found", "sessionKey")),
            (path, {"atTurn": 4}, (404, "turn_not_found", "atTurn")),
            (path, {"atTurn": "t_nope"}, (404, "turn_not_found", "atTurn")),
            (path, {"atTurn": "a\u0000b"}, (404, "turn_not_found", "atTurn")),
            (fork_path("helper", "gone"), {"atTurn": 1}, (409, "fork_turn_cleared", "atTurn")),
            (path, {"atTurn": 1, "newKey": "s"}, (409, "session_exists", "newKey")),
            (path, {"atTurn": 1, "newKey": "taken"}, (409, "session_exists", "newKey")),
            (path, {"atTurn": 1, "newKey": "gone"}, (409, "session_exists", "newKey")),
        ]  # fmt: skip
        wrong = []
        for where, body, expected in cases:
            answer = await http.post(where, json=body)
            if problem(answer) != expected:
                wrong.append(f"{where} {body!r}: {answer.status_code} {answer.text}")
        assert wrong == []
        # After a clear, a turn accepted after it can be forked: only its history is there.
        later = await http.post(fork_path("helper", "gone"), json={"atTurn": after_clear})
        assert later.status_code == 201, later.text
        assert (later.json()["messages"], later.json()["forkedFrom"]["turns"]) == (2, 1)
        # A turn still running cannot be forked at; once it has ended it can.
        slow = await send(api.node, "helper", "slow answer", "s")
        running = await http.post(path, json={"atTurn": slow.turn_id})
        assert problem(running) == (409, "turn_not_ended", "atTurn")
        assert (await stop(api.node, slow.turn_id)).stopping
        await wait_end(api.node, slow.turn_id)
        stopped = await http.post(path, json={"atTurn": slow.turn_id, "newKey": "s.stopped"})
        assert stopped.status_code == 201, stopped.text
        # None of it touched the session forked from, nor made a session of a refused key.
        listed = await sessions(http, "helper")
    assert {"a/b", "x" * 513, "nope"} & listed.keys() == set()
    assert listed["taken"]["forkedFrom"]["turnId"] == first


# ---- the command as another node forwards it -------------------------------------------------


@pytest.mark.asyncio
async def test_a_forwarded_fork_is_carried_out_by_the_new_sessions_owner(
    api: ApiServer, servers: Servers
) -> None:
    """What a node that does not own the new session sends: the command, over NATS, to the
    owner's subject for the new session's partition; the answer is the Reply envelope."""
    accepted = await send(api.node, "assistant", "hello", "src")
    await wait_end(api.node, accepted.turn_id)
    command = ForkSession(agent_id="assistant", session_key="dst", source_agent_id="assistant",
                          source_session_key="src", at_turn=accepted.turn_id)  # fmt: skip
    partition = partition_of("assistant", "dst", api.node.settings.partitions)
    subject = subjects.node_command(api.node.node_id, "fork", partition)
    nc = await nats.connect(servers.nats_url)
    try:
        answers = [
            msgspec.json.decode((await nc.request(subject, body, timeout=10)).data, type=Answer)
            for body in (msgspec.json.encode(command), msgspec.json.encode(command))
        ]
    finally:
        await nc.close()
    assert answers[0] == Answer(forked=Forked(
        agent_id="assistant", session_key="dst", source_agent_id="assistant",
        source_session_key="src", turn_id=accepted.turn_id, turns=1, messages=2,
    ))  # fmt: skip
    assert answers[1].error is not None and answers[1].error.code == "session_exists"


# ---- the session's decision ------------------------------------------------------------------


FORKED = SessionForked(
    source_agent_id="a", source_session_key="src", at_turn_id="t1", turns=["t1"],
    messages=[ForkedMessage(turn_id="t1", position=3, role="user",
                            content={"type": "text", "text": "hi"})],
)  # fmt: skip
ANSWER = Forked(agent_id="a", session_key="k", source_agent_id="a", source_session_key="src",
                turn_id="t1", turns=1, messages=1)  # fmt: skip
IDLE = SessionState(agent_id="a", session_key="k")


def test_a_new_session_appends_the_fork_as_its_first_event_and_reloads_its_history() -> None:
    assert decide(IDLE, Fork(FORKED, ANSWER)) == Decision(
        OnceStored(ANSWER),
        Append(streams.session("a", "k"), FORKED, Metadata(agent_id="a", session_key="k"),
               NO_STREAM),
        effects=(ReloadHistory(),),
    )  # fmt: skip


def test_a_session_with_a_turn_in_hand_is_not_forked_into() -> None:
    decision = decide(evolve(IDLE, Queued("t9")), Fork(FORKED, ANSWER))
    assert isinstance(decision.answer, Refused) and decision.append is None
    assert (decision.answer.code, decision.answer.field) == ("session_busy", "newKey")

"""``GET /v1/agents/{agent}/context`` (what the next turn of a session would read, block by block)
and ``GET …/turns/{turnId}/context`` (what each model call of a past turn was sent), against a
real node and its default agent (the offline scripted model)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.conftest import ApiFactory, ApiServer
from tests.turns import send, store_of, wait_end

Json = dict[str, Any]
CONTEXT = "/v1/agents/assistant/context"


async def context(api: ApiServer, key: str, **params: str) -> Json:
    async with httpx.AsyncClient(base_url=api.url, headers=api.headers) as client:
        answer = await client.get(CONTEXT, params={"sessionKey": key, **params})
    assert answer.status_code == 200, answer.text
    body: Json = answer.json()
    return body


async def turn_context(api: ApiServer, turn_id: str) -> Json:
    async with httpx.AsyncClient(base_url=api.url, headers=api.headers) as client:
        answer = await client.get(f"/v1/agents/assistant/turns/{turn_id}/context")
    assert answer.status_code == 200, answer.text
    body: Json = answer.json()
    return body


async def run(api: ApiServer, text: str, key: str) -> str:
    accepted = await send(api.node, "assistant", text, session=key)
    await wait_end(api.node, accepted.turn_id)
    return accepted.turn_id


def labels(view: Json) -> list[str]:
    return [b["label"] for b in view["slots"]]


def block(view: Json, label: str) -> Json:
    found: list[Json] = [b for b in view["slots"] if b["label"] == label]
    assert len(found) == 1, labels(view)
    return found[0]


def consistent(view: Json) -> None:
    """The figures of a view agree with each other."""
    assert view["budget"] == view["window"] - view["reserveOutput"]
    assert view["pressure"] == round(view["tokens"] / view["budget"], 4)
    assert [b["slot"] for b in view["slots"]] == list(range(len(view["slots"])))
    assert view["total"] == sum(b["tokens"] for b in view["slots"])
    if view["source"] == "estimated":  # not corrected by reported figures
        assert view["tokens"] == view["total"]


# ---- the next turn's context ---------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_fresh_session_shows_the_pinned_blocks_and_no_history(api: ApiServer) -> None:
    view = await context(api, "ctx:fresh")
    assert (view["agentId"], view["sessionKey"]) == ("assistant", "ctx:fresh")
    assert labels(view) == ["tools", "identity", "configuration", "history"]
    assert [b["pinned"] for b in view["slots"]] == [True, True, True, False]
    assert "text" not in block(view, "tools") and "text" not in block(view, "history")
    assert block(view, "identity")["text"].startswith("You are Assistant")
    assert block(view, "configuration")["text"]
    assert block(view, "tools")["tokens"] > 0 and block(view, "history")["tokens"] == 0
    assert view["history"] == {"turns": 0, "messages": 0,
                               "compacted": {"excerpt": 0, "dedupe": 0, "stub": 0}}  # fmt: skip
    assert view["digest"] is None and view["source"] == "estimated"
    assert (view["window"], view["reserveOutput"], view["budget"]) == (200_000, 4096, 195_904)
    assert view["thresholds"] == {"excerpt": 0.6, "dedupe": 0.7, "stub": 0.8, "digest": 0.88,
                                  "reset": 0.95}  # fmt: skip
    assert 0 < view["pressure"] < 0.1
    assert view["breakpoints"] == 1  # the end of the pinned system blocks
    assert "messages" not in view and "system" not in view
    consistent(view)
    # Reading a context activates no session actor.
    engine = api.node.engine
    assert engine is not None and ("assistant", "ctx:fresh") not in engine.live_sessions()


@pytest.mark.asyncio
async def test_messages_true_adds_the_request_as_the_model_gets_it(api: ApiServer) -> None:
    view = await context(api, "ctx:fresh-messages", messages="true")
    assert view["messages"] == []  # no history, and no input yet
    texts = [b["text"] for b in view["slots"] if "text" in b]
    assert [s["text"] for s in view["system"]] == texts
    assert view["system"][-1]["cache_control"] == {"type": "ephemeral"}
    assert (await context(api, "ctx:fresh-messages", messages="false")).keys() == (
        view.keys() - {"messages", "system"}
    )


@pytest.mark.asyncio
async def test_an_input_is_assembled_as_the_next_turn_would(api: ApiServer) -> None:
    """Dispach v1's ``?input=``: the input slot, and the request the first call would send."""
    key = "ctx:input"
    await run(api, "calculate 3*3", key)
    bare = await context(api, key, messages="true")
    view = await context(api, key, input="and 4*4?", messages="true")
    consistent(view)
    assert labels(view) == [*labels(bare), "input"]
    typed = block(view, "input")
    assert typed["text"] == "and 4*4?" and typed["pinned"] is True and typed["tokens"] > 0
    assert view["total"] == bare["total"] + typed["tokens"]
    assert view["messages"][:-1] == bare["messages"]
    assert view["messages"][-1] == {
        "role": "user",
        "content": [{"type": "text", "text": "and 4*4?", "cache_control": {"type": "ephemeral"}}],
    }
    assert view["breakpoints"] == bare["breakpoints"] + 1 == 3
    turn_id = await run(api, "and 4*4?", key)
    first = (await turn_context(api, turn_id))["steps"][0]
    assert (first["system"], first["messages"]) == (view["system"], view["messages"])


@pytest.mark.asyncio
async def test_two_turns_with_a_tool_call_grow_the_history(api: ApiServer) -> None:
    key = "ctx:two"
    fresh = await context(api, key)
    await run(api, "calculate 6*7", key)
    one = await context(api, key)
    await run(api, "hello", key)
    two = await context(api, key, messages="true")
    for view in (one, two):
        consistent(view)
        assert labels(view) == ["tools", "identity", "configuration", "history"]
    # The first turn: its input, the tool call, its result, the answer.
    assert one["history"] == {"turns": 1, "messages": 4,
                              "compacted": {"excerpt": 0, "dedupe": 0, "stub": 0}}  # fmt: skip
    assert two["history"]["turns"] == 2 and two["history"]["messages"] == 6
    history = [block(v, "history")["tokens"] for v in (fresh, one, two)]
    assert history[0] == 0 < history[1] < history[2]
    assert fresh["tokens"] < one["tokens"] < two["tokens"]
    assert fresh["pressure"] < one["pressure"] < two["pressure"]
    # The pinned blocks do not change from turn to turn.
    pinned = [b for b in fresh["slots"] if b["pinned"]]
    assert [b for b in two["slots"] if b["pinned"]] == pinned
    messages = two["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user",
                                             "assistant"]  # fmt: skip
    assert messages[0]["content"] == [{"type": "text", "text": "calculate 6*7"}]
    (call,) = messages[1]["content"]
    (result,) = messages[2]["content"]
    assert call["type"] == "tool_use" and call["name"] == "calculator"
    assert result["type"] == "tool_result" and result["tool_use_id"] == call["id"]
    assert "42" in str(result["content"])
    assert messages[4]["content"] == [{"type": "text", "text": "hello"}]
    # Cache breakpoints: the end of the pinned system blocks, the end of the history (the
    # next turn's input will carry a third).
    assert messages[-1]["content"][-1]["cache_control"] == {"type": "ephemeral"}
    assert two["breakpoints"] == 2


@pytest.mark.asyncio
async def test_notes_written_by_session_notes_are_a_block(api: ApiServer) -> None:
    key = "ctx:notes"
    await run(api, "note: the budget is 40 euros", key)
    view = await context(api, key, messages="true")
    consistent(view)
    assert labels(view) == ["tools", "identity", "configuration", "notes", "history"]
    notes = block(view, "notes")
    assert notes["pinned"] is False and notes["tokens"] > 0
    assert notes["text"] == (
        "Your notes for this session (session_notes):\n1. the budget is 40 euros"
    )
    assert view["system"][-1] == {"type": "text", "text": notes["text"]}
    await run(api, "remember: pay by card", key)
    again = block(await context(api, key), "notes")
    assert again["text"].endswith("1. the budget is 40 euros\n2. pay by card")
    # Another session has no notes.
    assert "notes" not in labels(await context(api, "ctx:notes-other"))


@pytest.mark.asyncio
async def test_a_passivated_session_shows_the_same_context_rebuilt_from_the_log(
    api_factory: ApiFactory,
) -> None:
    api = await api_factory.start(session_idle_seconds=1.0)
    key = "ctx:sleepy"
    await run(api, "calculate 2+3", key)
    await run(api, "note: call back at 5", key)
    live = await context(api, key, messages="true")
    engine = api.node.engine
    assert engine is not None and ("assistant", key) in engine.live_sessions()

    async def passivated() -> None:
        while ("assistant", key) in engine.live_sessions():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(passivated(), 10)
    rebuilt = await context(api, key, messages="true")
    assert rebuilt["source"] == "estimated"
    consistent(rebuilt)
    for field in ("slots", "total", "history", "digest", "messages", "system", "breakpoints"):
        assert rebuilt[field] == live[field], field
    assert ("assistant", key) not in engine.live_sessions()


TIGHT = """
id: tight
model:
  provider: scripted
  context_window: 5000
  max_output_tokens: 500
  script:
    - {match: "^fetch ([a-z]+)$", tool: fetch_report, input: {topic: "{1}"}}
tools:
  - name: fetch_report
    module: tests.test_context_api:fetch_report
    description: A long report on a topic.
    input_schema: {type: object, properties: {topic: {type: string}}, required: [topic]}
context:
  keep_turns: 1
  thresholds: {excerpt: 0.3, dedupe: 0.35, stub: 0.4, digest: 0.45, reset: 0.9}
"""


def fetch_report(args: dict[str, Any], ctx: object) -> str:
    """The ``tight`` agent's tool: about 1,500 tokens of distinct lines."""
    topic = str(args["topic"])
    return "\n".join(f"{topic} line {i}: {i * 7919 % 10007} units" for i in range(250))


def rendered_marks(messages: list[Json]) -> dict[str, int]:
    """How many tool results the request shows compacted, by how they read."""
    results = [str(b["content"]) for m in messages for b in m["content"]
               if b.get("type") == "tool_result"]  # fmt: skip
    return {
        "excerpt": sum("characters cut by compaction" in r for r in results),
        "dedupe": sum(r.startswith("[superseded") for r in results),
        "stub": sum(r.startswith("[compacted tool result") for r in results),
    }


@pytest.mark.asyncio
async def test_compaction_shows_as_marks_and_a_digest(api_factory: ApiFactory) -> None:
    api_factory.write_agent("tight", TIGHT)
    api = await api_factory.start(session_idle_seconds=1.0)
    key = "ctx:tight"
    turn_id = ""
    async with httpx.AsyncClient(base_url=api.url) as client:

        async def view() -> Json:
            answer = await client.get("/v1/agents/tight/context",
                                      params={"sessionKey": key, "messages": "true"})  # fmt: skip
            assert answer.status_code == 200, answer.text
            body: Json = answer.json()
            return body

        for topic in ("alpha", "beta", "gamma", "delta"):
            accepted = await send(api.node, "tight", f"fetch {topic}", session=key)
            await wait_end(api.node, accepted.turn_id)
            turn_id = accepted.turn_id
        live = await view()
        replayed = await client.get(f"/v1/agents/tight/turns/{turn_id}/context")
        engine = api.node.engine
        assert engine is not None

        async def passivated() -> None:
            while ("tight", key) in engine.live_sessions():
                await asyncio.sleep(0.05)

        await asyncio.wait_for(passivated(), 10)
        rebuilt = await view()
    consistent(live)
    assert live["window"] == 5000 and live["budget"] == 4500
    assert live["thresholds"] == {"excerpt": 0.3, "dedupe": 0.35, "stub": 0.4, "digest": 0.45,
                                  "reset": 0.9}  # fmt: skip
    # The digest covers the turns before the one kept verbatim when it was written.
    digest = live["digest"]
    assert digest is not None and digest["source"] == "mechanical"
    assert (digest["turns"], digest["requests"]) == (2, 2)
    assert live["history"]["turns"] == 2 and live["history"]["messages"] == 8
    assert labels(live) == ["tools", "configuration", "digest", "history"]
    block_text = block(live, "digest")["text"]
    assert block_text.startswith("[Summary of the 2 earlier turns")
    assert digest["text"] in block_text
    assert "1. fetch alpha\n2. fetch beta" in block_text  # the requests, verbatim
    assert live["messages"][0]["content"][0]["text"] == block_text
    # The counts are the marks the request shows.
    assert live["history"]["compacted"] == rendered_marks(live["messages"])
    assert sum(live["history"]["compacted"].values()) > 0
    # The last model call of the last turn read the digest too.
    assert replayed.status_code == 200
    last = replayed.json()["steps"][-1]["messages"]
    assert last[0]["content"][0]["text"] == block_text
    # Rebuilt from the session's snapshot, the same view.
    for field in ("slots", "total", "history", "digest", "messages", "system", "breakpoints"):
        assert rebuilt[field] == live[field], field
    assert rebuilt["source"] == "estimated" and rebuilt["tokens"] == rebuilt["total"]


# ---- a past turn's context -----------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_turn_replays_one_step_per_model_call(api: ApiServer) -> None:
    key = "ctx:replay"
    turn_id = await run(api, "calculate 6*7", key)
    replayed = await turn_context(api, turn_id)
    events = await store_of(api.node).aread_turn(turn_id)
    calls = [e for e in events if e.type == "model.call"]
    assert replayed["turnId"] == turn_id
    steps = replayed["steps"]
    assert len(steps) == len(calls) == 2
    assert [s["step"] for s in steps] == [1, 2]
    first, second = steps
    assert first["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "calculate 6*7", "cache_control": {"type": "ephemeral"}}
            ],
        }
    ]
    (call,) = second["messages"][1]["content"]
    assert call["type"] == "tool_use" and call["name"] == "calculator"
    result = second["messages"][-1]["content"][-1]
    assert result["type"] == "tool_result" and result["tool_use_id"] == call["id"]
    assert "calculator" in {t["name"] for t in first["tools"]}
    assert first["system"] == second["system"] and first["tools"] == second["tools"]


@pytest.mark.asyncio
async def test_a_later_turn_read_what_the_context_view_showed_before_it(api: ApiServer) -> None:
    key = "ctx:before"
    await run(api, "calculate 1+1", key)
    await run(api, "note: blue", key)
    before = await context(api, key, messages="true")
    turn_id = await run(api, "hello again", key)
    (step,) = (await turn_context(api, turn_id))["steps"]
    assert step["system"] == before["system"]
    *history, last = step["messages"]
    assert history == before["messages"]
    assert last == {
        "role": "user",
        "content": [
            {"type": "text", "text": "hello again", "cache_control": {"type": "ephemeral"}}
        ],
    }
    # A turn that is not the newest replays the same as when it was.
    assert (await turn_context(api, turn_id))["steps"] == [step]


# ---- errors --------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("params", "status", "code", "field"),
    [
        ({"sessionKey": ""}, 400, "session_key_invalid", "sessionKey"),
        ({"sessionKey": "a/b"}, 400, "session_key_invalid", "sessionKey"),
        ({"sessionKey": "k" * 513}, 400, "session_key_invalid", "sessionKey"),
        ({"sessionKey": "k", "messages": "yes"}, 400, "context_query_invalid", "messages"),
        ({"sessionKey": "k", "input": "x" * 4001}, 400, "context_query_invalid", "input"),
    ],
)
async def test_a_bad_context_query_is_refused(
    api: ApiServer, params: dict[str, str], status: int, code: str, field: str
) -> None:
    async with httpx.AsyncClient(base_url=api.url) as client:
        answer = await client.get(CONTEXT, params=params)
    assert answer.status_code == status
    error = answer.json()["error"]
    assert (error["code"], error["field"]) == (code, field) and error["hint"]


@pytest.mark.asyncio
async def test_unknown_agents_and_turns_are_not_found(api: ApiServer) -> None:
    turn_id = await run(api, "hello", "ctx:errors")
    async with httpx.AsyncClient(base_url=api.url) as client:
        agent = await client.get("/v1/agents/nobody/context", params={"sessionKey": "k"})
        turn_agent = await client.get(f"/v1/agents/nobody/turns/{turn_id}/context")
        turn = await client.get("/v1/agents/assistant/turns/t-nope/context")
    for answer in (agent, turn_agent):
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "agent_not_found"
    assert turn.status_code == 404 and turn.json()["error"]["code"] == "turn_not_found"


@pytest.mark.asyncio
async def test_a_turn_of_another_agent_is_not_found(api_factory: ApiFactory) -> None:
    api_factory.write_agent("other", "id: other\nmodel: {provider: scripted}\n")
    api = await api_factory.start()
    accepted = await send(api.node, "other", "hi", session="ctx:other")
    await wait_end(api.node, accepted.turn_id)
    async with httpx.AsyncClient(base_url=api.url) as client:
        mine = await client.get(f"/v1/agents/other/turns/{accepted.turn_id}/context")
        theirs = await client.get(f"/v1/agents/assistant/turns/{accepted.turn_id}/context")
    assert mine.status_code == 200 and len(mine.json()["steps"]) == 1
    assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "turn_not_found"


@pytest.mark.asyncio
async def test_the_context_needs_the_token(api_factory: ApiFactory) -> None:
    api = await api_factory.start(tokens=["ctx-secret"])
    async with httpx.AsyncClient(base_url=api.url) as client:
        without = await client.get(CONTEXT, params={"sessionKey": "k"})
        scoped = await client.get(CONTEXT, params={"sessionKey": "k"}, headers=api.headers)
    assert without.status_code == 401 and scoped.status_code == 200

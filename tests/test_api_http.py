"""The REST side of HTTP API v1 against a real uvicorn server: accepting messages, idempotency,
the error envelope, turns, stop, sessions and their history, authentication and the Host check,
and what Dispach v1 clients rely on."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx
import pytest

from actors.messages import Accepted
from eventstore import streams
from gateways.ingress import IngressMessage, request
from tests.conftest import ApiFactory, ApiServer

T = TypeVar("T")
Json = dict[str, Any]

# ---- agents declared by some tests ---------------------------------------------------------------

HELPER = """
id: helper
model: {provider: scripted}
"""

SLEEPY = """
id: sleepy
model:
  provider: scripted
  script:
    - {match: "^nap$", tool: nap, input: {seconds: 60}}
tools:
  - name: nap
    module: tests.test_api_http:nap
    description: Sleeps until its turn is stopped.
    input_schema: {type: object}
"""

BRIEF = """
id: brief
model: {provider: scripted}
tools: [calculator]
limits: {max_steps: 1}
"""


async def nap(args: dict[str, Any], ctx: object) -> str:
    """The `sleepy` agent's tool: a coroutine, so stopping its turn cancels it at once."""
    await asyncio.sleep(float(args.get("seconds", 60)))
    return "rested"


# ---- helpers -------------------------------------------------------------------------------------

TURN_FIELDS = {
    "turnId", "agentId", "sessionKey", "status", "state", "source", "input", "text", "steps",
    "promptTokens", "outputTokens", "startedAt", "endedAt", "durationMs",
}  # fmt: skip


def client_of(api: ApiServer, **headers: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=api.url, headers={**api.headers, **headers}, timeout=30)


async def post(
    http: httpx.AsyncClient,
    text: str,
    *,
    agent: str = "assistant",
    key: str | bytes | None = None,
    **body: Any,
) -> httpx.Response:
    raw = key.encode() if isinstance(key, str) else key
    headers = [] if raw is None else [(b"Idempotency-Key", raw)]
    return await http.post(
        f"/v1/agents/{agent}/messages", json={"text": text, **body}, headers=headers
    )


def burst(api: ApiServer, key: str, requests: list[Json]) -> list[httpx.Response]:
    """POST every body of ``requests`` at once with one Idempotency-Key, from a thread with a
    loop of its own: the test's loop, which runs the server, then has only the server to run."""

    async def send_all() -> list[httpx.Response]:
        async with client_of(api) as http:
            return await asyncio.gather(*(post(http, key=key, **body) for body in requests))

    return asyncio.run(send_all())


async def accept(http: httpx.AsyncClient, text: str, **options: Any) -> Json:
    """POST a message that must be accepted (202); its ``{turnId, sessionKey}``."""
    response = await post(http, text, **options)
    assert response.status_code == 202, response.text
    body: Json = response.json()
    return body


JSON_BODY = {"Content-Type": "application/json"}


def cleared_body(key: str) -> Json:
    """The answer to clearing session ``key`` (v1's flag: nothing beyond the session is
    touched; what the session starts again without)."""
    return {"cleared": key, "memoryFilesKept": True, "reset": ["history", "notes", "phase"]}


def error_of(response: httpx.Response, status: int, code: str) -> Json:
    """The error envelope of ``response``, checked: its status, code, a message and a hint."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error: Json = response.json()["error"]
    assert error["code"] == code, error
    assert error["message"] and error["hint"], error
    return error


async def eventually(
    probe: Callable[[], Awaitable[T | None]], what: str, timeout: float = 10.0
) -> T:
    """The first non-None answer of ``probe``, polled until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        found = await probe()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.05)


async def get_turn(http: httpx.AsyncClient, turn_id: str, agent: str = "assistant") -> Json:
    response = await http.get(f"/v1/agents/{agent}/turns/{turn_id}")
    assert response.status_code == 200, response.text
    body: Json = response.json()
    return body


async def ended(
    http: httpx.AsyncClient, turn_id: str, agent: str = "assistant", timeout: float = 30.0
) -> Json:
    """The turn resource once its status is no longer ``running``."""

    async def probe() -> Json | None:
        turn = await get_turn(http, turn_id, agent)
        return None if turn["status"] == "running" else turn

    return await eventually(probe, f"turn {turn_id} to end", timeout)


async def turn_events(
    http: httpx.AsyncClient, turn_id: str, agent: str = "assistant"
) -> list[Json]:
    response = await http.get(f"/v1/agents/{agent}/turns/{turn_id}/events")
    assert response.status_code == 200, response.text
    events: list[Json] = response.json()["events"]
    return events


async def started_tool(http: httpx.AsyncClient, turn_id: str, agent: str = "sleepy") -> None:
    """Wait until the turn has called its (slow) tool."""

    async def probe() -> bool | None:
        events = await turn_events(http, turn_id, agent)
        return True if any(e["type"] == "tool.call" for e in events) else None

    await eventually(probe, f"turn {turn_id} to call its tool")


async def history(http: httpx.AsyncClient, session: str, agent: str = "assistant") -> list[Json]:
    """The session's messages, newest first. The history projection is updated in the
    transaction of each event, so once a turn has ended its messages are all there."""
    response = await http.get(f"/v1/agents/{agent}/sessions/{session}/messages")
    assert response.status_code == 200, response.text
    messages: list[Json] = response.json()["messages"]
    return messages


async def all_turns(http: httpx.AsyncClient, agent: str = "assistant", **query: Any) -> list[Json]:
    response = await http.get(f"/v1/agents/{agent}/turns", params=query)
    assert response.status_code == 200, response.text
    turns: list[Json] = response.json()["turns"]
    return turns


async def sse_frames(response: httpx.Response) -> AsyncIterator[tuple[str, str | None, Json]]:
    """``(event, id, data)`` for each frame of an SSE body (heartbeat comments skipped)."""
    fields: dict[str, str] = {}
    data: list[str] = []
    async for line in response.aiter_lines():
        if line.startswith(":"):
            continue
        if not line:
            if data:
                yield fields.get("event", "message"), fields.get("id"), json.loads("\n".join(data))
            fields, data = {}, []
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        else:
            fields[name] = value


# ---- accepting a message -------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_message_is_accepted_with_its_turn_id_and_the_default_session(
    api: ApiServer,
) -> None:
    async with client_of(api) as http:
        response = await post(http, "hello there")
    assert response.status_code == 202, response.text
    body = response.json()
    assert set(body) == {"turnId", "sessionKey"}  # no `replayed` on a first acceptance
    assert body["sessionKey"] == "api:default"
    assert body["turnId"].startswith("t_")


@pytest.mark.asyncio
async def test_the_turn_is_readable_right_after_acceptance(api: ApiServer) -> None:
    async with client_of(api) as http:
        accepted = await accept(http, "hello there")
        turn = await get_turn(http, accepted["turnId"])
        anywhere = await http.get(f"/v1/turns/{accepted['turnId']}")
    assert turn["status"] in ("running", "final")
    assert turn["state"] in ("accepted", "running", "ended")
    assert anywhere.status_code == 200 and anywhere.json()["turnId"] == accepted["turnId"]


@pytest.mark.asyncio
async def test_a_turn_runs_to_its_end_with_no_client_attached(api: ApiServer) -> None:
    async with client_of(api) as http:
        accepted = await accept(http, "hello there", sessionKey="s1")
        turn = await ended(http, accepted["turnId"])
    assert set(turn) >= TURN_FIELDS
    assert turn["turnId"] == accepted["turnId"]
    assert (turn["agentId"], turn["sessionKey"]) == ("assistant", "s1")
    assert (turn["status"], turn["state"], turn["source"]) == ("final", "ended", "api")
    assert turn["input"] == "hello there"
    assert "[scripted model, offline] You said: hello there" in turn["text"]
    assert turn["steps"] == 1
    assert turn["promptTokens"] > 0 and turn["outputTokens"] > 0
    assert turn["startedAt"] <= turn["endedAt"]
    assert turn["durationMs"] >= 0


# ---- idempotency ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_fifty_concurrent_posts_with_one_key_make_one_turn(api: ApiServer) -> None:
    responses = await asyncio.to_thread(burst, api, "key-50", [{"text": "once"}] * 50)
    async with client_of(api) as http:
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [200] * 49 + [202], [r.text for r in responses if r.status_code >= 300]
        bodies = [r.json() for r in responses]
        assert len({b["turnId"] for b in bodies}) == 1
        turn_id = bodies[0]["turnId"]
        for response, body in zip(responses, bodies, strict=True):
            assert body["sessionKey"] == "api:default"
            assert body.get("replayed", False) is (response.status_code == 200)
        await ended(http, turn_id)
        listed = await all_turns(http)
        again = await post(http, "once", key="key-50")  # after the end: still a replay
    assert [t["turnId"] for t in listed] == [turn_id]
    assert api.node.store is not None
    events = await api.node.store.aread_stream(streams.turn(turn_id))
    assert [e.type for e in events].count("turn.start") == 1
    assert [e.type for e in events].count("turn.end") == 1
    assert again.status_code == 200
    assert again.json() == {"turnId": turn_id, "sessionKey": "api:default", "replayed": True}


@pytest.mark.asyncio
async def test_a_key_reused_for_another_text_is_refused_naming_the_turn(api: ApiServer) -> None:
    async with client_of(api) as http:
        first = await accept(http, "first text", key="key-1")
        response = await post(http, "other text", key="key-1")
    error = error_of(response, 409, "idempotency_key_reused")
    assert first["turnId"] in error["message"]


@pytest.mark.asyncio
async def test_a_key_reused_in_another_session_is_refused(api: ApiServer) -> None:
    async with client_of(api) as http:
        await accept(http, "same text", key="key-1", sessionKey="s1")
        response = await post(http, "same text", key="key-1", sessionKey="s2")
    error_of(response, 409, "idempotency_key_reused")


@pytest.mark.asyncio
async def test_invalid_idempotency_keys_are_refused(api: ApiServer) -> None:
    keys: dict[str, str | bytes] = {
        "empty": "",
        "256 characters": "k" * 256,
        "non-ASCII": "clé".encode(),
        "a control character": "a\tb",
    }
    async with client_of(api) as http:
        for case, key in keys.items():
            response = await post(http, "hi", key=key)
            error = error_of(response, 400, "idempotency_key_invalid")
            assert error["field"] == "Idempotency-Key", case
        longest = await post(http, "hi", key="k" * 255)
        turns = await all_turns(http)
    assert longest.status_code == 202, longest.text
    assert [t["turnId"] for t in turns] == [longest.json()["turnId"]]


@pytest.mark.asyncio
async def test_a_refused_request_does_not_use_up_its_key(api: ApiServer) -> None:
    async with client_of(api) as http:
        refused = await post(http, " ", key="key-1")
        response = await post(http, "hi", key="key-1")
    error_of(refused, 400, "message_text_required")
    assert response.status_code == 202, response.text


@pytest.mark.asyncio
async def test_a_key_belongs_to_one_agent(api_factory: ApiFactory) -> None:
    api_factory.write_agent("helper", HELPER)
    api = await api_factory.start()
    async with client_of(api) as http:
        mine = await accept(http, "hi", key="shared-key")
        theirs = await accept(http, "hi", key="shared-key", agent="helper")
        assert mine["turnId"] != theirs["turnId"]
        assert (await ended(http, mine["turnId"]))["agentId"] == "assistant"
        assert (await ended(http, theirs["turnId"], "helper"))["agentId"] == "helper"


@pytest.mark.asyncio
async def test_nats_ingress_replays_a_keyed_message(api: ApiServer) -> None:
    assert api.node.nc is not None
    message = IngressMessage(text="over nats", idempotency_key="nats-key")
    first = await request(api.node.nc, "assistant", message)
    second = await request(api.node.nc, "assistant", message)
    assert isinstance(first, Accepted) and isinstance(second, Accepted)
    assert (first.replayed, second.replayed) == (False, True)
    assert first.turn_id == second.turn_id
    async with client_of(api) as http:  # the same key over HTTP names the same turn
        response = await post(http, "over nats", key="nats-key")
    assert response.status_code == 200, response.text
    assert response.json()["turnId"] == first.turn_id


@pytest.mark.asyncio
async def test_one_key_sent_to_many_sessions_at_once_accepts_one_turn(api: ApiServer) -> None:
    sessions = [f"s{i % 4}" for i in range(20)]
    bodies = [{"text": "racing", "sessionKey": s} for s in sessions]
    responses = await asyncio.to_thread(burst, api, "race-key", bodies)
    async with client_of(api) as http:
        winners = [s for s, r in zip(sessions, responses, strict=True) if r.status_code == 202]
        assert len(winners) == 1, [r.text for r in responses]
        turn_id = next(r.json()["turnId"] for r in responses if r.status_code == 202)
        for session, response in zip(sessions, responses, strict=True):
            if session == winners[0]:  # the same request as the accepted one: a replay
                assert response.status_code in (200, 202), response.text
                assert response.json()["turnId"] == turn_id
                assert response.json()["sessionKey"] == session
            else:
                error = error_of(response, 409, "idempotency_key_reused")
                assert turn_id in error["message"]
        await ended(http, turn_id)
        listed = await all_turns(http)
    assert [t["turnId"] for t in listed] == [turn_id]


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_message_without_text_is_refused(api: ApiServer) -> None:
    async with client_of(api) as http:
        for text in ("", "   \n\t"):
            error = error_of(await post(http, text), 400, "message_text_required")
            assert error["field"] == "text"
        assert await all_turns(http) == []


@pytest.mark.asyncio
async def test_text_and_session_keys_that_are_too_long_are_refused(api: ApiServer) -> None:
    async with client_of(api) as http:
        long_text = await post(http, "x" * 200_001)
        long_key = await post(http, "hi", sessionKey="k" * 513)
        empty_key = await post(http, "hi", sessionKey="")
        assert await all_turns(http) == []
    assert error_of(long_text, 400, "text_too_long")["field"] == "text"
    assert error_of(long_key, 400, "session_key_invalid")["field"] == "sessionKey"
    assert error_of(empty_key, 400, "session_key_invalid")["field"] == "sessionKey"


@pytest.mark.asyncio
async def test_a_body_that_is_not_json_is_refused(api: ApiServer) -> None:
    async with client_of(api) as http:
        response = await http.post(
            "/v1/agents/assistant/messages",
            content=b"{not json",
            headers={"Content-Type": "application/json"},
        )
    error_of(response, 400, "body_not_json")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"text": 5}, "text"),
        ({"text": "hi", "sessionKey": 3}, "sessionKey"),
        ({"text": "hi", "concurrency": "sometimes"}, "concurrency"),
        ({"text": "hi", "stream": "yes"}, "stream"),
    ],
    ids=["text", "sessionKey", "concurrency", "stream"],
)
async def test_a_field_of_the_wrong_type_is_named(api: ApiServer, body: Json, field: str) -> None:
    async with client_of(api) as http:
        response = await http.post("/v1/agents/assistant/messages", json=body)
    error = error_of(response, 400, "request_body_invalid")
    assert error["field"] == field


@pytest.mark.asyncio
async def test_a_body_without_text_names_the_missing_field(api: ApiServer) -> None:
    async with client_of(api) as http:
        response = await http.post("/v1/agents/assistant/messages", json={"sessionKey": "s1"})
    error = error_of(response, 400, "request_body_invalid")
    assert error["field"] == "text"


@pytest.mark.asyncio
async def test_a_body_over_one_megabyte_is_refused_by_its_length(api: ApiServer) -> None:
    async with client_of(api) as http:
        response = await post(http, "x" * 1_100_000)
        assert await all_turns(http) == []
    error_of(response, 413, "body_too_large")


@pytest.mark.asyncio
async def test_a_chunked_body_over_one_megabyte_is_refused_while_read(api: ApiServer) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"text": "'
        for _ in range(20):
            yield b"x" * 64_000
        yield b'"}'

    async with client_of(api) as http:
        response = await http.post(
            "/v1/agents/assistant/messages", content=chunks(), headers=JSON_BODY
        )
        assert "content-length" not in response.request.headers
        assert await all_turns(http) == []
    error_of(response, 413, "body_too_large")


@pytest.mark.asyncio
async def test_an_unknown_agent_is_not_found(api: ApiServer) -> None:
    async with client_of(api) as http:
        for response in (
            await post(http, "hi", agent="nobody"),
            await http.get("/v1/agents/nobody"),
            await http.get("/v1/agents/nobody/turns"),
            await http.get("/v1/agents/nobody/sessions"),
        ):
            error = error_of(response, 404, "agent_not_found")
            assert error["field"] == "agent"


@pytest.mark.asyncio
async def test_an_unknown_turn_is_not_found(api: ApiServer) -> None:
    async with client_of(api) as http:
        for response in (
            await http.get("/v1/agents/assistant/turns/t_nope"),
            await http.get("/v1/turns/t_nope"),
            await http.post("/v1/agents/assistant/turns/t_nope/stop"),
            await http.get("/v1/agents/assistant/turns/t_nope/events"),
            await http.get("/v1/agents/assistant/turns/t_nope/stream"),
        ):
            error_of(response, 404, "turn_not_found")


@pytest.mark.asyncio
async def test_a_turn_is_not_found_under_another_agent(api_factory: ApiFactory) -> None:
    api_factory.write_agent("helper", HELPER)
    api = await api_factory.start()
    async with client_of(api) as http:
        theirs = await accept(http, "hi", agent="helper")
        await ended(http, theirs["turnId"], "helper")
        path = f"/v1/agents/assistant/turns/{theirs['turnId']}"
        for response in (
            await http.get(path),
            await http.post(path + "/stop"),
            await http.get(path + "/events"),
            await http.get(path + "/stream"),
        ):
            error_of(response, 404, "turn_not_found")
        assert await all_turns(http) == []


@pytest.mark.asyncio
async def test_an_unknown_route_is_not_found(api: ApiServer) -> None:
    async with client_of(api) as http:
        for path in ("/v1/nothing", "/v2/agents", "/v1/agents/assistant/nothing"):
            error_of(await http.get(path), 404, "not_found")


@pytest.mark.asyncio
async def test_a_wrong_method_names_the_allowed_ones(api: ApiServer) -> None:
    async with client_of(api) as http:
        response = await http.get("/v1/agents/assistant/messages")
        error_of(response, 405, "method_not_allowed")
        assert response.headers["allow"] == "POST"
        response = await http.delete("/v1/agents/assistant/turns")
        error_of(response, 405, "method_not_allowed")
        assert "GET" in response.headers["allow"]


@pytest.mark.asyncio
async def test_a_wrong_method_on_a_session_allows_both_get_and_delete(api: ApiServer) -> None:
    async with client_of(api) as http:
        for path in ("/sessions/s1", "/sessions/s1/messages"):
            response = await http.put("/v1/agents/assistant" + path)
            error = error_of(response, 405, "method_not_allowed")
            allowed = {m.strip() for m in response.headers["allow"].split(",")}
            assert {"GET", "DELETE"} <= allowed, (path, response.headers["allow"])
            assert "DELETE" in error["hint"]


@pytest.mark.asyncio
async def test_an_unknown_cursor_is_refused(api: ApiServer) -> None:
    async with client_of(api) as http:
        accepted = await accept(http, "hi")
        path = f"/v1/agents/assistant/turns/{accepted['turnId']}"
        for response in (
            await http.get(path + "/events", params={"after": "not-a-cursor"}),
            await http.get(path + "/stream", params={"after": "not-a-cursor"}),
            await http.get(path + "/stream", headers={"Last-Event-ID": "not-a-cursor"}),
            await http.get("/v1/events", params={"after": "not-a-cursor"}),
        ):
            error_of(response, 400, "cursor_invalid")


@pytest.mark.asyncio
async def test_a_bad_limit_is_refused_naming_it(api: ApiServer) -> None:
    async with client_of(api) as http:
        accepted = await accept(http, "hi")
        pages = {
            "/v1/agents/assistant/turns": "turns_page_invalid",
            f"/v1/agents/assistant/turns/{accepted['turnId']}/events": "events_page_invalid",
            "/v1/agents/assistant/sessions": "sessions_page_invalid",
            "/v1/agents/assistant/sessions/api:default/messages": "messages_page_invalid",
        }
        for path, code in pages.items():
            for limit in ("0", "-1", "many", "100000"):
                response = await http.get(path, params={"limit": limit})
                assert error_of(response, 400, code)["field"] == "limit", (path, limit)
        for before in ("0", "soon"):
            response = await http.get(
                "/v1/agents/assistant/sessions/api:default/messages", params={"before": before}
            )
            assert error_of(response, 400, "messages_page_invalid")["field"] == "before"


# ---- the turns list ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_turns_are_listed_newest_first_and_filtered(api_factory: ApiFactory) -> None:
    api_factory.write_agent("brief", BRIEF)
    api = await api_factory.start()
    plan = [("s1", "one"), ("s2", "two"), ("s1", "calculate 6*7"), ("s2", "four"), ("s1", "five")]
    async with client_of(api) as http:
        ids = []
        for session, text in plan:  # one after another, so their start times are ordered
            accepted = await accept(http, text, agent="brief", sessionKey=session)
            await ended(http, accepted["turnId"], "brief")
            ids.append(accepted["turnId"])
        listed = await all_turns(http, "brief")
        in_s1 = await all_turns(http, "brief", sessionKey="s1")
        cut_short = await all_turns(http, "brief", status="max_steps")
        final_in_s2 = await all_turns(http, "brief", status="final", sessionKey="s2")
        running = await all_turns(http, "brief", status="running")
        elsewhere = await all_turns(http, "brief", sessionKey="s3")
    assert [t["turnId"] for t in listed] == ids[::-1]
    assert [t["turnId"] for t in in_s1] == [ids[4], ids[2], ids[0]]
    assert [t["turnId"] for t in cut_short] == [ids[2]]  # one step allowed, the tool needs two
    assert [t["turnId"] for t in final_in_s2] == [ids[3], ids[1]]
    assert running == elsewhere == []
    assert all(set(t) >= TURN_FIELDS for t in listed)


@pytest.mark.asyncio
async def test_turn_pages_cover_every_turn_once(api: ApiServer) -> None:
    async with client_of(api) as http:
        # Accepted at once, several share a commit and so a start time: pages must still
        # neither repeat nor skip a turn.
        accepted = await asyncio.gather(
            *(accept(http, f"turn {i}", sessionKey=f"s{i % 4}") for i in range(11))
        )
        ids = [a["turnId"] for a in accepted]
        seen: list[str] = []
        before: str | None = None
        for _ in range(10):
            query: Json = {"limit": 2} | ({"before": before} if before else {})
            response = await http.get("/v1/agents/assistant/turns", params=query)
            assert response.status_code == 200, response.text
            page = response.json()
            assert len(page["turns"]) <= 2
            seen += [t["turnId"] for t in page["turns"]]
            before = page.get("nextBefore")
            if before is None:
                break
        everything = await all_turns(http)
    assert seen == [t["turnId"] for t in everything]
    assert sorted(seen) == sorted(ids)
    assert len(set(seen)) == len(seen)


@pytest.mark.asyncio
async def test_a_bad_turns_page_is_refused(api_factory: ApiFactory) -> None:
    api_factory.write_agent("helper", HELPER)
    api = await api_factory.start()
    async with client_of(api) as http:
        theirs = await accept(http, "hi", agent="helper")
        for before in ("t_nope", theirs["turnId"]):
            response = await http.get("/v1/agents/assistant/turns", params={"before": before})
            assert error_of(response, 400, "turns_page_invalid")["field"] == "before"
        response = await http.get("/v1/agents/assistant/turns", params={"status": "done"})
        assert error_of(response, 400, "turns_page_invalid")["field"] == "status"


# ---- stopping a turn -----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_stopping_a_turn_in_a_slow_tool_ends_it_stopped(api_factory: ApiFactory) -> None:
    api_factory.write_agent("sleepy", SLEEPY)
    api = await api_factory.start()
    async with client_of(api) as http:
        turn_id = (await accept(http, "nap", agent="sleepy"))["turnId"]
        await started_tool(http, turn_id)
        response = await http.post(f"/v1/agents/sleepy/turns/{turn_id}/stop")
        assert response.status_code == 202, response.text
        assert response.json() == {"turnId": turn_id, "stopping": True, "state": "stopping"}
        turn = await ended(http, turn_id, "sleepy", timeout=5)
        again = await http.post(f"/v1/agents/sleepy/turns/{turn_id}/stop")
        events = await turn_events(http, turn_id, "sleepy")
    assert (turn["status"], turn["state"]) == ("stopped", "ended")
    error_of(again, 409, "turn_not_running")
    results = [e for e in events if e["type"] == "tool.result"]
    assert len(results) == 1  # the dangling call was closed, so the transcript stays valid


@pytest.mark.asyncio
async def test_stopping_a_queued_turn_ends_it_without_running(api_factory: ApiFactory) -> None:
    api_factory.write_agent("sleepy", SLEEPY)
    api = await api_factory.start()
    async with client_of(api) as http:
        running = (await accept(http, "nap", agent="sleepy"))["turnId"]
        queued = (await accept(http, "after the nap", agent="sleepy"))["turnId"]
        await started_tool(http, running)
        response = await http.post(f"/v1/agents/sleepy/turns/{queued}/stop")
        assert response.status_code == 202, response.text
        assert response.json() == {"turnId": queued, "stopping": True, "state": "stopped"}
        stopped = await ended(http, queued, "sleepy", timeout=5)
        assert (await get_turn(http, running, "sleepy"))["status"] == "running"
        await http.post(f"/v1/agents/sleepy/turns/{running}/stop")
        await ended(http, running, "sleepy", timeout=5)
    assert (stopped["status"], stopped["steps"]) == ("stopped", 0)


@pytest.mark.asyncio
async def test_a_message_for_a_busy_session_can_be_rejected(api_factory: ApiFactory) -> None:
    api_factory.write_agent("sleepy", SLEEPY)
    api = await api_factory.start()
    async with client_of(api) as http:
        running = (await accept(http, "nap", agent="sleepy"))["turnId"]
        await started_tool(http, running)
        response = await post(http, "hello", agent="sleepy", concurrency="reject")
        elsewhere = await post(http, "hello", agent="sleepy", concurrency="reject", sessionKey="s2")
        await http.post(f"/v1/agents/sleepy/turns/{running}/stop")
        await ended(http, running, "sleepy", timeout=5)
    error_of(response, 409, "session_busy")
    assert elsewhere.status_code == 202, elsewhere.text


@pytest.mark.asyncio
async def test_a_message_can_interrupt_the_running_turn(api_factory: ApiFactory) -> None:
    api_factory.write_agent("sleepy", SLEEPY)
    api = await api_factory.start()
    async with client_of(api) as http:
        running = (await accept(http, "nap", agent="sleepy"))["turnId"]
        await started_tool(http, running)
        interrupting = await accept(http, "hello", agent="sleepy", concurrency="interrupt")
        interrupted = await ended(http, running, "sleepy", timeout=5)
        answered = await ended(http, interrupting["turnId"], "sleepy", timeout=5)
    assert interrupted["status"] == "stopped"
    assert (answered["status"], answered["input"]) == ("final", "hello")


@pytest.mark.asyncio
async def test_the_turn_after_a_stopped_one_answers_its_own_message(
    api_factory: ApiFactory,
) -> None:
    api_factory.write_agent("sleepy", SLEEPY)
    api = await api_factory.start()
    async with client_of(api) as http:
        stopped = (await accept(http, "nap", agent="sleepy"))["turnId"]
        await started_tool(http, stopped)
        await http.post(f"/v1/agents/sleepy/turns/{stopped}/stop")
        await ended(http, stopped, "sleepy", timeout=5)
        after = await accept(http, "hello", agent="sleepy")
        answered = await ended(http, after["turnId"], "sleepy")
    assert "You said: hello" in answered["text"], answered["text"]


# ---- sessions and their history ------------------------------------------------------------------


@pytest.mark.asyncio
async def test_sessions_are_listed_after_their_turns(api: ApiServer) -> None:
    async with client_of(api) as http:
        first = await accept(http, "hello", sessionKey="s1")
        await ended(http, first["turnId"])
        last = await accept(http, "calculate 6*7", sessionKey="s1")
        await ended(http, last["turnId"])

        async def listed() -> list[Json] | None:
            response = await http.get("/v1/agents/assistant/sessions")
            assert response.status_code == 200, response.text
            sessions: list[Json] = response.json()
            settled = sessions and sessions[0]["turns"] == 2 and sessions[0]["messages"] == 6
            return sessions if settled else None

        sessions = await eventually(listed, "the session to be listed with its two turns")
        response = await http.get("/v1/agents/assistant/sessions/s1")
        missing = await http.get("/v1/agents/assistant/sessions/s2")
    assert [s["sessionKey"] for s in sessions] == ["s1"]
    assert response.status_code == 200 and response.json() == sessions[0]
    summary = sessions[0]
    assert summary["agentId"] == "assistant" and summary["lastTurnId"] == last["turnId"]
    assert summary["createdAt"] <= summary["lastActivityAt"]
    assert error_of(missing, 404, "session_not_found")["field"] == "sessionKey"


@pytest.mark.asyncio
async def test_history_is_newest_first_with_tool_calls_and_observations(api: ApiServer) -> None:
    async with client_of(api) as http:
        first = await accept(http, "hello", sessionKey="s1")
        await ended(http, first["turnId"])
        second = await accept(http, "calculate 6*7", sessionKey="s1")
        await ended(http, second["turnId"])
        messages = await history(http, "s1")
    roles = [m["role"] for m in messages]
    assert roles == ["assistant", "tool", "assistant", "user", "assistant", "user"]
    answer, observation, call, question, echo, greeting = messages
    assert [m["turnId"] for m in messages] == [second["turnId"]] * 4 + [first["turnId"]] * 2
    assert [m["id"] for m in messages] == sorted((m["id"] for m in messages), reverse=True)
    assert all(m["sessionKey"] == "s1" for m in messages)
    assert (greeting["content"], question["content"]) == ("hello", "calculate 6*7")
    assert "You said: hello" in echo["content"] and "toolCalls" not in echo
    assert call["origin"] == "call"
    assert [set(c) for c in call["toolCalls"]] == [{"id", "name"}]  # arguments stay in the log
    assert call["toolCalls"][0]["name"] == "calculator"
    assert observation["origin"] == "observation" and observation["content"] == "42"
    assert observation["toolCallId"] == call["toolCalls"][0]["id"]
    assert "42" in answer["content"]


@pytest.mark.asyncio
async def test_history_pages_cover_every_message_once(api: ApiServer) -> None:
    async with client_of(api) as http:
        for text in ("one", "calculate 6*7", "three"):
            await ended(http, (await accept(http, text, sessionKey="s1"))["turnId"])
        everything = await history(http, "s1")
        assert len(everything) == 8
        seen: list[Json] = []
        before: int | None = None
        for _ in range(10):
            query: Json = {"limit": 3} | ({"before": before} if before else {})
            response = await http.get("/v1/agents/assistant/sessions/s1/messages", params=query)
            assert response.status_code == 200, response.text
            page = response.json()
            seen += page["messages"]
            before = page.get("nextBefore")
            if before is None:
                break
    assert seen == everything


@pytest.mark.asyncio
@pytest.mark.parametrize("key", ["team/alpha", "a b?c", "café"])
async def test_a_session_key_the_api_accepts_can_be_addressed(api: ApiServer, key: str) -> None:
    """A key is either refused when the message comes, or reachable (URL-encoded) afterwards."""
    path = "/v1/agents/assistant/sessions/" + urllib.parse.quote(key, safe="")
    async with client_of(api) as http:
        response = await post(http, "hi", sessionKey=key)
        if response.status_code == 400:
            assert error_of(response, 400, "session_key_invalid")["field"] == "sessionKey"
            return
        assert response.status_code == 202, response.text
        await ended(http, response.json()["turnId"])
        messages = await http.get(path + "/messages")
        assert messages.status_code == 200, messages.text
        assert [m["sessionKey"] for m in messages.json()["messages"]] == [key, key]
        cleared = await http.delete(path)
    assert cleared.status_code == 200 and cleared.json() == cleared_body(key)


@pytest.mark.asyncio
async def test_clearing_a_session_empties_its_history_and_the_next_turn_works(
    api: ApiServer,
) -> None:
    async with client_of(api) as http:
        await ended(http, (await accept(http, "hello", sessionKey="s1"))["turnId"])
        assert len(await history(http, "s1")) == 2
        response = await http.delete("/v1/agents/assistant/sessions/s1")
        assert response.status_code == 200, response.text
        assert response.json() == cleared_body("s1")
        assert await history(http, "s1") == []

        async def marked_cleared() -> Json | None:
            summary: Json = (await http.get("/v1/agents/assistant/sessions/s1")).json()
            return summary if summary.get("clearedAt") else None

        summary = await eventually(marked_cleared, "the session summary to show the clearing")
        after = await accept(http, "hello again", sessionKey="s1")
        turn = await ended(http, after["turnId"])
        messages = await history(http, "s1")
        cleared = await http.delete("/v1/agents/assistant/sessions/s1/messages")
    assert summary["clearedAt"] and summary["messages"] == 0
    assert turn["status"] == "final"
    assert [m["turnId"] for m in messages] == [after["turnId"]] * 2
    assert cleared.status_code == 200 and cleared.json() == cleared_body("s1")


@pytest.mark.asyncio
async def test_a_session_with_a_turn_running_or_queued_cannot_be_cleared(
    api_factory: ApiFactory,
) -> None:
    api_factory.write_agent("sleepy", SLEEPY)
    api = await api_factory.start()
    path = "/v1/agents/sleepy/sessions/s1"
    async with client_of(api) as http:
        running = (await accept(http, "nap", agent="sleepy", sessionKey="s1"))["turnId"]
        queued = (await accept(http, "later", agent="sleepy", sessionKey="s1"))["turnId"]
        await started_tool(http, running)
        error_of(await http.delete(path), 409, "session_busy")
        await http.post(f"/v1/agents/sleepy/turns/{queued}/stop")
        await ended(http, queued, "sleepy")
        error_of(await http.delete(path + "/messages"), 409, "session_busy")
        await http.post(f"/v1/agents/sleepy/turns/{running}/stop")
        await ended(http, running, "sleepy", timeout=5)
        response = await http.delete(path)  # a client that saw the end may clear at once
    assert response.status_code == 200 and response.json() == cleared_body("s1")


# ---- authentication and the Host check -----------------------------------------------------------

FULL = "a" * 32
SCOPED = "b" * 32


async def guarded(api_factory: ApiFactory, **overrides: Any) -> ApiServer:
    """A node with two agents, a full token and one scoped to `assistant`."""
    api_factory.write_agent("helper", HELPER)
    return await api_factory.start(tokens=[FULL, SCOPED + "@assistant"], **overrides)


@pytest.mark.asyncio
async def test_a_request_without_a_valid_token_is_unauthorized(api_factory: ApiFactory) -> None:
    api = await guarded(api_factory)
    async with httpx.AsyncClient(base_url=api.url, timeout=30) as http:
        for headers in (
            {},
            {"Authorization": "Bearer " + "c" * 32},
            {"Authorization": "Bearer " + FULL[:-1]},
            {"Authorization": "Basic " + FULL},
            {"Authorization": "Bearer " + SCOPED + "@assistant"},
        ):
            for response in (
                await http.get("/v1/agents", headers=headers),
                await http.post(
                    "/v1/agents/assistant/messages", json={"text": "hi"}, headers=headers
                ),
                await http.get("/metrics", headers=headers),
            ):
                error_of(response, 401, "unauthorized")
        granted = await http.get("/v1/agents", headers={"Authorization": "bearer " + FULL})
    assert granted.status_code == 200


@pytest.mark.asyncio
async def test_health_ready_and_openapi_are_open(api_factory: ApiFactory) -> None:
    api = await guarded(api_factory)
    async with httpx.AsyncClient(base_url=api.url, timeout=30) as http:
        for path in ("/v1/health", "/v1/ready", "/v1/openapi.json"):
            response = await http.get(path)
            assert response.status_code == 200, (path, response.text)


@pytest.mark.asyncio
async def test_a_scoped_token_sees_only_its_agents(api_factory: ApiFactory) -> None:
    api = await guarded(api_factory)
    async with (
        client_of(api) as full,
        client_of(api, Authorization=f"Bearer {SCOPED}") as scoped,
    ):
        theirs = await accept(full, "hi", agent="helper")
        await ended(full, theirs["turnId"], "helper")
        everyone = (await full.get("/v1/agents")).json()
        mine = (await scoped.get("/v1/agents")).json()
        for response in (
            await scoped.get("/v1/agents/helper"),
            await post(scoped, "hi", agent="helper"),
            await scoped.get("/v1/agents/helper/turns"),
            await scoped.get(f"/v1/agents/helper/turns/{theirs['turnId']}"),
            await scoped.get("/v1/agents/helper/sessions"),
            await scoped.get("/v1/events", params={"agentId": "helper"}),
        ):
            error_of(response, 404, "agent_not_found")
        for response in (
            await scoped.get(f"/v1/turns/{theirs['turnId']}"),
            await scoped.get(f"/v1/agents/assistant/turns/{theirs['turnId']}"),
        ):
            error_of(response, 404, "turn_not_found")
        own = await accept(scoped, "hi")
        assert (await ended(scoped, own["turnId"]))["status"] == "final"
    assert sorted(a["id"] for a in everyone) == ["assistant", "helper"]
    assert [a["id"] for a in mine] == ["assistant"]


@pytest.mark.asyncio
async def test_a_foreign_host_name_is_refused(api: ApiServer) -> None:
    async with client_of(api) as http:
        for path in ("/v1/health", "/v1/agents"):
            response = await http.get(path, headers={"Host": "evil.example"})
            error_of(response, 403, "host_not_allowed")
        rebinding = await http.get("/v1/agents", headers={"Host": f"evil.example:{api.port}"})
        error_of(rebinding, 403, "host_not_allowed")
        for host in (f"localhost:{api.port}", "localhost", f"127.0.0.1:{api.port}"):
            response = await http.get("/v1/agents", headers={"Host": host})
            assert response.status_code == 200, (host, response.text)


@pytest.mark.asyncio
async def test_allowed_hosts_add_names_to_the_loopback_ones(api_factory: ApiFactory) -> None:
    api = await api_factory.start(allowed_hosts=("dispach.test",))
    async with client_of(api) as http:
        for host in ("dispach.test", f"dispach.test:{api.port}", f"localhost:{api.port}"):
            response = await http.get("/v1/agents", headers={"Host": host})
            assert response.status_code == 200, (host, response.text)
        response = await http.get("/v1/agents", headers={"Host": "evil.example"})
    error_of(response, 403, "host_not_allowed")


# ---- Dispach v1 compatibility --------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_message_with_stream_answers_with_the_turns_sse_stream(api: ApiServer) -> None:
    frames: list[tuple[str, str | None, Json]] = []
    async with (
        client_of(api) as http,
        http.stream(
            "POST", "/v1/agents/assistant/messages", json={"text": "hi", "stream": True}
        ) as response,
    ):
        assert response.status_code == 202
        assert response.headers["content-type"].startswith("text/event-stream")
        async for item in sse_frames(response):
            frames.append(item)
    names = [name for name, _, _ in frames]
    assert names[:3] == ["turn.accepted", "stream.replay", "turn.start"]
    assert names[-2:] == ["turn.end", "stream.ended"]
    accepted = frames[0][2]
    assert set(accepted) == {"turnId", "sessionKey"} and accepted["sessionKey"] == "api:default"
    assert frames[1][2]["turnId"] == accepted["turnId"]
    events = frames[2:-1]
    assert all(cursor for _, cursor, _ in events)  # event frames carry their cursor as `id:`
    assert all(data["turnId"] == accepted["turnId"] for _, _, data in events)
    assert "model.chunk" not in names  # text deltas only with `chunks`
    control = {"turn.accepted", "stream.replay", "stream.ended"}
    assert all(cursor is None for name, cursor, _ in frames if name in control)
    assert frames[-1][2] == {"turnId": accepted["turnId"], "status": "final", "steps": 1}


@pytest.mark.asyncio
async def test_a_replayed_message_with_stream_replays_the_whole_turn(api: ApiServer) -> None:
    body = {"text": "hi", "stream": True}
    headers = {"Idempotency-Key": "stream-key"}
    async with client_of(api) as http:
        first = await accept(http, "hi", key="stream-key")
        await ended(http, first["turnId"])
        async with http.stream(
            "POST", "/v1/agents/assistant/messages", json=body, headers=headers
        ) as response:
            assert response.status_code == 200
            frames = [item async for item in sse_frames(response)]
    names = [name for name, _, _ in frames]
    assert names[:3] == ["turn.accepted", "stream.replay", "turn.start"]
    assert names[-2:] == ["turn.end", "stream.ended"]
    assert frames[0][2] == {"turnId": first["turnId"], "sessionKey": "api:default",
                            "replayed": True}  # fmt: skip
    assert frames[1][2]["state"] == "ended"


@pytest.mark.asyncio
async def test_fields_unknown_to_this_version_are_ignored(api: ApiServer) -> None:
    async with client_of(api) as http:
        accepted = await accept(http, "hi", futureField=1, metadata={"a": [1, 2]})
        assert (await ended(http, accepted["turnId"]))["status"] == "final"


@pytest.mark.asyncio
async def test_deliver_none_is_accepted(api: ApiServer) -> None:
    async with client_of(api) as http:
        accepted = await accept(http, "hi", deliver="none")
        assert (await ended(http, accepted["turnId"]))["status"] == "final"

"""What the web console reads, against a real node: sessions filtered by key and by the status
of their last turn, the agent's deliveries as a person reads them, a turn's tool arguments and
outputs for the API token (never for a stream token, never on a stream), and a stream token for
an agent's whole firehose."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from eventstore import START
from tests.conftest import ApiFactory
from tests.fakes.webhook_receiver import WebhookReceiver
from tests.test_api_streams import (
    Frame,
    client,
    envelopes,
    kind,
    opened,
    read_sse,
    receive_until,
)
from tests.test_api_streams import send as ws_send
from tests.turns import wait_end

Json = dict[str, Any]
TOKEN = "console-secret"

CONSOLE = """
id: console
model:
  provider: scripted
  script:
    - {{match: "^wait$", tool: record, input: {{path: "{path}", seconds: 0}}}}
    - {{match: "^sum$", tool: calculator, input: {{expression: "2+2"}}}}
tools:
  - name: record
    module: tests.fixtures_tools:record_and_wait
    description: Records that it ran.
    mutating: true
    policy: ask
    input_schema: {{type: object, properties: {{path: {{type: string}}}}, required: [path]}}
  - calculator
"""


def error_of(response: httpx.Response, status: int, code: str, field: str | None = None) -> Json:
    assert response.status_code == status, response.text
    error: Json = response.json()["error"]
    assert error["code"] == code and error["message"] and error["hint"], error
    if field is not None:
        assert error.get("field") == field, error
    return error


async def eventually(probe: Callable[[], Awaitable[Any]], what: str, timeout: float = 10) -> Any:
    """``probe()``'s first truthy answer (the sessions projection is asynchronous)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        answer = await probe()
        if answer:
            return answer
        assert asyncio.get_running_loop().time() < deadline, f"never: {what}"
        await asyncio.sleep(0.05)


async def post(http: httpx.AsyncClient, agent: str, text: str, session: str, **body: Any) -> str:
    response = await http.post(
        f"/v1/agents/{agent}/messages", json={"text": text, "sessionKey": session, **body}
    )
    assert response.status_code == 202, response.text
    turn_id: str = response.json()["turnId"]
    return turn_id


# --- 1. sessions: q, status, lastTurnStatus, lastTurnAt ----------------------------------------


async def sessions(http: httpx.AsyncClient, **params: str) -> list[Json]:
    response = await http.get("/v1/agents/console/sessions", params=params)
    assert response.status_code == 200, response.text
    listed: list[Json] = response.json()
    return listed


@pytest.mark.asyncio
async def test_sessions_filter_by_key_and_by_the_status_of_their_last_turn(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    api_factory.write_agent("console", CONSOLE.format(path=tmp_path / "ran.txt"))
    api = await api_factory.start()
    async with client(api) as http:
        done = await post(http, "console", "sum", "Team:Alpha")
        await wait_end(api.node, done)
        waiting = await post(http, "console", "wait", "team_beta")  # parked: awaiting approval
        echoed = await post(http, "console", "hello", "100%real")
        await wait_end(api.node, echoed)
        stopped = await post(http, "console", "wait", "other")
        await eventually(lambda: _pending(http, 2), "both waits parked for approval")
        answer = await http.post(f"/v1/agents/console/turns/{stopped}/stop")
        assert answer.status_code == 202, answer.text
        await wait_end(api.node, stopped)
        cleared = await http.delete("/v1/agents/console/sessions/fresh")  # a session, no turn
        assert cleared.status_code == 200, cleared.text

        async def settled() -> list[Json] | None:
            listed = await sessions(http)
            statuses = {s["sessionKey"]: s["lastTurnStatus"] for s in listed}
            expected = {"Team:Alpha": "final", "team_beta": "running", "100%real": "final",
                        "other": "stopped", "fresh": None}  # fmt: skip
            return listed if statuses == expected else None

        listed = await eventually(settled, "every session with its last turn's status")
        by_key = {s["sessionKey"]: s for s in listed}
        assert by_key["team_beta"]["lastTurnId"] == waiting
        turn = (await http.get(f"/v1/turns/{waiting}")).json()
        assert by_key["team_beta"]["lastTurnAt"] == turn["startedAt"]
        # Always present, null included: a session without a turn (a clear of a new key).
        assert "lastTurnStatus" in by_key["fresh"] and by_key["fresh"]["lastTurnAt"] is None
        activity = [s["lastActivityAt"] for s in listed]
        assert activity == sorted(activity, reverse=True)  # newest first, as before

        assert sorted(keys(await sessions(http, q="TEAM"))) == ["Team:Alpha", "team_beta"]
        assert keys(await sessions(http, q="%")) == ["100%real"]  # literal, not a wildcard
        assert keys(await sessions(http, q="_")) == ["team_beta"]
        assert keys(await sessions(http, q="nobody")) == []
        assert keys(await sessions(http, status="running")) == ["team_beta"]
        assert keys(await sessions(http, status="stopped")) == ["other"]
        assert sorted(keys(await sessions(http, status="final"))) == ["100%real", "Team:Alpha"]
        assert keys(await sessions(http, status="final", q="team")) == ["Team:Alpha"]
        assert keys(await sessions(http, status="error")) == []
        assert len(await sessions(http, limit="2")) == 2
        one = (await http.get("/v1/agents/console/sessions/other")).json()
        assert (one["lastTurnStatus"], one["lastTurnId"]) == ("stopped", stopped)

        for bad in ("ended", "RUNNING", ""):
            response = await http.get("/v1/agents/console/sessions", params={"status": bad})
            error_of(response, 400, "invalid_value", "status")


def keys(listed: list[Json]) -> list[str]:
    return [s["sessionKey"] for s in listed]


async def _pending(http: httpx.AsyncClient, n: int) -> bool:
    listed = (await http.get("/v1/agents/console/approvals")).json()["approvals"]
    return len(listed) >= n


# --- 2. deliveries ----------------------------------------------------------------------------

WEBHOOK_SECRET = "console-webhook-secret"


def hooked(url: str) -> str:
    # A long pause before the second attempt (a 503 leaves its item `retrying` for the test),
    # a send that may answer late, and an item in doubt settled as such (not resent).
    return f"""
id: hooked
model: {{provider: scripted}}
channels:
  - {{id: hooks, type: webhook, url: "{url}", backoff_s: [60, 60], timeout_s: 90,
     on_uncertain: skip}}
"""


async def deliveries(http: httpx.AsyncClient, agent: str = "hooked", **params: str) -> list[Json]:
    response = await http.get(f"/v1/agents/{agent}/deliveries", params=params)
    assert response.status_code == 200, response.text
    items: list[Json] = response.json()["deliveries"]
    return items


async def delivery_of(http: httpx.AsyncClient, turn_id: str, status: str) -> Json:
    async def found() -> Json | None:
        items = [d for d in await deliveries(http) if d["turnId"] == turn_id]
        return items[0] if items and items[0]["status"] == status else None

    item: Json = await eventually(found, f"the delivery of {turn_id} {status}")
    return item


@pytest.mark.asyncio
async def test_deliveries_say_where_each_reply_stands_and_never_what_it_says(
    api_factory: ApiFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISPACH_WEBHOOK_SECRET", WEBHOOK_SECRET)
    with WebhookReceiver(WEBHOOK_SECRET) as receiver:
        api_factory.write_agent("hooked", hooked(receiver.url))
        api = await api_factory.start(tokens=[TOKEN, "scoped@assistant"])
        target = {"deliver": {"channel": "hooks", "to": "ops"}}
        async with client(api) as http:
            sent_turn = await post(http, "hooked", "marker-sent-1", "s-sent", **target)
            sent = await delivery_of(http, sent_turn, "sent")

            receiver.fail_next(400)
            failed_turn = await post(http, "hooked", "marker-failed-2", "s-failed", **target)
            failed = await delivery_of(http, failed_turn, "failed")

            receiver.hold_next(60)  # kept at once, answered late: the attempt is in flight
            held_turn = await post(http, "hooked", "marker-held-3", "s-held", **target)
            sending = await delivery_of(http, held_turn, "sending")

            items = await deliveries(http)
            assert [d["turnId"] for d in items] == [held_turn, failed_turn, sent_turn]
            created = [d["createdAt"] for d in items]
            assert created == sorted(created, reverse=True)

        # Sent: when, and by which provider id; no error.
        assert sent["channel"] == "hooks" and sent["to"] == "ops" and sent["thread"] is None
        assert sent["sessionKey"] == "s-sent" and sent["id"].startswith("o_")
        assert (sent["chunkIndex"], sent["chunkTotal"], sent["attempts"]) == (0, 1, 1)
        assert sent["lastError"] is None and sent["uncertain"] is False
        assert sent["sentAt"] == sent["updatedAt"] and sent["providerMessageId"]
        assert sent["nextAttemptAt"] is None
        # Failed for good (a 4xx): the channel's code and message.
        assert failed["lastError"]["code"] == "delivery_http_400"
        assert "400" in failed["lastError"]["message"]
        assert failed["sentAt"] is None and failed["nextAttemptAt"] is None
        assert sending["attempts"] == 1 and sending["sentAt"] is None
        # Every field always present, null included, and not one of them the reply.
        assert set(sent) == set(failed) == set(sending) == {
            "id", "channel", "to", "thread", "sessionKey", "turnId", "chunkIndex",
            "chunkTotal", "status", "attempts", "uncertain", "lastError", "providerMessageId",
            "createdAt", "updatedAt", "sentAt", "nextAttemptAt",
        }  # fmt: skip

        async with client(api) as http:
            receiver.fail_next(503)  # retried after a 60 s pause: `retrying` meanwhile
            retry_turn = await post(http, "hooked", "marker-retry-4", "s-retry", **target)
            retrying = await delivery_of(http, retry_turn, "retrying")
            assert retrying["attempts"] == 1 and retrying["uncertain"] is False
            assert retrying["lastError"]["code"] == "delivery_http_503"
            assert retrying["nextAttemptAt"] > retrying["updatedAt"]
            receiver.drop_next()  # no answer: it may have arrived, and is not sent again
            doubt_turn = await post(http, "hooked", "marker-doubt-5", "s-doubt", **target)
            doubt = await delivery_of(http, doubt_turn, "uncertain")
            assert doubt["uncertain"] is True and doubt["lastError"]["code"]
            assert doubt["sentAt"] is None and doubt["nextAttemptAt"] is None

            body = (await http.get("/v1/agents/hooked/deliveries")).text
            assert "marker-" not in body  # the replies echo their input: none is here
            by_status = {
                status: [d["turnId"] for d in await deliveries(http, status=status)]
                for status in ("sent", "failed", "sending", "retrying", "pending", "uncertain")
            }
            assert by_status == {"sent": [sent_turn], "failed": [failed_turn],
                                 "sending": [held_turn], "retrying": [retry_turn],
                                 "pending": [], "uncertain": [doubt_turn]}  # fmt: skip
            only = await deliveries(http, sessionKey="s-failed")
            assert [d["turnId"] for d in only] == [failed_turn]
            assert [d["turnId"] for d in await deliveries(http, limit="1")] == [doubt_turn]
            assert await deliveries(http, sessionKey="nobody") == []
            for name, value in (("status", "inflight"), ("status", "SENT"), ("limit", "0"),
                                ("limit", "501"), ("limit", "ten")):  # fmt: skip
                response = await http.get("/v1/agents/hooked/deliveries", params={name: value})
                error_of(response, 400, "invalid_value", name)
            error_of(await http.get("/v1/agents/nobody/deliveries"), 404, "agent_not_found")

        async with client(api, "scoped") as scoped:  # a token for `assistant` only
            error_of(await scoped.get("/v1/agents/hooked/deliveries"), 404, "agent_not_found")
            assert await deliveries(scoped, "assistant") == []
        async with httpx.AsyncClient(base_url=api.url) as nobody:
            error_of(await nobody.get("/v1/agents/hooked/deliveries"), 401, "unauthorized")


# --- 3. private event fields for the API token -------------------------------------------------


def by_type(events: list[Json], name: str) -> Json:
    found: Json = next(e for e in events if e["type"] == name)
    return found


@pytest.mark.asyncio
async def test_private_true_shows_the_api_token_tool_args_and_outputs_and_nothing_else(
    api_factory: ApiFactory,
) -> None:
    api = await api_factory.start(tokens=[TOKEN])
    async with client(api) as http:
        response = await http.post(
            "/v1/agents/assistant/messages",
            json={"text": "calculate 6*7", "sessionKey": "p1"},
            headers={"Idempotency-Key": "console-key-1"},
        )
        assert response.status_code == 202, response.text
        turn_id = response.json()["turnId"]
        await wait_end(api.node, turn_id)
        path = f"/v1/agents/assistant/turns/{turn_id}/events"
        public = (await http.get(path)).json()["events"]
        revealed = (await http.get(path, params={"private": "true"})).json()["events"]
        assert (await http.get(path, params={"private": "false"})).json()["events"] == public
        for bad in ("yes", "1", "TRUE", ""):
            error_of(await http.get(path, params={"private": bad}), 400, "invalid_value",
                     "private")  # fmt: skip

    assert [e["id"] for e in revealed] == [e["id"] for e in public]
    call, result = by_type(public, "tool.call"), by_type(public, "tool.result")
    assert "args" not in call["data"] and call["data"]["argsHash"]
    assert "output" not in result["data"]
    call, result = by_type(revealed, "tool.call"), by_type(revealed, "tool.result")
    assert call["data"]["args"] == {"expression": "6*7"}
    assert "42" in result["data"]["output"]
    # Only the revealable fields differ (a result's content blocks are null here: no images):
    # the rest of what is private stays in the log.
    for mine, theirs in zip(revealed, public, strict=True):
        extra = set(mine["data"]) - set(theirs["data"])
        revealable = {"tool.call": {"args"}, "tool.result": {"output", "content"}}
        assert extra == revealable.get(mine["type"], set())
    start = by_type(revealed, "turn.start")["data"]
    assert "idempotencyKey" not in start and "requestHash" not in start
    assert all("content" not in e["data"] for e in revealed if e["type"] == "model.result")
    assert "console-key-1" not in json.dumps(revealed)


@pytest.mark.asyncio
async def test_a_stream_token_never_gets_private_fields_and_streams_never_carry_them(
    api_factory: ApiFactory,
) -> None:
    api = await api_factory.start(tokens=[TOKEN])
    async with client(api) as http:
        turn_id = await post(http, "assistant", "calculate 6*7", "p2")
        await wait_end(api.node, turn_id)
        issued = await http.post(
            "/v1/stream-tokens", json={"agentId": "assistant", "turnId": turn_id}
        )
        st = issued.json()["token"]
        stream = f"/v1/agents/assistant/turns/{turn_id}/stream"
        # With the API token, `private` changes nothing on a stream: public fields only.
        frames = await read_sse(http, stream, params={"private": "true"})
        assert frames[-1].event == "stream.ended"
        tools = [f.data for f in frames if f.event in ("tool.call", "tool.result")]
        assert len(tools) == 2
        assert all("args" not in f["data"] and "output" not in f["data"] for f in tools)
        firehose = await read_sse(http, "/v1/events", stop=lambda f: f.event == "turn.end",
                                  params={"agentId": "assistant", "private": "true",
                                          "after": START.cursor()})  # fmt: skip
        assert any(f.event == "tool.call" for f in firehose)
        assert all("args" not in f.data.get("data", {}) for f in firehose)
        assert all("output" not in f.data.get("data", {}) for f in firehose)

    async with httpx.AsyncClient(base_url=api.url) as browser:  # holds only the stream token
        events = f"/v1/agents/assistant/turns/{turn_id}/events"
        for path in (events, stream, "/v1/events"):
            response = await browser.get(path, params={"st": st, "private": "true"})
            error = error_of(response, 403, "private_needs_token")
            assert "Bearer" in error["hint"] and st not in response.text
        # Without `private`, the stream token reads its stream as before.
        frames = await read_sse(browser, stream, params={"st": st})
        assert frames[-1].event == "stream.ended"
        error_of(await browser.get(events, params={"st": st}), 403, "stream_token_read_only")

    async with opened(api) as ws:
        await ws_send(ws, type="subscribe", turnId=turn_id, sub="t")
        got = envelopes(await receive_until(ws, kind("stream.ended")))
    calls = [e for e in got if e["type"] in ("tool.call", "tool.result")]
    assert len(calls) == 2
    assert all("args" not in e["data"] and "output" not in e["data"] for e in calls)


# --- 4. a stream token for an agent's whole firehose ------------------------------------------


async def issue(http: httpx.AsyncClient, **body: Any) -> Json:
    response = await http.post("/v1/stream-tokens", json=body)
    assert response.status_code == 201, response.text
    issued: Json = response.json()
    return issued


def ends(turn_id: str) -> Callable[[Frame], bool]:
    """A stop condition: the ``turn.end`` of ``turn_id``."""
    return lambda f: f.event == "turn.end" and f.data["turnId"] == turn_id


def turn_ends(frames: list[Frame]) -> set[str]:
    return {f.data["turnId"] for f in frames if f.event == "turn.end"}


@pytest.mark.asyncio
async def test_an_agent_stream_token_reads_every_session_of_its_agent_only(
    api_factory: ApiFactory,
) -> None:
    api_factory.write_agent("other", "id: other\n")
    api = await api_factory.start(tokens=[TOKEN])
    async with client(api) as http:
        first = await post(http, "assistant", "hello one", "s1")
        second = await post(http, "assistant", "hello two", "s2")
        foreign = await post(http, "other", "hello there", "s1")
        for turn_id in (first, second, foreign):
            await wait_end(api.node, turn_id)
        agent = await issue(http, agentId="assistant", ttlS=60)
        session = await issue(http, agentId="assistant", sessionKey="s1")
        both = await http.post(
            "/v1/stream-tokens", json={"agentId": "assistant", "turnId": first, "sessionKey": "s1"}
        )
        error_of(both, 400, "stream_token_target_invalid", "turnId")
        too_long = await http.post("/v1/stream-tokens", json={"agentId": "assistant", "ttlS": 0})
        error_of(too_long, 400, "stream_token_ttl_invalid", "ttlS")  # TTLs as before
        error_of(await http.post("/v1/stream-tokens", json={"agentId": "nobody"}), 404,
                 "agent_not_found", "agentId")  # fmt: skip

    assert agent["scope"] == "agent" and agent["agentId"] == "assistant"
    assert agent["ttlS"] == 60 and "turnId" not in agent and "sessionKey" not in agent
    assert session["scope"] == "session" and session["sessionKey"] == "s1"

    async with httpx.AsyncClient(base_url=api.url, timeout=30) as browser:
        st = agent["token"]
        everything = {"st": st, "after": START.cursor()}
        frames = await read_sse(browser, "/v1/events", params={"agentId": "assistant"} | everything,
                                stop=ends(second))  # fmt: skip
        assert frames[0].event == "stream.subscribed"
        assert frames[0].data["agentId"] == "assistant" and frames[0].data["sessionKey"] is None
        events = [f for f in frames if f.id is not None]
        assert {f.data["sessionKey"] for f in events} == {"s1", "s2"}
        assert {f.data["agentId"] for f in events} == {"assistant"}
        assert turn_ends(frames) == {first, second}
        # agentId defaults to the token's; one session of the agent may be asked for.
        frames = await read_sse(browser, "/v1/events", params=everything, stop=ends(first))
        assert frames[0].data["agentId"] == "assistant"
        one = await read_sse(browser, "/v1/events", stop=ends(second),
                             params={"sessionKey": "s2"} | everything)  # fmt: skip
        assert {f.data["sessionKey"] for f in one if f.id is not None} == {"s2"}
        # Any of the agent's turns; nothing of another agent's.
        turn = await read_sse(browser, f"/v1/agents/assistant/turns/{second}/stream",
                              params={"st": st})  # fmt: skip
        assert turn[-1].event == "stream.ended"
        error_of(await browser.get("/v1/events", params={"agentId": "other", "st": st}), 403,
                 "stream_token_wrong_agent")  # fmt: skip
        error_of(await browser.get(f"/v1/agents/other/turns/{foreign}/stream",
                                   params={"st": st}), 403, "stream_token_wrong_agent")  # fmt: skip
        error_of(await browser.get("/v1/agents", params={"st": st}), 403,
                 "stream_token_read_only")  # fmt: skip

        # A session's token: its session only, whatever the firehose is asked for.
        mine = {"st": session["token"], "after": START.cursor()}
        frames = await read_sse(browser, "/v1/events", params={"agentId": "assistant"} | mine,
                                stop=ends(first))  # fmt: skip
        assert frames[0].data["sessionKey"] == "s1"
        assert {f.data["sessionKey"] for f in frames if f.id is not None} == {"s1"}
        error_of(await browser.get("/v1/events", params={"sessionKey": "s2"} | mine), 403,
                 "stream_token_wrong_session")  # fmt: skip
        error_of(await browser.get(f"/v1/agents/assistant/turns/{second}/stream",
                                   params={"st": session["token"]}), 403,
                 "stream_token_wrong_session")  # fmt: skip
        error_of(await browser.get("/v1/events", params={"agentId": "other"} | mine), 403,
                 "stream_token_wrong_agent")  # fmt: skip

    # On the WebSocket, the agent's token subscribes to any session of its agent, not another's.
    async with connect(f"{api.ws_url}?st={agent['token']}") as ws:
        assert json.loads(await ws.recv())["type"] == "ws.open"
        await ws_send(ws, type="subscribe", agentId="assistant", sub="all")
        await ws_send(ws, type="subscribe", agentId="assistant", sessionKey="s2", sub="s2")
        await ws_send(ws, type="subscribe", agentId="other", sub="theirs")
        answers: dict[str, tuple[str, str | None]] = {}

        def answered(frame: Json) -> bool:
            if frame["type"] in ("ws.subscribed", "ws.error"):
                answers[frame["sub"]] = (frame["type"], frame.get("code"))
            return len(answers) == 3

        await receive_until(ws, answered, timeout=10)
    assert answers == {"all": ("ws.subscribed", None), "s2": ("ws.subscribed", None),
                       "theirs": ("ws.error", "stream_token_wrong_agent")}  # fmt: skip


# --- 5. approvals with what the call would run with ----------------------------------------------


@pytest.mark.asyncio
async def test_approvals_show_the_api_token_the_calls_arguments_on_private_true(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    path = tmp_path / "asked.txt"
    api_factory.write_agent("console", CONSOLE.format(path=path))
    api = await api_factory.start(tokens=[TOKEN])
    async with client(api) as http:
        turn_id = await post(http, "console", "wait", "asks")

        async def waiting() -> list[Json]:
            answer = await http.get("/v1/agents/console/approvals")
            listed: list[Json] = answer.json()["approvals"]
            return listed

        [public] = await eventually(waiting, "the approval")
        assert public["turnId"] == turn_id and "args" not in public
        revealed = await http.get("/v1/agents/console/approvals", params={"private": "true"})
        assert revealed.status_code == 200, revealed.text
        [asked] = revealed.json()["approvals"]
        assert asked["args"] == {"path": str(path), "seconds": 0}
        assert {k: v for k, v in asked.items() if k != "args"} == public
        error_of(await http.get("/v1/agents/console/approvals", params={"private": "yes"}),
                 400, "invalid_value", "private")  # fmt: skip
        # The event keeps them private: the turn's public events do not show them.
        events = (await http.get(f"/v1/agents/console/turns/{turn_id}/events")).json()["events"]
        requested = by_type(events, "approval.requested")
        assert "args" not in requested["data"]
        events = (
            await http.get(f"/v1/agents/console/turns/{turn_id}/events", params={"private": "true"})
        ).json()["events"]
        assert by_type(events, "approval.requested")["data"]["args"] == asked["args"]

"""Stream tokens over plain HTTP and the WebSocket (issue 13, section 1): ``POST
/v1/stream-tokens`` issues a short-lived read-only token that ``?st=`` presents to a turn's SSE
stream, the session firehose and ``/v1/ws``. Each way a token can be wrong is refused with its own
code, nothing but reading is allowed with one, and no token ever reaches the node's log. A
reconnect at or past a turn's end is answered 204, which is what makes an ``EventSource`` stop
(tests/test_browser.py shows it in Chromium).

Every node here is a real ``dispach serve`` with an API token and a fixed ``DISPACH_SECRET``, on
the suite's Postgres and NATS (tests/test_browser.py's :class:`ServeNode`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import ClientConnection
from websockets.sync.client import connect as ws_connect

from gateways.client import parse
from tests import test_browser
from tests.conftest import Servers
from tests.test_browser import (
    API_TOKEN,
    SECRET,
    ServeFactory,
    ServeNode,
    logged,
    turn_status,
    wait_until,
    write_agent,
)

serve = test_browser.serve
pytestmark = pytest.mark.slow

Json = dict[str, Any]
READ_ONLY = "stream_token_read_only"


def token_node(serve: ServeFactory, tmp_path: Path, **env: str) -> ServeNode:
    """A node with the API token, the secret, and a second agent ``other``."""
    write_agent(tmp_path, "other", "id: other\n")
    return serve(**({"DISPACH_API_TOKEN": API_TOKEN, "DISPACH_SECRET": SECRET} | env))


def finished_turn(node: ServeNode, agent: str = "assistant", session: str = "s1") -> str:
    with node.http() as http:
        response = http.post(
            f"/v1/agents/{agent}/messages", json={"text": "calculate 6*7", "sessionKey": session}
        )
    assert response.status_code == 202, response.text
    turn_id: str = response.json()["turnId"]
    wait_until(lambda: turn_status(node, agent, turn_id) != "running", f"turn {turn_id} to end")
    return turn_id


def issue(node: ServeNode, **body: Any) -> Json:
    with node.http() as http:
        response = http.post("/v1/stream-tokens", json=body)
    assert response.status_code == 201, response.text
    issued: Json = response.json()
    return issued


def anonymous(node: ServeNode) -> httpx.Client:
    """A client with no API token: what a browser holding only a stream token has."""
    return httpx.Client(base_url=node.url, timeout=30)


def sse(response: httpx.Response) -> Iterator[tuple[str, str | None, Json]]:
    """``(event, id, data)`` for each frame of an SSE body (comments and ``retry:`` skipped)."""
    for frame in parse(response.iter_lines()):
        yield frame.event, frame.id, json.loads(frame.data)


def read_turn(http: httpx.Client, path: str, **params: str) -> list[tuple[str, str | None, Json]]:
    """Every frame of an ended turn's stream, model.chunk included (the server closes it after
    ``stream.ended``)."""
    with http.stream("GET", path, params={"chunks": "true"} | params) as response:
        assert response.status_code == 200, response.read().decode()
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(sse(response))


def refusal(response: httpx.Response, status: int, code: str, token: str | None = None) -> None:
    """The response is the envelope with ``status`` and ``code``, and does not echo ``token``."""
    assert response.status_code == status, (code, str(response.url), response.text[:300])
    error = response.json()["error"]
    assert error["code"] == code, (code, error)
    assert error["message"] and error["hint"], error
    if token is not None:
        assert token not in response.text and token.split(".")[-1] not in response.text


def frames_until(ws: ClientConnection, done: str, timeout: float = 15) -> list[Json]:
    """Frames from the socket up to and including the first of type ``done``."""
    got: list[Json] = []
    deadline = time.monotonic() + timeout
    while not got or got[-1]["type"] != done:
        got.append(json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic()))))
    return got


def tamper(token: str, other: str) -> list[str]:
    """Tokens one edit away from ``token``: a character changed (at the start, in the middle;
    not the last, whose low bits base64 may ignore), cut short, lengthened, ``other`` (another
    grant) up to its first difference from ``token`` and ``token`` after it, and garbage."""

    def changed(at: int) -> str:
        return token[:at] + ("A" if token[at] != "A" else "B") + token[at + 1 :]

    split = next(i for i, (a, b) in enumerate(zip(token, other, strict=False)) if a != b) + 1
    variants = [
        changed(0),
        changed(len(token) // 2),
        changed(len(token) - 5),
        token[:-4],
        token + "AAAA",
        other[:split] + token[split:],
        "not-a-token",
        "",
    ]
    assert token not in variants
    return variants


# --- issuing --------------------------------------------------------------------------------------


def test_a_stream_token_is_issued_for_one_turn_or_one_session(
    serve: ServeFactory, tmp_path: Path
) -> None:
    node = token_node(serve, tmp_path)
    turn_id = finished_turn(node)

    issued = issue(node, agentId="assistant", turnId=turn_id)
    assert isinstance(issued["token"], str) and len(issued["token"]) > 20
    assert (issued["agentId"], issued["turnId"], issued["ttlS"]) == ("assistant", turn_id, 300)
    assert "sessionKey" not in issued or issued["sessionKey"] is None
    expires = datetime.fromisoformat(issued["expiresAt"].replace("Z", "+00:00"))
    assert abs((expires - datetime.now(UTC)).total_seconds() - 300) < 10
    session = issue(node, agentId="assistant", sessionKey="s1", ttlS=3600)
    assert (session["sessionKey"], session["ttlS"]) == ("s1", 3600)
    assert session["token"] != issued["token"]
    again = issue(node, agentId="assistant", turnId=turn_id)
    assert again["token"] != issued["token"], "every token is its own"

    with node.http() as http:
        for ttl in (0, 3601, -5, 1.5, "60"):
            response = http.post(
                "/v1/stream-tokens", json={"agentId": "assistant", "turnId": turn_id, "ttlS": ttl}
            )
            assert response.status_code in (400, 422), (ttl, response.text)
            assert response.json()["error"]["field"] == "ttlS", (ttl, response.text)
        # A token is for one turn, one session, or (neither) all of the agent's sessions
        # (tests/test_console_api.py reads with one); never for a turn and a session.
        both = {"agentId": "assistant", "turnId": turn_id, "sessionKey": "s1"}
        refusal(http.post("/v1/stream-tokens", json=both), 400, "stream_token_target_invalid")
        unknown = http.post("/v1/stream-tokens", json={"agentId": "nobody", "sessionKey": "s1"})
        assert unknown.status_code == 404, unknown.text
        elsewhere = http.post("/v1/stream-tokens", json={"agentId": "other", "turnId": turn_id})
        assert elsewhere.status_code == 404, "a turn of another agent is not that agent's"
        as_text = http.post(
            "/v1/stream-tokens",
            content=json.dumps({"agentId": "assistant", "turnId": turn_id}),
            headers={"Content-Type": "text/plain"},
        )
        refusal(as_text, 415, "content_type_unsupported")
    with anonymous(node) as http:
        response = http.post("/v1/stream-tokens", json={"agentId": "assistant", "turnId": turn_id})
        refusal(response, 401, "unauthorized")
        minted = http.post(
            "/v1/stream-tokens",
            params={"st": issued["token"]},
            json={"agentId": "assistant", "turnId": turn_id},
        )
        refusal(minted, 403, READ_ONLY, issued["token"])  # a stream token mints no tokens


# --- reading with one -----------------------------------------------------------------------------


def test_a_stream_token_reads_its_turn_or_session_and_nothing_else(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """A turn token opens that turn's stream; a session token the streams of that session's
    turns and the session's firehose; on the WebSocket, subscriptions within the same scope.
    Another turn, agent or session is refused with its own code."""
    node = token_node(serve, tmp_path)
    mine = finished_turn(node, session="s1")
    sibling = finished_turn(node, session="s1")
    elsewhere = finished_turn(node, session="s2")
    foreign = finished_turn(node, agent="other", session="s1")
    turn_token = issue(node, agentId="assistant", turnId=mine)["token"]
    session_token = issue(node, agentId="assistant", sessionKey="s1")["token"]
    other_token = issue(node, agentId="other", turnId=foreign)["token"]
    with node.http() as http:
        stored = http.get(f"/v1/agents/assistant/turns/{mine}/events").json()["events"]

    def stream(turn_id: str, agent: str = "assistant") -> str:
        return f"/v1/agents/{agent}/turns/{turn_id}/stream"

    with anonymous(node) as http:
        refusal(http.get(stream(mine)), 401, "unauthorized")  # no token at all
        frames = read_turn(http, stream(mine), st=turn_token)
        assert [i for _, i, _ in frames if i is not None] == [e["cursor"] for e in stored]
        assert frames[-1][0] == "stream.ended"
        assert read_turn(http, stream(sibling), st=session_token)[-1][0] == "stream.ended"
        assert read_turn(http, stream(foreign, "other"), st=other_token)[-1][0] == "stream.ended"

        refusal(http.get(stream(sibling), params={"st": turn_token}), 403,
                "stream_token_wrong_turn", turn_token)  # fmt: skip
        refusal(http.get(stream(elsewhere), params={"st": session_token}), 403,
                "stream_token_wrong_session", session_token)  # fmt: skip

        firehose = "/v1/events"
        with http.stream(
            "GET",
            firehose,
            params={"agentId": "assistant", "sessionKey": "s1", "st": session_token},
        ) as response:
            assert response.status_code == 200, response.read().decode()
            assert response.headers["content-type"].startswith("text/event-stream")
        other_session = {"agentId": "assistant", "sessionKey": "s2", "st": session_token}
        refusal(http.get(firehose, params=other_session), 403, "stream_token_wrong_session",
                session_token)  # fmt: skip

    ws_url = f"ws://127.0.0.1:{node.port}/v1/ws?st={turn_token}"
    with ws_connect(ws_url, open_timeout=10) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "ws.open"
        ws.send(json.dumps({"type": "subscribe", "turnId": mine, "sub": "mine", "chunks": True}))
        got = frames_until(ws, "stream.ended")
        assert [f["cursor"] for f in got if "cursor" in f] == [e["cursor"] for e in stored]
        ws.send(json.dumps({"type": "subscribe", "turnId": sibling, "sub": "sibling"}))
        [error] = frames_until(ws, "ws.error")[-1:]
        assert error["code"] == "stream_token_wrong_turn", error
        for frame in (
            {"type": "message", "agentId": "assistant", "text": "hello", "ref": "m"},
            {"type": "stop", "turnId": mine},
            {"type": "approve", "agentId": "assistant", "approvalId": "ap_x", "granted": True},
        ):
            ws.send(json.dumps(frame))
            [error] = frames_until(ws, "ws.error")[-1:]
            assert error["code"] == READ_ONLY, (frame, error)
    assert len(logged_turns(node)) == 4, "the socket started no turn"

    with anonymous(node) as http:  # another agent, whichever way round
        refusal(http.get(stream(foreign, "other"), params={"st": turn_token}), 403,
                "stream_token_wrong_agent", turn_token)  # fmt: skip
        refusal(http.get(stream(mine), params={"st": other_token}), 403,
                "stream_token_wrong_agent", other_token)  # fmt: skip
        other_agent = {"agentId": "other", "sessionKey": "s1", "st": session_token}
        refusal(http.get(firehose, params=other_agent), 403, "stream_token_wrong_agent",
                session_token)  # fmt: skip


def logged_turns(node: ServeNode) -> list[str]:
    with node.http() as http:
        return [
            t["turnId"]
            for agent in ("assistant", "other")
            for t in http.get(f"/v1/agents/{agent}/turns").json()["turns"]
        ]


# --- refusals -------------------------------------------------------------------------------------


def test_each_wrong_token_is_refused_with_its_own_code_and_none_is_logged(
    serve: ServeFactory, tmp_path: Path, servers: Servers, schema: str
) -> None:
    """Expired, tampered (or signed with another node's secret), another turn's, another
    agent's, another session's, and one presented to anything but reading a stream: six
    distinct codes. Afterwards no token, the API token or the secret is in the node's log (at
    debug level)."""
    node = token_node(serve, tmp_path, DISPACH_LOG_LEVEL="debug")
    mine = finished_turn(node, session="s1")
    sibling = finished_turn(node, session="s2")
    foreign = finished_turn(node, agent="other")
    path = f"/v1/agents/assistant/turns/{mine}/stream"
    token = issue(node, agentId="assistant", turnId=mine)["token"]
    short_issued = issue(node, agentId="assistant", turnId=mine, ttlS=2)
    short = short_issued["token"]
    tokens = [token, short]
    codes: dict[str, int] = {}

    def refused(response: httpx.Response, status: int, code: str, presented: str) -> None:
        refusal(response, status, code, presented or None)
        codes[code] = status

    with anonymous(node) as http:
        assert read_turn(http, path, st=short)[-1][0] == "stream.ended"  # valid for now
        # ttlS=2: expired from its expiresAt on (whole seconds: 1-2 s after it was issued).
        expires = datetime.fromisoformat(short_issued["expiresAt"]).timestamp()
        time.sleep(max(0.0, expires - time.time()) + 0.05)
        refused(http.get(path, params={"st": short}), 401, "stream_token_expired", short)

        for bad in tamper(token, short):
            refused(http.get(path, params={"st": bad}), 401, "stream_token_invalid", bad)

        stranger = serve(
            DISPACH_API_TOKEN=API_TOKEN, DISPACH_SECRET="another-secret-of-another-node-000000"
        )  # the same database, another secret: a misconfigured second node
        theirs = issue(stranger, agentId="assistant", turnId=mine)["token"]
        tokens.append(theirs)
        with anonymous(stranger) as their_http:
            assert read_turn(their_http, path, st=theirs)[-1][0] == "stream.ended"
        refused(http.get(path, params={"st": theirs}), 401, "stream_token_invalid", theirs)

        other_turn = f"/v1/agents/assistant/turns/{sibling}/stream"
        refused(http.get(other_turn, params={"st": token}), 403, "stream_token_wrong_turn", token)
        session_token = issue(node, agentId="assistant", sessionKey="s1")["token"]
        tokens.append(session_token)
        refused(http.get(other_turn, params={"st": session_token}), 403,
                "stream_token_wrong_session", session_token)  # fmt: skip

        turns_before = len(logged(servers, schema, "turn.start"))
        for method, where, body in (
            ("POST", "/v1/agents/assistant/messages", {"text": "hello"}),
            ("POST", f"/v1/agents/assistant/turns/{mine}/stop", None),
            ("GET", "/v1/agents/assistant/turns", None),
            ("GET", f"/v1/agents/assistant/turns/{mine}", None),
            ("GET", f"/v1/agents/assistant/turns/{mine}/events", None),
            ("GET", "/v1/agents", None),
            ("DELETE", "/v1/agents/assistant/sessions/s1", None),
            ("POST", path, None),
        ):
            response = http.request(method, where, params={"st": token}, json=body)
            refused(response, 403, READ_ONLY, token)
        with node.http() as bearer:  # the API token with a stream token is still a stream token
            response = bearer.post(
                "/v1/agents/assistant/messages", params={"st": token}, json={"text": "hello"}
            )
            refused(response, 403, READ_ONLY, token)
        assert len(logged(servers, schema, "turn.start")) == turns_before, "a POST made a turn"

        foreign_token = issue(node, agentId="other", turnId=foreign)["token"]
        tokens.append(foreign_token)
        refused(http.get(path, params={"st": foreign_token}), 403, "stream_token_wrong_agent",
                foreign_token)  # fmt: skip

    assert set(codes) == {
        "stream_token_expired",
        "stream_token_invalid",
        "stream_token_wrong_turn",
        "stream_token_wrong_agent",
        "stream_token_wrong_session",
        READ_ONLY,
    }
    assert node.stop() == 0
    output = node.output() + stranger.output()
    assert output, "the node logged nothing: the check below would prove nothing"
    for presented in tokens:
        half = len(presented) // 2
        assert presented[:half] not in output and presented[half:] not in output
    assert API_TOKEN not in output and SECRET not in output


# --- the end of a stream --------------------------------------------------------------------------


def test_a_reconnect_at_or_past_the_end_gets_204(serve: ServeFactory, tmp_path: Path) -> None:
    """What stops an EventSource: a Last-Event-ID at the turn's ``turn.end`` is answered 204 No
    Content; one before it gets the rest of the turn; a first connect gets the whole replay and
    stream.ended; an explicit ``?after=`` at the end (a program, not a browser reconnecting)
    still gets the preamble and stream.ended. The same with the API token and a stream token."""
    node = token_node(serve, tmp_path)
    turn_id = finished_turn(node)
    path = f"/v1/agents/assistant/turns/{turn_id}/stream"
    with node.http() as http:
        events = http.get(f"/v1/agents/assistant/turns/{turn_id}/events").json()["events"]
    cursors = [e["cursor"] for e in events]
    assert events[-1]["type"] == "turn.end"
    token = issue(node, agentId="assistant", turnId=turn_id)["token"]

    ways: list[tuple[httpx.Client, dict[str, str]]] = [
        (node.http(), {}),
        (anonymous(node), {"st": token}),
    ]
    for client, params in ways:
        with client as http:
            first = read_turn(http, path, **params)
            assert [i for _, i, _ in first if i is not None] == cursors
            assert first[-1][0] == "stream.ended"
            rest = read_turn(http, path, after=cursors[-3], **params)
            assert [i for _, i, _ in rest if i is not None] == cursors[-2:]
            ended = http.get(path, params=params, headers={"Last-Event-ID": cursors[-1]})
            assert ended.status_code == 204, ended.text
            assert ended.content == b""
            after = read_turn(http, path, after=cursors[-1], **params)
            assert [e for e, _, _ in after] == ["stream.replay", "stream.ended"]


def test_a_stream_asked_for_while_the_node_starts_is_not_refused_for_good(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """An EventSource that reconnects while its node restarts must not be answered with an
    error status: Chromium then fails it for good (readyState CLOSED, no more reconnects), so
    the page never resumes. A refused connection is fine (it retries), and so is a 200 event
    stream (one that says ``retry:`` and closes, or one that waits for the node). Asked from the
    moment the process starts until it is ready, with Last-Event-ID as a browser would."""
    node = token_node(serve, tmp_path)
    turn_id = finished_turn(node)
    token = issue(node, agentId="assistant", turnId=turn_id)["token"]
    with node.http() as http:
        cursors = [e["cursor"] for e in http.get(f"/v1/agents/assistant/turns/{turn_id}/events")
                   .json()["events"]]  # fmt: skip
    path = f"/v1/agents/assistant/turns/{turn_id}/stream"
    headers = {"Accept": "text/event-stream", "Last-Event-ID": cursors[1]}
    node.kill()
    node.start(wait=False)
    answers: list[int | str] = []
    ready: list[int] = []
    deadline = time.monotonic() + 60
    with anonymous(node) as http:
        while not ready or ready[-1] != 200:
            assert time.monotonic() < deadline, (answers, ready, node.output()[-2000:])
            try:
                with http.stream("GET", path, params={"st": token}, headers=headers,
                                 timeout=2) as response:  # fmt: skip
                    kind = response.headers.get("content-type", "")
                    answers.append(f"{response.status_code} {kind.split(';')[0]}")
                ready.append(http.get("/v1/ready", timeout=2).status_code)
            except httpx.TransportError:
                answers.append("refused")
                time.sleep(0.01)
        with http.stream("GET", path, params={"st": token}, headers=headers) as response:
            assert response.status_code == 200, "ready: the stream is served"
    wrong = [a for a in answers if a not in ("refused", "200 text/event-stream")]
    assert wrong == [], f"answers a browser would give up on: {wrong} (ready: {ready})"

"""The live surfaces of API v1 against a real server: the SSE turn stream, the SSE firehose and
the WebSocket, with replay, resume from a cursor, filters, scoped tokens and backpressure.

Slow turns come from the fake Anthropic server (a real local HTTP server streaming text deltas);
everything else is the real node: Postgres, NATS, actors, uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, NamedTuple

import httpx
import pytest
import pytest_asyncio
from prometheus_client import REGISTRY
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.typing import Subprotocol

from eventstore import Checkpoint, to_wire
from gateways.streams.sse import joined
from tests import fakes
from tests.conftest import ApiFactory, ApiServer
from tests.fakes import FakeAnthropic, Reply
from tests.test_turns_anthropic import KEY_ENV, manifest
from tests.turns import store_of, wait_end

fake_anthropic = fakes.fake_anthropic

WORDS = "word " * 400  # 250 deltas of 8 characters, 10 ms apart: a turn streams for ~2.5 s
OTHER = "id: other\n"  # a second agent on the offline scripted model


@pytest_asyncio.fixture
async def slow(
    api_factory: ApiFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> ApiServer:
    """A node whose agent ``helper`` streams :data:`WORDS` slowly (and ``assistant`` is there)."""
    monkeypatch.setenv(KEY_ENV, "test-key")
    api_factory.write_agent("helper", manifest(fake_anthropic))
    fake_anthropic.default = Reply(text=WORDS, chunk_size=8, event_delay=0.01)
    return await api_factory.start()


# --- SSE plumbing --------------------------------------------------------------------------------


class Frame(NamedTuple):
    event: str
    id: str | None
    data: dict[str, Any]


async def sse_frames(response: httpx.Response) -> AsyncGenerator[Frame, None]:
    event: str | None = None
    cursor: str | None = None
    data: list[str] = []
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield Frame(event or "message", cursor, json.loads("\n".join(data)))
            event, cursor, data = None, None, []
            continue
        if line.startswith(":"):
            continue  # a heartbeat
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            event = value
        elif name == "id":
            cursor = value
        elif name == "data":
            data.append(value)


def client(api: ApiServer, token: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else api.headers
    return httpx.AsyncClient(base_url=api.url, headers=headers, timeout=30)


async def read_sse(
    http: httpx.AsyncClient,
    path: str,
    *,
    params: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
    stop: Callable[[Frame], bool] | None = None,
    timeout: float = 30,
) -> list[Frame]:
    """Frames of one SSE response until ``stop`` says so (then the connection is dropped) or the
    server closes it."""
    got: list[Frame] = []
    try:
        async with (
            asyncio.timeout(timeout),
            http.stream("GET", path, params=params, headers=headers) as response,
        ):
            assert response.status_code == 200, (await response.aread()).decode()
            assert response.headers["content-type"].startswith("text/event-stream")
            async with contextlib.aclosing(sse_frames(response)) as frames:
                async for frame in frames:
                    got.append(frame)
                    if stop is not None and stop(frame):
                        break
    except TimeoutError:
        seen = [(f.event, f.data.get("state")) for f in got]
        raise AssertionError(f"the stream was still open after {timeout} s: {seen}") from None
    return got


def events_of(frames: list[Frame]) -> list[Frame]:
    return [f for f in frames if f.id is not None]


def nth(kind: str, n: int) -> Callable[[Frame], bool]:
    """A stop condition: the ``n``-th frame of type ``kind``."""
    seen = 0

    def stop(frame: Frame) -> bool:
        nonlocal seen
        seen += frame.event == kind
        return seen >= n

    return stop


async def post(http: httpx.AsyncClient, agent: str, text: str, session: str = "api:default") -> str:
    response = await http.post(
        f"/v1/agents/{agent}/messages", json={"text": text, "sessionKey": session}
    )
    assert response.status_code == 202, response.text
    turn_id: str = response.json()["turnId"]
    return turn_id


async def stored(http: httpx.AsyncClient, agent: str, turn_id: str) -> list[dict[str, Any]]:
    response = await http.get(
        f"/v1/agents/{agent}/turns/{turn_id}/events", params={"limit": "10000"}
    )
    assert response.status_code == 200, response.text
    events: list[dict[str, Any]] = response.json()["events"]
    return events


async def status(http: httpx.AsyncClient, turn_id: str) -> str:
    response = await http.get(f"/v1/turns/{turn_id}")
    assert response.status_code == 200, response.text
    return str(response.json()["status"])


def cursors(events: list[dict[str, Any]], chunks: bool = True) -> list[str]:
    return [e["cursor"] for e in events if chunks or e["type"] != "model.chunk"]


# --- 1. replay of an ended turn ------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [False, True])
@pytest.mark.asyncio
async def test_a_reader_after_the_end_gets_every_stored_event_then_the_server_closes(
    api: ApiServer, chunks: bool
) -> None:
    async with client(api) as http:
        turn_id = await post(http, "assistant", "calculate 6*7")
        await wait_end(api.node, turn_id)
        params = {"chunks": "true"} if chunks else None
        frames = await read_sse(
            http, f"/v1/agents/assistant/turns/{turn_id}/stream", params=params
        )  # returns only because the server closed the stream
        events = await stored(http, "assistant", turn_id)
    expected = cursors(events, chunks)
    replay, *middle, ended = frames
    assert replay.event == "stream.replay" and replay.id is None
    assert replay.data["state"] == "ended"
    assert replay.data["events"] == len(expected) == len(middle)
    assert replay.data["from"] is None and replay.data["to"] == expected[-1]
    assert [f.id for f in middle] == expected
    assert [f.data["cursor"] for f in middle] == expected  # the SSE id is the event's cursor
    assert [f.event for f in middle] == [f.data["type"] for f in middle]
    assert ("model.chunk" in [f.event for f in middle]) is chunks
    assert middle[-1].event == "turn.end"
    assert ended.event == "stream.ended" and ended.id is None
    assert ended.data == {"turnId": turn_id, "status": "final", "steps": 2}


NOTER = """\
id: noter
name: Takes a note, then answers
model:
  provider: scripted
  script:
    - {match: ".", tool: session_notes, input: {action: append, text: "prefers tea"}}
tools: [session_notes]
"""


@pytest.mark.asyncio
async def test_a_reader_after_the_end_gets_the_turns_events_on_other_streams(
    api_factory: ApiFactory,
) -> None:
    """The note the turn's tool writes is on the session's stream, with the turn's id: a reader
    of the turn gets it in its place in the log's order, also from the node that ran the turn
    (which serves the turn's start from memory)."""
    api_factory.write_agent("noter", NOTER)
    api = await api_factory.start()
    async with client(api) as http:
        turn_id = await post(http, "noter", "remember that I like tea")
        await wait_end(api.node, turn_id)
        frames = await read_sse(http, f"/v1/agents/noter/turns/{turn_id}/stream")
        events = await stored(http, "noter", turn_id)
    assert "session.note" in [e["type"] for e in events]
    assert [f.id for f in events_of(frames)] == cursors(events, chunks=False)


def subscribed(kind: str) -> float:
    return REGISTRY.get_sample_value("dispach_stream_subscribers", {"kind": kind}) or 0.0


@pytest.mark.asyncio
async def test_a_reader_that_leaves_frees_its_subscription_at_once(slow: ApiServer) -> None:
    """A client that closes an SSE stream while nothing is being sent (the firehose between
    events, a turn stream between deltas) is noticed at once, not at the next heartbeat 15 s
    later: the stream's task ends and its subscription closes, and its turn goes on."""
    before = {kind: subscribed(kind) for kind in ("sse_events", "sse_turn")}
    async with client(slow) as http:
        turn_id = await post(http, "helper", "talk")
        await read_sse(http, f"/v1/agents/helper/turns/{turn_id}/stream",
                       stop=lambda f: f.event == "stream.replay")  # fmt: skip
        await read_sse(http, "/v1/events", stop=lambda f: f.event == "stream.subscribed")
        async with asyncio.timeout(5):
            while {kind: subscribed(kind) for kind in before} != before:
                await asyncio.sleep(0.02)
        assert await status(http, turn_id) == "running"
    await wait_end(slow.node, turn_id)


# --- 2. resume mid-stream ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_sse_resumes_mid_stream_with_last_event_id_and_after(slow: ApiServer) -> None:
    async with client(slow) as http:
        turn_id = await post(http, "helper", "talk")
        path = f"/v1/agents/helper/turns/{turn_id}/stream"
        chunky = {"chunks": "true"}
        first = await read_sse(http, path, params=chunky, stop=nth("model.chunk", 5))
        assert await status(http, turn_id) == "running"  # dropped while deltas stream
        cut = events_of(first)[-1].id
        assert cut is not None
        second = await read_sse(
            http, path, params=chunky, headers={"Last-Event-ID": cut}, stop=nth("model.chunk", 5)
        )
        assert await status(http, turn_id) == "running"
        cut2 = events_of(second)[-1].id
        assert cut2 is not None
        third = await read_sse(http, path, params={**chunky, "after": cut2})
        events = await stored(http, "helper", turn_id)

    assert second[0].event == "stream.replay" and second[0].data["from"] == cut
    assert third[0].event == "stream.replay" and third[0].data["from"] == cut2
    assert third[-1].event == "stream.ended" and third[-1].data["status"] == "final"
    parts = [events_of(part) for part in (first, second, third)]
    assert all(any(f.event == "model.chunk" for f in part) for part in parts)
    union = [f.id for part in parts for f in part]
    assert len(union) == len(set(union)), "an event was delivered twice"
    assert union == cursors(events), "the resumed streams do not add up to the stored events"


@pytest.mark.asyncio
async def test_resuming_after_turn_end_replays_nothing_and_ends_at_once(api: ApiServer) -> None:
    async with client(api) as http:
        turn_id = await post(http, "assistant", "hello")
        await wait_end(api.node, turn_id)
        end = (await stored(http, "assistant", turn_id))[-1]
        assert end["type"] == "turn.end"
        path = f"/v1/agents/assistant/turns/{turn_id}/stream"
        by_param = await read_sse(http, path, params={"after": end["cursor"]}, timeout=5)
        # A reconnect (Last-Event-ID) past the end is told there is nothing more: 204 is what
        # stops a browser's EventSource from reconnecting forever.
        reconnect = await http.get(path, headers={"Last-Event-ID": end["cursor"]})
    assert [f.event for f in by_param] == ["stream.replay", "stream.ended"]
    assert by_param[0].data["events"] == 0 and by_param[0].data["state"] == "ended"
    assert by_param[1].data["status"] == "final"
    assert reconnect.status_code == 204 and reconnect.content == b""


@pytest.mark.asyncio
async def test_a_turn_stream_filtered_by_type_still_ends_with_its_turn(api: ApiServer) -> None:
    async with client(api) as http:
        turn_id = await post(http, "assistant", "calculate 6*7")
        await wait_end(api.node, turn_id)
        frames = await read_sse(
            http,
            f"/v1/agents/assistant/turns/{turn_id}/stream",
            params={"types": "tool.call"},
            timeout=5,
        )
    assert [f.event for f in frames] == ["stream.replay", "tool.call", "stream.ended"]
    assert frames[0].data["state"] == "ended"


@pytest.mark.asyncio
async def test_a_bad_cursor_is_refused_with_a_hint(api: ApiServer) -> None:
    async with client(api) as http:
        turn_id = await post(http, "assistant", "hello")
        response = await http.get(
            f"/v1/agents/assistant/turns/{turn_id}/stream", headers={"Last-Event-ID": "nope!"}
        )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "cursor_invalid" and error["hint"]


# --- 3. a dropped stream never stops its turn ----------------------------------------------------


@pytest.mark.asyncio
async def test_closing_a_stream_never_stops_its_turn(slow: ApiServer) -> None:
    async with client(slow) as http:
        watched = await post(http, "helper", "talk", session="a")
        frames = await read_sse(
            http,
            f"/v1/agents/helper/turns/{watched}/stream",
            params={"chunks": "true"},
            stop=nth("model.chunk", 1),
        )
        assert frames[0].event == "stream.replay" and frames[0].data["state"] == "running"
        # POST with stream=true answers with the turn's stream; the caller hangs up at once.
        async with http.stream(
            "POST",
            "/v1/agents/helper/messages",
            json={"text": "talk", "sessionKey": "b", "stream": True, "chunks": True},
        ) as response:
            assert response.status_code == 202
            async with contextlib.aclosing(sse_frames(response)) as posted:
                accepted = await anext(posted)
        assert accepted.event == "turn.accepted"
        streamed = accepted.data["turnId"]
        for turn_id in (watched, streamed):
            await wait_end(slow.node, turn_id)
            assert await status(http, turn_id) == "final"


# --- 4. chunks -----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_text_deltas_only_when_asked_and_they_add_up_to_the_reply(slow: ApiServer) -> None:
    async with client(slow) as http:
        turn_id = await post(http, "helper", "talk")
        path = f"/v1/agents/helper/turns/{turn_id}/stream"
        plain, chunky = await asyncio.gather(
            read_sse(http, path), read_sse(http, path, params={"chunks": "true"})
        )
    assert "model.chunk" not in [f.event for f in plain]
    deltas = [f.data["data"] for f in chunky if f.event == "model.chunk"]
    assert 1 < len(deltas) < len(WORDS) // 8  # coalesced: fewer events than the model's deltas
    assert {d["kind"] for d in deltas} == {"text"}
    end = next(f for f in chunky if f.event == "turn.end")
    assert "".join(d["delta"] for d in deltas) == end.data["data"]["text"] == WORDS
    assert [f.id for f in events_of(plain)] == [
        f.id for f in events_of(chunky) if f.event != "model.chunk"
    ]


# --- 5. the firehose -----------------------------------------------------------------------------


def until_turn_end(turn_id: str) -> Callable[[Frame], bool]:
    return lambda f: f.event == "turn.end" and f.data["turnId"] == turn_id


class Watch:
    """An SSE stream read in the background into ``frames``."""

    def __init__(
        self, http: httpx.AsyncClient, path: str, params: dict[str, str] | None = None
    ) -> None:
        self.frames: list[Frame] = []
        self.opened = asyncio.Event()
        self._task = asyncio.create_task(self._read(http, path, params))

    async def _read(
        self, http: httpx.AsyncClient, path: str, params: dict[str, str] | None
    ) -> None:
        async with (
            http.stream("GET", path, params=params) as response,
            contextlib.aclosing(sse_frames(response)) as frames,
        ):
            assert response.status_code == 200, (await response.aread()).decode()
            async for frame in frames:
                self.frames.append(frame)
                self.opened.set()

    async def until(self, stop: Callable[[Frame], bool], timeout: float = 30) -> list[Frame]:
        """The frames up to the first that ``stop`` accepts; the connection is then dropped."""
        try:
            async with asyncio.timeout(timeout):
                while not any(stop(f) for f in self.frames):
                    if self._task.done():
                        self._task.result()
                        raise AssertionError("the server ended the stream")
                    await asyncio.sleep(0.01)
        finally:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        return self.frames[: next(i for i, f in enumerate(self.frames) if stop(f)) + 1]


@pytest.mark.asyncio
async def test_the_firehose_filters_by_agent_session_and_type(api_factory: ApiFactory) -> None:
    api_factory.write_agent("other", OTHER)
    api = await api_factory.start()
    filters = {
        "all": {},
        "agent": {"agentId": "assistant"},
        "session": {"agentId": "assistant", "sessionKey": "s1"},
        "ends": {"types": "turn.end"},
    }
    async with client(api) as http:
        watches = {name: Watch(http, "/v1/events", params) for name, params in filters.items()}
        for watch in watches.values():
            await asyncio.wait_for(watch.opened.wait(), 10)  # stream.subscribed came
        turns = {}
        for key, (agent, session) in {
            "other": ("other", "s1"),
            "s2": ("assistant", "s2"),
            "s1": ("assistant", "s1"),
        }.items():
            turns[key] = await post(http, agent, f"hello {key}", session)
            await wait_end(api.node, turns[key])
        got = {name: await w.until(until_turn_end(turns["s1"])) for name, w in watches.items()}
    first = events_of(got["all"])[0]
    assert first.event == "turn.start" and first.data["turnId"] == turns["other"]
    log = [to_wire(e) for e in await store_of(api.node).aread_all(limit=10_000)]
    start = next(i for i, e in enumerate(log) if e.cursor == first.id)
    expected = [e.cursor for e in log[start:] if e.type != "model.chunk"]
    for name, frames in got.items():
        head, events = frames[0], events_of(frames)
        assert head.event == "stream.subscribed" and head.id is None, name
        assert [f.id for f in events] == [f.data["cursor"] for f in events], name
        assert events[-1].event == "turn.end" and events[-1].data["turnId"] == turns["s1"], name
        assert "model.chunk" not in [f.event for f in events], name
    assert got["agent"][0].data["agentId"] == "assistant"
    assert got["ends"][0].data["types"] == ["turn.end"]
    assert [f.id for f in events_of(got["all"])] == expected
    by_agent = events_of(got["agent"])
    assert {f.data["agentId"] for f in by_agent} == {"assistant"}
    assert {f.data["turnId"] for f in by_agent} == {turns["s1"], turns["s2"]}
    by_session = events_of(got["session"])
    assert {(f.data["agentId"], f.data["sessionKey"]) for f in by_session} == {("assistant", "s1")}
    assert {f.data["turnId"] for f in by_session} == {turns["s1"]}
    ends = events_of(got["ends"])
    assert [f.event for f in ends] == ["turn.end"] * 3
    assert [f.data["turnId"] for f in ends] == [turns["other"], turns["s2"], turns["s1"]]


@pytest.mark.asyncio
async def test_the_firehose_refuses_unknown_types_agents_and_cursors(api: ApiServer) -> None:
    async with client(api) as http:
        typo = await http.get("/v1/events", params={"types": "turn.start,turn.ende"})
        nobody = await http.get("/v1/events", params={"agentId": "nobody"})
        cursor = await http.get("/v1/events", params={"after": "not a cursor"})
    assert typo.status_code == 400
    error = typo.json()["error"]
    assert error["code"] == "unknown_event_type" and error["field"] == "types"
    assert "turn.ende" in error["message"] and "'turn.end'" in error["hint"]
    assert nobody.status_code == 404 and nobody.json()["error"]["code"] == "agent_not_found"
    assert cursor.status_code == 400 and cursor.json()["error"]["code"] == "cursor_invalid"


@pytest.mark.asyncio
async def test_the_firehose_resumes_after_a_cursor(api: ApiServer) -> None:
    async with client(api) as http:
        one = await post(http, "assistant", "calculate 6*7", "r1")
        await wait_end(api.node, one)
        two = await post(http, "assistant", "hello", "r2")
        await wait_end(api.node, two)
        cut = (await stored(http, "assistant", one))[3]["cursor"]
        by_param = await read_sse(
            http, "/v1/events", params={"after": cut, "chunks": "true"}, stop=until_turn_end(two)
        )
        by_header = await read_sse(
            http,
            "/v1/events",
            params={"chunks": "true"},
            headers={"Last-Event-ID": cut},
            stop=until_turn_end(two),
        )
    log = await store_of(api.node).aread_all(Checkpoint.from_cursor(cut), 10_000)
    expected = [e.checkpoint.cursor() for e in log]
    expected = expected[: expected.index(by_param[-1].id or "") + 1]
    for frames in (by_param, by_header):
        assert frames[0].event == "stream.subscribed" and frames[0].data["after"] == cut
        assert [f.id for f in events_of(frames)] == expected


@pytest.mark.asyncio
async def test_a_scoped_token_never_sees_another_agents_events(api_factory: ApiFactory) -> None:
    api_factory.write_agent("other", OTHER)
    scoped, full = "x" * 32, "y" * 32
    api = await api_factory.start(tokens=[f"{scoped}@assistant", full])
    async with client(api, scoped) as http, client(api, full) as admin:
        watch = Watch(http, "/v1/events")
        await asyncio.wait_for(watch.opened.wait(), 10)
        hidden = await post(admin, "other", "secret business")
        await wait_end(api.node, hidden)
        last = await post(http, "assistant", "hello")
        frames = await watch.until(until_turn_end(last))
        refused = await http.get("/v1/events", params={"agentId": "other"})
        hidden_turn = await http.get(f"/v1/turns/{hidden}")
    seen = events_of(frames)
    assert seen and {f.data["agentId"] for f in seen} == {"assistant"}
    assert hidden not in {f.data["turnId"] for f in seen}
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "agent_not_found"
    assert hidden_turn.status_code == 404

    async with opened(api, token=scoped) as ws:
        await send(ws, type="subscribe", agentId="other", sub="a")
        await send(ws, type="subscribe", turnId=hidden, sub="t")
        errors = [await receive(ws), await receive(ws)]
    assert [(e["type"], e["code"], e["sub"]) for e in errors] == [
        ("ws.error", "agent_not_found", "a"),
        ("ws.error", "turn_not_found", "t"),
    ]


# --- 6. the WebSocket ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def opened(
    api: ApiServer, token: str | None = None, **options: Any
) -> AsyncIterator[ClientConnection]:
    """A socket past its ``ws.open`` frame."""
    secret = token or api.token
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    async with connect(api.ws_url, additional_headers=headers, **options) as ws:
        hello = await receive(ws)
        assert hello["type"] == "ws.open" and hello["node"]
        yield ws


async def send(ws: ClientConnection, **frame: Any) -> None:
    await ws.send(json.dumps(frame))


async def receive(ws: ClientConnection, timeout: float = 10) -> dict[str, Any]:
    frame: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), timeout))
    return frame


async def receive_until(
    ws: ClientConnection, stop: Callable[[dict[str, Any]], bool], timeout: float = 30
) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []
    try:
        async with asyncio.timeout(timeout):
            while True:
                got.append(await receive(ws, timeout))
                if stop(got[-1]):
                    return got
    except TimeoutError:
        kinds = [f.get("type") for f in got]
        raise AssertionError(f"the awaited frame never came within {timeout} s: {kinds}") from None


def envelopes(frames: list[dict[str, Any]], sub: str | None = None) -> list[dict[str, Any]]:
    return [f for f in frames if "cursor" in f and (sub is None or f["sub"] == sub)]


def kind(name: str, sub: str | None = None) -> Callable[[dict[str, Any]], bool]:
    return lambda f: f.get("type") == name and (sub is None or f.get("sub") == sub)


@pytest.mark.asyncio
async def test_ws_message_then_watch_the_turn_to_its_end(api: ApiServer) -> None:
    async with opened(api) as ws:
        await send(ws, type="message", agentId="assistant", text="calculate 6*7",
                   sessionKey="ws-1", ref="r1")  # fmt: skip
        accepted = await receive(ws)
        assert accepted["type"] == "ws.accepted", accepted
        assert accepted["ref"] == "r1" and accepted["sessionKey"] == "ws-1"
        turn_id = accepted["turnId"]
        await send(ws, type="subscribe", turnId=turn_id)
        frames = await receive_until(ws, kind("stream.ended"))
    async with client(api) as http:
        events = await stored(http, "assistant", turn_id)
    subscribed, replay = frames[0], frames[1]
    assert subscribed["type"] == "ws.subscribed" and subscribed["turnId"] == turn_id
    sub = subscribed["sub"]
    assert replay["type"] == "stream.replay" and replay["sub"] == sub
    assert all(f["sub"] == sub for f in frames)
    got = envelopes(frames)
    assert [e["cursor"] for e in got] == cursors(events, chunks=False)
    assert [e["id"] for e in got] == [e["id"] for e in events if e["type"] != "model.chunk"]
    assert frames[-2]["type"] == "turn.end"
    assert frames[-1] == {"type": "stream.ended", "sub": sub, "turnId": turn_id,
                          "status": "final", "steps": 2}  # fmt: skip


@pytest.mark.asyncio
async def test_one_socket_watches_two_turns_at_once(slow: ApiServer) -> None:
    async with opened(slow) as ws:
        for session in ("a", "b"):
            await send(ws, type="message", agentId="helper", text="talk", sessionKey=session,
                       ref=session)  # fmt: skip
        accepted = {f["ref"]: f["turnId"] for f in [await receive(ws), await receive(ws)]}
        for session, turn_id in accepted.items():
            await send(ws, type="subscribe", turnId=turn_id, chunks=True, sub=session)
        ended: set[str] = set()

        def both(frame: dict[str, Any]) -> bool:
            if frame.get("type") == "stream.ended":
                ended.add(frame["sub"])
            return ended == {"a", "b"}

        frames = await receive_until(ws, both)
    async with client(slow) as http:
        for session, turn_id in accepted.items():
            mine = envelopes(frames, session)
            assert [e["cursor"] for e in mine] == cursors(await stored(http, "helper", turn_id))
            assert {e["turnId"] for e in mine} == {turn_id}
    subs = [f["sub"] for f in envelopes(frames)]
    first_b = subs.index("b")
    assert "a" in subs[first_b:], "the two turns were not streamed side by side"


@pytest.mark.asyncio
async def test_ws_subscribe_after_a_cursor_resumes_mid_stream(slow: ApiServer) -> None:
    async with opened(slow) as ws:
        await send(ws, type="message", agentId="helper", text="talk")
        turn_id = (await receive(ws))["turnId"]
        await send(ws, type="subscribe", turnId=turn_id, chunks=True)
        chunks = 0

        def fifth_chunk(frame: dict[str, Any]) -> bool:
            nonlocal chunks
            chunks += frame.get("type") == "model.chunk"
            return chunks == 5

        first = await receive_until(ws, fifth_chunk)
    async with client(slow) as http:
        assert await status(http, turn_id) == "running"  # the socket dropped mid-stream
        cut = envelopes(first)[-1]["cursor"]
        async with opened(slow) as ws:
            await send(ws, type="subscribe", turnId=turn_id, chunks=True, after=cut, sub="again")
            second = await receive_until(ws, kind("stream.ended"))
        events = await stored(http, "helper", turn_id)
    replay = next(f for f in second if f["type"] == "stream.replay")
    assert replay["sub"] == "again" and replay["from"] == cut
    assert any(e["type"] == "model.chunk" for e in envelopes(second))
    union = [e["cursor"] for e in envelopes(first) + envelopes(second)]
    assert len(union) == len(set(union)), "an event was delivered twice"
    assert union == cursors(events)
    assert second[-1]["status"] == "final"


@pytest.mark.asyncio
async def test_ws_subscribe_after_the_turn_end_cursor_ends_at_once(api: ApiServer) -> None:
    async with client(api) as http:
        turn_id = await post(http, "assistant", "hello")
        await wait_end(api.node, turn_id)
        end = (await stored(http, "assistant", turn_id))[-1]
    async with opened(api) as ws:
        await send(ws, type="subscribe", turnId=turn_id, after=end["cursor"], sub="late")
        frames = await receive_until(ws, kind("stream.ended"), timeout=5)
    assert envelopes(frames) == []
    assert frames[-1] == {"type": "stream.ended", "sub": "late", "turnId": turn_id,
                          "status": "final", "steps": 1}  # fmt: skip


@pytest.mark.asyncio
async def test_ws_agent_subscription_is_live_and_scoped_to_its_session(api: ApiServer) -> None:
    async with opened(api) as ws, client(api) as http:
        await send(ws, type="subscribe", agentId="assistant", sessionKey="s1", sub="s1")
        head = await receive_until(ws, kind("stream.live"))
        assert [f["type"] for f in head] == ["ws.subscribed", "stream.replay", "stream.live"]
        assert head[0]["agentId"] == "assistant" and head[0]["sessionKey"] == "s1"
        assert head[1]["events"] == 0
        turns = []
        for session in ("s2", "s1", "s2", "s1"):
            turns.append(await post(http, "assistant", f"hello {session}", session))
            await wait_end(api.node, turns[-1])
        last = turns[-1]
        frames = await receive_until(
            ws, lambda f: f.get("type") == "turn.end" and f["turnId"] == last
        )
        await send(ws, type="ping", ref="barrier")
        rest = await receive_until(ws, kind("pong"))
    got = envelopes(frames)
    assert {(e["sub"], e["agentId"], e["sessionKey"]) for e in got} == {("s1", "assistant", "s1")}
    assert {e["turnId"] for e in got} == {turns[1], turns[3]}
    assert [f["type"] for f in rest] == ["pong"], "the subscription ended with a turn"


@pytest.mark.asyncio
async def test_ws_unsubscribe_stops_the_events(api: ApiServer) -> None:
    async with opened(api) as ws, client(api) as http:
        await send(ws, type="subscribe", agentId="assistant", sub="watch")
        await receive_until(ws, kind("stream.live"))
        await send(ws, type="unsubscribe", sub="watch")
        assert await receive(ws) == {"type": "ws.unsubscribed", "sub": "watch"}
        turn_id = await post(http, "assistant", "hello")
        await wait_end(api.node, turn_id)
        await send(ws, type="unsubscribe", sub="watch")
        error = await receive(ws)
        await send(ws, type="ping", ref="p")
        assert await receive(ws) == {"type": "pong", "ref": "p"}  # and no event before it
    assert error["type"] == "ws.error" and error["code"] == "subscription_not_found"
    assert error["sub"] == "watch" and error["hint"]


@pytest.mark.asyncio
async def test_ws_stop_ends_the_turn_stopped(slow: ApiServer) -> None:
    async with opened(slow) as ws:
        await send(ws, type="message", agentId="helper", text="talk")
        turn_id = (await receive(ws))["turnId"]
        await send(ws, type="subscribe", turnId=turn_id, chunks=True, sub="t")
        await receive_until(ws, kind("model.chunk"))
        await send(ws, type="stop", turnId=turn_id)
        seen: set[str] = set()

        def stopping_and_ended(frame: dict[str, Any]) -> bool:
            seen.add(frame.get("type", ""))
            return {"ws.stopping", "stream.ended"} <= seen

        frames = await receive_until(ws, stopping_and_ended)
        await send(ws, type="stop", turnId=turn_id)
        again = await receive_until(ws, kind("ws.stopping"))
        await send(ws, type="stop", turnId="t_nope")
        unknown = await receive(ws)
    stopping = next(f for f in frames if f["type"] == "ws.stopping")
    assert stopping == {"type": "ws.stopping", "turnId": turn_id, "found": True}
    assert frames[-1]["status"] == "stopped"
    assert again[-1] == {"type": "ws.stopping", "turnId": turn_id, "found": False}
    assert unknown["type"] == "ws.error" and unknown["code"] == "turn_not_found"


MALFORMED: list[tuple[str, str | bytes, str]] = [
    ("not JSON", "hello?", "frame_not_json"),
    ("a binary frame", b"\x00\x01", "frame_not_json"),
    ("an unknown type", '{"type": "dance"}', "unknown_frame_type"),
    ("no type at all", '{"text": "hi"}', "unknown_frame_type"),
    ("not an object", "[1, 2]", "frame_invalid"),
    ("a message without text", '{"type": "message", "agentId": "assistant"}', "frame_invalid"),
    ("a message without an agent", '{"type": "message", "text": "hi"}', "agent_id_required"),
    ("a message to nobody", '{"type": "message", "agentId": "x", "text": "hi"}', "agent_not_found"),
    ("a subscribe without a target", '{"type": "subscribe"}', "subscribe_needs_target"),
    (
        "a subscribe with a bad cursor",
        '{"type": "subscribe", "agentId": "assistant", "after": "!!"}',
        "cursor_invalid",
    ),
    ("a subscribe to no turn", '{"type": "subscribe", "turnId": "t_nope"}', "turn_not_found"),
    ("an unsubscribe without sub", '{"type": "unsubscribe"}', "frame_invalid"),
    ("a stop without a turn", '{"type": "stop"}', "frame_invalid"),
]


@pytest.mark.asyncio
async def test_ws_malformed_frames_get_an_error_and_the_socket_stays_open(api: ApiServer) -> None:
    async with opened(api) as ws:
        answers = []
        for _, raw, _ in MALFORMED:
            await ws.send(raw)
            answers.append(await receive(ws))
        await send(ws, type="ping", ref="still here")
        assert await receive(ws) == {"type": "pong", "ref": "still here"}
    for (name, _, code), answer in zip(MALFORMED, answers, strict=True):
        assert answer["type"] == "ws.error", name
        assert answer["code"] == code, f"{name}: {answer}"
        assert answer["message"] and answer["hint"], name


@pytest.mark.asyncio
async def test_ws_needs_a_token_when_tokens_are_configured(api_factory: ApiFactory) -> None:
    secret = "s" * 32
    api = await api_factory.start(tokens=[secret])
    bearer = Subprotocol("dispach.bearer")
    for headers, protocols in [
        ({}, None),
        ({"Authorization": "Bearer " + "w" * 32}, None),
        ({}, [bearer, Subprotocol("w" * 32)]),
    ]:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(api.ws_url, additional_headers=headers, subprotocols=protocols):
                pass
        assert refused.value.response.status_code in (401, 403)
    async with connect(api.ws_url, subprotocols=[bearer, Subprotocol(secret)]) as ws:
        assert ws.subprotocol == "dispach.bearer"
        assert (await receive(ws))["type"] == "ws.open"
        await send(ws, type="ping")
        assert (await receive(ws))["type"] == "pong"
    async with opened(api, token=secret) as ws:
        await send(ws, type="ping")
        assert (await receive(ws))["type"] == "pong"


@pytest.mark.asyncio
async def test_closing_a_socket_never_stops_a_turn(slow: ApiServer) -> None:
    async with opened(slow) as ws:
        await send(ws, type="message", agentId="helper", text="talk")
        turn_id = (await receive(ws))["turnId"]
        await send(ws, type="subscribe", turnId=turn_id, chunks=True)
        await receive_until(ws, kind("model.chunk"))
    async with client(slow) as http:
        assert await status(http, turn_id) == "running"
        await wait_end(slow.node, turn_id)
        assert await status(http, turn_id) == "final"


# --- 7. backpressure -----------------------------------------------------------------------------

BIG = 2000
"""Deltas of a big turn: each is over the runtime's coalescing size (512 characters), so every
one becomes its own ``model.chunk`` event: well over the 1024 frames a socket may have pending."""


async def drain(ws: ClientConnection, into: list[dict[str, Any]], timeout: float = 30) -> None:
    """Read everything until the server closes the socket (ConnectionClosed)."""
    async with asyncio.timeout(timeout):
        while True:
            into.append(await receive(ws))


@pytest.mark.asyncio
async def test_a_socket_that_does_not_read_is_closed_4008_and_resumes_from_its_cursor(
    slow: ApiServer, fake_anthropic: FakeAnthropic
) -> None:
    fake_anthropic.default = Reply(text=("y" * 519 + " ") * BIG, chunk_size=520)
    # What the server writes must stay on the server, where the cap is: the client socket has a
    # small receive buffer and a small segment size (so the kernel does not grow the server's
    # send buffer to megabytes), no compression (repeated text would shrink to nothing), and the
    # client stops reading from it altogether.
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    raw.setblocking(False)
    await asyncio.get_running_loop().sock_connect(raw, ("127.0.0.1", slow.port))
    async with client(slow) as http, contextlib.AsyncExitStack() as stack:
        stack.callback(raw.close)
        async with opened(slow, sock=raw, max_size=None, compression=None) as ws:
            await send(ws, type="subscribe", agentId="helper", chunks=True, sub="all")
            await receive_until(ws, kind("stream.live"))
            ws.transport.pause_reading()
            shed = REGISTRY.get_sample_value("dispach_ws_slow_consumers_total") or 0.0
            turn_id = await post(http, "helper", "talk a lot")
            async with asyncio.timeout(60):  # not reading meanwhile, until the server gives up
                while (REGISTRY.get_sample_value("dispach_ws_slow_consumers_total") or 0) <= shed:
                    await asyncio.sleep(0.02)
            # Read again within the grace (gateways.streams.ws.CLOSE_GRACE_S): the close frame
            # arrives (a client that never reads is aborted instead: tests/test_bad_input.py).
            ws.transport.resume_reading()
            first: list[dict[str, Any]] = []
            with pytest.raises(ConnectionClosed) as closed:
                await drain(ws, first)
        assert closed.value.rcvd is not None, "the server did not close the socket"
        assert closed.value.rcvd.code == 4008 and "slow_consumer" in closed.value.rcvd.reason
        await wait_end(slow.node, turn_id, timeout=60)
        events = await stored(http, "helper", turn_id)
        got = [e for e in envelopes(first) if e["turnId"] == turn_id]
        assert got and len(got) < len(events)
        assert [e["cursor"] for e in got] == cursors(events)[: len(got)]
        async with opened(slow, max_size=None) as ws:
            await send(ws, type="subscribe", turnId=turn_id, chunks=True,
                       after=got[-1]["cursor"], sub="again")  # fmt: skip
            second = await receive_until(ws, kind("stream.ended"), timeout=60)
    union = [e["cursor"] for e in got + envelopes(second)]
    assert union == cursors(events), "resuming from the last cursor lost or repeated events"


@pytest.mark.asyncio
async def test_a_socket_that_reads_promptly_may_replay_more_than_1024_events(
    slow: ApiServer, fake_anthropic: FakeAnthropic
) -> None:
    fake_anthropic.default = Reply(text=("y" * 519 + " ") * BIG, chunk_size=520)
    async with client(slow) as http:
        turn_id = await post(http, "helper", "talk a lot")
        await wait_end(slow.node, turn_id, timeout=60)
        events = await stored(http, "helper", turn_id)
    assert len(events) > 1024
    async with opened(slow, max_size=None) as ws:
        await send(ws, type="subscribe", turnId=turn_id, chunks=True, sub="replay")
        try:
            frames = await receive_until(ws, kind("stream.ended"), timeout=60)
        except ConnectionClosed as e:
            code = e.rcvd.code if e.rcvd else None
            raise AssertionError(f"a prompt reader was closed ({code}) during the replay") from e
    assert [e["cursor"] for e in envelopes(frames)] == cursors(events)


def test_a_batch_of_frames_goes_out_in_few_writes_of_bounded_size() -> None:
    """What one read of a stream brought is written at once (gateways/streams/sse.py ``joined``); a
    long replay is cut into writes of about 64 KiB, every byte kept in order."""
    small = [f"data: {n}\n\n".encode() for n in range(20)]
    assert list(joined(small)) == [b"".join(small)]
    assert list(joined([])) == []
    big = [bytes([65 + n % 26]) * 10_000 for n in range(50)]
    writes = list(joined(big))
    assert b"".join(writes) == b"".join(big)
    assert len(writes) == 8 and all(len(w) <= (64 << 10) + 10_000 for w in writes)

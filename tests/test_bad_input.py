"""Bounds on what clients send, at every door: JSON nested too deeply (HTTP, WebSocket, NATS
ingress and the session actors' subjects), bodies over the cap whatever their transfer encoding,
WebSockets that never read, blank session keys, and who may read ``/metrics``.

Everything runs against the real node (Postgres, NATS, actors) behind a real uvicorn server; the
slow consumer is a real TCP client that completes the WebSocket upgrade and then never reads."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import jsonschema
import msgspec
import nats
import psycopg
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.uri import parse_uri

from actors.messages import MAX_DEPTH, too_deep
from eventstore import subjects
from eventstore.catalogue import TurnEnd
from gateways.http.app import create_app
from gateways.streams.ws import CLOSE_GRACE_S
from tests import fakes
from tests.conftest import ApiFactory, ApiServer, Servers
from tests.fakes import FakeAnthropic, Reply
from tests.test_api_http import eventually
from tests.test_api_streams import opened, receive, send, slow
from tests.test_node import Serve
from tests.test_turns_anthropic import KEY_ENV, manifest
from tests.turns import wait_end

fake_anthropic = fakes.fake_anthropic
__all__ = ["fake_anthropic", "slow"]  # fixtures used by the tests below

T = TypeVar("T")
Json = dict[str, Any]


def nested(levels: int, inner: str = "1") -> str:
    """``levels`` arrays, one inside the other."""
    return "[" * levels + inner + "]" * levels


DEEP = '{"text": "hi", "x": ' + nested(1000) + "}"
"""The probe of the issue: 1,000 levels in 1.9 KB (msgspec raised RecursionError on it)."""


def error_of(response: httpx.Response, status: int, code: str) -> Json:
    assert response.status_code == status, response.text
    error: Json = response.json()["error"]
    assert error["code"] == code, error
    assert error["message"] and error["hint"], error
    return error


def client_of(api: ApiServer, **headers: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=api.url, headers={**api.headers, **headers}, timeout=30)


JSON = {"Content-Type": "application/json"}

# --- 1. the depth scanner (a pure function) -------------------------------------------------------

DEPTHS: list[tuple[str, str, int]] = [
    ("empty", "", 0),
    ("a scalar", "42", 0),
    ("an object", '{"a": 1}', 1),
    ("arrays in arrays", nested(5), 5),
    ("siblings do not add up", "[" + ",".join([nested(3)] * 50) + "]", 4),
    ("objects and arrays alike", '{"a": [{"b": [{"c": []}]}]}', 6),
    ("brackets in a string", '{"text": "' + "[{" * 500 + '"}', 1),
    ("an escaped quote does not end a string", '{"t": "\\"' + "[" * 500 + '"}', 1),
    ("an escaped backslash does end a string", '["\\\\", ' + nested(3) + "]", 4),
    ("three backslashes then a quote", '["\\\\\\"[[[[", ' + nested(2) + "]", 3),
    ("unicode escapes", '["\\u005b\\u007b", ' + nested(2) + "]", 3),
]


def depth_of(text: str) -> int:
    """The smallest limit that ``too_deep`` accepts: the nesting depth it sees."""
    return next(limit for limit in range(10_000) if not too_deep(text, limit))


@pytest.mark.parametrize(("text", "depth"), [(t, d) for _, t, d in DEPTHS],
                         ids=[name for name, _, _ in DEPTHS])  # fmt: skip
def test_the_scanner_counts_nesting_outside_strings(text: str, depth: int) -> None:
    assert depth_of(text) == depth
    raw = text.encode()  # NATS bodies are bytes, WebSocket frames text
    assert not too_deep(raw, depth)
    assert too_deep(raw, depth - 1) == (depth > 0)


STRINGS = ["plain", 'a "quoted" [word]', "\\", '\\"', "{[", "]}", "\u00e9\u3000 ok", '\\\\["']


def depth_of_value(value: Any) -> int:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return 1 + max(map(depth_of_value, value), default=0)
    return 0


def test_the_scanner_agrees_with_the_json_parser_on_valid_json() -> None:
    seed = 1313
    rng = random.Random(seed)

    def value(levels: int) -> Any:
        if levels == 0 or rng.random() < 0.2:
            return rng.choice([*STRINGS, 1, None, True])
        items = [value(levels - 1) for _ in range(rng.randint(0, 3))]
        if rng.random() < 0.5:
            return items
        return {rng.choice(STRINGS) + str(i): item for i, item in enumerate(items)}

    for _ in range(3000):
        document = value(rng.randint(0, 10))
        text = json.dumps(document, ensure_ascii=rng.random() < 0.5)
        assert depth_of(text) == depth_of_value(document), f"seed {seed}: {text}"


def test_the_bound_is_a_few_times_what_requests_need_and_below_msgspec_s_limit() -> None:
    assert 32 <= MAX_DEPTH <= 128
    msgspec.json.decode(nested(MAX_DEPTH))  # decodes: the bound refuses nothing msgspec takes
    assert too_deep(nested(MAX_DEPTH + 1)) and not too_deep(nested(MAX_DEPTH))


def test_the_scanner_is_cheap_on_big_bodies() -> None:
    prose = json.dumps({"text": "a" * 1_000_000}).encode()
    code = json.dumps({"text": 'f(x) = {"a": [x[i] for i in y]}\n' * 30_000}).encode()
    for body, budget_s in ((prose, 0.005), (code, 0.1)):  # measured: 0.04 ms and 6 ms
        started = time.perf_counter()
        for _ in range(5):
            assert not too_deep(body)
        assert (time.perf_counter() - started) / 5 < budget_s


# --- 2. deep JSON at every door -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_deep_json_gets_400_body_too_deep_on_every_body_route(api: ApiServer) -> None:
    routes = [
        "/v1/agents/assistant/messages",
        "/v1/agents/assistant/approvals/ap_nope",
        "/v1/agents/assistant/schedules",
        "/v1/stream-tokens",
    ]
    async with client_of(api, **JSON) as http:
        for path in routes:
            response = await http.post(path, content=DEEP)
            error = error_of(response, 400, "body_too_deep")
            assert str(MAX_DEPTH) in error["message"], path


@pytest.mark.asyncio
async def test_deep_json_keeps_the_connection_and_a_shallow_body_still_passes(
    api: ApiServer,
) -> None:
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=api.url, headers=JSON, limits=limits, timeout=30) as http:
        deep = await http.post("/v1/agents/assistant/messages", content=DEEP)
        error_of(deep, 400, "body_too_deep")
        first = deep.extensions["network_stream"].get_extra_info("client_addr")
        at_bound = '{"text": "hello", "x": ' + nested(MAX_DEPTH - 1) + "}"
        ok = await http.post("/v1/agents/assistant/messages", content=at_bound)
        assert ok.status_code == 202, ok.text
        second = ok.extensions["network_stream"].get_extra_info("client_addr")
    assert first == second, "the deep body cost the client its keep-alive connection"


@pytest.mark.asyncio
async def test_a_deep_websocket_frame_gets_ws_error_and_the_socket_stays_open(
    api: ApiServer,
) -> None:
    async with opened(api) as ws:
        await ws.send('{"type": "message", "agentId": "assistant", "text": "hi", "x": '
                      + nested(1000) + "}")  # fmt: skip
        error = await receive(ws)
        await send(ws, type="ping", ref="still here")
        assert await receive(ws) == {"type": "pong", "ref": "still here"}
    assert error["type"] == "ws.error" and error["code"] == "body_too_deep", error
    assert error["message"] and error["hint"]


@pytest.mark.asyncio
async def test_deep_json_on_nats_gets_an_error_reply_on_every_subject(
    api: ApiServer, servers: Servers
) -> None:
    targets = [
        subjects.ingress("assistant"),
        *(
            subjects.node_command(api.node.node_id, kind, 0)
            for kind in ("submit", "stop", "clear", "resolve", "fork")
        ),
    ]
    nc = await nats.connect(servers.nats_url)
    try:
        for subject in targets:
            answer = await nc.request(subject, DEEP.encode(), timeout=10)
            error = json.loads(answer.data)["error"]
            assert error["code"] == "body_too_deep", (subject, error)
            assert error["message"] and error["hint"], subject
        # and the doors still work
        answer = await nc.request(subjects.ingress("assistant"), b'{"text": "hello"}', timeout=10)
        assert "turnId" in json.loads(answer.data), answer.data
    finally:
        await nc.close()


# --- 3. the body cap on every transfer encoding ---------------------------------------------------


@contextlib.asynccontextmanager
async def served(api_factory: ApiFactory, max_body: int) -> AsyncIterator[str]:
    """A node's app served by uvicorn with ``max_body`` (as ``dispach serve`` passes
    ``DISPACH_MAX_BODY``); its base URL."""
    import uvicorn

    node = await api_factory.nodes.start()
    app = create_app(node, loopback=True, allowed_hosts=node.settings.allowed_hosts,
                     max_body=max_body)  # fmt: skip
    config = uvicorn.Config(app, host="127.0.0.1", port=0, loop="none", lifespan="off",
                            log_config=None, access_log=False)  # fmt: skip
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(server.serve(), name="uvicorn-capped")
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def chunked(body: bytes, size: int = 1000) -> AsyncIterator[bytes]:
    """The body in pieces: httpx sends it with ``Transfer-Encoding: chunked``."""
    for start in range(0, len(body), size):
        yield body[start : start + size]


@pytest.mark.asyncio
async def test_the_configured_body_cap_holds_for_chunked_bodies(api_factory: ApiFactory) -> None:
    big = json.dumps({"text": "x" * 20_000}).encode()
    small = json.dumps({"text": "x" * 5_000}).encode()
    async with (
        served(api_factory, max_body=10_000) as url,
        httpx.AsyncClient(base_url=url, headers=JSON, timeout=30) as http,
    ):
        path = "/v1/agents/assistant/messages"
        sized = await http.post(path, content=big)  # with Content-Length
        streamed = await http.post(path, content=chunked(big))
        fits = await http.post(path, content=chunked(small))
    assert streamed.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in streamed.request.headers
    error_of(sized, 413, "body_too_large")
    error = error_of(streamed, 413, "body_too_large")
    assert "10000" in error["message"]
    assert fits.status_code == 202, fits.text


# --- 4. a WebSocket that never reads --------------------------------------------------------------

BIG = 2000
"""Deltas of a big turn, each its own ``model.chunk``: far more than a socket may have pending."""


def gauge(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def server_side(client: tuple[int, int]) -> str | None:
    """The kernel's TCP state of the server's end of ``client``'s connection (from
    /proc/net/tcp, hex as the kernel writes it: ``01`` established), or None once the server
    holds nothing of it; ``client`` is the client's (local port, server port). (The client's
    own state proves nothing: a reset the client does not take, its window being full, leaves it
    "established" on its side alone.)"""
    here, there = client
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            local, remote, state = line.split()[1:4]
            if int(local.split(":")[1], 16) == there and int(remote.split(":")[1], 16) == here:
                return state
    return None


@contextlib.contextmanager
def small_socket() -> Iterator[socket.socket]:
    """A client socket that holds little: a 4 KB receive buffer and small segments, so what the
    server writes stays on the server, where its cap is."""
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    raw.setblocking(False)
    try:
        yield raw
    finally:
        raw.close()


async def upgraded(api: ApiServer, raw: socket.socket, first: Json) -> list[Json]:
    """Open the WebSocket on ``raw`` (the real protocol, sans I/O), send ``first`` and read the
    text frames up to ``stream.live``; after that nothing on this socket is ever read."""
    loop = asyncio.get_running_loop()
    await loop.sock_connect(raw, ("127.0.0.1", api.port))
    client = ClientProtocol(parse_uri(api.ws_url))
    client.send_request(client.connect())
    await loop.sock_sendall(raw, b"".join(client.data_to_send()))
    frames: list[Json] = []
    async with asyncio.timeout(10):
        while not frames or frames[-1].get("type") != "stream.live":
            client.receive_data(await loop.sock_recv(raw, 4096))
            for event in client.events_received():
                if isinstance(event, Response):  # upgraded: now send ``first``
                    assert event.status_code == 101, event
                    client.send_text(json.dumps(first).encode())
                    await loop.sock_sendall(raw, b"".join(client.data_to_send()))
                elif isinstance(event, Frame) and event.opcode is Opcode.TEXT:
                    frames.append(json.loads(bytes(event.data)))
    return frames


@pytest.mark.asyncio
async def test_a_socket_that_never_reads_is_dropped_within_bounded_time(
    slow: ApiServer, fake_anthropic: FakeAnthropic
) -> None:
    fake_anthropic.default = Reply(text=("y" * 519 + " ") * BIG, chunk_size=520)
    subscribers = gauge("dispach_stream_subscribers", kind="ws")
    shed = gauge("dispach_ws_slow_consumers_total")
    with small_socket() as raw:
        head = await upgraded(slow, raw, {"type": "subscribe", "agentId": "helper",
                                          "chunks": True, "sub": "all"})  # fmt: skip
        assert [f["type"] for f in head][-1] == "stream.live"
        ends = raw.getsockname()[1], raw.getpeername()[1]
        assert gauge("dispach_stream_subscribers", kind="ws") == subscribers + 1
        async with client_of(slow) as http:
            response = await http.post("/v1/agents/helper/messages", json={"text": "talk"})
            assert response.status_code == 202, response.text
        turn_id = response.json()["turnId"]

        async def overflowed() -> float | None:
            return time.monotonic() if gauge("dispach_ws_slow_consumers_total") > shed else None

        async def released() -> float | None:
            freed = gauge("dispach_stream_subscribers", kind="ws") == subscribers
            return time.monotonic() if freed else None

        async def dropped() -> bool | None:
            return True if server_side(ends) is None else None

        overflow_at = await eventually(overflowed, "the socket to fall behind", 60)
        released_at = await eventually(released, "the server to let go of the socket", 30)
        # Without reading anything: the server's side of the connection is gone (a reset;
        # a mere close would leave it waiting, with its send buffer, for the client to read).
        await eventually(dropped, "the server to drop the connection", 5)
    assert released_at - overflow_at < CLOSE_GRACE_S + 1.5
    end = (await wait_end(slow.node, turn_id, timeout=60))[-1].data
    assert isinstance(end, TurnEnd) and end.reason == "final"  # dropping a socket stops no turn


def served_gauges(url: str) -> dict[str, float]:
    """The two WebSocket series of a node's ``/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "dispach_ws_slow_consumers_total"
        or (sample.name == "dispach_stream_subscribers" and sample.labels.get("kind") == "ws")
    }


def polled(probe: Callable[[], T | None], what: str, timeout: float) -> T:
    deadline = time.monotonic() + timeout
    while (found := probe()) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)
    return found


@pytest.mark.slow
def test_dispach_serve_drops_a_socket_that_never_reads(
    servers: Servers, fake_anthropic: FakeAnthropic, tmp_path: Path
) -> None:
    """The same on the node's own server (uvloop, gateways/http/protocol.py's WebSocket
    protocol)."""
    fake_anthropic.default = Reply(text=("y" * 519 + " ") * BIG, chunk_size=520)
    agents = tmp_path / "agents"
    agents.mkdir()
    (agents / "helper.yaml").write_text(manifest(fake_anthropic))
    schema = f"t_{uuid.uuid4().hex[:12]}"
    node = Serve(tmp_path / "home", DATABASE_URL=servers.database_url,
                 NATS_URL=servers.nats_url, DISPACH_DB_SCHEMA=schema,
                 DISPACH_AGENTS=str(agents), **{KEY_ENV: "test-key"})  # fmt: skip
    try:
        node.wait_ready()
        with small_socket() as raw:
            raw.setblocking(True)
            raw.settimeout(10)
            raw.connect(("127.0.0.1", node.port))
            client = ClientProtocol(parse_uri(f"ws://127.0.0.1:{node.port}/v1/ws"))
            client.send_request(client.connect())
            raw.sendall(b"".join(client.data_to_send()))
            live = False
            while not live:
                client.receive_data(raw.recv(4096))
                for event in client.events_received():
                    if isinstance(event, Response):
                        assert event.status_code == 101, event
                        client.send_text(b'{"type": "subscribe", "agentId": "helper", '
                                         b'"chunks": true}')  # fmt: skip
                        raw.sendall(b"".join(client.data_to_send()))
                    elif isinstance(event, Frame) and event.opcode is Opcode.TEXT:
                        live = json.loads(bytes(event.data))["type"] == "stream.live"
            ends = raw.getsockname()[1], raw.getpeername()[1]
            assert server_side(ends) == "01"  # (established)
            before = served_gauges(node.url)
            assert before["dispach_stream_subscribers"] == 1
            accepted = httpx.post(f"{node.url}/v1/agents/helper/messages",
                                  json={"text": "talk"}, timeout=30)  # fmt: skip
            assert accepted.status_code == 202, accepted.text

            def shed() -> float | None:
                gauges = served_gauges(node.url)
                overflowed = gauges.get("dispach_ws_slow_consumers_total", 0) > 0
                return time.monotonic() if overflowed else None

            def freed() -> float | None:
                gone = served_gauges(node.url)["dispach_stream_subscribers"] == 0
                return time.monotonic() if gone else None

            overflow_at = polled(shed, "the socket to fall behind", 60)
            freed_at = polled(freed, "the node to let go of the socket", 30)
            polled(lambda: True if server_side(ends) is None else None,
                   "the node to drop the connection", 5)  # fmt: skip
        assert freed_at - overflow_at < CLOSE_GRACE_S + 1.5
        assert "ws_aborted" in node.output()
    finally:
        node.stop()
        with psycopg.connect(servers.database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


# --- 5. blank session keys ------------------------------------------------------------------------

BLANKS = [" ", "   ", "\t\n", "\u00a0", "\u3000 \ufeff"]


@pytest.mark.asyncio
async def test_a_blank_session_key_is_refused_at_every_door(
    api: ApiServer, servers: Servers
) -> None:
    async with client_of(api) as http:
        for key in BLANKS:
            response = await http.post(
                "/v1/agents/assistant/messages", json={"text": "hi", "sessionKey": key}
            )
            assert error_of(response, 400, "session_key_invalid")["field"] == "sessionKey"
    async with opened(api) as ws:
        await send(ws, type="message", agentId="assistant", text="hi", sessionKey=" ", ref="r")
        error = await receive(ws)
    assert (error["type"], error["code"]) == ("ws.error", "session_key_invalid")
    nc = await nats.connect(servers.nats_url)
    try:
        answer = await nc.request(subjects.ingress("assistant"),
                                  b'{"text": "hi", "sessionKey": "  "}', timeout=10)  # fmt: skip
    finally:
        await nc.close()
    assert json.loads(answer.data)["error"]["code"] == "session_key_invalid"


@pytest.mark.asyncio
async def test_the_openapi_document_refuses_a_blank_session_key_too(api: ApiServer) -> None:
    async with client_of(api) as http:
        document = (await http.get("/v1/openapi.json")).json()
    schema = {**document["components"]["schemas"]["MessageBody"],
              "components": document["components"]}  # fmt: skip
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({"text": "hi", "sessionKey": "tg:-100"})
    for key in BLANKS:
        assert not validator.is_valid({"text": "hi", "sessionKey": key}), repr(key)


# --- 6. /metrics and scoped tokens ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_metrics_answer_only_an_unscoped_token(api_factory: ApiFactory) -> None:
    root, scoped = "r" * 32, "s" * 32
    api = await api_factory.start(tokens=[root, f"{scoped}@assistant"])
    async with httpx.AsyncClient(base_url=api.url, timeout=30) as http:
        anonymous = await http.get("/metrics")
        narrow = await http.get("/metrics", headers={"Authorization": f"Bearer {scoped}"})
        full = await http.get("/metrics", headers={"Authorization": f"Bearer {root}"})
    error_of(anonymous, 401, "unauthorized")
    error = error_of(narrow, 403, "metrics_forbidden")
    assert "unscoped" in error["hint"] or "not scoped" in error["hint"], error
    assert "dispach_" not in narrow.text
    assert full.status_code == 200 and "dispach_stream_subscribers" in full.text


@pytest.mark.asyncio
async def test_metrics_stay_open_without_tokens_on_loopback(api: ApiServer) -> None:
    async with httpx.AsyncClient(base_url=api.url, timeout=30) as http:
        response = await http.get("/metrics")
    assert response.status_code == 200 and "dispach_stream_subscribers" in response.text

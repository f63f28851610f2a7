"""The HTTP server's edges, on raw sockets against a real ``dispach serve``: read timeouts
(slowloris heads and bodies), the cap on connections per client address, and the error envelope
for what no route sees (malformed HTTP, an oversized head, a bad WebSocket handshake), and a
response's head written with its body.

One node serves the whole module, with short timeouts and a small cap. Each test connects from
an address of its own in 127.0.0.0/8 (Linux routes all of it to loopback), so what one test holds
open never counts against another's cap.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import uuid
from collections.abc import Iterator
from importlib.metadata import version
from typing import Any

import psycopg
import pytest
from psycopg import sql
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.sync.client import connect as connect_ws

from gateways.http.protocol import EdgeProtocol
from gateways.http.wsprotocol import EdgeWebSocket
from runtime.config import from_env
from runtime.errors import ConfigError
from tests.conftest import Servers
from tests.test_node import Serve

pytestmark = pytest.mark.slow

HEAD_S = 2
BODY_S = 3
CAP = 6
SLACK = 1.5
"""How late past a timeout an answer may come (a loaded 2-core machine)."""


@pytest.fixture(scope="module")
def node(servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    schema = f"t_{uuid.uuid4().hex[:12]}"
    serve = Serve(
        tmp_path_factory.mktemp("edges") / "home",
        DATABASE_URL=servers.database_url,
        NATS_URL=servers.nats_url,
        DISPACH_DB_SCHEMA=schema,
        DISPACH_HEAD_TIMEOUT_SECONDS=str(HEAD_S),
        DISPACH_BODY_TIMEOUT_SECONDS=str(BODY_S),
        DISPACH_MAX_CONNECTIONS_PER_CLIENT=str(CAP),
    )
    try:
        serve.wait_ready()
        yield serve
    finally:
        if serve.proc.poll() is None:
            serve.stop()
        with psycopg.connect(servers.database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


# ---- raw HTTP ------------------------------------------------------------------------------------


def connect(node: Serve, source: str) -> socket.socket:
    """A TCP connection to the node from ``source`` (an address in 127.0.0.0/8)."""
    return socket.create_connection(
        ("127.0.0.1", node.port), timeout=10, source_address=(source, 0)
    )


def read_to_eof(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes; fails if it has not closed by ``timeout``."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"still open after {timeout} s; received {data[:300]!r}") from None
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
        sock.settimeout(max(0.01, deadline - time.monotonic()))


def read_answer(sock: socket.socket, timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    """One response with a Content-Length body (the connection stays open)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before an answer: {data!r}"
        data += chunk
    status, headers, body = split(data)
    while len(body) < int(headers.get("content-length", "0")):
        body += sock.recv(65536)
    return status, headers, body


def split(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        assert name.strip().lower() not in headers, f"{name} twice in {head!r}"
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split(" ")[1]), headers, body


def envelope(raw: bytes, status: int, code: str) -> dict[str, Any]:
    """The error envelope of a whole answer (read to EOF), checked: status, JSON, closed."""
    assert raw, "closed without an answer"
    got, headers, body = split(raw)
    assert got == status, raw[:400]
    assert headers["content-type"] == "application/json", headers
    assert headers["connection"] == "close", headers
    assert int(headers["content-length"]) == len(body), raw[:400]
    error: dict[str, Any] = json.loads(body)["error"]
    assert error["code"] == code and error["message"] and error["hint"], error
    return error


def get(path: str, *extra: str) -> bytes:
    return "\r\n".join([f"GET {path} HTTP/1.1", "Host: 127.0.0.1", *extra, "", ""]).encode()


def health(node: Serve, source: str) -> int:
    """The status of GET /v1/health on a new connection from ``source``."""
    with connect(node, source) as sock:
        sock.sendall(get("/v1/health"))
        return read_answer(sock)[0]


def eventually_served(node: Serve, source: str, timeout: float = 5) -> None:
    """Wait until a new connection from ``source`` is served (the server frees a slot when it
    sees the close, a moment after the client's)."""
    deadline = time.monotonic() + timeout
    while (status := health(node, source)) != 200:
        assert status == 503 and time.monotonic() < deadline, status
        time.sleep(0.05)


# ---- read timeouts -------------------------------------------------------------------------------


def test_a_head_sent_a_byte_a_second_is_answered_408_and_closed(node: Serve) -> None:
    with connect(node, "127.0.0.11") as sock:
        start = time.monotonic()
        answer = b""
        for byte in get("/v1/health", "X-Padding: " + "p" * 40):
            sock.sendall(bytes([byte]))
            sock.settimeout(1)
            try:
                answer = sock.recv(65536)
            except TimeoutError:
                assert time.monotonic() - start < HEAD_S + SLACK + 1, "no answer in time"
                continue
            break
        answered = time.monotonic() - start
        error = envelope(answer + read_to_eof(sock, SLACK), 408, "request_timeout")
    assert HEAD_S - 0.2 <= answered <= HEAD_S + SLACK, answered
    assert "head" in error["message"], error


def test_a_connection_that_never_sends_is_closed_without_an_answer(node: Serve) -> None:
    with connect(node, "127.0.0.12") as sock:
        start = time.monotonic()
        assert read_to_eof(sock, HEAD_S + SLACK) == b""
    assert time.monotonic() - start >= HEAD_S - 0.2


def test_a_body_that_stops_coming_is_answered_408_and_closed(node: Serve) -> None:
    head = (
        "POST /v1/agents/assistant/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    with connect(node, "127.0.0.13") as sock:
        sock.sendall(head.encode())
        # A byte a second, each within the idle bound: the connection stays open past it.
        for byte in b'{"te':
            time.sleep(1)
            sock.sendall(bytes([byte]))
        last = time.monotonic()
        raw = read_to_eof(sock, BODY_S + SLACK)
    assert BODY_S - 0.2 <= time.monotonic() - last <= BODY_S + SLACK
    error = envelope(raw, 408, "request_timeout")
    assert "body" in error["message"], error


# ---- connections per client address --------------------------------------------------------------


def test_past_the_cap_a_connection_gets_503_and_a_freed_slot_is_used_again(node: Serve) -> None:
    source = "127.0.0.21"
    held = []
    try:
        for _ in range(CAP):  # long-lived: each holds the firehose open
            sock = connect(node, source)
            sock.sendall(get("/v1/events"))
            status, headers, _ = read_answer(sock)
            assert status == 200 and headers["content-type"].startswith("text/event-stream")
            held.append(sock)
        with connect(node, source) as extra:
            raw = read_to_eof(extra, 5)
        error = envelope(raw, 503, "too_many_connections")
        assert split(raw)[1]["retry-after"].isdigit()
        assert str(CAP) in error["message"], error
        assert health(node, "127.0.0.22") == 200, "another address is not capped"
        held.pop().close()
        eventually_served(node, source)
    finally:
        for sock in held:
            sock.close()


def test_websockets_count_against_the_cap_until_they_close(node: Serve) -> None:
    source = "127.0.0.23"
    with contextlib.ExitStack() as held:
        for n in range(CAP):
            ws = held.enter_context(
                connect_ws(f"ws://127.0.0.1:{node.port}/v1/ws", sock=connect(node, source))
            )
            assert json.loads(ws.recv(timeout=10))["type"] == "ws.open"
            ws.send(json.dumps({"type": "ping", "ref": str(n)}))  # upgraded, and it talks
            assert json.loads(ws.recv(timeout=10)) == {"type": "pong", "ref": str(n)}
        with connect(node, source) as extra:
            envelope(read_to_eof(extra, 5), 503, "too_many_connections")
    eventually_served(node, source)


# ---- the envelope for what no route sees ---------------------------------------------------------

HOST = b"Host: 127.0.0.1\r\n"
MALFORMED = {
    "bad Content-Length": b"POST /v1/health HTTP/1.1\r\n" + HOST + b"Content-Length: 1x\r\n\r\n",
    "two Content-Lengths": b"POST /v1/health HTTP/1.1\r\n" + HOST
    + b"Content-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    "NUL in the path": b"GET /v1/he\x00alth HTTP/1.1\r\n" + HOST + b"\r\n",
    "a control byte in a header": b"GET /v1/health HTTP/1.1\r\n" + HOST + b"X-A: a\x01b\r\n\r\n",
    "a space in a header name": b"GET /v1/health HTTP/1.1\r\n" + HOST + b"X A: b\r\n\r\n",
    "a garbage request line": b"HELLO THERE\r\n\r\n",
    "TLS spoken to plain HTTP": b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 32,
    "a path that is not ASCII": b"GET /v1/h\xc3\xa9alth HTTP/1.1\r\n" + HOST + b"\r\n",
    "a bad chunk size": b"POST /v1/health HTTP/1.1\r\n" + HOST
    + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
}  # fmt: skip


@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_http_gets_the_envelope(node: Serve, raw: bytes) -> None:
    with connect(node, "127.0.0.31") as sock:
        sock.sendall(raw)
        error = envelope(read_to_eof(sock, 5), 400, "http_request_invalid")
    assert "Invalid HTTP request received" not in error["message"]


@pytest.mark.parametrize("piece", [None, 8192], ids=["at once", "in 8 KiB pieces"])
def test_a_request_head_over_the_cap_gets_431(node: Serve, piece: int | None) -> None:
    head = get("/v1/health", "X-Big: " + "b" * 100_000)
    with connect(node, "127.0.0.32") as sock:
        with contextlib.suppress(OSError):  # the server may refuse before it has read it all
            for at in range(0, len(head), piece or len(head)):
                sock.sendall(head[at : at + (piece or len(head))])
                time.sleep(0.01 if piece else 0)
        error = envelope(read_to_eof(sock, 5), 431, "request_head_too_large")
    assert "65536" in error["message"], error


def test_a_bad_websocket_handshake_gets_the_envelope(node: Serve) -> None:
    with connect(node, "127.0.0.33") as sock:
        sock.sendall(get("/v1/ws", "Upgrade: websocket", "Connection: Upgrade",
                         "Sec-WebSocket-Version: 13"))  # fmt: skip
        error = envelope(read_to_eof(sock, 5), 400, "websocket_handshake_invalid")
    assert "Sec-WebSocket-Key" in error["message"], error


def test_keep_alive_requests_are_served_as_before(node: Serve) -> None:
    """Many requests on one connection, each well within the head timeout: all answered."""
    with connect(node, "127.0.0.34") as sock:
        for _ in range(20):
            sock.sendall(get("/v1/health"))
            status, _, body = read_answer(sock)
            assert status == 200 and json.loads(body)["status"] == "ok"
        sock.sendall(get("/v1/health") * 2)  # pipelined: both answers may come in one read
        data = b""
        while data.count(b'"status":"ok"') < 2:
            chunk = sock.recv(65536)
            assert chunk, f"closed after {data!r}"
            data += chunk
        assert data.count(b"HTTP/1.1 200 OK\r\n") == 2, data


def test_an_idle_keep_alive_connection_outlives_a_clients_own_expiry(node: Serve) -> None:
    """A connection left idle past httpx's 5 s (uvicorn's own default) is still served: the
    client closes first, so no request meets a connection the server is closing."""
    with connect(node, "127.0.0.37") as sock:
        sock.sendall(get("/v1/health"))
        assert read_answer(sock)[0] == 200
        time.sleep(6)  # the idle time is what is tested
        sock.sendall(get("/v1/health"))
        status, _, body = read_answer(sock)
        assert status == 200 and json.loads(body)["status"] == "ok"


def test_a_response_leaves_in_one_write(node: Serve) -> None:
    """The head waits for the body and goes out with it (gateways/http/protocol.py): the first read
    of the answer holds all of it. (Two writes would make the first read return the head alone
    whenever the client reads between them.)"""
    with connect(node, "127.0.0.35") as sock:
        for _ in range(20):
            sock.sendall(get("/v1/health"))
            sock.settimeout(10)
            first = sock.recv(65536)
            status, headers, body = split(first)
            assert status == 200 and int(headers["content-length"]) == len(body), first
            assert json.loads(body)["status"] == "ok"


def test_a_100_continue_comes_before_the_body_is_sent(node: Serve) -> None:
    """A client that asks ``Expect: 100-continue`` gets the interim answer once the handler
    reads the body (it is the cycle's first write, held only to the end of the loop's step),
    then the answer to what it sends."""
    body = json.dumps({"text": "hello", "sessionKey": "continue"}).encode()
    head = "\r\n".join([
        "POST /v1/agents/assistant/messages HTTP/1.1", "Host: 127.0.0.1",
        "Content-Type: application/json", f"Content-Length: {len(body)}",
        "Expect: 100-continue", "", "",
    ]).encode()  # fmt: skip
    with connect(node, "127.0.0.36") as sock:
        sock.sendall(head)
        sock.settimeout(10)
        interim = b""
        while b"\r\n\r\n" not in interim:
            chunk = sock.recv(65536)
            assert chunk, f"closed before the interim answer: {interim!r}"
            interim += chunk
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n", interim
        sock.sendall(body)
        status, _, answer = read_answer(sock)
        assert status == 202, answer
        assert json.loads(answer)["sessionKey"] == "continue"


# ---- the settings ---------------------------------------------------------------------------


def test_the_limits_are_settings_with_defaults_that_a_client_never_meets() -> None:
    settings = from_env({})
    assert (settings.head_timeout_seconds, settings.body_timeout_seconds) == (10, 30)
    assert settings.max_connections_per_client == 256
    assert settings.keep_alive_seconds == 65
    assert from_env({"DISPACH_MAX_CONNECTIONS_PER_CLIENT": "0"}).max_connections_per_client == 0
    for name, value in [("DISPACH_HEAD_TIMEOUT_SECONDS", "0"), ("DISPACH_BODY_TIMEOUT_SECONDS",
                        "soon"), ("DISPACH_MAX_CONNECTIONS_PER_CLIENT", "-1"),
                        ("DISPACH_KEEP_ALIVE_SECONDS", "0")]:  # fmt: skip
        with pytest.raises(ConfigError) as caught:
            from_env({name: value})
        assert caught.value.field == name and caught.value.hint


# ---- the uvicorn it is written for ---------------------------------------------------------------


def test_the_protocols_override_methods_this_uvicorn_has() -> None:
    """gateways/http/protocol.py and wsprotocol.py change uvicorn 0.54.0's protocols by overriding
    their methods: one
    that uvicorn renamed would silently be dead code. Upgrading uvicorn means re-reading
    uvicorn/protocols/http/httptools_impl.py and websockets_sansio_impl.py, then this pin."""
    assert version("uvicorn") == "0.54.0"
    for ours, theirs in (
        (EdgeProtocol, HttpToolsProtocol),
        (EdgeWebSocket, WebSocketsSansIOProtocol),
    ):
        overridden = [
            name
            for name in vars(ours)
            if not name.startswith("_") and callable(getattr(ours, name))
        ]
        assert overridden, ours
        assert [name for name in overridden if not hasattr(theirs, name)] == [], ours

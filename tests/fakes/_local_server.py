"""What the local fakes share: a threaded HTTP/1.1 server on a real loopback socket that a test
starts and stops, with the faults a provider's network can show.

A fake subclasses ``LocalServer`` (its state guarded by ``_lock``; ``_changed`` wakes whoever
waits on that state) and names a request handler derived from ``Handler``. ``stop()`` sets
``_stopping`` and notifies ``_changed`` first, so held answers, stalls and long polls end at
once; then it stops accepting, shuts every open connection down (held and idle keep-alive ones
too) and joins the connection threads: no thread of a fake outlives ``stop()``. An exception
escaping a handler, other than the client going away, is kept in ``errors``: a bug in the fake,
never in the client under test.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Generic, Self, TypeVar, cast

__all__ = ["Drop", "Handler", "Hold", "LocalServer", "phrase"]


@dataclass(frozen=True)
class Drop:
    """A scripted fault: close the connection without an answer; ``processed``: act first."""

    processed: bool


@dataclass(frozen=True)
class Hold:
    """A scripted fault: act at once, answer ``seconds`` late (at once when the fake stops)."""

    seconds: float


class LocalServer:
    """The lifecycle of a fake: ``start()``/``stop()`` or a context manager; thread-safe.
    ``handler`` answers its requests; ``name`` names its threads."""

    def __init__(
        self, handler: type[Handler[Any]], name: str, *, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self._handler, self._name = handler, name
        self._host, self._port = host, port
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._errors: list[BaseException] = []

    def start(self) -> Self:
        with self._lock:
            if self._server is not None:
                raise RuntimeError(f"{type(self).__name__} is already running")
            self._stopping.clear()
            self._server = _Server((self._host, self._port), self)
            self._thread = threading.Thread(
                target=self._server.serve_forever, args=(0.05,), name=self._name, daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Wake every wait, stop accepting, cut every open connection, join their threads."""
        with self._changed:
            server, thread = self._server, self._thread
            self._server = self._thread = None
            self._stopping.set()
            self._changed.notify_all()
        if server is not None:
            server.stop(thread)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The root the fake serves, ``http://<host>:<port>``."""
        with self._lock:
            if self._server is None:
                raise RuntimeError(f"{type(self).__name__} is not running")
            return f"http://{self._host}:{self._server.server_address[1]}"

    @property
    def errors(self) -> list[BaseException]:
        """Unexpected exceptions inside the fake itself (a bug in the fake, never the client)."""
        with self._lock:
            return list(self._errors)

    def _record_error(self, error: BaseException) -> None:
        with self._lock:
            self._errors.append(error)


OwnerT = TypeVar("OwnerT", bound=LocalServer)


class Handler(BaseHTTPRequestHandler, Generic[OwnerT]):
    """HTTP/1.1 with keep-alive and no Nagle delay (each answer leaves at once), quiet: a fake's
    record of requests is its own."""

    protocol_version = "HTTP/1.1"
    server: _Server

    @property
    def owner(self) -> OwnerT:
        return cast(OwnerT, self.server.owner)

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""

    def _lowered_headers(self) -> dict[str, str]:
        return {name.lower(): value for name, value in self.headers.items()}

    @staticmethod
    def _json_object(raw: bytes) -> dict[str, Any] | None:
        """The body as a JSON object, or None when it is empty, not JSON or not an object."""
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            return None
        return parsed if isinstance(parsed, dict) else None

    @staticmethod
    def _retry_count(headers: dict[str, str]) -> int:
        """Which retry of a request this is, as the official SDKs (Stainless) number them."""
        try:
            return int(headers.get("x-stainless-retry-count", "0"))
        except ValueError:
            return 0

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def do_PUT(self) -> None:
        self._serve()

    def do_PATCH(self) -> None:
        self._serve()

    def do_DELETE(self) -> None:
        self._serve()

    def _serve(self) -> None:
        """Answer one request, whatever its method (a fake API routes on the path)."""
        self.send_error(404)

    def _start(self, status: int, request_id: str, headers: Sequence[tuple[str, str]]) -> None:
        """Send the status line and headers (a fake adds its API's request-id header)."""
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()

    def _send_json_text(self, status: int, text: str, request_id: str,
                        headers: Sequence[tuple[str, str]] = ()) -> None:  # fmt: skip
        data = text.encode()
        sent = [("content-type", "application/json"), ("content-length", str(len(data)))]
        self._start(status, request_id, [*sent, *headers])
        self.wfile.write(data)
        self.wfile.flush()

    def _start_event_stream(self, request_id: str) -> None:
        """A ``200 text/event-stream`` sent with chunked transfer-encoding: each
        :meth:`_chunk` reaches the client when it is written."""
        self._start(200, request_id, [
            ("content-type", "text/event-stream; charset=utf-8"),
            ("cache-control", "no-cache"),
            ("transfer-encoding", "chunked"),
        ])  # fmt: skip

    def _chunk(self, data: bytes) -> None:
        """One chunk of a chunked body (``b""`` ends the body)."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _read_body(self) -> bytes:
        """The body, sent with a ``Content-Length`` or chunked."""
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            parts: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("content-length") or 0)
        return self.rfile.read(length) if length else b""

    def _reply(self, status: int, data: bytes, headers: Iterable[tuple[str, str]]) -> None:
        """The whole answer in one write (a client gone meanwhile is no error of the fake)."""
        head = f"HTTP/1.1 {status} {phrase(status)}\r\n"
        head += "".join(f"{name}: {value}\r\n" for name, value in headers)
        head += f"Content-Length: {len(data)}\r\n\r\n"
        with contextlib.suppress(ConnectionError):
            self.wfile.write(head.encode() + data)

    def _drop(self) -> None:
        """End the connection at once, without (finishing) an answer."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)


def phrase(status: int) -> str:
    """The reason phrase of ``status`` ("Error" for a code HTTP does not name)."""
    with contextlib.suppress(ValueError):
        return HTTPStatus(status).phrase
    return "Error"


class _Server(ThreadingHTTPServer):
    """A thread per connection, kept with its socket so ``stop`` can cut and join it."""

    daemon_threads, block_on_close, request_queue_size = True, False, 128

    def __init__(self, address: tuple[str, int], owner: LocalServer) -> None:
        self.owner = owner
        self._connections: dict[Any, threading.Thread] = {}
        self._connections_lock = threading.Lock()
        super().__init__(address, owner._handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name=f"{self.owner._name}-connection",
            daemon=True,
        )
        with self._connections_lock:
            self._connections[request] = thread
        thread.start()

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.pop(request, None)
        super().shutdown_request(request)

    def stop(self, thread: threading.Thread | None) -> None:
        self.shutdown()
        self.server_close()
        with self._connections_lock:
            open_now = list(self._connections.items())
        for connection, _ in open_now:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        for joined in [thread, *(t for _, t in open_now)]:
            if joined is not None:
                joined.join(5.0)

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if error is not None and not isinstance(error, ConnectionError | TimeoutError):
            self.owner._record_error(error)


_PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


def isolate_from_environment(monkeypatch: Any, prefix: str) -> None:
    """Keep a provider's settings (``<prefix>*`` variables) and proxies of the machine out of a
    test whose client talks to a fake on loopback."""
    for name in list(os.environ):
        if name.upper().startswith(prefix) or name.upper() in _PROXY_VARIABLES:
            monkeypatch.delenv(name)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


@dataclass(frozen=True)
class Recorded:
    """One request as a fake received it. ``body`` is ``{}`` if it was not a JSON object."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: dict[str, Any]
    retry_count: int
    at: float
    client_port: int = 0
    """The client's end of the connection: equal ports are one kept-alive connection."""

"""A local receiver for Dispach's outbound webhook channel, served on a real socket.

The wire contract it checks, in this order, for a ``POST`` to any path:

1. ``X-Dispach-Timestamp: <unix seconds>`` and ``X-Dispach-Signature: v1=<hex>``, where hex is
   ``HMAC-SHA256(secret, f"{timestamp}.{raw body}")``. Several comma-separated ``v1=`` values
   are allowed (a secret being rotated); one must match. A missing or wrong signature, or a
   timestamp more than ``max_age`` seconds away from now (replay protection), answers 401.
2. ``Idempotency-Key: <key>``: missing answers 400.
3. A JSON body: anything else answers 400.

A new key is kept (``kept``, in arrival order) and answered 200 ``{"id": "<receiver id>"}``. A
repeated key is not kept again: it gets the first answer once more and is recorded with
``duplicate=True``; a repeat whose body differs from the first one answers 422, as payment APIs
do, since a retry must resend the same request.

Faults are scripted first in first out: ``fail_next`` answers an error before any checking (a
load balancer or an overloaded app: nothing is kept); ``drop_next`` keeps the request (unless
``processed=False``) and closes the connection without an answer, the crash window where the
sender cannot know; ``hold_next`` keeps it and answers late. Every request is recorded in
``received``. The handler stays lean (no logging, one response write, keep-alive) because a
benchmark drains thousands of deliveries a second through it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

__all__ = ["Received", "WebhookReceiver", "sign"]


def sign(secret: str, timestamp: str, raw: bytes) -> str:
    """The ``X-Dispach-Signature`` value for a body sent at ``timestamp``."""
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + raw, hashlib.sha256)
    return f"v1={digest.hexdigest()}"


@dataclass(frozen=True)
class Received:
    """One request as it arrived; ``status`` is what it was answered (None: dropped)."""

    idempotency_key: str | None
    body: Any
    raw: bytes
    headers: dict[str, str]
    signature_ok: bool
    duplicate: bool
    path: str
    status: int | None


@dataclass(frozen=True)
class _Fail:
    status: int
    retry_after: int | None
    body: Any


@dataclass(frozen=True)
class _Drop:
    processed: bool


@dataclass(frozen=True)
class _Hold:
    seconds: float


class WebhookReceiver:
    """The receiving server. Thread-safe; use as a context manager or ``start()``/``stop()``."""

    def __init__(
        self, secret: str, *, max_age: float | None = 300.0, host: str = "127.0.0.1"
    ) -> None:
        self.secret = secret
        self.max_age = max_age
        self._host = host
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._faults: deque[_Fail | _Drop | _Hold] = deque()
        self._received: list[Received] = []
        self._kept: dict[str, Any] = {}
        self._answers: dict[str, bytes] = {}
        self._errors: list[BaseException] = []

    # lifecycle ------------------------------------------------------------------------------

    def start(self) -> WebhookReceiver:
        with self._lock:
            if self._server is not None:
                raise RuntimeError("WebhookReceiver is already running")
            self._stopping.clear()
            self._server = _Server((self._host, 0), self)
            self._thread = threading.Thread(
                target=self._server.serve_forever,
                args=(0.05,),
                name="webhook-receiver",
                daemon=True,
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, end holds at once, cut every open connection."""
        with self._lock:
            server, thread = self._server, self._thread
            self._server = self._thread = None
        self._stopping.set()
        if server is not None:
            server.stop(thread)

    def __enter__(self) -> WebhookReceiver:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """Where to post (any path under it is accepted)."""
        with self._lock:
            if self._server is None:
                raise RuntimeError("WebhookReceiver is not running")
            return f"http://{self._host}:{self._server.server_address[1]}/hooks/dispach"

    # scripting ------------------------------------------------------------------------------

    def fail_next(
        self, status: int, count: int = 1, retry_after: int | None = None, body: Any = None
    ) -> None:
        """Answer the next ``count`` requests with ``status`` (and ``Retry-After``, if given)."""
        with self._lock:
            self._faults.extend([_Fail(status, retry_after, body)] * count)

    def drop_next(self, count: int = 1, *, processed: bool = True) -> None:
        """Read the next ``count`` requests, then close their connections without an answer."""
        with self._lock:
            self._faults.extend([_Drop(processed)] * count)

    def hold_next(self, seconds: float) -> None:
        """Answer the next request ``seconds`` late (it is kept at once)."""
        with self._lock:
            self._faults.append(_Hold(seconds))

    # records --------------------------------------------------------------------------------

    @property
    def received(self) -> list[Received]:
        """Every request, in arrival order (a copy)."""
        with self._lock:
            return list(self._received)

    @property
    def kept(self) -> dict[str, Any]:
        """Idempotency-Key to body, one per key, the first arrival wins (a copy)."""
        with self._lock:
            return dict(self._kept)

    @property
    def errors(self) -> list[BaseException]:
        """Unexpected exceptions inside the receiver itself (a bug here, never the sender)."""
        with self._lock:
            return list(self._errors)

    def wait_for(self, n_kept: int, timeout: float = 5.0) -> dict[str, Any]:
        """Block until at least ``n_kept`` distinct keys are kept; return ``kept``."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: len(self._kept) >= n_kept, timeout):
                raise TimeoutError(f"{len(self._kept)} of {n_kept} kept in {timeout} s")
            return dict(self._kept)

    # answering (on connection threads) ------------------------------------------------------

    def _answer(self, path: str, headers: dict[str, str], raw: bytes) -> _Answer:
        """Check, keep and record one request; return the answer, or None to drop it."""
        key = headers.get("idempotency-key") or None
        signature_ok = self._signature_ok(headers, raw)
        try:
            body, is_json = json.loads(raw), True
        except ValueError:
            body, is_json = None, False
        with self._arrived:
            fault = self._faults.popleft() if self._faults else None
            duplicate = False
            if isinstance(fault, _Fail):
                answer: _Answer = _fail_answer(fault)
            elif isinstance(fault, _Drop) and not fault.processed:
                answer = None
            elif not signature_ok:
                answer = 401, _json({"error": "bad signature"}), ()
            elif key is None:
                answer = 400, _json({"error": "missing Idempotency-Key"}), ()
            elif not is_json:
                answer = 400, _json({"error": "body is not JSON"}), ()
            elif key in self._answers:
                duplicate = True
                same = self._kept[key] == body
                answer = (200, self._answers[key], ()) if same else (422, _REUSED, ())
            else:
                self._kept[key] = body
                self._answers[key] = _json({"id": f"rcv_{len(self._answers) + 1:06d}"})
                answer = 200, self._answers[key], ()
            if isinstance(fault, _Drop):
                answer = None
            status = None if answer is None else answer[0]
            received = Received(key, body, raw, headers, signature_ok, duplicate, path, status)
            self._received.append(received)
            self._arrived.notify_all()
        if isinstance(fault, _Hold) and self._stopping.wait(fault.seconds):
            return None
        return answer

    def _signature_ok(self, headers: dict[str, str], raw: bytes) -> bool:
        timestamp = headers.get("x-dispach-timestamp", "")
        offered = [v.strip() for v in headers.get("x-dispach-signature", "").split(",")]
        if not timestamp.isdigit():
            return False
        if self.max_age is not None and abs(time.time() - int(timestamp)) > self.max_age:
            return False
        expected = sign(self.secret, timestamp, raw)
        return any(hmac.compare_digest(expected, value) for value in offered)

    def _record_error(self, error: BaseException) -> None:
        with self._lock:
            self._errors.append(error)


_Answer = tuple[int, bytes, tuple[tuple[str, str], ...]] | None
_REUSED = b'{"error": "Idempotency-Key reused with a different body"}'


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def _fail_answer(fault: _Fail) -> _Answer:
    body = fault.body if fault.body is not None else {"error": _phrase(fault.status)}
    retry = () if fault.retry_after is None else (("Retry-After", str(fault.retry_after)),)
    return fault.status, _json(body), retry


# --------------------------------------------------------------------------------------------
# The server


class _Server(ThreadingHTTPServer):
    """Tracks its connections so ``stop()`` can cut them (held and idle keep-alive ones too);
    ``server_close`` then joins their threads (``block_on_close``)."""

    daemon_threads, block_on_close, request_queue_size = True, True, 128

    def __init__(self, address: tuple[str, int], receiver: WebhookReceiver) -> None:
        self.receiver = receiver
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def stop(self, thread: threading.Thread | None) -> None:
        self.shutdown()
        with self._connections_lock:
            open_now = list(self._connections)
        for connection in open_now:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        self.server_close()
        if thread is not None:
            thread.join(5.0)

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if error is not None and not isinstance(error, ConnectionError | TimeoutError):
            self.receiver._record_error(error)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        headers = {name.lower(): value for name, value in self.headers.items()}
        try:
            answer = self.server.receiver._answer(self.path, headers, raw)
        except Exception as error:  # a bug in the receiver: say so, as a 500
            self.server.receiver._record_error(error)
            answer = 500, _json({"error": repr(error)}), ()
        if answer is None:
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            return
        status, data, extra = answer
        head = f"HTTP/1.1 {status} {_phrase(status)}\r\nContent-Type: application/json\r\n"
        head += "".join(f"{name}: {value}\r\n" for name, value in extra)
        head += f"Content-Length: {len(data)}\r\n\r\n"
        with contextlib.suppress(ConnectionError):
            self.wfile.write(head.encode() + data)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the record is ``WebhookReceiver.received``."""


def _phrase(status: int) -> str:
    with contextlib.suppress(ValueError):
        return HTTPStatus(status).phrase
    return "Error"

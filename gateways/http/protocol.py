"""The node's HTTP/1.1 protocol: uvicorn's, with the edges a server reached without a proxy in
front needs.

uvicorn 0.54.0 (``http="httptools"``) leaves these to a proxy:

- **Read timeouts.** uvicorn waits forever for a request head or body (only an idle keep-alive
  connection times out), so a client sending a byte a second holds a connection for as long as it
  likes (slowloris). Here a head must be complete within ``head_timeout`` of the connection
  opening (its first request) or of its first byte (the next ones on a keep-alive connection), and
  a body may not pause longer than ``body_timeout``: ``408 request_timeout``. A new connection
  that never sends a byte is closed without an answer: that is a browser's preconnect, not an
  error, and an unasked answer could be read as the reply to its next request.
- **A head size bound.** httptools buffers a header of any length (by repeated concatenation);
  a head over ``MAX_HEAD`` bytes is ``431 request_head_too_large``.
- **Connections per client address.** Past ``per_client`` open connections from one address
  (WebSockets included, until they close), a new one is answered ``503 too_many_connections``
  with ``Retry-After``.
- **The error envelope for what no route sees.** Malformed HTTP (a bad ``Content-Length``, NUL or
  non-ASCII bytes in the path, invalid header bytes, a request line that is not one) got uvicorn's
  plain text ``Invalid HTTP request received.``: here ``400 http_request_invalid`` with the
  parser's reason. (A refused WebSocket handshake: gateways/http/wsprotocol.py.)
- **One write per response.** uvicorn writes a response's head and its body separately: two
  system calls and two packets for every small JSON answer (10 % of a node's CPU under a burst
  of turns, most of it in the kernel). Here the head waits for the body's first bytes (or the end
  of the loop's step, for a stream) and goes out with them.

Every answer made here carries ``Connection: close``; then the server stops writing, reads and
drops what the client still sends for up to ``LINGER`` seconds, and closes. Closing at once would
make the kernel reset the connection when the rest of the request arrives, and a reset can destroy
the answer before the client has read it (the "lingering close" of Apache and nginx). An answer
that would land in the middle of another response on the connection (pipelining) is not written:
the connection is closed instead.

What this relies on in uvicorn, checked by tests/test_http_edges.py (which also pins the
version): the methods overridden here, the protocol's ``cycle``, ``pipeline``, ``flow``,
``transport``, ``client``, ``loop`` and ``server_state``, the cycle's ``response_started``,
``response_complete``, ``disconnected``, ``message_event`` and ``transport`` (every write of a
response goes through it), and that uvicorn calls
``send_400_response`` while it handles the parser's error.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import http
import sys
from collections.abc import Sequence
from typing import Any, ClassVar

import httptools
import msgspec
import structlog
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateways.http.errors import ErrorBody, ErrorEnvelope
from gateways.http.wsprotocol import EdgeWebSocket

log = structlog.get_logger("dispach.http")

MAX_HEAD = 64 * 1024
"""Bytes of a request line and headers (tokens and cookies fit many times over)."""
LINGER = 2.0
"""Seconds an answered connection still reads (and drops) what the client sends."""
RETRY_AFTER = 1
HTTP_HINT = (
    "send HTTP/1.1: a request line `METHOD /path HTTP/1.1` (the path percent-encoded, no spaces "
    "or control characters), header lines `Name: value`, and at most one of Content-Length "
    "(digits) or Transfer-Encoding: chunked"
)
_ENCODE = msgspec.json.Encoder().encode


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    head_timeout: float = 10.0
    """Seconds a request head may take (DISPACH_HEAD_TIMEOUT_SECONDS)."""
    body_timeout: float = 30.0
    """Seconds a request body may pause between bytes (DISPACH_BODY_TIMEOUT_SECONDS)."""
    per_client: int = 256
    """Open connections per client address; 0: no cap (DISPACH_MAX_CONNECTIONS_PER_CLIENT)."""


class Peers:
    """Open connections per client address, shared by one server's protocols (all on the loop)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.open: dict[str, int] = {}

    def admit(self, address: str) -> bool:
        count = self.open.get(address, 0)
        if self.cap and count >= self.cap:
            return False
        self.open[address] = count + 1
        return True

    def release(self, address: str) -> None:
        left = self.open[address] - 1
        if left:
            self.open[address] = left
        else:
            del self.open[address]


def http_protocol(limits: Limits) -> type[EdgeProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, with ``ws=EdgeWebSocket``. One class
    per server, so that servers in one process count their clients apart."""

    class Bound(EdgeProtocol):
        pass

    Bound.limits = limits
    Bound.peers = Peers(limits.per_client)
    return Bound


class _Phase(enum.Enum):
    WAITING = "no byte of a request yet, on a new connection"
    HEAD = "reading a request head"
    BODY = "reading a request body"
    APP = "the request is read: the app's, then uvicorn's keep-alive timeout"
    UPGRADED = "handed to the WebSocket protocol"
    CLOSING = "answered here: dropping input until the linger ends"


# The members as module globals: read several times a request, and an Enum member's lookup on
# its class costs ten times a global's in Python 3.11.
WAITING, HEAD, BODY, APP, UPGRADED, CLOSING = _Phase


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the timeouts, the head bound, the per-address cap and
    the envelope (see the module's docstring). Make it with :func:`http_protocol`."""

    limits: ClassVar[Limits]
    peers: ClassVar[Peers]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = WAITING
        self._since = 0.0
        """When the phase began, or (a body) when its last bytes came."""
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._peer: str | None = None
        """The address this connection is counted under, while it is."""
        self._head_bytes = 0
        """Bytes of the current head in the data fed before (while it is still incomplete)."""
        self._fed = 0
        """Bytes in the data being fed."""
        self._ended = False
        """A message ended in the data being fed (its head's share of that data is unknown)."""

    # --- the connection ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = self.client[0] if self.client else None
        if address is not None:
            if not self.peers.admit(address):
                self._answer(
                    503,
                    "too_many_connections",
                    f"{address} already has {self.peers.cap} connections open to this node",
                    "close idle connections or reuse them (keep-alive), then retry; the node's "
                    "DISPACH_MAX_CONNECTIONS_PER_CLIENT sets the cap",
                    retry_after=RETRY_AFTER,
                )
                return
            self._peer = address
        self._enter(WAITING, self.limits.head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._stop_timer()
        if self._peer is not None:
            self.peers.release(self._peer)
            self._peer = None

    def data_received(self, data: bytes) -> None:
        if self._phase is CLOSING:
            return  # answered: drop what still comes until the linger ends
        self._ended = False
        self._fed = len(data)
        super().data_received(data)
        if self._phase is HEAD and not self._ended:
            self._head_bytes += len(data)  # all of it is head: no message ended in it
            if self._head_bytes > MAX_HEAD:
                self._answer(*_head_too_large().args)

    def handle_websocket_upgrade(self) -> None:
        self._stop_timer()
        self._phase = UPGRADED
        super().handle_websocket_upgrade()
        # The transport now reports to the WebSocket protocol and never calls this one's
        # connection_lost: the connection's count goes with it.
        upgraded = self.transport.get_protocol()
        if self._peer is not None:
            if isinstance(upgraded, EdgeWebSocket):
                upgraded.release = functools.partial(self.peers.release, self._peer)
            else:
                self.peers.release(self._peer)
            self._peer = None

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this inside `except httptools.HttpParserError` (data_received): the
        # exception being handled says what is wrong.
        error = sys.exception()
        cause = (error.__cause__ or error.__context__) if error is not None else None
        if isinstance(cause, _Refusal):  # raised by a callback of ours
            self._answer(*cause.args)
            return
        reason = _parser_reason(error, cause)
        log.info("http_request_invalid", client=self._address(), reason=reason)
        self._answer(
            400, "http_request_invalid", f"the request is not valid HTTP/1.1: {reason}", HTTP_HINT
        )

    # --- parser callbacks: the phases -------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        if self._phase is WAITING:
            self._phase = HEAD  # the first head's time counts from the connection's start
        else:
            self._enter(HEAD, self.limits.head_timeout)

    def on_headers_complete(self) -> None:
        # A head that ended in this data was not counted yet: measure it when it may be over.
        if self._head_bytes + self._fed > MAX_HEAD and _size(self.url, self.headers) > MAX_HEAD:
            raise _head_too_large()  # before uvicorn starts the app on it
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before and self.cycle is not None:
            self.cycle.transport = _HeadWithBody(self.transport, self.loop)  # type: ignore[assignment]
        self._enter(BODY, self.limits.body_timeout)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._since = self.loop.time()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._ended = True
        self._phase = APP  # no bound: the app's time, then uvicorn's keep-alive timeout

    # --- timeouts ---------------------------------------------------------------------------

    def _limit(self) -> float | None:
        match self._phase:
            case _Phase.WAITING | _Phase.HEAD:
                return self.limits.head_timeout
            case _Phase.BODY:
                return self.limits.body_timeout
            case _:
                return None

    def _enter(self, phase: _Phase, limit: float) -> None:
        """Start ``phase``, bounded by ``limit`` seconds, now. One timer serves every phase: it
        is moved only when the new deadline is earlier, and a timer that fires early looks
        again (so a keep-alive connection's fast requests cost a timer per ``head_timeout``, not
        one per request)."""
        self._phase = phase
        self._since = now = self.loop.time()
        deadline = now + limit
        if self._timer is not None:
            if self._timer_at <= deadline:
                return
            self._timer.cancel()
        self._arm(deadline)

    def _arm(self, deadline: float) -> None:
        self._timer_at = deadline
        self._timer = self.loop.call_at(deadline, self._on_timer)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        limit = self._limit()
        if limit is None:
            return
        now = self.loop.time()
        if self.flow.read_paused:
            self._since = now  # the server stopped reading (flow control), not the client
        if self._since + limit > now:
            self._arm(self._since + limit)
            return
        match self._phase:
            case _Phase.WAITING:
                self._phase = CLOSING
                self.transport.close()
            case _Phase.HEAD:
                self._timed_out(f"the request head was not complete within {limit:g} s", limit)
            case _:
                self._timed_out(f"no byte of the request body came for {limit:g} s", limit)

    def _timed_out(self, message: str, limit: float) -> None:
        log.info("request_timeout", client=self._address(), phase=self._phase.name.lower())
        self._answer(
            408,
            "request_timeout",
            message,
            f"send the whole request without pauses of {limit:g} s or more; the node's "
            "DISPACH_HEAD_TIMEOUT_SECONDS and DISPACH_BODY_TIMEOUT_SECONDS set the bounds",
        )

    # --- answering ------------------------------------------------------------------------------

    def _answer(
        self, status: int, code: str, message: str, hint: str, retry_after: int | None = None
    ) -> None:
        """Answer with the envelope, stop writing, linger, close; or only close when another
        response is (or is due) on the wire before this one could be."""
        if self._phase is CLOSING:
            return
        cycle = self.cycle
        if self._phase is BODY:
            free = cycle is None or not cycle.response_started
        else:  # the cycle, if any, is an earlier request's
            free = cycle is None or cycle.response_complete
        free = free and not self.pipeline
        self._phase = CLOSING
        self._stop_timer()
        if not free:
            self.transport.close()
            return
        if cycle is not None and not cycle.response_complete:
            # The app is reading this request's body: it gets a disconnect, and what it sends
            # is dropped (uvicorn's own path when a client goes away).
            cycle.disconnected = True
            cycle.message_event.set()
        extra = [] if retry_after is None else [(b"retry-after", b"%d" % retry_after)]
        self.transport.write(
            _response(status, code, message, hint, [*self.server_state.default_headers, *extra])
        )
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()
        self._timer = self.loop.call_later(LINGER, self.transport.close)

    def _address(self) -> str | None:
        return self.client[0] if self.client else None


class _HeadWithBody:
    """A response cycle's transport: a response's head waits for its body's first bytes and goes
    out with them, in one write (one system call, one packet) where uvicorn makes two. A head
    whose body does not follow in the same step of the loop (a stream's first event comes later)
    is written at the end of that step. Everything else is the connection's transport."""

    __slots__ = ("_first", "_head", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None
        """The head, not written yet."""
        self._first = True

    def write(self, data: bytes) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.write(head + data)
        elif self._first:  # the head (or a 100 Continue before it: held the same way)
            self._first = False
            self._head = data
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        head = self._head
        if head is not None:
            self._head = None
            if not self._transport.is_closing():
                self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _response(
    status: int, code: str, message: str, hint: str, headers: Sequence[tuple[bytes, bytes]]
) -> bytes:
    body = _ENCODE(ErrorEnvelope(ErrorBody(code=code, message=message, hint=hint)))
    lines = [b"HTTP/1.1 %d %s" % (status, http.HTTPStatus(status).phrase.encode())]
    lines += [name + b": " + value for name, value in headers]
    lines += [
        b"content-type: application/json",
        b"content-length: %d" % len(body),
        b"connection: close",
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


class _Refusal(Exception):
    """An answer a parser callback of ours makes (raised through the parser to end its run)."""

    args: tuple[int, str, str, str]


def _head_too_large() -> _Refusal:
    return _Refusal(
        431,
        "request_head_too_large",
        f"the request line and headers are over {MAX_HEAD} bytes",
        "send large data in the body; check for a runaway header or cookie",
    )


def _size(url: bytes, headers: Sequence[tuple[bytes, bytes]]) -> int:
    return len(url) + sum(len(name) + len(value) + 4 for name, value in headers)


def _parser_reason(error: BaseException | None, cause: BaseException | None) -> str:
    """What httptools (or uvicorn's reading of the head) found wrong, in a few words."""
    if isinstance(error, httptools.HttpParserCallbackError):
        if isinstance(cause, UnicodeDecodeError):
            return "the request target is not ASCII (percent-encode it)"
        if isinstance(cause, httptools.HttpParserInvalidURLError):
            return "the request target is not a URL path"
        return "the request head could not be read"
    return str(error) or "the parser refused it"

"""The node's WebSocket protocol: uvicorn's, with the error envelope for a refused handshake
and the connection's count (gateways/http/protocol.py) released when it closes.

uvicorn 0.54.0's WebSocket protocol (websockets' sans-I/O one, which ``ws="auto"`` picks) answers
a handshake websockets refuses (no ``Sec-WebSocket-Key``, a version other than 13, a head over
websockets' limits...) with websockets' plain text; here it is ``websocket_handshake_invalid``
with websockets' status and reason. What this relies on (pinned by tests/test_http_edges.py):
the protocol's ``conn`` (the websockets ``ServerProtocol``) and the methods overridden here.
"""

from __future__ import annotations

import http
from collections.abc import Callable
from typing import Any

import msgspec
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.datastructures import Headers
from websockets.http11 import Response
from websockets.server import ServerProtocol

from gateways.http.errors import ErrorBody, ErrorEnvelope

JSON = "application/json"
_ENCODE = msgspec.json.Encoder().encode


class EdgeWebSocket(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol with two changes: a refused handshake is answered with the
    envelope, and the connection's count (taken over from ``gateways.http.protocol.EdgeProtocol`` at
    the upgrade) is released when it closes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.release: Callable[[], None] | None = None
        # Keep the handshake protocol uvicorn built (its extensions, size cap, logger) and
        # change only how it words a refusal.
        self.conn.__class__ = _Handshake

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.release is not None:
            self.release()
            self.release = None


class _Handshake(ServerProtocol):
    """websockets' server side, refusing a handshake with the envelope instead of plain text."""

    def reject(self, status: http.HTTPStatus | int, text: str) -> Response:
        plain = super().reject(status, text)
        reason = text.splitlines()[0].removeprefix("Failed to open a WebSocket connection")
        reason = reason.strip(":. ") or "see the node's log"
        failed = plain.status_code >= 500
        body = _ENCODE(
            ErrorEnvelope(
                ErrorBody(
                    code="internal_error" if failed else "websocket_handshake_invalid",
                    message=f"the WebSocket handshake was refused: {reason}",
                    hint="retry; if it persists, the node's log has the cause"
                    if failed
                    else "open it with a WebSocket client: GET with Upgrade: websocket, "
                    "Connection: Upgrade, Sec-WebSocket-Key and Sec-WebSocket-Version: 13",
                )
            )
        )
        headers = Headers(plain.headers)
        for name, value in (("Content-Length", str(len(body))), ("Content-Type", JSON)):
            del headers[name]  # a Headers item is multi-valued: setting one would add a second
            headers[name] = value
        return Response(plain.status_code, plain.reason_phrase, headers, body)

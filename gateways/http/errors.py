"""The public error envelope: ``{"error": {"code", "message", "hint", "field"?}}``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
from starlette.responses import Response
from starlette.types import Message, Scope, Send


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    code: str
    message: str
    hint: str
    field: str | None = None
    accepted: Literal["unknown"] | None = None
    """On ``504 accept_timeout``: whether the message was accepted is not known
    (gateways/api/acceptance.py)."""


class ErrorEnvelope(msgspec.Struct, frozen=True):
    error: ErrorBody


_ENCODER = msgspec.json.Encoder()


def error_response(
    status: int,
    code: str,
    message: str,
    hint: str,
    *,
    field: str | None = None,
    headers: dict[str, str] | None = None,
    accepted: Literal["unknown"] | None = None,
) -> Response:
    body = ErrorEnvelope(
        ErrorBody(code=code, message=message, hint=hint, field=field, accepted=accepted)
    )
    return Response(_ENCODER.encode(body), status, headers=headers, media_type="application/json")


def json_response(value: object, status: int = 200) -> Response:
    return Response(_ENCODER.encode(value), status, media_type="application/json")


async def deny(
    scope: Scope, send: Send, status: int, code: str, message: str, hint: str,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> None:  # fmt: skip
    """Answer a request with the error envelope before it reaches a route (an ASGI middleware's
    refusal). A WebSocket is refused before its upgrade: with the envelope where the server
    supports the denial-response extension (uvicorn does), else with close code 1008."""
    body = _ENCODER.encode(ErrorEnvelope(ErrorBody(code=code, message=message, hint=hint)))
    start: Message = {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            *headers,
        ],
    }
    if scope["type"] == "websocket":
        if "websocket.http.response" in scope.get("extensions", {}):
            await send({**start, "type": "websocket.http.response.start"})
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": 1008, "reason": code})
        return
    await send(start)
    await send({"type": "http.response.body", "body": body})

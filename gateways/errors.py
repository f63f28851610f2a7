"""The public error envelope: ``{"error": {"code", "message", "hint", "field"?}}``."""

from __future__ import annotations

import msgspec
from starlette.responses import Response


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    code: str
    message: str
    hint: str
    field: str | None = None


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
) -> Response:
    body = ErrorEnvelope(ErrorBody(code=code, message=message, hint=hint, field=field))
    return Response(_ENCODER.encode(body), status, headers=headers, media_type="application/json")


def json_response(value: object, status: int = 200) -> Response:
    return Response(_ENCODER.encode(value), status, media_type="application/json")

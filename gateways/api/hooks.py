"""``POST /v1/channels/{channel}/webhook/{agent}``: updates a chat provider pushes to us.

The route is open (a provider sends no bearer token); each channel verifies its own provider
(Telegram: the secret token header, compared in constant time). An unknown agent and an unknown
channel look the same from outside, so the route does not reveal which agents exist.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateways.api.common import ApiError, read_body, runtime
from gateways.http.errors import json_response
from gateways.http.operation import AGENT, Operation, answer, param

_HOOK_BODY_MAX = 1_000_000


@runtime_checkable
class WebhookTaker(Protocol):
    async def webhook(self, headers: dict[str, str], update: Any) -> tuple[int, str]: ...


class Taken(msgspec.Struct, frozen=True):
    ok: bool


_CODES = {401: "unauthorized", 400: "request_body_invalid", 503: "not_ready"}


async def channel_webhook(request: Request) -> Response:
    agent_id, channel_id = request.path_params["agent"], request.path_params["channel"]
    channel: object = runtime(request).channel(agent_id, channel_id)  # only some take webhooks
    if not isinstance(channel, WebhookTaker):
        raise _not_found()
    raw = await read_body(request, _HOOK_BODY_MAX)
    try:
        update = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise ApiError(400, "body_not_json", f"the body is not JSON: {e}",
                       "the provider sends its update as a JSON object") from e  # fmt: skip
    headers = {k.lower(): v for k, v in request.headers.items()}
    status, detail = await channel.webhook(headers, update)
    if status == 404:
        raise _not_found()
    if status != 200:
        raise ApiError(status, _CODES.get(status, "webhook_refused"), detail,
                       "check the channel's secret token and the provider's webhook "
                       "settings")  # fmt: skip
    return json_response(Taken(ok=True))


CHANNEL_WEBHOOK = Operation(
    "POST",
    "/v1/channels/{channel}/webhook/{agent}",
    channel_webhook,
    "An update a chat provider pushes (Telegram webhook mode); the channel checks the "
    "provider's secret, no bearer token",
    {"200": answer(Taken, "Taken")},
    params=[param("channel", "path", "Channel id"), AGENT],
    errors=("400", "401", "404", "413", "503"),
    security="open",
)


def _not_found() -> ApiError:
    return ApiError(404, "webhook_not_found", "no such webhook",
                    "the path is /v1/channels/<channel id>/webhook/<agent id> of a channel in "
                    "webhook mode")  # fmt: skip

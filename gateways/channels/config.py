"""Channel settings as an agent's manifest declares them (``channels:``), and building them.

Secrets are never in the manifest: it names the environment variable that holds each one.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from actors.outbox import Channel
from eventstore.errors import DispachError

_ID = r"^[a-z][a-z0-9_-]{0,31}$"
ChannelId = Annotated[str, msgspec.Meta(pattern=_ID)]
Pauses = Annotated[list[Annotated[float, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=20)]
_BACKOFF = [1.0, 5.0, 25.0, 120.0, 600.0]
"""Pauses before attempts 2..6 (seconds, jittered by ±20 %)."""


class ChannelError(DispachError):
    code = "invalid_channel"


class _Common(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    id: ChannelId
    on_uncertain: Literal["resend", "skip"] = "resend"
    """An item whose send may have happened (the node died in its send window, or the answer was
    lost: a dropped connection, a timeout): send it again (flagged), or record it as uncertain
    and send nothing."""
    backoff_s: Pauses = msgspec.field(default_factory=lambda: list(_BACKOFF))
    enabled: bool = True


class TelegramConfig(_Common, frozen=True, kw_only=True, tag="telegram", tag_field="type"):
    token_env: str = "TELEGRAM_BOT_TOKEN"  # noqa: S105 - the name of a variable
    mode: Literal["longpoll", "webhook"] = "longpoll"
    secret_token_env: str | None = None
    """webhook mode: the variable holding the secret Telegram echoes in
    ``X-Telegram-Bot-Api-Secret-Token`` (required in webhook mode)."""
    api_base_url: str = "https://api.telegram.org"
    allow_from: list[str] = msgspec.field(default_factory=list)
    """Who may talk to the agent: user ids, ``@usernames``, or ``"*"`` for anyone. Closed by
    default: a sender not listed is refused (``channel.rejected``, with the line to add)."""
    poll_timeout_s: Annotated[int, msgspec.Meta(ge=0, le=50)] = 25
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=55)] = 30.0
    """How long a ``sendMessage`` may take; past it the send is in doubt (it may have been
    delivered), not retried blindly. Under the outbox's own 60 s cut."""


class WebhookConfig(_Common, frozen=True, kw_only=True, tag="webhook", tag_field="type"):
    url: str
    secret_env: str = "DISPACH_WEBHOOK_SECRET"  # noqa: S105 - the name of a variable
    max_message_chars: Annotated[int, msgspec.Meta(ge=64)] = 100_000
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=120)] = 10.0
    concurrency: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 64


ChannelConfig = TelegramConfig | WebhookConfig


def build(agent_id: str, config: ChannelConfig, env: dict[str, str]) -> Channel:
    from gateways.channels.telegram import TelegramChannel
    from gateways.channels.webhook import WebhookChannel

    match config:
        case TelegramConfig():
            token = _secret(agent_id, config.id, config.token_env, env)
            secret = None
            if config.mode == "webhook":
                if config.secret_token_env is None:
                    raise ChannelError(
                        f"agent {agent_id!r}: channel {config.id!r} takes webhooks without a "
                        "secret token",
                        "set secret_token_env to a variable holding a random string; Telegram "
                        "sends it back with every update so forged updates are refused",
                        field="channels.secret_token_env",
                    )
                secret = _secret(agent_id, config.id, config.secret_token_env, env)
            return TelegramChannel(config, token, secret)
        case WebhookConfig():
            return WebhookChannel(config, _secret(agent_id, config.id, config.secret_env, env))


def _secret(agent_id: str, channel_id: str, name: str, env: dict[str, str]) -> str:
    value = env.get(name, "")
    if not value.strip():
        raise ChannelError(
            f"agent {agent_id!r}: channel {channel_id!r} needs {name}, which is not set",
            f"export {name}=... before `dispach serve` (secrets never go in the manifest)",
            field="channels",
        )
    return value

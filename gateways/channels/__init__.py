"""Delivery channels: the transports behind the outbox (and, for chat, inbound messages)."""

from gateways.channels.config import ChannelConfig, TelegramConfig, WebhookConfig, build
from gateways.channels.telegram import TelegramChannel
from gateways.channels.webhook import WebhookChannel

__all__ = [
    "ChannelConfig",
    "TelegramChannel",
    "TelegramConfig",
    "WebhookChannel",
    "WebhookConfig",
    "build",
]

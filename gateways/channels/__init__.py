"""Delivery channels: the transports behind the outbox (and, for chat, inbound messages). Each
kind is one module and one entry in :data:`kinds.KINDS`."""

from gateways.channels.config import ChannelError, ChannelKind, ChannelSettings
from gateways.channels.kinds import KINDS, ChannelConfig, build

__all__ = ["KINDS", "ChannelConfig", "ChannelError", "ChannelKind", "ChannelSettings", "build"]

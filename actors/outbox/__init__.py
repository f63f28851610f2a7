"""The outbox: replies promised to channels, delivered once where the channel allows it."""

from actors.outbox.channel import Channel, Inbound, InboundMessage, Outbound, SendResult
from actors.outbox.chunks import utf16_len

__all__ = ["Channel", "Inbound", "InboundMessage", "Outbound", "SendResult", "utf16_len"]

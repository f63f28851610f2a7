"""The outbox: replies promised to channels, delivered once where the channel allows it."""

from actors.outbox.channel import Channel, Inbound, InboundMessage, Outbound, SendResult

__all__ = ["Channel", "Inbound", "InboundMessage", "Outbound", "SendResult"]

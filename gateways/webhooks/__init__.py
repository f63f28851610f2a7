"""Outbound event webhooks' edge: where a delivery may go (target.py) and the transport that
POSTs it, signed (channel.py)."""

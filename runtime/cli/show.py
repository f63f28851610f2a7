"""Printing events for people: one line per event, or the public JSON envelope per line."""

from __future__ import annotations

import click
import msgspec

from eventstore import RecordedEvent, encode_wire
from eventstore.event import Event as _Event
from eventstore.event import encode_data, public_data

_COLOURS = {"turn": "cyan", "model": "blue", "tool": "magenta", "delivery": "green"}


def line(event: RecordedEvent, *, full: bool = False) -> str:
    """``#position  time  stream@version  type  {data}`` with private fields left out unless
    ``full`` (tool arguments and outputs are for operators, never for public streams)."""
    data = event.data
    body = encode_data(data) if full and isinstance(data, _Event) else public_data(data)
    kind = event.type.split(".", 1)[0]
    meta = msgspec.json.encode(event.metadata).decode()
    return "  ".join(
        [
            click.style(f"#{event.position}", dim=True),
            event.recorded_at.strftime("%H:%M:%S.%f")[:-3],
            f"{event.stream}@{event.version}",
            click.style(event.type, fg=_COLOURS.get(kind), bold=True),
            body.decode(),
            click.style(meta, dim=True) if meta != "{}" else "",
        ]
    ).rstrip()


def as_json(event: RecordedEvent) -> str:
    return encode_wire(event).decode()

"""The event base class, its registry and codec.

Events are frozen msgspec Structs. The type name lives in the ``events.type`` column and the
struct's fields in ``data``; ``data`` carries no tag of its own, so the stored JSON is exactly the
``data`` object of Dispach v1's wire envelope. Dispatch on the type name goes through
:data:`REGISTRY`, and code branches on the class with ``match``.

Evolution rules (docs/events.md): new fields get defaults, a field's type never changes, a rename
is a new type. Readers ignore fields they do not know, and an unknown type decodes to
:class:`UnknownEvent` instead of failing, so an older node can read a newer log.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec


class Event(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """Base of every event type. Subclasses set ``TYPE`` (the wire name)."""

    TYPE: ClassVar[str] = ""
    PRIVATE: ClassVar[frozenset[str]] = frozenset()
    """Fields kept in the log but never sent on a public stream (e.g. tool arguments)."""
    REVEALABLE: ClassVar[frozenset[str]] = frozenset()
    """The private fields an operator may ask to read (a turn's stored events with
    ``?private=true`` and the API token): a tool's own input and output, never the conversation,
    a digest or an idempotency key. Streams never carry them."""


class UnknownEvent(msgspec.Struct, frozen=True):
    """An event whose type this code does not know (written by a newer node)."""

    type: str
    raw: msgspec.Raw


REGISTRY: dict[str, type[Event]] = {}
_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {}
_ENCODER = msgspec.json.Encoder()


def register(*classes: type[Event]) -> None:
    """Add event classes to the registry; a type name may be registered once."""
    for cls in classes:
        if not cls.TYPE:
            raise TypeError(f"{cls.__name__} has no TYPE")
        known = REGISTRY.get(cls.TYPE)
        if known is not None and known is not cls:
            raise TypeError(f"event type {cls.TYPE!r} is registered twice")
        REGISTRY[cls.TYPE] = cls
        _DECODERS[cls.TYPE] = msgspec.json.Decoder(cls)


def encode_data(event: Event) -> bytes:
    return _ENCODER.encode(event)


def decode_data(type_name: str, raw: bytes | str) -> Event | UnknownEvent:
    decoder = _DECODERS.get(type_name)
    if decoder is None:
        return UnknownEvent(type_name, msgspec.Raw(raw.encode() if isinstance(raw, str) else raw))
    event: Event = decoder.decode(raw)
    return event


def public_data(event: Event | UnknownEvent, *, reveal: bool = False) -> bytes:
    """The ``data`` JSON a public stream may carry: private fields removed (``reveal``: but the
    event's :attr:`~Event.REVEALABLE` ones kept, for an operator who asked for them)."""
    if isinstance(event, UnknownEvent):
        return bytes(event.raw)
    hidden = event.PRIVATE - event.REVEALABLE if reveal else event.PRIVATE
    if not hidden:
        return _ENCODER.encode(event)
    fields = msgspec.to_builtins(event)
    for name in hidden:
        fields.pop(_camel(name), None)
    return _ENCODER.encode(fields)


def type_name(event: Event | UnknownEvent) -> str:
    return event.type if isinstance(event, UnknownEvent) else event.TYPE


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)

"""Logs written before catalogue v2, read as v2 (docs/events.md, "Catalogue v2").

Catalogue v1 wrote each model call as three events, always in one append: ``context.assembled``,
``context.pressure``, then ``model.call``. v2 writes one ``model.call`` that carries the other
two as its ``context`` and ``pressure``. :func:`upcast` turns each such v1 run into the v2 event
(the ``model.call``'s own position, version and id), so code that folds a turn reads one shape.

Everything else of v1 is valid v2 as it stands: a v1 ``turn.start`` has ``attempt`` 0 (accepted,
not begun) and its ``turn.attempt`` follows, as for a v2 turn accepted behind another. A
``context.assembled`` with no ``model.call`` after it (a request over its budget, never sent)
is left as it is: v2 records such a request the same way.

Public streams carry events as stored (a v1 log's frames are v1 frames): their readers take
both shapes, and a cursor always names a stored event.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from eventstore.catalogue import ContextAssembled, ContextPressure, ContextView, ModelCall, Pressure
from eventstore.envelope import RecordedEvent


def upcast(events: Iterable[RecordedEvent]) -> list[RecordedEvent]:
    """``events`` (in log order, of one stream or several) with every v1 model call as v2."""
    out: list[RecordedEvent] = []
    held: list[RecordedEvent] = []  # a v1 call's context.assembled (and pressure), so far
    for event in events:
        if _completes(held, event):
            out.append(_merged(held, event))
            held = []
        elif (
            isinstance(event.data, ContextPressure) and len(held) == 1 and _follows(held[0], event)
        ):
            held.append(event)
        else:
            out.extend(held)
            held = [event] if isinstance(event.data, ContextAssembled) else []
            if not held:
                out.append(event)
    out.extend(held)
    return out


def _completes(held: list[RecordedEvent], event: RecordedEvent) -> bool:
    """Whether ``event`` is the v1 ``model.call`` that ``held`` (its ``context.assembled`` and
    ``context.pressure``, in this order) was written with, in one append."""
    data = event.data
    return (
        isinstance(data, ModelCall) and data.context is None and len(held) == 2
        and _follows(held[1], event)
    )  # fmt: skip


def _follows(before: RecordedEvent, event: RecordedEvent) -> bool:
    return event.stream == before.stream and event.version == before.version + 1


def _merged(held: list[RecordedEvent], at: RecordedEvent) -> RecordedEvent:
    assembled, pressure, call = held[0].data, held[1].data, at.data
    assert isinstance(assembled, ContextAssembled) and isinstance(pressure, ContextPressure)
    assert isinstance(call, ModelCall)
    merged = msgspec.structs.replace(
        call,
        context=ContextView(slots=assembled.slots, total=assembled.total, budget=assembled.budget,
                            window=assembled.window, breakpoints=assembled.breakpoints),
        pressure=Pressure(fraction=pressure.fraction, tokens=pressure.tokens,
                          budget=pressure.budget, source=pressure.source, peak=pressure.peak),
    )  # fmt: skip
    return msgspec.structs.replace(at, data=merged)

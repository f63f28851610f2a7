"""The event catalogue: codec round trips, the public view, and docs/events.md kept true."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime

import msgspec

from eventstore import REGISTRY, Metadata, RecordedEvent, UnknownEvent, encode_wire
from eventstore.catalogue import ToolCall, ToolResult, TurnStart
from eventstore.event import decode_data, encode_data
from tests.conftest import ROOT


def recorded(event: object) -> RecordedEvent:
    return RecordedEvent(
        stream="turn-t1", version=0, position=7, txid=99, event_id=uuid.uuid4(),
        type=event.TYPE,  # type: ignore[attr-defined]
        data=event,  # type: ignore[arg-type]
        metadata=Metadata(agent_id="a", turn_id="t1"), recorded_at=datetime.now(UTC),
    )  # fmt: skip


def test_docs_list_exactly_the_types_of_the_code() -> None:
    text = (ROOT / "docs" / "events.md").read_text()
    documented = set(re.findall(r"^\| `([a-z]+\.[a-z.]+)` \|", text, re.MULTILINE))
    assert documented == set(REGISTRY)


def test_data_is_stored_without_a_type_tag_and_in_camel_case() -> None:
    data = msgspec.json.decode(encode_data(TurnStart(source="api", input_tokens=3)))
    assert "type" not in data and data["inputTokens"] == 3
    assert decode_data("turn.start", encode_data(TurnStart(source="x"))) == TurnStart(source="x")


def test_unknown_types_and_fields_decode_instead_of_failing() -> None:
    newer = decode_data("turn.start", b'{"source":"api","addedLater":1}')
    assert newer == TurnStart(source="api")
    unknown = decode_data("turn.teleported", b'{"to":"mars"}')
    assert isinstance(unknown, UnknownEvent) and bytes(unknown.raw) == b'{"to":"mars"}'


def test_tool_arguments_and_outputs_never_reach_the_wire() -> None:
    call = ToolCall(slug="shell", call_id="c1", args_hash="9f", mutating=True, args={"pw": "s3"})
    result = ToolResult(slug="shell", call_id="c1", ok=True, latency_ms=1, bytes=9, output="s3")
    for event in (call, result):
        wire = msgspec.json.decode(encode_wire(recorded(event)))
        assert "s3" not in msgspec.json.encode(wire).decode()
        assert set(wire) >= {"v", "id", "cursor", "position", "ts", "type", "data", "agentId"}
    assert msgspec.json.decode(encode_wire(recorded(call)))["data"]["argsHash"] == "9f"


def test_every_type_is_registered_once_with_its_class() -> None:
    for name, cls in REGISTRY.items():
        assert name == cls.TYPE
        assert cls.__struct_config__.frozen

"""The tools of one agent: their definitions for the model, and the check of a call's arguments."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import jsonschema
import msgspec
from jsonschema.exceptions import SchemaError

from actors.tools.errors import DuplicateTool, InvalidToolSchema
from actors.tools.spec import ToolSpec

# Sorted keys and no whitespace: equal arguments encode to equal bytes whatever their key order.
_CANONICAL = msgspec.json.Encoder(order="sorted")
_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193


class ToolRegistry:
    def __init__(self, specs: Iterable[ToolSpec]) -> None:
        self._specs: dict[str, ToolSpec] = {}
        self._validators: dict[str, jsonschema.Draft202012Validator] = {}
        for spec in specs:
            if spec.name in self._specs:
                raise DuplicateTool(spec.name)
            problem = schema_problem(spec.input_schema)
            if problem is not None:
                raise InvalidToolSchema(spec.name, problem)
            self._specs[spec.name] = spec
            self._validators[spec.name] = jsonschema.Draft202012Validator(spec.input_schema)
        # Built once, in declaration order: the tool block of every prompt is then byte-identical
        # from turn to turn, which is what lets the model provider cache the prompt prefix.
        # A copy of each schema: a declaration changed later does not change what is sent.
        self._definitions = [
            {"name": s.name, "description": s.description,
             "input_schema": copy.deepcopy(s.input_schema)}
            for s in self._specs.values()
        ]  # fmt: skip

    def get(self, name: str) -> ToolSpec | None:
        return self._specs.get(name)

    @property
    def names(self) -> list[str]:
        return list(self._specs)

    def definitions(self) -> list[dict[str, Any]]:
        """The tools in Anthropic's format, in declaration order. Shared, not copied (a deep copy
        per model call was 0.9 ms of a turn's 2.7 ms of event-loop time): read it, never mutate
        it; a caller that needs a variant builds new dicts."""
        return self._definitions

    def validate(self, name: str, args: object) -> list[str]:
        """What is wrong with a call, one ``"<path>: <message>"`` per problem; empty if nothing."""
        validator = self._validators.get(name)
        if validator is None:
            return [f"unknown tool {name!r}; available: {', '.join(self._specs) or '(none)'}"]
        return sorted(
            f"{json_path(e.absolute_path)}: {e.message}" for e in validator.iter_errors(args)
        )


def json_path(path: Sequence[str | int]) -> str:
    """``items[2].name`` for ``["items", 2, "name"]``; ``$`` for the root."""
    parts: list[str] = []
    for part in path:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif part.isidentifier():
            parts.append(f".{part}" if parts else part)
        else:
            parts.append(f"[{msgspec.json.encode(part).decode()}]")
    return "".join(parts) or "$"


def args_hash(args: object) -> str:
    """32-bit FNV-1a of the canonical JSON of ``args``, as 8 hex digits.

    It tells calls with equal arguments apart from others (the ``argsHash`` of ``tool.call``, on
    public streams) without carrying the arguments. It is a fingerprint, not a secret: arguments
    drawn from a small set of values can be guessed from it.
    """
    value = _FNV_OFFSET
    for byte in _CANONICAL.encode(args):
        value = ((value ^ byte) * _FNV_PRIME) & 0xFFFFFFFF
    return f"{value:08x}"


def schema_problem(schema: object) -> str | None:
    """What makes ``schema`` unfit as a tool's input schema (not a JSON Schema, or not of an
    object: the model sends a tool's input as one JSON object, and Anthropic refuses others);
    None if it fits."""
    if not isinstance(schema, dict):
        return "it is not a JSON object"
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        return _describe_schema_error(e)
    if schema.get("type") != "object":
        return 'the top level must be {"type": "object", ...}'
    return None


def _describe_schema_error(error: SchemaError) -> str:
    where = json_path(error.absolute_path)
    return error.message if where == "$" else f"{where}: {error.message}"

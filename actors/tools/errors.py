"""Errors of the tool layer: raised while tools are declared or loaded, never while one runs (a
failing run is a :class:`~actors.tools.spec.ToolOutcome` the model reads)."""

from __future__ import annotations

from eventstore.errors import DispachError


class ToolError(DispachError):
    """Base of every error the tool layer raises."""

    code = "tool_error"


class DuplicateTool(ToolError):
    code = "duplicate_tool"

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(
            f"tool {name!r} is declared more than once",
            "give every tool a unique name; the model calls tools by name",
            field=name,
        )


class InvalidToolSchema(ToolError):
    code = "invalid_tool_schema"

    def __init__(self, name: str, problem: str) -> None:
        self.name = name
        super().__init__(
            f"the input_schema of tool {name!r} is not a valid JSON Schema: {problem}",
            "fix the schema (JSON Schema draft 2020-12), e.g. "
            '{"type": "object", "properties": {...}, "required": [...]}',
            field=name,
        )


class ToolLoadError(ToolError):
    code = "tool_load_failed"


class ToolCallFailed(Exception):
    """Raised by a tool's ``run`` to fail with a code of its own (``tool_unavailable`` when the
    process behind it is down) rather than the generic ``tool_failed``; the message is what the
    model reads, so it should say what to do (the hint) as well as what went wrong."""

    def __init__(self, message: str, code: str = "tool_failed") -> None:
        super().__init__(message)
        self.code = code

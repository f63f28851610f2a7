"""The tool layer of the turn engine: what a tool is, the registry that checks calls against
their schemas, the execution of calls (bounded, parallel when read-only), session notes, the
built-in tools and the loading of operator-written ones."""

from actors.tools.builtins import BUILTINS, calculator, current_time, session_notes
from actors.tools.custom import load_custom
from actors.tools.errors import (
    DuplicateTool,
    InvalidToolSchema,
    ToolCallFailed,
    ToolError,
    ToolLoadError,
)
from actors.tools.execute import execute, execute_calls, truncate
from actors.tools.notes import Notes, StoreNotes
from actors.tools.registry import ToolRegistry, args_hash, schema_problem
from actors.tools.source import (
    LiveSources,
    SourceKind,
    SourcesChanged,
    StaticSource,
    ToolSource,
    ToolSourceKind,
)
from actors.tools.spec import ToolContext, ToolOutcome, ToolOutput, ToolRun, ToolSpec

__all__ = [
    "BUILTINS",
    "DuplicateTool",
    "InvalidToolSchema",
    "LiveSources",
    "Notes",
    "SourceKind",
    "SourcesChanged",
    "StaticSource",
    "StoreNotes",
    "ToolCallFailed",
    "ToolContext",
    "ToolError",
    "ToolLoadError",
    "ToolOutcome",
    "ToolOutput",
    "ToolRegistry",
    "ToolRun",
    "ToolSource",
    "ToolSourceKind",
    "ToolSpec",
    "args_hash",
    "calculator",
    "current_time",
    "execute",
    "execute_calls",
    "load_custom",
    "schema_problem",
    "session_notes",
    "truncate",
]

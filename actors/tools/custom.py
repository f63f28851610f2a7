"""Tools written by the operator: a Python function named as ``"package.module:function"``."""

from __future__ import annotations

import importlib
from typing import Any

from actors.tools.errors import ToolLoadError
from actors.tools.spec import ToolSpec

_FORM = 'name it as "package.module:function"'


def load_custom(
    name: str,
    module_path: str,
    description: str,
    input_schema: dict[str, Any],
    mutating: bool,
    timeout_s: float | None = None,
) -> ToolSpec:
    """Import the function behind a custom tool. It is called as ``function(args, ctx)`` and
    returns the text the model reads; a plain function runs in a worker thread, a coroutine
    function on the event loop. The schema is checked when the tools are registered."""
    module_name, sep, attribute = module_path.partition(":")
    if not (sep and module_name and attribute):
        raise ToolLoadError(
            f"tool {name!r}: {module_path!r} does not say which function to call",
            _FORM + ", e.g. my_tools.weather:forecast",
            field=name,
        )
    try:
        module = importlib.import_module(module_name)
    # Importing runs the module's code: whatever it raises (SyntaxError too), the tool cannot load.
    except Exception as e:
        raise ToolLoadError(
            f"tool {name!r}: cannot import module {module_name!r} ({type(e).__name__}: {e})",
            "check the module's spelling and that its directory is on PYTHONPATH of the node "
            f"(and that the module's own imports are installed); {_FORM}",
            field=name,
        ) from e
    run = getattr(module, attribute, None)
    if run is None:
        raise ToolLoadError(
            f"tool {name!r}: module {module_name!r} has no attribute {attribute!r}",
            f"check the function's name after the colon; {_FORM}",
            field=name,
        )
    if not callable(run):
        raise ToolLoadError(
            f"tool {name!r}: {module_path} is a {type(run).__name__}, not a function",
            f"point at a function taking (args, ctx) and returning str; {_FORM}",
            field=name,
        )
    return ToolSpec(
        name=name,
        description=description,
        input_schema=input_schema,
        mutating=mutating,
        run=run,
        timeout_s=timeout_s,
    )

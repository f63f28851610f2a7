"""Models behind the ``actors.model.Model`` port.

The provider adapters (``gateways.model.anthropic``, ``gateways.model.openai``) are imported
where an agent needs one (the factories of :mod:`gateways.model.providers`): each SDK weighs
tens of MiB.
"""

from typing import Any

from gateways.model.scripted import ScriptedModel, ScriptRule

__all__ = ["AnthropicModel", "ScriptRule", "ScriptedModel"]


def __getattr__(name: str) -> Any:
    if name == "AnthropicModel":  # the old import path, loaded on first use
        from gateways.model.anthropic import AnthropicModel

        return AnthropicModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

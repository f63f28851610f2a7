"""Models behind the ``actors.model.Model`` port."""

from gateways.model.anthropic import AnthropicModel
from gateways.model.scripted import ScriptedModel, ScriptRule

__all__ = ["AnthropicModel", "ScriptRule", "ScriptedModel"]

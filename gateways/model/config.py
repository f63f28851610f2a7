"""A model as an agent's manifest declares it (``model:``, ``context.compactor:``): which
provider, which model, its limits, thinking and server tools. Which provider takes what is
:mod:`gateways.model.providers`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from gateways.manifests import Positive, Seconds
from gateways.model.providers import AUTO, PROVIDERS, default_key_env
from gateways.model.scripted import ScriptRule

if TYPE_CHECKING:
    ProviderName = str
else:  # the registry's names, checked by msgspec as a Literal (mypy cannot read one built here)
    ProviderName = Literal[(AUTO, *PROVIDERS)]


class ThinkingConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How much the model may think before it answers. Anthropic: ``budget_tokens`` (at least
    1024, below ``max_output_tokens``) or ``adaptive: true``; OpenAI-compatible endpoints:
    ``effort`` (sent as ``reasoning_effort``)."""

    budget_tokens: Annotated[int, msgspec.Meta(ge=1024)] | None = None
    adaptive: bool = False
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


SERVER_TOOL_TYPES = {
    "web_search": "web_search_20250305",
    "web_fetch": "web_fetch_20250910",
    "code_execution": "code_execution_20250825",
}
"""The API's tool type for each server tool's name (``type`` in the manifest overrides it)."""


class ServerToolConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                       omit_defaults=True):  # fmt: skip
    """A tool the provider runs inside the model call (Anthropic only). The fields after
    ``policy`` are the API's own and go into the tool's definition as given."""

    name: str
    type: str | None = None
    policy: Literal["allow", "deny"] = "allow"
    """``deny`` leaves it out of every request (the API cannot ask a person mid-call, so
    ``ask`` does not exist for server tools)."""
    max_uses: Positive | None = None
    allowed_domains: list[str] | None = None
    blocked_domains: list[str] | None = None
    user_location: dict[str, Any] | None = None
    max_content_tokens: Positive | None = None
    citations: dict[str, Any] | None = None


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    provider: ProviderName = AUTO
    """``auto``: Anthropic when the API key variable is set, else the offline scripted model.
    ``openai``: any endpoint speaking OpenAI's Chat Completions (OpenAI, vLLM, Ollama,
    llama.cpp, OpenRouter), at ``base_url``."""
    id: str = "claude-sonnet-5"
    max_output_tokens: Positive = 4096
    api_key_env: str | None = None
    """The variable holding the API key (default ``ANTHROPIC_API_KEY``, or ``OPENAI_API_KEY``
    for ``provider: openai``). A local OpenAI-compatible server needs none: ``""`` sends
    none (with ``base_url``)."""
    base_url: str | None = None
    max_retries: Annotated[int, msgspec.Meta(ge=0, le=10)] = 2
    stall_timeout_s: Seconds = 120.0
    script: list[ScriptRule] | None = None
    context_window: Positive = 200_000
    """The model's context window in tokens: no request is sent that would not fit."""
    reserve_output: Positive | None = None
    """Tokens of the window kept for the reply (default: max_output_tokens)."""
    thinking: ThinkingConfig | None = None
    truncation: Literal["end", "retry"] = "end"
    """A reply cut off by ``max_output_tokens``: ``end`` the turn ``truncated`` (its text
    kept, a cut-off tool call never run), or ``retry`` once with twice the budget."""
    server_tools: list[str | ServerToolConfig] = msgspec.field(default_factory=list)
    """Anthropic's server tools by name (``web_search``, ``web_fetch``, ``code_execution``) or
    with their options."""
    betas: list[str] = msgspec.field(default_factory=list)
    """Anthropic beta features to switch on (the ``anthropic-beta`` header)."""
    max_tokens_param: Literal["max_completion_tokens", "max_tokens"] = "max_completion_tokens"
    """OpenAI-compatible endpoints: the parameter that carries the output limit (older local
    servers only know ``max_tokens``)."""
    stream_usage: bool = True
    """OpenAI-compatible endpoints: ask for token usage at the end of the stream."""
    reasoning_field: Literal["auto", "reasoning_content", "reasoning", "none"] = "auto"
    """OpenAI-compatible endpoints: where the server streams the model's reasoning
    (``reasoning_content``: vLLM, DeepSeek, llama.cpp; ``reasoning``: OpenRouter)."""

    @property
    def key_env(self) -> str:
        """The variable the API key is read from."""
        if self.api_key_env is not None:
            return self.api_key_env
        return default_key_env(self.provider)

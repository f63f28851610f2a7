"""What the real Messages API refuses with a 400 before generating anything, with its wording
where it is known (quoted in public issue threads; the rest is modelled on it).

``validation_error(body, issuer)`` is the first refusal a request earns, or None. Besides the
shape of the fields: text blocks must say something; ``thinking`` must have a budget of at least
1024 below ``max_tokens``; tools are custom ones or server tools of a known type; every
``thinking``, ``redacted_thinking`` and ``compaction`` block sent back must be one the fake
issued, unchanged (``issuer`` checks its HMAC); a ``server_tool_use`` must be followed in its
message by its result; a ``tool_use`` by a ``tool_result`` at the start of the next message;
and with thinking on, the assistant message of the current tool-use loop must begin with
thinking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.fakes._anthropic_blocks import Issuer, result_type
from tests.fakes._anthropic_prompt import Prompt, blocks_of

__all__ = ["Refusal", "thinking_on", "validation_error", "window_error"]

MAX_CACHE_MARKERS = 4
MIN_THINKING_BUDGET = 1024
REMOVED_SAMPLING_PARAMETERS = ("temperature", "top_p", "top_k")
THINKING_TYPES = ("adaptive", "between_tools", "disabled", "enabled")
SERVER_TOOL_TYPES = frozenset(
    {
        # the versioned tool types of anthropic 2.14's ToolUnionParam
        "bash_20250124",
        "browser_toolset_20260801",
        "code_execution_20250522",
        "code_execution_20250825",
        "code_execution_20260120",
        "code_execution_20260521",
        "computer_toolset_20260801",
        "memory_20250818",
        "text_editor_20250124",
        "text_editor_20250429",
        "text_editor_20250728",
        "tool_search_tool_bm25",
        "tool_search_tool_bm25_20251119",
        "tool_search_tool_regex",
        "tool_search_tool_regex_20251119",
        "web_fetch_20250910",
        "web_fetch_20260209",
        "web_fetch_20260309",
        "web_fetch_20260318",
        "web_search_20250305",
        "web_search_20260209",
        "web_search_20260318",
    }
)
_THINKING_KINDS = ("thinking", "redacted_thinking")
_DOCS = "https://docs.claude.com/en/docs/build-with-claude/extended-thinking"


@dataclass(frozen=True)
class Refusal:
    """A 400 ``invalid_request_error``: its message and, for the errors the SDK maps to a
    subclass, the ``details.error_code``."""

    message: str
    code: str | None = None


def thinking_on(body: dict[str, Any]) -> bool:
    """Whether the request asks the model to think (a budget, or adaptive)."""
    thinking = body.get("thinking")
    return isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")


def validation_error(
    body: dict[str, Any], issuer: Issuer, *, needs_max_tokens: bool
) -> Refusal | None:
    """The 400 the real API would give ``body``, or None if it is acceptable."""
    problem = (
        _field_error(body, needs_max_tokens=needs_max_tokens)
        or _thinking_error(body)
        or _tools_error(body.get("tools"))
        or ("messages: Field required" if "messages" not in body else None)
        or _messages_error(body["messages"])
    )
    if problem is not None:
        return Refusal(problem)
    messages: list[dict[str, Any]] = body["messages"]
    for index, message in enumerate(messages):
        refusal = _content_error(index, message, issuer, final=index == len(messages) - 1)
        if refusal is not None:
            return refusal
    problem = (
        _tool_pairing_error(messages)
        or _thinking_loop_error(messages, thinking_on(body))
        or _final_assistant_error(messages, thinking_on(body))
    )
    if problem is not None:
        return Refusal(problem)
    found = Prompt.of(body).marker_count
    if found > MAX_CACHE_MARKERS:
        return Refusal(
            f"A maximum of {MAX_CACHE_MARKERS} blocks with cache_control may be provided. "
            f"Found {found}."
        )
    return None


def window_error(prompt: int, max_tokens: int, window: int) -> str | None:
    """The real API's 400 for a request that does not fit the model's context window: the
    prompt alone, or the prompt with room for ``max_tokens`` of output."""
    if prompt > window:
        return f"prompt is too long: {prompt} tokens > {window} maximum"
    if prompt + max_tokens > window:
        return (
            f"input length and `max_tokens` exceed context limit: {prompt} + {max_tokens} > "
            f"{window}, decrease input length or `max_tokens` and try again"
        )
    return None


# --------------------------------------------------------------------------------------------
# Top-level fields


def _field_error(body: dict[str, Any], *, needs_max_tokens: bool) -> str | None:
    for name in REMOVED_SAMPLING_PARAMETERS:
        if name in body:
            return f"{name}: Extra inputs are not permitted"
    if "model" not in body:
        return "model: Field required"
    if not isinstance(body["model"], str):
        return "model: Input should be a valid string"
    if needs_max_tokens:
        if "max_tokens" not in body:
            return "max_tokens: Field required"
        max_tokens = body["max_tokens"]
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            return "max_tokens: Input should be a valid integer"
        if max_tokens < 0:
            return "max_tokens: Input should be greater than or equal to 0"
    return None


def _tag_error(path: str, tag: object, tags: list[str]) -> str:
    expected = ", ".join(f"'{t}'" for t in tags)
    return (
        f"{path}: Input tag '{tag}' found using 'type' does not match any of the expected tags: "
        f"{expected}"
    )


def _thinking_error(body: dict[str, Any]) -> str | None:
    thinking = body.get("thinking")
    if thinking is None:
        return None
    if not isinstance(thinking, dict):
        return "thinking: Input should be a valid dictionary or object to extract fields from"
    kind = thinking.get("type")
    if kind not in THINKING_TYPES:
        return _tag_error("thinking", kind, list(THINKING_TYPES))
    display = thinking.get("display")
    if display is not None and display not in ("summarized", "omitted"):
        return f"thinking.{kind}.display: Input should be 'summarized' or 'omitted'"
    if kind != "enabled":
        return None
    if "budget_tokens" not in thinking:
        return "thinking.enabled.budget_tokens: Field required"
    budget = thinking["budget_tokens"]
    if isinstance(budget, bool) or not isinstance(budget, int):
        return "thinking.enabled.budget_tokens: Input should be a valid integer"
    if budget < MIN_THINKING_BUDGET:
        return (
            "thinking.enabled.budget_tokens: Input should be greater than or equal to "
            f"{MIN_THINKING_BUDGET}"
        )
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, int) and budget >= max_tokens:
        return (
            "`max_tokens` must be greater than `thinking.budget_tokens`. Please consult our "
            f"documentation at {_DOCS}#max-tokens-and-context-window-size"
        )
    return None


def _tools_error(tools: Any) -> str | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        return "tools: Input should be a valid list"
    names: set[str] = set()
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict):
            return f"tools.{index}: Input should be a valid dictionary"
        kind = tool.get("type") or "custom"
        if kind != "custom" and kind not in SERVER_TOOL_TYPES:
            return _tag_error(f"tools.{index}", kind, sorted(SERVER_TOOL_TYPES | {"custom"}))
        if kind == "custom":
            for name in ("name", "input_schema"):
                if name not in tool:
                    return f"tools.{index}.custom.{name}: Field required"
        named = tool.get("name")
        if isinstance(named, str):
            if named in names:
                return "tools: Tool names must be unique."
            names.add(named)
    return None


def _messages_error(messages: Any) -> str | None:
    if not isinstance(messages, list):
        return "messages: Input should be a valid list"
    if not messages:
        return "messages: at least one message is required"
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages.{index}: Input should be a valid dictionary"
        if message.get("role") not in ("user", "assistant", "system"):
            return f"messages.{index}.role: Input should be 'user', 'assistant' or 'system'"
        if "content" not in message:
            return f"messages.{index}.content: Field required"
        if not isinstance(message["content"], str | list):
            return f"messages.{index}.content: Input should be a valid string or list"
    return None


# --------------------------------------------------------------------------------------------
# Blocks, one message at a time


def _content_error(
    index: int, message: dict[str, Any], issuer: Issuer, *, final: bool
) -> Refusal | None:
    content = message["content"]
    blocks = [] if content == "" else blocks_of(content)
    if not blocks and not (final and message["role"] == "assistant"):
        return Refusal(
            f"messages.{index}: all messages must have non-empty content except for the "
            "optional final assistant message"
        )
    problem = _text_error(index, blocks)
    if problem is not None:
        return Refusal(problem)
    for position, block in enumerate(blocks):
        where = f"messages.{index}.content.{position}"
        if not isinstance(block, dict):
            return Refusal(f"{where}: Input should be a valid dictionary")
        if message["role"] == "assistant":
            problem = _thinking_block_error(where, block, issuer)
            if problem is not None:
                return Refusal(problem)
        if block.get("type") == "compaction":
            refusal = _compaction_error(where, block, issuer)
            if refusal is not None:
                return refusal
    problem = _server_tool_error(index, blocks) if message["role"] == "assistant" else None
    return None if problem is None else Refusal(problem)


def _text_error(index: int, blocks: list[Any]) -> str | None:
    texts = [b for b in blocks if isinstance(b, dict) and b.get("type") == "text"]
    for position, block in enumerate(blocks):
        if isinstance(block, dict) and block.get("type") == "text" and "text" not in block:
            return f"messages.{index}.content.{position}.text: Field required"
    if any(block["text"] == "" for block in texts):
        return "messages: text content blocks must be non-empty"
    only_text = len(texts) == len(blocks)
    if texts and only_text and all(not str(block["text"]).strip() for block in texts):
        return "messages: text content blocks must contain non-whitespace text"
    return None


def _thinking_block_error(where: str, block: dict[str, Any], issuer: Issuer) -> str | None:
    kind = block.get("type")
    if kind == "thinking":
        if "signature" not in block:
            return f"{where}.thinking.signature: Field required"
        if not issuer.issued("thinking", block["signature"], str(block.get("thinking", ""))):
            return f"{where}: Invalid `signature` in `thinking` block"
    elif kind == "redacted_thinking" and not issuer.issued("redacted_thinking", block.get("data")):
        return f"{where}: Invalid `data` in `redacted_thinking` block"
    return None


def _compaction_error(where: str, block: dict[str, Any], issuer: Issuer) -> Refusal | None:
    """A compaction block goes back as it came. Null ``content`` is a compaction that failed,
    which the API takes back as a no-op; a block without the field was never returned."""
    if "content" not in block:
        return Refusal(f"{where}.content: Field required")
    content = block["content"]
    if content is None:
        return None
    if not isinstance(content, str):
        return Refusal(f"{where}.content: Input should be a valid string")
    if not content:
        return Refusal(f"{where}.content: String should have at least 1 character")
    if not issuer.issued("compaction", block.get("encrypted_content"), content):
        return Refusal(
            f"{where}: The `compaction` block's `content` differs from the text its signature "
            "recorded. Send the block back exactly as it was returned.",
            "compaction_content_mismatch",
        )
    signature = block.get("signature")
    if signature is not None and not issuer.issued("compaction-signature", signature, content):
        return Refusal(
            f"{where}: The `compaction` block's `signature` does not verify.",
            "compaction_signature_invalid",
        )
    return None


def _server_tool_error(index: int, blocks: list[dict[str, Any]]) -> str | None:
    """Each ``server_tool_use`` needs its result later in the same message, and each server
    tool result a use before it (``mcp_tool_result`` pairs with ``mcp_tool_use`` instead)."""
    pending: dict[str, str] = {}
    for position, block in enumerate(blocks):
        kind = str(block.get("type", ""))
        if kind == "server_tool_use":
            pending[str(block.get("id"))] = str(block.get("name"))
        elif kind.endswith("_tool_result") and kind not in ("tool_result", "mcp_tool_result"):
            use_id = str(block.get("tool_use_id"))
            if pending.pop(use_id, None) is None:
                return (
                    f"messages.{index}.content.{position}: unexpected `tool_use_id` found in "
                    f"`{kind}` blocks: {use_id}. Each `{kind}` block must have a corresponding "
                    "`server_tool_use` block before it."
                )
    for use_id, name in pending.items():
        return (
            f"messages.{index}: `{name}` tool use with id `{use_id}` was found without a "
            f"corresponding `{result_type(name)}` block"
        )
    return None


# --------------------------------------------------------------------------------------------
# Across messages


def _types(content: Any) -> list[str]:
    return [str(b.get("type")) for b in blocks_of(content) if isinstance(b, dict)]


def _tool_pairing_error(messages: list[Any]) -> str | None:
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        use_ids = [
            str(block.get("id"))
            for block in blocks_of(message.get("content"))
            if isinstance(block, dict) and block.get("type") == "tool_use"
        ]
        following = messages[index + 1] if index + 1 < len(messages) else None
        blocks = []
        if isinstance(following, dict) and following.get("role") == "user":
            blocks = [b for b in blocks_of(following.get("content")) if isinstance(b, dict)]
        result_ids = [str(b.get("tool_use_id")) for b in blocks if b.get("type") == "tool_result"]
        leading = 0
        while leading < len(blocks) and blocks[leading].get("type") == "tool_result":
            leading += 1
        if use_ids:
            missing = [use_id for use_id in use_ids if use_id not in result_ids]
            if missing:
                return (
                    f"messages.{index}: `tool_use` ids were found without `tool_result` blocks "
                    f"immediately after: {', '.join(missing)}. Each `tool_use` block must have a "
                    "corresponding `tool_result` block in the next message."
                )
            if leading < len(use_ids):
                return (
                    f"messages.{index + 1}: Did not find {len(use_ids)} `tool_result` block(s) "
                    "at the beginning of this message. Messages following `tool_use` blocks must "
                    "begin with a matching number of `tool_result` blocks."
                )
        for position, block in enumerate(blocks):
            wanted = str(block.get("tool_use_id"))
            if block.get("type") == "tool_result" and wanted not in use_ids:
                return (
                    f"messages.{index + 1}.content.{position}: unexpected `tool_use_id` found in "
                    f"`tool_result` blocks: {wanted}. Each `tool_result` block must have a "
                    "corresponding `tool_use` block in the previous message."
                )
    first = messages[0]
    if first.get("role") == "user":
        for position, block in enumerate(blocks_of(first.get("content"))):
            if isinstance(block, dict) and block.get("type") == "tool_result":
                return (
                    f"messages.0.content.{position}: unexpected `tool_use_id` found in "
                    f"`tool_result` blocks: {block.get('tool_use_id')}. Each `tool_result` block "
                    "must have a corresponding `tool_use` block in the previous message."
                )
    return None


def _thinking_loop_error(messages: list[dict[str, Any]], thinking: bool) -> str | None:
    """With thinking on, the assistant message the request's final tool results answer (the
    current tool-use loop) must begin with its thinking; older turns need not keep theirs."""
    if not thinking or len(messages) < 2:
        return None
    previous, last = messages[-2], messages[-1]
    if previous["role"] != "assistant" or last["role"] != "user":
        return None
    if _types(last["content"])[:1] != ["tool_result"]:
        return None
    first = _types(previous["content"])[:1]
    if first and first[0] in _THINKING_KINDS:
        return None
    return (
        f"messages.{len(messages) - 2}.content.0.type: Expected `thinking` or "
        f"`redacted_thinking`, but found `{first[0] if first else 'nothing'}`. When `thinking` is "
        "enabled, a final `assistant` message must start with a thinking block (preceeding the "
        "lastmost set of `tool_use` and `tool_result` blocks). We recommend you include thinking "
        "blocks from previous turns. To avoid this requirement, disable `thinking`. Please "
        f"consult our documentation at {_DOCS}"
    )


def _final_assistant_error(messages: list[dict[str, Any]], thinking: bool) -> str | None:
    """A final assistant message (a prefill the model continues) must not end in whitespace,
    nor hold thinking when thinking is off."""
    last = messages[-1]
    if last["role"] != "assistant":
        return None
    blocks = [b for b in blocks_of(last["content"]) if isinstance(b, dict)]
    for position, block in enumerate(blocks):
        kind = block.get("type")
        if not thinking and kind in _THINKING_KINDS:
            return (
                f"messages.{len(messages) - 1}.content.{position}: When thinking is disabled, an "
                f"`assistant` message in the final position cannot contain `{kind}`. To use "
                "thinking blocks, enable `thinking` in your request."
            )
    tail = blocks[-1] if blocks else None
    if tail is not None and tail.get("type") == "text":
        text = str(tail.get("text", ""))
        if text != text.rstrip():
            return "messages: final assistant content cannot end with trailing whitespace"
    return None

"""The content blocks a scripted reply is made of, and how each goes on the wire.

A scripted block (``Text``, ``Thinking``, ``Redacted``, ``ToolUse``, ``ServerToolUse``,
``Compaction``, ``Unknown``) stands for one or more blocks of the answer: ``wire`` turns it into
them, ids and opaque fields filled in (a ``ServerToolUse`` is the use and, after it, its result).
Each wire block renders what a non-streaming answer carries (``render``) and how the real API
streams it: the ``content_block_start`` payload, then its deltas. Text comes in ``text_delta``s
after one ``citations_delta`` per citation; thinking in ``thinking_delta``s then one
``signature_delta``; tool input in ``input_json_delta``s, the first one empty; a compaction in one
``compaction_delta`` (the SDK's beta accumulator replaces, never appends, its fields); redacted
thinking, server tool results and unknown types arrive whole in their start, with no deltas.

Everything opaque the fake issues (signatures, redacted data, compaction ``encrypted_content``)
is an HMAC under the fake's own secret (``Issuer``), base64 like a real one, so the fake can later
tell a block it issued from an edited or invented one without remembering anything.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeAlias

__all__ = [
    "BILLED_SERVER_TOOLS",
    "Block",
    "CodeRun",
    "Compaction",
    "Cut",
    "Fetched",
    "Issuer",
    "Redacted",
    "SearchResult",
    "ServerResult",
    "ServerToolUse",
    "Text",
    "Thinking",
    "ToolError",
    "ToolUse",
    "Unknown",
    "WireBlock",
    "billed_server_tools",
    "cite_chars",
    "cite_search",
    "dumps_message",
    "result_type",
    "wire_blocks",
]

_NONCE = 16
_RESULT_TYPES = {
    "web_search": "web_search_tool_result",
    "web_fetch": "web_fetch_tool_result",
    "code_execution": "code_execution_tool_result",
    "bash_code_execution": "bash_code_execution_tool_result",
    "text_editor_code_execution": "text_editor_code_execution_tool_result",
}
BILLED_SERVER_TOOLS = {"web_search": "web_search_requests", "web_fetch": "web_fetch_requests"}
"""The server tools ``usage.server_tool_use`` counts, and the field each is counted in."""


def result_type(tool_name: str) -> str:
    """The type of the block a server tool's result comes in (``web_search_tool_result``)."""
    return _RESULT_TYPES.get(tool_name, f"{tool_name}_tool_result")


def _opaque(size: int = 48) -> str:
    return base64.b64encode(secrets.token_bytes(size)).decode()


class Issuer:
    """The fake's secret and the opaque values it issues and later checks. Each value is a
    random nonce and an HMAC of (purpose, nonce, text): unforgeable without the secret, different
    on every issue like a real one, and checked by recomputing, so nothing is remembered.

    Purposes: ``"thinking"`` (a signature, over the thinking text), ``"redacted_thinking"``
    (the data, over nothing), ``"compaction"`` (``encrypted_content``, over the summary) and
    ``"compaction-signature"`` (over the summary)."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else secrets.token_bytes(32)
        self._vouched: set[tuple[str, str, str]] = set()

    def vouch(self, purpose: str, value: str, text: str = "") -> None:
        """Take ``value`` back as if issued for ``text``: a value the real API issued, in a
        recorded stream replayed through the fake (the API knows its own signatures)."""
        self._vouched.add((purpose, value, text))

    def _mac(self, purpose: str, nonce: bytes, text: str) -> bytes:
        message = purpose.encode() + b"\x00" + nonce + text.encode()
        return hmac.new(self._secret, message, hashlib.sha256).digest()

    def issue(self, purpose: str, text: str = "") -> str:
        nonce = secrets.token_bytes(_NONCE)
        return base64.b64encode(nonce + self._mac(purpose, nonce, text)).decode()

    def issued(self, purpose: str, value: object, text: str = "") -> bool:
        """Whether ``value`` is what ``issue(purpose, text)`` gave (for any nonce)."""
        if not isinstance(value, str):
            return False
        if (purpose, value, text) in self._vouched:
            return True
        try:
            raw = base64.b64decode(value, validate=True)
        except ValueError:
            return False
        nonce, mac = raw[:_NONCE], raw[_NONCE:]
        return len(nonce) == _NONCE and hmac.compare_digest(mac, self._mac(purpose, nonce, text))

    def thinking_signature(self, thinking: str) -> str:
        """A signature the fake accepts back with exactly this thinking text."""
        return self.issue("thinking", thinking)

    def redacted_data(self) -> str:
        """A ``redacted_thinking`` ``data`` the fake accepts back."""
        return self.issue("redacted_thinking")

    def compaction_fields(self, content: str) -> dict[str, str]:
        """The ``encrypted_content`` and ``signature`` the fake accepts back with ``content``."""
        return {
            "encrypted_content": self.issue("compaction", content),
            "signature": self.issue("compaction-signature", content),
        }


# --------------------------------------------------------------------------------------------
# Wire blocks: what one block of the answer renders to, whole and streamed


class WireBlock(Protocol):
    """One block of the answer, ids and opaque fields filled in."""

    @property
    def generated(self) -> int:
        """Characters the model generated for it (the output token estimate's base)."""
        ...

    def render(self) -> dict[str, Any]: ...

    def start(self) -> dict[str, Any]: ...

    def deltas(self, size: int) -> list[dict[str, Any]]: ...

    def cut(self, chars: int, issuer: Issuer) -> WireBlock:
        """This block as a reply cut off after ``chars`` of its streamed text shows it."""
        ...


def _chunks(text: str, size: int) -> list[str]:
    return [text[start : start + size] for start in range(0, len(text), size)]


@dataclass(frozen=True)
class _Whole:
    """A block that arrives whole in its ``content_block_start``: nothing to cut."""

    block: dict[str, Any]
    generated: int = 0

    def render(self) -> dict[str, Any]:
        return self.block

    def start(self) -> dict[str, Any]:
        return self.block

    def deltas(self, size: int) -> list[dict[str, Any]]:
        return []

    def cut(self, chars: int, issuer: Issuer) -> WireBlock:
        return self


_RAW_PLACEHOLDER = "\x00fake-anthropic-raw-json-{}\x00"


@dataclass(frozen=True)
class _Use:
    """A ``tool_use`` or ``server_tool_use``: input streamed as JSON text, sent verbatim (raw
    JSON, possibly invalid, is spliced into a non-streaming body by ``dumps_message``)."""

    type: str
    id: str
    name: str
    json_text: str
    input: dict[str, Any] | None
    raw: bool

    @property
    def generated(self) -> int:
        return len(self.json_text)

    def render(self) -> dict[str, Any]:
        value: Any = _RAW_PLACEHOLDER.format(self.id) if self.raw else (self.input or {})
        return {"type": self.type, "id": self.id, "name": self.name, "input": value}

    def start(self) -> dict[str, Any]:
        return {"type": self.type, "id": self.id, "name": self.name, "input": {}}

    def deltas(self, size: int) -> list[dict[str, Any]]:
        pieces = ["", *_chunks(self.json_text, size)]
        return [{"type": "input_json_delta", "partial_json": p} for p in pieces]

    def cut(self, chars: int, issuer: Issuer) -> WireBlock:
        return _Partial(self, self.json_text[:chars])


@dataclass(frozen=True)
class _Partial:
    """A tool use cut off mid-input: the JSON streamed stops part-way; a non-streaming answer
    carries ``input: {}``, the API having no whole input to give."""

    use: _Use
    json_text: str

    @property
    def generated(self) -> int:
        return len(self.json_text)

    def render(self) -> dict[str, Any]:
        return self.use.start()

    def start(self) -> dict[str, Any]:
        return self.use.start()

    def deltas(self, size: int) -> list[dict[str, Any]]:
        pieces = ["", *_chunks(self.json_text, size)]
        return [{"type": "input_json_delta", "partial_json": p} for p in pieces]

    def cut(self, chars: int, issuer: Issuer) -> WireBlock:
        return _Partial(self.use, self.json_text[:chars])


# --------------------------------------------------------------------------------------------
# Scripted blocks


class Block(Protocol):
    """A scripted block: the wire blocks it stands for, given the fake's issuer."""

    def wire(self, issuer: Issuer) -> tuple[WireBlock, ...]: ...


@dataclass(frozen=True)
class Text:
    """A ``text`` block; each citation (a dict, see ``cite_search``/``cite_chars``) comes in a
    ``citations_delta`` before the text, and in the block's ``citations`` list."""

    text: str
    citations: Sequence[Mapping[str, Any]] = ()

    @property
    def generated(self) -> int:
        return len(self.text)

    def wire(self, issuer: Issuer) -> tuple[WireBlock, ...]:
        return (self,)

    def render(self) -> dict[str, Any]:
        block: dict[str, Any] = {"type": "text", "text": self.text}
        if self.citations:
            block["citations"] = [dict(c) for c in self.citations]
        return block

    def start(self) -> dict[str, Any]:
        return {"type": "text", "text": "", **({"citations": []} if self.citations else {})}

    def deltas(self, size: int) -> list[dict[str, Any]]:
        cited = [{"type": "citations_delta", "citation": dict(c)} for c in self.citations]
        return cited + [{"type": "text_delta", "text": c} for c in _chunks(self.text, size)]

    def cut(self, chars: int, issuer: Issuer) -> WireBlock:
        return replace(self, text=self.text[:chars])


@dataclass(frozen=True)
class Thinking:
    """A ``thinking`` block. ``signature`` None: the fake signs the text (and accepts it back
    unchanged); a given one is sent verbatim (a foreign or forged signature, to be refused)."""

    thinking: str
    signature: str | None = None

    @property
    def generated(self) -> int:
        return len(self.thinking)

    def wire(self, issuer: Issuer) -> tuple[WireBlock, ...]:
        if self.signature is not None:
            return (self,)
        return (replace(self, signature=issuer.thinking_signature(self.thinking)),)

    def render(self) -> dict[str, Any]:
        return {"type": "thinking", "thinking": self.thinking, "signature": self.signature or ""}

    def start(self) -> dict[str, Any]:
        return {"type": "thinking", "thinking": "", "signature": ""}

    def deltas(self, size: int) -> list[dict[str, Any]]:
        deltas = [{"type": "thinking_delta", "thinking": c} for c in _chunks(self.thinking, size)]
        return [*deltas, {"type": "signature_delta", "signature": self.signature or ""}]

    def cut(self, chars: int, issuer: Issuer) -> WireBlock:
        """Thinking cut off still gets its signature, over the text that was sent."""
        shown = self.thinking[:chars]
        return Thinking(shown, issuer.thinking_signature(shown))


@dataclass(frozen=True)
class Redacted:
    """A ``redacted_thinking`` block; ``data`` None: opaque data the fake accepts back."""

    data: str | None = None

    def wire(self, issuer: Issuer) -> tuple[WireBlock, ...]:
        data = self.data if self.data is not None else issuer.redacted_data()
        return (_Whole({"type": "redacted_thinking", "data": data}, generated=len(data)),)


@dataclass(frozen=True)
class ToolUse:
    """One ``tool_use`` block. ``raw_json`` (if given) is sent verbatim instead of ``input``:
    chunked into ``input_json_delta`` events when streaming, spliced into the body as the
    ``input`` value otherwise. Use it to send malformed or invalid JSON."""

    name: str
    input: dict[str, Any] | None = None
    raw_json: str | None = None
    id: str | None = None

    def __post_init__(self) -> None:
        if self.input is not None and self.raw_json is not None:
            raise ValueError("ToolUse takes input or raw_json, not both")

    def json_text(self) -> str:
        """The tool input exactly as it goes on the wire."""
        if self.raw_json is not None:
            return self.raw_json
        return json.dumps(self.input or {}, ensure_ascii=False)

    def wire(self, issuer: Issuer) -> tuple[WireBlock, ...]:
        use_id = self.id or f"toolu_01{secrets.token_hex(12)}"
        raw = self.raw_json is not None
        return (_Use("tool_use", use_id, self.name, self.json_text(), self.input, raw),)


@dataclass(frozen=True)
class SearchResult:
    """One ``web_search_result`` of a ``web_search`` result (``encrypted_content`` None: an
    opaque value, as the real API's page contents are)."""

    url: str
    title: str
    page_age: str | None = None
    encrypted_content: str | None = None

    def render(self) -> dict[str, Any]:
        return {
            "type": "web_search_result",
            "url": self.url,
            "title": self.title,
            "encrypted_content": self.encrypted_content or _opaque(),
            "page_age": self.page_age,
        }


@dataclass(frozen=True)
class Fetched:
    """A ``web_fetch`` result: the page as a plain-text ``document``."""

    url: str
    text: str
    title: str | None = None
    retrieved_at: str | None = None

    def render(self) -> dict[str, Any]:
        source = {"type": "text", "media_type": "text/plain", "data": self.text}
        document = {"type": "document", "source": source, "title": self.title, "citations": None}
        return {
            "type": "web_fetch_result",
            "url": self.url,
            "retrieved_at": self.retrieved_at,
            "content": document,
        }


@dataclass(frozen=True)
class CodeRun:
    """A ``code_execution`` result."""

    stdout: str = ""
    stderr: str = ""
    return_code: int = 0

    def render(self) -> dict[str, Any]:
        return {
            "type": "code_execution_result",
            "stdout": self.stdout,
            "stderr": self.stderr,
            "return_code": self.return_code,
            "content": [],
        }


@dataclass(frozen=True)
class ToolError:
    """A server tool's failure: ``{"type": "<result type>_error", "error_code": …}``
    (``max_uses_exceeded``, ``unavailable``, ``url_not_accessible``, …)."""

    error_code: str


ServerResult: TypeAlias = (
    Sequence[SearchResult] | Fetched | CodeRun | ToolError | Mapping[str, Any] | None
)
"""A server tool's result: search results, a fetched page, a code run, an error, the result
block's whole ``content`` as a dict, or None (no result block follows the use)."""


@dataclass(frozen=True)
class ServerToolUse:
    """A ``server_tool_use`` (id ``srvtoolu_…``, input streamed like a tool's) followed by its
    result block, which arrives whole: ``web_search_tool_result`` for ``web_search`` and so on."""

    name: str
    input: Mapping[str, Any] = field(default_factory=dict)
    result: ServerResult = ()
    id: str | None = None

    def wire(self, issuer: Issuer) -> tuple[WireBlock, ...]:
        use_id = self.id or f"srvtoolu_01{secrets.token_hex(12)}"
        text = json.dumps(dict(self.input), ensure_ascii=False)
        use = _Use("server_tool_use", use_id, self.name, text, dict(self.input), raw=False)
        content = self._content()
        if content is None:
            return (use,)
        kind = result_type(self.name)
        return use, _Whole({"type": kind, "tool_use_id": use_id, "content": content})

    def _content(self) -> Any:
        result = self.result
        if result is None:
            return None
        if isinstance(result, ToolError):
            return {"type": f"{result_type(self.name)}_error", "error_code": result.error_code}
        if isinstance(result, Fetched | CodeRun):
            return result.render()
        if isinstance(result, Mapping):
            return dict(result)
        return [item.render() for item in result]


@dataclass(frozen=True)
class Compaction:
    """A ``compaction`` block (beta): the summary in ``content``, ``encrypted_content`` the fake
    issues for it and, if ``signed``, a ``signature``. Given values are sent verbatim."""

    content: str
    encrypted_content: str | None = None
    signed: bool = False
    signature: str | None = None

    @property
    def generated(self) -> int:
        return len(self.content)

    def wire(self, issuer: Issuer) -> tuple[WireBlock, ...]:
        issued = issuer.compaction_fields(self.content)
        return (
            replace(
                self,
                encrypted_content=self.encrypted_content or issued["encrypted_content"],
                signature=self.signature or (issued["signature"] if self.signed else None),
            ),
        )

    def _signature(self) -> dict[str, Any]:
        return {} if self.signature is None else {"signature": self.signature}

    def render(self) -> dict[str, Any]:
        block = {"type": "compaction", "content": self.content}
        return {**block, "encrypted_content": self.encrypted_content, **self._signature()}

    def start(self) -> dict[str, Any]:
        """The summary comes in the delta; the signature, known once it is written, in the
        start, where the SDK's beta accumulator keeps it (its delta type has no such field)."""
        block = {"type": "compaction", "content": None, "encrypted_content": None}
        return {**block, **self._signature()}

    def deltas(self, size: int) -> list[dict[str, Any]]:
        delta = {"type": "compaction_delta", "content": self.content}
        return [{**delta, "encrypted_content": self.encrypted_content}]

    def cut(self, chars: int, issuer: Issuer) -> WireBlock:
        return self


@dataclass(frozen=True)
class Unknown:
    """A block of a type newer than any client: ``{"type": type, **fields}``, whole."""

    type: str
    fields: Mapping[str, Any] = field(default_factory=dict)

    def wire(self, issuer: Issuer) -> tuple[WireBlock, ...]:
        return (_Whole({"type": self.type, **self.fields}),)


def cite_search(result: SearchResult, cited_text: str) -> dict[str, Any]:
    """A ``web_search_result_location`` citation of ``result``."""
    return {
        "type": "web_search_result_location",
        "url": result.url,
        "title": result.title,
        "cited_text": cited_text,
        "encrypted_index": _opaque(24),
    }


def cite_chars(
    cited_text: str, document_index: int, start: int, end: int, title: str | None = None
) -> dict[str, Any]:
    """A ``char_location`` citation of a plain-text document of the request."""
    return {
        "type": "char_location",
        "cited_text": cited_text,
        "document_index": document_index,
        "document_title": title,
        "start_char_index": start,
        "end_char_index": end,
    }


# --------------------------------------------------------------------------------------------
# A whole answer


@dataclass(frozen=True)
class Cut:
    """A reply cut off by ``max_tokens``: block ``block`` (its index in the answer's content, a
    server tool's result counting as a block of its own) stops after ``chars`` characters of its
    streamed text or JSON; no later block is sent. Blocks that arrive whole are sent whole.
    ``stop``: whether the cut block still gets its ``content_block_stop`` (the real API sends
    one; a recording in the SDK's tests has none)."""

    block: int
    chars: int = 0
    stop: bool = True

    def __post_init__(self) -> None:
        if self.block < 0 or self.chars < 0:
            raise ValueError("Cut takes a block index and a character count, neither negative")


def wire_blocks(blocks: Sequence[Block], issuer: Issuer, cut: Cut | None) -> list[WireBlock]:
    """The blocks of the answer, in order, cut off as ``cut`` says."""
    wired = [w for block in blocks for w in block.wire(issuer)]
    if cut is None:
        return wired
    if cut.block >= len(wired):
        raise ValueError(f"Cut.block {cut.block}: the answer has {len(wired)} blocks")
    return [*wired[: cut.block], wired[cut.block].cut(cut.chars, issuer)]


def dumps_message(message: dict[str, Any], wired: Sequence[WireBlock]) -> str:
    """A non-streaming answer's JSON, raw tool JSON spliced in verbatim."""
    text = json.dumps(message, ensure_ascii=False)
    for block in wired:
        if isinstance(block, _Use) and block.raw:
            text = text.replace(json.dumps(_RAW_PLACEHOLDER.format(block.id)), block.json_text)
    return text


def billed_server_tools(wired: Sequence[WireBlock]) -> dict[str, int] | None:
    """``usage.server_tool_use`` of an answer: the web searches and fetches that ran (a use
    cut off mid-input never ran); None when no server tool ran."""
    ran = [w.name for w in wired if isinstance(w, _Use) and w.type == "server_tool_use"]
    if not ran:
        return None
    return {key: ran.count(name) for name, key in BILLED_SERVER_TOOLS.items()}

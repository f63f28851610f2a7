"""Tools from MCP servers, through the official ``mcp`` SDK: one session per server per node.

A :class:`Connection` keeps the session with one server for as long as the node runs: a stdio
server is started with the node, stopped at drain and started again, with backoff, when it dies;
an HTTP session is opened again when the server forgets it (404). It lists the server's tools at
the start of each session and again when the server says they changed
(``notifications/tools/list_changed``, or a ``subscriptions/listen`` event on 2026-07-28
sessions), and then tells the node, which rebuilds the tool lists of the agents that use it.

:class:`McpTools` is the tool-source port (:class:`actors.tools.ToolSource`) over a connection,
for one agent's declaration of the server: which of its tools the agent may use, their policy and
deadline. Its tools are named ``<server>__<tool>`` (two servers cannot collide); a tool is
read-only only when the server says so (``readOnlyHint``), so a crash resume never runs anything
else twice. A call made while the server is down fails at once with ``tool_unavailable``; a call
past its deadline is cancelled (the SDK sends ``notifications/cancelled``), by the turn engine's
timeout like any coroutine tool.

:func:`output` turns a result into what the model reads: text, images as image blocks, embedded
text resources inline, a note for what it cannot read; ``isError`` is a tool error.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Literal

import anyio
import mcp_types as types
import msgspec
import structlog
from mcp.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.client.subscriptions import SubscriptionLost
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from actors.tools import (
    SourceKind,
    ToolCallFailed,
    ToolContext,
    ToolOutput,
    ToolSpec,
    schema_problem,
)
from gateways.http.metrics import MCP_CALLS, MCP_SERVER_FAILURES, MCP_SERVER_TOOLS, MCP_SERVER_UP
from gateways.mcp.spec import Http, ServerSpec, Stdio
from gateways.mcp.stdio import MessageTooLarge, stdio_transport

log = structlog.get_logger("dispach.mcp")

State = Literal["starting", "up", "down", "stopped"]

SEPARATOR = "__"
"""Between the server's name and its tool's: ``files__read_file``."""
NAME_LIMIT = 64
"""The longest tool name the model APIs take (``^[a-zA-Z0-9_-]{1,64}$``)."""
LIST_TIMEOUT_S = 10.0
"""How long one listing of a server's tools may take."""
HEALTH_S = 15.0
"""How often an idle session is pinged (a server that died between calls is noticed)."""
BACKOFF_S = (0.25, 30.0)
"""The first and the longest wait before a server is started again."""
LISTEN_AGAIN_S = 1.0
"""The wait before a lost ``subscriptions/listen`` stream is opened again."""
HEALTHY_S = 30.0
"""A session that lasted this long resets the backoff."""
IMAGE_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})
"""The image types the model takes in a tool result."""


class McpTools:
    """The tools one agent takes from one MCP server (the :class:`~actors.tools.ToolSource`
    port)."""

    kind: SourceKind = "mcp"

    def __init__(self, spec: ServerSpec, connection: Connection) -> None:
        self.spec = spec
        self.connection = connection

    @property
    def name(self) -> str:
        return self.spec.name

    def specs(self) -> list[ToolSpec]:
        allowed = self.spec.tools
        return [
            ToolSpec(
                name=namespaced(self.spec.name, tool.name),
                description=tool.description or (tool.title or tool.name),
                input_schema=tool.input_schema,
                mutating=not read_only(tool),
                run=self._runner(tool.name),
                timeout_s=self.spec.timeout_s,
                untrusted_output=self.spec.untrusted_output,
                policy=self.spec.policy.get(tool.name, "allow"),
                mcp_server=self.spec.name,
            )
            for tool in self.connection.tools
            if allowed is None or tool.name in allowed
        ]

    def problems(self) -> list[str]:
        """Allowed tools the server does not offer now (a typo in the manifest, a server that
        dropped them, or one that is down), and its tools this node cannot offer."""
        offered = {tool.name for tool in self.connection.tools}
        found = [f"the server offers no tool {name!r} (allowed by `tools`)"
                 for name in sorted((self.spec.tools or frozenset()) - offered)]  # fmt: skip
        allowed = self.spec.tools
        found += [f"its tool {name!r} is left out: {why}"
                  for name, why in self.connection.refused.items()
                  if allowed is None or name in allowed]  # fmt: skip
        return found

    def _runner(self, tool: str) -> Callable[[dict[str, Any], ToolContext], Any]:
        connection = self.connection

        async def run(args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
            return output(await connection.call(tool, args))

        return run


class Connection:
    """This node's session with one MCP server, kept open by a task of its own."""

    def __init__(
        self,
        name: str,
        transport: Stdio | Http,
        *,
        client_version: str = "",
        on_change: Callable[[Connection], None] | None = None,
    ) -> None:
        self.name = name
        self.transport = transport
        self.state: State = "starting"
        self.tools: tuple[types.Tool, ...] = ()
        """The usable tools as last listed (refused ones left out)."""
        self.refused: dict[str, str] = {}
        """Tools of the last listing that cannot be offered, with the reason."""
        self.error: str | None = None
        """Why the session is down (or why it was last lost)."""
        self.since = time.time()
        self.sessions = 0
        self.protocol: str | None = None
        self._version = client_version
        self._on_change = on_change
        self._client: Client | None = None
        self._calls = 0
        """Calls waiting for the server now."""
        self._too_large: str | None = None
        """Why the transport is about to end the session: a message over its limit."""
        self._lost = asyncio.Event()
        self._stale = asyncio.Event()
        """The server said its tools changed: list them again."""
        self._stop = asyncio.Event()
        self._tried = asyncio.Event()
        """Set once the first session opened or failed: the node waits for it at start."""
        self._opened = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        MCP_SERVER_UP.labels(server=name).set(0)

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._supervise(), name=f"mcp-{self.name}")

    async def ready(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) for the first session to open or fail."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._tried.wait()

    async def aclose(self, timeout: float = 5.0) -> None:
        """End the session (a stdio server is asked to exit, then terminated) and stay down."""
        self._stop.set()
        self._lost.set()
        task, self._task = self._task, None
        if task is not None:
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.shield(task)
            except TimeoutError:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._set("stopped", None)
        log.info("mcp_server_stopped", server=self.name)

    # --- calls ---------------------------------------------------------------------------------

    async def call(self, tool: str, args: dict[str, Any]) -> types.CallToolResult:
        """Call ``tool`` on the server; a server that is down, or goes down during the call,
        fails it with ``tool_unavailable``. An HTTP session the server forgot is opened again
        and the call sent once more (the server never saw it)."""
        for attempt in range(2):
            client = self._client
            if client is None or self.state != "up":
                raise self._unavailable()
            self._calls += 1
            try:
                result = await client.call_tool(tool, args)
            except asyncio.CancelledError:
                MCP_CALLS.labels(server=self.name, outcome="cancelled").inc()
                raise
            except MCPError as e:
                if e.code == types.CONNECTION_CLOSED and self._too_large:
                    why, self._too_large = self._too_large, None
                    self._lose(why)
                    MCP_CALLS.labels(server=self.name, outcome="refused").inc()
                    raise ToolCallFailed(
                        f"the MCP server {self.name!r} answered with more than this node reads "
                        f"({why}); its session is opened again. Ask the tool for less (a page, "
                        "a range, a filter)",
                    ) from e
                if e.code == types.CONNECTION_CLOSED:
                    self._lose("the connection closed during a call")
                    raise self._unavailable() from e
                if attempt == 0 and _forgotten(e) and isinstance(self.transport, Http):
                    self._lose("the server ended the session (HTTP 404)")
                    await self._reopened()
                    continue
                MCP_CALLS.labels(server=self.name, outcome="refused").inc()
                raise ToolCallFailed(
                    f"the MCP server {self.name!r} refused the call ({e.code}: {e.error.message}); "
                    "check the arguments against the tool's input schema",
                ) from e
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as e:
                self._lose(f"the connection broke during a call: {_describe(e)}")
                raise self._unavailable() from e
            finally:
                self._calls -= 1
            MCP_CALLS.labels(server=self.name, outcome="error" if result.is_error else "ok").inc()
            return result
        raise self._unavailable()

    def _unavailable(self) -> ToolCallFailed:
        MCP_CALLS.labels(server=self.name, outcome="unavailable").inc()
        why = f": {self.error}" if self.error else ""
        return ToolCallFailed(
            f"the MCP server {self.name!r} is {self.state}{why}. The node starts it again by "
            "itself; try the tool later, or go on without it",
            "tool_unavailable",
        )

    async def _reopened(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LIST_TIMEOUT_S):
                while self.state != "up" and not self._stop.is_set():
                    self._opened.clear()
                    await self._opened.wait()

    # --- the session ---------------------------------------------------------------------------

    async def _supervise(self) -> None:
        wait = BACKOFF_S[0]
        while not self._stop.is_set():
            opened = time.monotonic()
            try:
                await self._session()
            except Exception as e:  # noqa: BLE001 - whatever ends a session, it is started again
                self._fail(_describe(e))
            else:
                if not self._stop.is_set():
                    self._fail(self.error or "the session ended")
            finally:
                self._client = None
                self._tried.set()
            if self._stop.is_set():
                return
            if time.monotonic() - opened > HEALTHY_S:
                wait = BACKOFF_S[0]
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._stop.wait()
            wait = min(wait * 2, BACKOFF_S[1])

    async def _session(self) -> None:
        self._lost.clear()
        self._set("starting", self.error)
        client = Client(
            self._target(),
            client_info=types.Implementation(name="dispach", version=self._version or "0"),
            message_handler=self._on_message,
            cache=None,
        )
        async with client:
            self._client = client
            self.protocol = client.protocol_version
            await self._list(client)
            self.sessions += 1
            self._set("up", None)
            self._opened.set()
            self._tried.set()
            log.info(
                "mcp_server_up", server=self.name, transport=self.transport.describe(),
                protocol=self.protocol, tools=len(self.tools), session=self.sessions,
            )  # fmt: skip
            async with anyio.create_task_group() as group:
                if client.protocol_version in MODERN_PROTOCOL_VERSIONS:
                    group.start_soon(self._listen, client)
                group.start_soon(self._watch, client)
                group.start_soon(self._refresh, client)
                await self._lost.wait()
                group.cancel_scope.cancel()
            self._client = None

    def _target(self) -> Any:
        transport = self.transport
        if isinstance(transport, Stdio):
            return stdio_transport(transport)
        return _http(transport.url, dict(transport.headers))

    async def _list(self, client: Client) -> None:
        """List the tools (every page), keep the usable ones, and tell the node if they
        changed."""
        listed: list[types.Tool] = []
        cursor: str | None = None
        with anyio.fail_after(LIST_TIMEOUT_S):
            for _ in range(100):
                page = await client.list_tools(cursor=cursor)
                listed.extend(page.tools)
                cursor = page.next_cursor
                if cursor is None:
                    break
        kept, refused = admit(self.name, listed)
        for name, why in refused.items():
            if self.refused.get(name) != why:
                log.warning("mcp_tool_refused", server=self.name, tool=name, reason=why)
        changed = [_fingerprint(t) for t in kept] != [_fingerprint(t) for t in self.tools]
        self.tools, self.refused = tuple(kept), refused
        MCP_SERVER_TOOLS.labels(server=self.name).set(len(kept))
        if changed:
            log.info("mcp_tools_listed", server=self.name, tools=[t.name for t in kept])
            if self._on_change is not None:
                self._on_change(self)

    async def _on_message(self, message: Any) -> None:
        # Listed again by a task of the session: a request sent from the dispatcher's own
        # handler would wait for a reply only that dispatcher can read.
        if isinstance(message, types.ToolListChangedNotification):
            self._stale.set()
        elif isinstance(message, MessageTooLarge):
            self._too_large = str(message)  # the transport ends the session after it

    async def _refresh(self, client: Client) -> None:
        while True:
            await self._stale.wait()
            self._stale.clear()
            await self._relist(client)

    async def _listen(self, client: Client) -> None:
        """On 2026-07-28 sessions, changes arrive on a subscription the client opens. A lost
        one (an HTTP server restarted: its requests are stateless, its subscriptions are not)
        is opened again and the list read again, since changes made meanwhile were missed."""
        while True:
            try:
                async with client.listen(tools_list_changed=True) as events:
                    async for _ in events:
                        self._stale.set()
            except SubscriptionLost as e:
                log.info("mcp_listen_lost", server=self.name, error=_describe(e))
            except Exception as e:  # noqa: BLE001 - a server without the feature still serves tools
                log.info("mcp_listen_refused", server=self.name, error=_describe(e))
                return
            else:
                return  # the server closed it on purpose
            await anyio.sleep(LISTEN_AGAIN_S)
            self._stale.set()

    async def _relist(self, client: Client) -> None:
        try:
            await self._list(client)
        except Exception as e:  # noqa: BLE001 - the old list stays until one succeeds
            log.warning("mcp_list_failed", server=self.name, error=_describe(e))

    async def _watch(self, client: Client) -> None:
        """Ask an idle session now and then whether the server is there (``ping`` before
        2026-07-28, which has none; ``server/discover`` from then): one that died is noticed
        before the next call needs it. Not while calls run: a long one (a large result being
        read) is no sign of a dead server, and its failure would say so anyway."""
        modern = client.protocol_version in MODERN_PROTOCOL_VERSIONS
        while True:
            await anyio.sleep(HEALTH_S)
            if self._calls:
                continue
            try:
                with anyio.fail_after(LIST_TIMEOUT_S):
                    if modern:
                        await client.session.send_discover(client.protocol_version)
                    else:
                        await client.send_ping()
            except Exception as e:  # noqa: BLE001 - any failure of the check loses the session
                if not self._calls:
                    self._lose(f"it did not answer a health check: {_describe(e)}")
                    return

    def _lose(self, why: str) -> None:
        if self.state == "up":
            self._fail(why)
        self._lost.set()

    def _fail(self, why: str) -> None:
        if self.state != "down":
            MCP_SERVER_FAILURES.labels(server=self.name).inc()
            log.warning("mcp_server_down", server=self.name, error=why,
                        transport=self.transport.describe())  # fmt: skip
        self._set("down", why)

    def _set(self, state: State, error: str | None) -> None:
        if state != self.state:
            self.since = time.time()
        self.state, self.error = state, error
        MCP_SERVER_UP.labels(server=self.name).set(1 if state == "up" else 0)


class Hub:
    """The node's connections, one per declared server (agents that declare the same server
    the same way share it)."""

    def __init__(
        self, *, client_version: str = "", on_change: Callable[[Connection], None] | None = None
    ) -> None:
        self._version = client_version
        self._on_change = on_change
        self._connections: dict[tuple[str, Stdio | Http], Connection] = {}

    def source(self, spec: ServerSpec) -> McpTools:
        key = (spec.name, spec.transport)
        connection = self._connections.get(key)
        if connection is None:
            connection = Connection(spec.name, spec.transport, client_version=self._version,
                                    on_change=self._on_change)  # fmt: skip
            self._connections[key] = connection
        return McpTools(spec, connection)

    @property
    def connections(self) -> list[Connection]:
        return list(self._connections.values())

    async def start(self, wait_s: float) -> None:
        """Start every server; wait (at most ``wait_s``) until each has listed its tools or
        failed. One that is not up yet comes later: its tools appear when it does."""
        for connection in self._connections.values():
            connection.start()
        await asyncio.gather(*(c.ready(wait_s) for c in self._connections.values()))

    async def aclose(self, timeout: float) -> None:
        await asyncio.gather(*(c.aclose(timeout) for c in self._connections.values()))


# --- what a server offers ----------------------------------------------------------------------

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def namespaced(server: str, tool: str) -> str:
    """The name the model calls a server's tool by."""
    return f"{server}{SEPARATOR}{_UNSAFE.sub('_', tool)}"


def read_only(tool: types.Tool) -> bool:
    """Only the server's ``readOnlyHint`` makes a tool read-only; a destructive hint, or no
    hint, makes it mutating (never run twice)."""
    hints = tool.annotations
    return bool(hints is not None and hints.read_only_hint)


def admit(server: str, tools: Iterable[types.Tool]) -> tuple[list[types.Tool], dict[str, str]]:
    """The tools that can be offered to a model, and why each other one cannot: a name the
    APIs refuse or that another tool of the server takes once namespaced, or an input schema
    that is not a JSON Schema of an object."""
    kept: list[types.Tool] = []
    refused: dict[str, str] = {}
    taken: dict[str, str] = {}
    for tool in tools:
        name = namespaced(server, tool.name)
        if len(name) > NAME_LIMIT:
            refused[tool.name] = f"{name!r} is longer than the {NAME_LIMIT} characters a tool " \
                                 "name may have"  # fmt: skip
        elif name in taken:
            refused[tool.name] = f"it is named {name!r} here, as {taken[name]!r} already is"
        elif (problem := schema_problem(tool.input_schema)) is not None:
            refused[tool.name] = f"its inputSchema is invalid: {problem}"
        else:
            taken[name] = tool.name
            kept.append(tool)
    return kept, refused


def _fingerprint(tool: types.Tool) -> bytes:
    return msgspec.json.encode(tool.model_dump(mode="json", by_alias=True))


# --- what a call returns -----------------------------------------------------------------------


def output(result: types.CallToolResult) -> ToolOutput:
    """A result as the model reads it: the text of every block (an embedded text resource with
    its URI, a note for a block it cannot read), images as image blocks; ``isError`` is a
    failure of the tool, reported to the model as an error result."""
    texts: list[str] = []
    images: list[dict[str, Any]] = []
    for block in result.content:
        match block:
            case types.TextContent(text=text):
                texts.append(text)
            case types.ImageContent(data=data, mime_type=mime):
                texts.append(_image(data, mime, images, "an image"))
            case types.EmbeddedResource(resource=types.TextResourceContents() as res):
                texts.append(f"[resource {res.uri}]\n{res.text}")
            case types.EmbeddedResource(resource=types.BlobResourceContents() as res):
                texts.append(_image(res.blob, res.mime_type or "", images, f"resource {res.uri}"))
            case types.ResourceLink(uri=uri, name=name):
                texts.append(f"[resource link {name}: {uri}]")
            case types.AudioContent(mime_type=mime, data=data):
                texts.append(f"[audio ({mime}, {_size(data)}) is not passed to the model]")
    if not result.content and result.structured_content is not None:
        texts.append(msgspec.json.encode(result.structured_content).decode())
    return ToolOutput(text="\n".join(texts), blocks=tuple(images), error=bool(result.is_error))


def _image(data: str, mime: str, images: list[dict[str, Any]], what: str) -> str:
    if mime not in IMAGE_TYPES:
        return f"[{what} ({mime or 'binary'}, {_size(data)}) is not passed to the model]"
    images.append({"type": "image", "source": {"type": "base64", "media_type": mime,
                                               "data": data}})  # fmt: skip
    return f"[{what}: {mime}, {_size(data)}, attached]"


def _size(base64: str) -> str:
    size = math.floor(len(base64) * 3 / 4)
    return f"{size} bytes" if size < 10_000 else f"{size // 1024} KiB"


def _forgotten(error: MCPError) -> bool:
    """The SDK's reading of an HTTP 404 on a request of a session it had."""
    return error.code == types.INVALID_REQUEST and "terminated" in error.error.message.lower()


def _describe(error: BaseException) -> str:
    if isinstance(error, BaseExceptionGroup) and error.exceptions:
        return _describe(error.exceptions[0])
    message = str(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


@contextlib.asynccontextmanager
async def _http(url: str, headers: dict[str, str]) -> AsyncIterator[Any]:
    async with (
        create_mcp_http_client(headers=headers) as http,
        streamable_http_client(url, http_client=http) as streams,
    ):
        yield streams

"""Dispach agents as an MCP server: a host (an IDE, a desktop assistant) lists the agents, sends
one a message and reads its reply, reads a turn, and answers the approvals its tools wait on.

The tools go through API v1 with :class:`gateways.client.Client`, never around it, so an MCP
caller is authenticated, scoped, refused and rate-checked exactly as any other client:

- ``dispach mcp`` serves them on stdin/stdout for a node at ``DISPACH_URL``
  (:func:`serve_stdio`);
- ``/v1/mcp`` serves them over streamable HTTP on the node itself (:class:`HttpEndpoint`),
  calling the node back over loopback with the caller's own bearer token.

A tool that fails answers a result with ``isError`` and ``structuredContent.error`` holding the
API's ``code``, ``message`` and ``hint`` (and ``field`` / ``status`` when known), so a model can
read why and correct itself; a protocol error is kept for a malformed MCP request.

The client blocks, so each tool runs it on a worker thread (``anyio.to_thread``, the SDK's own
event loop library) of its own limiter: at most :data:`MAX_CALLS` at once, so that waiting turns
never take the threads the rest of the process shares (Starlette's among them); one more is
refused ``mcp_busy``. A turn's text is handed back to the loop as it streams with
``anyio.from_thread``, and becomes the request's progress notifications. A host that cancels a
``send_message`` it waits on (``notifications/cancelled``, or a closed connection) stops the
turn: nobody reads its reply, and the stopped turn's ``turn.end`` is what frees the thread,
which would otherwise block on the stream for as long as the turn runs.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

import anyio
import mcp_types as types
import msgspec
from mcp.server import Server, ServerRequestContext
from mcp.server.stdio import stdio_server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from starlette.datastructures import Headers
from starlette.types import Message, Receive, Scope, Send

from eventstore.bridge import Event, anyio_blocking, anyio_from_thread
from gateways.client import Client, ClientError
from gateways.http.errors import deny, error_response

__all__ = ["MAX_CALLS", "TOOLS", "Connect", "HttpEndpoint", "serve_stdio", "server"]

Connect = Callable[[], Client]
"""Makes a client of the node's API (one per tool call: a call may block its thread for as long
as a turn runs, and each has its own connections)."""

NAME = "dispach"
MAX_CALLS = 32
"""Tool calls one process runs at once (each holds a thread while its turn runs)."""
STOP_WAIT_S = 10.0
"""How long a cancelled send_message waits for the node to take its turn's stop."""
INSTRUCTIONS = (
    "Dispach runs AI agents. list_agents names them; send_message talks to one and waits for "
    "its reply (pass a progressToken to read the reply as it is written); a tool the agent "
    "must not run without a person waits in list_approvals until answer_approval."
)

_Id = Annotated[str, msgspec.Meta(min_length=1)]


class _Args(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    """A tool's arguments, checked before anything is sent to the node."""


class _ListAgents(_Args, frozen=True):
    pass


class _SendMessage(_Args, frozen=True):
    agent: _Id
    text: str
    session_key: str | None = None
    wait: bool = True


class _GetTurn(_Args, frozen=True):
    agent: _Id
    turn_id: _Id


class _ListApprovals(_Args, frozen=True):
    agent: _Id | None = None


class _AnswerApproval(_Args, frozen=True):
    agent: _Id
    approval_id: _Id
    granted: bool


_AGENT = {"type": "string", "minLength": 1, "description": "The agent's id (see list_agents)."}


def _schema(properties: dict[str, Any], *required: str) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}  # fmt: skip


TOOLS = (
    types.Tool(
        name="list_agents",
        description="The agents you may talk to: id, name, status, model.",
        input_schema=_schema({}),
        annotations=types.ToolAnnotations(read_only_hint=True),
    ),
    types.Tool(
        name="send_message",
        description=(
            "Send a message to an agent and wait for its turn to end; returns the reply's text "
            "with the turnId and the end status (an error result when the turn did not end "
            "`final`). Messages with the same sessionKey share one conversation. With a "
            "progressToken, progress notifications carry the reply as it is written (message: "
            "the next piece; progress: the characters so far). A tool with policy `ask` makes "
            "the turn wait for answer_approval."
        ),
        input_schema=_schema(
            {
                "agent": _AGENT,
                "text": {"type": "string", "description": "The message."},
                "sessionKey": {
                    "type": "string",
                    "description": "The conversation (default: the agent's api:default).",
                },
                "wait": {
                    "type": "boolean",
                    "default": True,
                    "description": "false: answer once the message is accepted (read the turn "
                    "later with get_turn).",
                },
            },
            "agent",
            "text",
        ),
        annotations=types.ToolAnnotations(read_only_hint=False, destructive_hint=False),
    ),
    types.Tool(
        name="get_turn",
        description="A turn: status (`running` until it ends, then its end reason), state, "
        "input, reply text, steps, tokens, error.",
        input_schema=_schema(
            {"agent": _AGENT, "turnId": {"type": "string", "minLength": 1}}, "agent", "turnId"
        ),
        annotations=types.ToolAnnotations(read_only_hint=True),
    ),
    types.Tool(
        name="list_approvals",
        description="Tool calls waiting for a person (their tool's policy is `ask`), with the "
        "arguments each would run with; of one agent, or of every agent you may reach.",
        input_schema=_schema({"agent": _AGENT}),
        annotations=types.ToolAnnotations(read_only_hint=True),
    ),
    types.Tool(
        name="answer_approval",
        description="Answer a waiting call: granted runs it, refused tells the model it was "
        "refused; either way its turn carries on.",
        input_schema=_schema(
            {
                "agent": _AGENT,
                "approvalId": {"type": "string", "minLength": 1},
                "granted": {"type": "boolean"},
            },
            "agent",
            "approvalId",
            "granted",
        ),
        annotations=types.ToolAnnotations(read_only_hint=False, destructive_hint=True),
    ),
)

_TOOL_NAMES = ", ".join(t.name for t in TOOLS)
A = TypeVar("A", bound=_Args)


def server(
    connect: Connect, version: str = "", limiter: anyio.CapacityLimiter | None = None
) -> Server[Any]:
    """The MCP server of :data:`TOOLS` over the API that ``connect`` reaches; its calls share
    ``limiter`` (a new one of :data:`MAX_CALLS` when None)."""
    threads = limiter or anyio.CapacityLimiter(MAX_CALLS)

    async def list_tools(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=list(TOOLS))

    async def call_tool(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        return await call(connect, params.name, params.arguments or {}, _Progress.of(ctx), threads)

    return Server(
        NAME,
        version=version,
        instructions=INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


async def serve_stdio(connect: Connect, version: str = "") -> None:
    """Serve MCP on this process's stdin and stdout until stdin ends. While it serves, the SDK
    points fd 1 at stderr, so nothing but MCP frames reaches stdout."""
    app = server(connect, version)
    async with stdio_server() as (read, write):
        await app.run(read, write, app.create_initialization_options())


@dataclass
class _Progress:
    """Where a tool reports the turn's text as it streams: the request's progress
    notifications, when its caller passed a progressToken."""

    report: Callable[[float, float | None, str | None], Coroutine[Any, Any, None]] | None = None
    written: int = field(default=0)

    @classmethod
    def of(cls, ctx: ServerRequestContext[Any]) -> _Progress:
        meta = ctx.meta or {}
        asked = meta.get("progress_token", meta.get("progressToken")) is not None
        return cls(ctx.session.report_progress if asked else None)

    def text(self, delta: str) -> None:
        """From the worker thread: the next piece of the reply."""
        if self.report is None or not delta:
            return
        self.written += len(delta)
        anyio_from_thread(self.report, float(self.written), None, delta)


@dataclass
class _Waiting:
    """Shared by a call's thread and the loop: whether the host gave up on the call, and the
    turn the thread waits on meanwhile. The thread records the turn before it looks at
    ``stop`` and the loop sets ``stop`` before it looks at the turn, so one of them at least
    sees the other's write and stops the turn (twice is harmless)."""

    stop: Event = field(default_factory=Event)
    turn: tuple[str, str] | None = None


async def call(
    connect: Connect,
    name: str,
    arguments: dict[str, Any],
    progress: _Progress | None = None,
    limiter: anyio.CapacityLimiter | None = None,
) -> types.CallToolResult:
    """Run the tool ``name``: its arguments checked, then the API called on a worker thread of
    ``limiter``, or the ``mcp_busy`` refusal when all of its threads are taken."""
    progress = progress or _Progress()
    limiter = limiter or anyio.CapacityLimiter(MAX_CALLS)
    waiting = _Waiting()
    if limiter.available_tokens < 1:
        return refusal("mcp_busy", f"{limiter.borrowed_tokens} tool calls are running here, "
                       f"the most this server runs at once ({limiter.total_tokens:g})",
                       "retry once one of them ends (a send_message ends with its turn)",
                       status=503)  # fmt: skip

    def run() -> types.CallToolResult:
        try:
            with connect() as client:
                return _run(client, name, arguments, progress, waiting)
        except ClientError as e:
            return refusal(e.code, e.message, e.hint, e.field, e.status)

    try:
        return await anyio_blocking(run, abandon_on_cancel=True, limiter=limiter)
    except anyio.get_cancelled_exc_class():
        # The host gave up: the abandoned thread ends once the stopped turn's end reaches it.
        waiting.stop.set()
        if (turn := waiting.turn) is not None:

            def stop_it() -> None:
                with connect() as client:
                    _stop_turn(client, *turn)

            with anyio.CancelScope(shield=True, deadline=anyio.current_time() + STOP_WAIT_S):
                await anyio_blocking(stop_it, abandon_on_cancel=True)
        raise


def _stop_turn(client: Client, agent: str, turn_id: str) -> None:
    """Stop a turn nobody waits on any more. A refusal is no news: the turn ended meanwhile,
    or the node is unreachable (and the stream the thread reads ends either way)."""
    with contextlib.suppress(ClientError):
        client.stop(agent, turn_id)


def _run(
    client: Client,
    name: str,
    arguments: dict[str, Any],
    progress: _Progress,
    waiting: _Waiting,
) -> types.CallToolResult:
    match name:
        case "list_agents":
            _parse(_ListAgents, arguments)
            return answer({"agents": client.agents()})
        case "send_message":
            return _send_message(client, _parse(_SendMessage, arguments), progress, waiting)
        case "get_turn":
            turn = _parse(_GetTurn, arguments)
            return answer(client.turn(turn.turn_id, turn.agent))
        case "list_approvals":
            which = _parse(_ListApprovals, arguments)
            ids = [which.agent] if which.agent else [a["id"] for a in client.agents()]
            asked = [w for i in ids for w in client.approvals(i, private=True)]
            asked.sort(key=lambda w: str(w.get("requestedAt")))
            return answer({"approvals": asked})
        case "answer_approval":
            decision = _parse(_AnswerApproval, arguments)
            return answer(client.decide(decision.agent, decision.approval_id, decision.granted))
    raise ClientError(None, "unknown_tool", f"there is no tool {name!r}",
                      f"use one of: {_TOOL_NAMES} (tools/list describes them)")  # fmt: skip


def _send_message(
    client: Client, args: _SendMessage, progress: _Progress, waiting: _Waiting
) -> types.CallToolResult:
    accepted = client.send(args.agent, args.text, session_key=args.session_key)
    base = {"turnId": accepted.turn_id, "sessionKey": accepted.session_key}
    if not args.wait:
        return answer({**base, "status": "running"}, f"accepted as turn {accepted.turn_id}")
    waiting.turn = (args.agent, accepted.turn_id)
    if waiting.stop.is_set():  # cancelled while the message was sent: the loop missed the turn
        _stop_turn(client, args.agent, accepted.turn_id)
    end: dict[str, Any] = {}
    status = "running"
    chunks = progress.report is not None
    for frame in client.stream_turn(args.agent, accepted.turn_id, chunks=chunks):
        if waiting.stop.is_set():
            break
        data: dict[str, Any] = frame.data.get("data") or {}
        if frame.event == "model.chunk" and data.get("kind", "text") == "text":
            progress.text(str(data.get("delta", "")))
        elif frame.event == "turn.end":
            end, status = data, str(data.get("reason"))
        elif frame.event == "stream.ended" and not end:
            status = str(frame.data.get("status") or status)
    text = str(end.get("text") or "")
    body = {**base, "status": status, "text": text}
    if status == "final":
        return answer(body, text)
    error = end.get("error") or {}
    code = str(error.get("code") or f"turn_{status}")
    message = str(error.get("message") or f"turn {accepted.turn_id} ended {status}")
    hint = str(error.get("hint") or f"get_turn with turnId {accepted.turn_id} shows the turn")
    return refusal(code, message, hint, body=body)


def _parse(kind: type[A], arguments: dict[str, Any]) -> A:
    """The arguments as ``kind``, or the ``invalid_value`` refusal naming the field."""
    try:
        return msgspec.convert(arguments, kind)
    except msgspec.ValidationError as e:
        found = _FIELD.search(str(e))
        where = (found.group(1) or found.group(2)) if found else None
        raise ClientError(
            None, "invalid_value", f"invalid arguments: {e}",
            "send the arguments the tool's inputSchema describes (tools/list)", where,
        ) from e  # fmt: skip


_FIELD = re.compile(r"`\$\.(\w+)`|field `(\w+)`")


def answer(body: dict[str, Any], text: str | None = None) -> types.CallToolResult:
    """A tool's result: ``body`` as structured content, ``text`` (or ``body`` as JSON) to read."""
    shown = text if text is not None else msgspec.json.encode(body).decode()
    return types.CallToolResult(content=[types.TextContent(text=shown)], structured_content=body)


def refusal(
    code: str,
    message: str,
    hint: str,
    field: str | None = None,
    status: int | None = None,
    *,
    body: dict[str, Any] | None = None,
) -> types.CallToolResult:
    """An error result: the API's error envelope as ``structuredContent.error``."""
    error: dict[str, Any] = {"code": code, "message": message, "hint": hint}
    if field is not None:
        error["field"] = field
    if status is not None:
        error["status"] = status
    return types.CallToolResult(
        content=[types.TextContent(text=f"{code}: {message} (hint: {hint})")],
        structured_content={**(body or {}), "error": error},
        is_error=True,
    )


class HttpEndpoint:
    """``/v1/mcp``: the server over streamable HTTP, behind the node's Host, Origin and token
    checks like any route.

    Stateless: each request gets a server of its own and a session manager whose task group
    this request owns and closes, so nothing outlives it, no lifespan has to run it (the node
    serves with uvicorn's lifespan off), and ``serve --workers`` may answer the requests of one
    MCP client in different processes. The tools call the node back over loopback (the address
    the request came in on) with the caller's own bearer token: the same routes, scope and
    refusals as a direct call, with no second path into the node."""

    def __init__(self, version: str = "", max_body: int = 1_000_000) -> None:
        self.version = version
        self.max_body = max_body
        self._limiter: anyio.CapacityLimiter | None = None
        # The manager logs its start and stop at info level, per request here: not news.
        logging.getLogger("mcp.server.streamable_http_manager").setLevel(logging.WARNING)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            # Stateless, so no session to DELETE and nothing to push on a GET stream: the SDK
            # would hold such a GET open, silent, for as long as the client keeps it.
            refused = error_response(
                405,
                "method_not_allowed",
                f"{scope['method']} is not allowed on {scope['path']}",
                "POST each JSON-RPC message (stateless streamable HTTP: no GET stream, no "
                "session to DELETE)",
                headers={"Allow": "POST"},
            )
            await refused(scope, receive, send)
            return
        body = await _body(receive, self.max_body)
        if body is None:
            await deny(scope, send, 413, "body_too_large",
                       f"the request body is over {self.max_body} bytes",
                       "send a smaller body")  # fmt: skip
            return
        base = _loopback(scope)
        token = _bearer(Headers(scope=scope))
        # Every request's server shares the process's threads for tool calls (MAX_CALLS).
        self._limiter = self._limiter or anyio.CapacityLimiter(MAX_CALLS)
        app = server(lambda: Client(base, token), self.version, self._limiter)
        manager = StreamableHTTPSessionManager(
            app, stateless=True, max_request_body_size=self.max_body
        )
        async with manager.run():
            await manager.handle_request(scope, _replay(body, receive), send)


async def _body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, whatever its transfer encoding, or None once it is over
    ``limit`` (the Guard checks only a declared Content-Length). Of a client that left midway,
    what it sent: the SDK answers that a parse error nobody reads."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return bytes(body)
        body += message.get("body", b"")
        if len(body) > limit:
            return None
        if not message.get("more_body", False):
            return bytes(body)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` with the body already read handed out first (then the disconnect)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


def _loopback(scope: Scope) -> str:
    """The node's own address, as this request reached it."""
    host, port = scope.get("server") or ("127.0.0.1", 7420)
    if host in ("0.0.0.0", ""):  # noqa: S104 - a wildcard bind: its loopback reaches it too
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _bearer(headers: Headers) -> str | None:
    scheme, _, value = headers.get("authorization", "").partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None

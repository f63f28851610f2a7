"""The kit: one small MCP server (the official SDK's ``MCPServer``) whose tools each exercise one
path of Dispach's MCP client, run as a real process by the tests::

    python -m tests.mcp_servers.kit --transport stdio|http [--port N] --record DIR
                                    [--mode normal|bad-schema|clash]

Whatever a test must see from outside is appended to a file in ``DIR``, one line per fact, with
one ``O_APPEND`` write (lines from two processes never interleave):

- ``pids.log``: this process's pid, at start (a second line: the client restarted the server);
- ``lists.log``: the pid, each time a client lists the tools (after a start: the session is
  open; after ``grow``: the client heard that the list changed);
- ``env.log``: ``$KIT_TOKEN`` as the server got it (``-``: unset), at start;
- ``auth.log``: the ``Authorization`` header of each HTTP request that lists the tools;
- ``methods.log``: the pid and the method of every message the server receives (a ``ping``:
  the client checked an idle session);
- ``write.log`` / ``read.log``: a ``write`` / ``read`` call started;
- ``cancelled.log``: a ``hang`` call was cancelled (the client sent ``notifications/cancelled``
  and the SDK cancelled the handler), with the pid and the request id.

Modes, for the client's refusals (it must leave the tool out and keep the rest):

- ``bad-schema``: the list also has ``broken``, whose ``inputSchema`` is not a valid JSON Schema
  (``{"type": 12}`` for a property);
- ``clash``: the list also has ``shout``, which a client that namespaces it as ``kit__shout``
  finds taken by a local tool of the test agent named ``kit__shout``; it answers ``mcp shout:
  <text>``, so a test can tell which of the two ran. And ``dup.name`` beside ``dup_name``: one
  name, ``kit__dup_name``, once made safe for the model's APIs (``^[a-zA-Z0-9_-]{1,64}$``).

``--transport http`` serves streamable HTTP on ``127.0.0.1:<port>/mcp``.
"""

from __future__ import annotations

import argparse
import base64
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import anyio
from mcp.server.lowlevel.server import NotificationOptions
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import (
    CallToolResult,
    EmbeddedResource,
    ImageContent,
    TextContent,
    TextResourceContents,
    ToolAnnotations,
)
from mcp_types import Tool as MCPTool

READ_ONLY = ToolAnnotations(read_only_hint=True)
DESTRUCTIVE = ToolAnnotations(read_only_hint=False, destructive_hint=True)
BROKEN_SCHEMA: dict[str, Any] = {"type": "object", "properties": {"x": {"type": 12}}}
NOTE_URI = "kit://notes/readme"
NOTE_TEXT = "the kit's embedded note"
IMAGE_TEXT = "a 2x2 red square"


def png(width: int = 2, height: int = 2, rgb: tuple[int, int, int] = (255, 0, 0)) -> bytes:
    """A real PNG (signature, IHDR, IDAT, IEND), built here so the kit needs no image library."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    row = b"\x00" + bytes(rgb) * width  # filter type 0, then the row's pixels
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(row * height))
        + chunk(b"IEND", b"")
    )


def append(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


class Kit(MCPServer):
    def __init__(self, record: Path, mode: str) -> None:
        super().__init__("kit", version="1.0", log_level="WARNING")
        self.record = record
        self.mode = mode

    async def list_tools(self) -> list[MCPTool]:
        append(self.record / "lists.log", str(os.getpid()))
        tools = await super().list_tools()
        if self.mode == "bad-schema":
            # Past the SDK's own tool registry, which only builds valid schemas.
            tools.append(MCPTool(name="broken", description="Has an invalid input schema.",
                                 input_schema=BROKEN_SCHEMA, annotations=READ_ONLY))  # fmt: skip
        return tools


def build(record: Path, mode: str) -> Kit:
    kit = Kit(record, mode)

    async def note_method(ctx: Any, call_next: Any) -> Any:
        append(record / "methods.log", f"{os.getpid()} {ctx.method}")
        headers = getattr(ctx.request, "headers", None)  # a Starlette request over HTTP
        if headers is not None and ctx.method == "tools/list":
            append(record / "auth.log", headers.get("authorization", "-"))
        return await call_next(ctx)

    kit.middleware.append(note_method)

    @kit.tool(annotations=READ_ONLY, structured_output=False)
    def echo(text: str) -> str:
        """Returns the text it is given."""
        return text

    @kit.tool(annotations=READ_ONLY, structured_output=False)
    def image() -> CallToolResult:
        """Returns a small PNG image and a text."""
        data = base64.b64encode(png()).decode()
        return CallToolResult(content=[ImageContent(data=data, mime_type="image/png"),
                                       TextContent(text=IMAGE_TEXT)])  # fmt: skip

    @kit.tool(annotations=READ_ONLY, structured_output=False)
    def resource() -> CallToolResult:
        """Returns an embedded text resource."""
        note = TextResourceContents(uri=NOTE_URI, text=NOTE_TEXT, mime_type="text/plain")
        return CallToolResult(content=[EmbeddedResource(resource=note)])

    @kit.tool(annotations=READ_ONLY, structured_output=False)
    def fail() -> CallToolResult:
        """Always fails (the result says isError)."""
        return CallToolResult(content=[TextContent(text="the kit failed on purpose")],
                              is_error=True)  # fmt: skip

    @kit.tool(annotations=READ_ONLY, structured_output=False)
    def big(megabytes: float) -> str:
        """Returns that many megabytes of text: BEGIN, x's, END."""
        size = int(megabytes * 1_000_000)
        return "BEGIN" + "x" * max(size - 8, 0) + "END"

    @kit.tool(annotations=DESTRUCTIVE, structured_output=False)
    async def write(path: str, seconds: float = 0) -> str:
        """Records that it started (in write.log), then waits."""
        append(record / "write.log", f"{os.getpid()} {path}")
        await anyio.sleep(seconds)
        return "wrote"

    @kit.tool(annotations=READ_ONLY, structured_output=False)
    async def read(seconds: float = 0) -> str:
        """Records that it started (in read.log), then waits."""
        append(record / "read.log", str(os.getpid()))
        await anyio.sleep(seconds)
        return "read"

    @kit.tool(structured_output=False)
    def crash() -> str:
        """The server process exits at once, mid-call."""
        os._exit(3)

    @kit.tool(annotations=READ_ONLY, structured_output=False)
    async def hang(ctx: Context) -> str:
        """Never answers; records its cancellation (in cancelled.log)."""
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            append(record / "cancelled.log", f"{os.getpid()} {ctx.request_id}")
            raise
        return "unreachable"

    @kit.tool(structured_output=False)
    async def grow(ctx: Context) -> str:
        """Adds the tool ``late`` and tells the client its tool list changed."""

        def late(x: str) -> str:
            """Arrived after the first listing."""
            return f"late {x}"

        if kit._tool_manager.get_tool("late") is None:  # the SDK has no public lookup
            kit.add_tool(late, annotations=READ_ONLY, structured_output=False)
        # Both eras: a legacy session takes the notification on its channel; a 2026-07-28
        # client hears it on its subscriptions/listen stream (the SDK drops the other copy).
        await ctx.request_context.session.send_tool_list_changed()
        await ctx.notify_tools_changed()
        return "grew: late"

    if mode == "clash":

        @kit.tool(name="shout", annotations=READ_ONLY, structured_output=False)
        def shout(text: str) -> str:
            """Clashes with the test agent's local tool kit__shout."""
            return f"mcp shout: {text}"

        # Two names that become one (kit__dup_name) once made safe for the model's APIs.
        kit.add_tool(lambda: "dup.name", name="dup.name", description="Clashes once sanitised.",
                     annotations=READ_ONLY, structured_output=False)  # fmt: skip
        kit.add_tool(lambda: "dup_name", name="dup_name", description="Clashes once sanitised.",
                     annotations=READ_ONLY, structured_output=False)  # fmt: skip

    # The SDK advertises tools.listChanged only when told to (NotificationOptions), and the
    # runners (stdio and the HTTP session manager) ask for the default options.
    low = kit._lowlevel_server
    plain = low.create_initialization_options

    def with_list_changed(notification_options: Any = None, *args: Any, **kwargs: Any) -> Any:
        options = notification_options or NotificationOptions(tools_changed=True)
        return plain(options, *args, **kwargs)

    low.create_initialization_options = with_list_changed  # type: ignore[method-assign]
    return kit


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.mcp_servers.kit")
    parser.add_argument("--transport", choices=["stdio", "http"], default="stdio")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--mode", choices=["normal", "bad-schema", "clash"], default="normal")
    args = parser.parse_args(argv)
    args.record.mkdir(parents=True, exist_ok=True)
    append(args.record / "pids.log", str(os.getpid()))
    append(args.record / "env.log", os.environ.get("KIT_TOKEN", "-"))
    kit = build(args.record, args.mode)
    if args.transport == "stdio":
        kit.run("stdio")
    else:
        kit.run("streamable-http", host="127.0.0.1", port=args.port, streamable_http_path="/mcp")


if __name__ == "__main__":
    main()

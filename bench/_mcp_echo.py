"""The MCP server bench/tools.py calls: read-only ``echo`` and ``blob`` (megabytes of text), on
the official SDK's ``MCPServer``, over stdio or streamable HTTP on 127.0.0.1.

    python bench/_mcp_echo.py stdio
    python bench/_mcp_echo.py http PORT
"""

from __future__ import annotations

import sys

from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

server = MCPServer("bench-echo")


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def echo(text: str) -> str:
    """Returns the text it is given."""
    return text


@server.tool(annotations=ToolAnnotations(read_only_hint=True), structured_output=False)
def blob(megabytes: int) -> str:
    """Returns that many megabytes of text (as text only: no structured copy beside it)."""
    return "x" * (megabytes * 1_000_000)


if __name__ == "__main__":
    if sys.argv[1] == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]),
                   streamable_http_path="/mcp")  # fmt: skip
    else:
        server.run("stdio")

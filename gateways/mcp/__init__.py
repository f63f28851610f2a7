"""MCP, both ways: tools from MCP servers for the agents (:mod:`gateways.mcp.client`, declared
as :mod:`gateways.mcp.spec`), and the agents offered to MCP hosts (:mod:`gateways.mcp.server`)."""

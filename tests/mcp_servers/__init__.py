"""MCP servers the MCP client tests run as real processes (``python -m tests.mcp_servers.kit``)."""

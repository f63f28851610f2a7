"""Every edge of a node.

- ``http/``: the HTTP server (Starlette on uvicorn's protocol), its guard, errors and OpenAPI.
- ``api/``: the REST resources of API v1 and their bodies.
- ``streams/``: the live streams (SSE, the WebSocket) and their tokens.
- ``mcp/``: MCP both ways: tools from MCP servers (client) and the agents as one (server).
- ``model/``, ``channels/``: the ports' adapters (model providers, chat channels).
- ``ingress.py``: NATS ingress for internal producers; ``client.py``: the Python client.
"""

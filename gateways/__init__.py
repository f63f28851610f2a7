"""Every edge of a node: HTTP, WebSocket and SSE (Starlette), NATS ingress, channels, the model."""

from gateways.http import NodeStatus, create_app

__all__ = ["NodeStatus", "create_app"]

"""Every edge of a node: HTTP, WebSocket and SSE (Starlette), NATS ingress, channels, the model."""

from gateways.api import Runtime
from gateways.http import create_app

__all__ = ["Runtime", "create_app"]

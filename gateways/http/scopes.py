"""What each route asks of its caller's scope: ``read`` < ``chat`` < ``write`` < ``admin``, as
the original Dispach defines its capabilities. ``read`` covers every GET (and the WebSocket's
subscriptions, and stream tokens for reading); ``chat`` sending a message, answering an approval,
stopping a turn (and MCP, whose tools send messages); ``write`` schedules, a session's phase,
clearing and forking a session; ``admin`` keys, webhooks, reloads, activity, and any other
change. A route this table does not name is ``admin`` unless it only reads: a new route is closed
to lesser keys until it is placed here.

Pure: :func:`required` is a function of the method and the path (tests/test_keys.py).
"""

from __future__ import annotations

import re
from typing import Literal

Scope = Literal["read", "chat", "write", "admin"]
SCOPES: tuple[Scope, ...] = ("read", "chat", "write", "admin")
RANK = {scope: rank for rank, scope in enumerate(SCOPES)}

_SEG = r"[^/]+"
_AGENT = rf"/v1/agents/{_SEG}"
_SESSION = rf"{_AGENT}/sessions/{_SEG}"
_ADMIN_READS = re.compile(r"/v1/activity|/v1/keys(/[^/]+)?|/v1/webhooks(/[^/]+(/deliveries)?)?")
"""GETs that are not for every reader: who holds which key, whether the cluster is idle, and
where the webhooks point."""
_CHAT = re.compile(
    rf"{_AGENT}/messages|{_AGENT}/turns/{_SEG}/stop|{_AGENT}/approvals/{_SEG}|/v1/mcp"
)
_WRITE = re.compile(rf"{_AGENT}/schedules(/{_SEG}(/run)?)?|{_SESSION}(/messages|/phase|/fork)?")
_READ_POSTS = re.compile(r"/v1/stream-tokens")
"""A POST that grants only reading (a stream token)."""


def required(method: str, path: str) -> Scope:
    """The least scope that may call ``method path``."""
    if _ADMIN_READS.fullmatch(path):
        return "admin"
    if path == "/v1/mcp":  # MCP's GET opens its event stream; its tools send messages
        return "chat"
    if method in ("GET", "HEAD", "OPTIONS"):
        return "read"
    if _READ_POSTS.fullmatch(path):
        return "read"
    if _CHAT.fullmatch(path):
        return "chat"
    if _WRITE.fullmatch(path):
        return "write"
    return "admin"


def allows(held: Scope, needed: Scope) -> bool:
    return RANK[held] >= RANK[needed]

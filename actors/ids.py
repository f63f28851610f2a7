"""Identifiers: sortable by creation time, safe as NATS subject tokens and stream names."""

from __future__ import annotations

import hashlib
import secrets
import time

_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"


def _base36(n: int) -> str:
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = _ALPHABET[r] + out
        if n == 0:
            return out


def _new(prefix: str) -> str:
    stamp = _base36(time.time_ns() // 1_000_000).rjust(9, "0")
    return f"{prefix}_{stamp}{_base36(secrets.randbelow(36**8)).rjust(8, '0')}"


def turn_id() -> str:
    """``t_<base36 ms><8 random>``, Dispach v1's shape."""
    return _new("t")


def step_id() -> str:
    return _new("s")


def keyed_turn_id(agent_id: str, idempotency_key: str) -> str:
    """The id of the turn an ``Idempotency-Key`` names: ``t_k`` + 16 base36 digits of a SHA-256
    of the agent and the key, so every node derives the same id (see actors/idempotency.py)."""
    digest = hashlib.sha256(f"{agent_id}\0{idempotency_key}".encode()).digest()
    return "t_k" + _base36(int.from_bytes(digest[:10], "big")).rjust(16, "0")[-16:]


def approval_id(turn_id: str, call_id: str) -> str:
    """``ap_`` + 16 base36 digits of a SHA-256 of the turn and the tool call: the same call asks
    under the same id, whichever node (or attempt) asks."""
    digest = hashlib.sha256(f"{turn_id}\0{call_id}".encode()).digest()
    return "ap_" + _base36(int.from_bytes(digest[:10], "big")).rjust(16, "0")[-16:]

"""Identifiers: sortable by creation time, safe as NATS subject tokens and stream names."""

from __future__ import annotations

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

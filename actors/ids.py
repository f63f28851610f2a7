"""Identifiers: sortable by creation time, safe as NATS subject tokens and stream names."""

from __future__ import annotations

import hashlib
import os
import time

from eventstore.bridge import Lock

_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"


def _base36(n: int) -> str:
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = _ALPHABET[r] + out
        if n == 0:
            return out


class _Entropy:
    """Random bytes from the OS, read 4 KB at a time: the ids stay unguessable, but a turn no
    longer makes a system call per id (``secrets.randbelow`` reads the entropy pool on every
    call, more than once when it rejects a draw; with the GIL hand-offs of the syscall that
    was 0.3 ms of a turn's event-loop time under load, five calls per turn)."""

    def __init__(self) -> None:
        self._lock = Lock()
        self._pool = b""
        self._at = 0
        os.register_at_fork(after_in_child=self.forget)

    def forget(self) -> None:
        """A forked child must not hand out its parent's bytes again."""
        self._pool, self._at = b"", 0

    def below(self, bound: int) -> int:
        """A uniform integer in ``[0, bound)``, for ``bound`` far below 2**64 (the bias of the
        modulo is then under ``bound / 2**64``)."""
        with self._lock:
            if self._at + 8 > len(self._pool):
                self._pool, self._at = os.urandom(4096), 0
            chunk = self._pool[self._at : self._at + 8]
            self._at += 8
        return int.from_bytes(chunk, "big") % bound


_ENTROPY = _Entropy()


def _new(prefix: str) -> str:
    stamp = _base36(time.time_ns() // 1_000_000).rjust(9, "0")
    return f"{prefix}_{stamp}{_base36(_ENTROPY.below(36**8)).rjust(8, '0')}"


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

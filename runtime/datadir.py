"""The node's data directory: its exclusive lock and the record of the services it runs."""

from __future__ import annotations

import fcntl
import json
import os
import secrets
from pathlib import Path
from typing import IO, Any

from runtime.errors import ConfigError, DataDirInUse


class DataDir:
    """The node's data directory and its exclusive lock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock: IO[str] | None = None

    @property
    def state_file(self) -> Path:
        return self.path / "services.json"

    def lock(self) -> None:
        """Take the directory for this process (idempotent); raise DataDirInUse if held."""
        if self._lock is not None:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        handle = (self.path / "dispach.lock").open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise DataDirInUse(
                f"the data directory {self.path} is in use by {holder}",
                "stop that node first, or give this one its own DISPACH_HOME; CLI commands "
                "reach a running node's services by themselves",
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"dispach pid {os.getpid()}\n")
        handle.flush()
        self._lock = handle

    def unlock(self) -> None:
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None

    def read_state(self) -> dict[str, Any]:
        try:
            state: dict[str, Any] = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}
        return state

    def write_state(self, **state: Any) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.state_file)

    def secret(self) -> bytes:
        """The node secret kept here (``secret``, owner-only), made on first use: it signs
        stream tokens, so they survive a restart. Written to a temporary file and linked into
        place, so two processes starting at once agree on one secret."""
        path = self.path / "secret"
        if path.exists():
            return _read_secret(path)
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / f".secret.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32) + "\n")
        try:
            os.link(tmp, path)  # fails if another process linked its secret first
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        return _read_secret(path)

    def is_locked(self) -> bool:
        """Whether a live process holds the lock (a running node)."""
        path = self.path / "dispach.lock"
        if not path.exists():
            return False
        with path.open("a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(handle, fcntl.LOCK_UN)
            return False


def _read_secret(path: Path) -> bytes:
    try:
        secret = bytes.fromhex(path.read_text().strip())
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise ConfigError(
            f"{path} does not hold a node secret (64 hex digits)",
            "delete the file to make a new one (stream tokens issued before stop working), or "
            "set DISPACH_SECRET",
            "DISPACH_SECRET",
        )
    return secret

"""The node's data directory: its exclusive lock and the record of the services it runs."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import IO, Any

from runtime.errors import DataDirInUse


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

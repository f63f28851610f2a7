"""Child processes of a node: started to die with it, stopped with a signal and a deadline."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from runtime.errors import EmbeddedServiceFailed

log = structlog.get_logger("dispach.embedded")

_PR_SET_PDEATHSIG = 1


class Child:
    """A service process we started, stopped with a chosen signal and a deadline."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], stop_signal: int) -> None:
        self.name = name
        self.proc = proc
        self.stop_signal = stop_signal

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(self.stop_signal)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("service_kill", service=self.name, after_s=timeout)
            self.proc.kill()
            self.proc.wait(5)


def spawn(
    argv: list[str], logfile: Path, user: str | None, death_signal: int
) -> subprocess.Popen[bytes]:
    libc = ctypes.CDLL(None, use_errno=True)

    def die_with_parent() -> None:
        # Runs in the child after setuid (which would clear the setting), before exec.
        libc.prctl(_PR_SET_PDEATHSIG, death_signal)

    with logfile.open("ab") as out:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            user=user,
            start_new_session=True,
            preexec_fn=die_with_parent,  # noqa: PLW1509 - prctl must run in the child itself
        )


def wait_until(ready: Callable[[], bool], child: Child, logfile: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if child.proc.poll() is not None:
            raise EmbeddedServiceFailed(
                f"{child.name} exited with code {child.proc.returncode}: {tail(logfile)}",
                f"see {logfile}",
            )
        if time.monotonic() > deadline:
            child.stop(5)
            raise EmbeddedServiceFailed(
                f"{child.name} did not accept connections within {timeout:g} s", f"see {logfile}"
            )
        time.sleep(0.05)


def free_port(preferred: int | None) -> int:
    for port in (preferred, 0) if preferred else (0,):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port or 0))
            except OSError:
                continue
            chosen: int = sock.getsockname()[1]
            return chosen
    raise EmbeddedServiceFailed("no free loopback port", "free a port on 127.0.0.1")


def stop_orphan(pidfile: Path, name: str) -> None:
    """A Postgres left running on our data directory (its parent died) is shut down first."""
    try:
        pid = int(pidfile.read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return
    stop_pid(pid, name, signal.SIGINT)


def stop_pid(pid: int, name: str, sig: int, timeout: float = 30.0) -> None:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if name.encode() not in cmdline:
        return
    log.warning("orphan_stopping", service=name, pid=pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        if _is_zombie(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True


def tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"

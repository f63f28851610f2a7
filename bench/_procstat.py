"""CPU, memory and threads from /proc: of a process, of one of its threads, of a process and its
children, and of the whole machine; and the threads this process starts, counted by family.

Linux only (the benchmarks' machine): each reader opens /proc/<pid>/stat or status afresh."""

from __future__ import annotations

import contextlib
import math
import os
import re
import threading
from collections import Counter
from pathlib import Path

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(path: str | Path) -> list[str]:
    """The fields of a /proc stat file after the command name (which may hold spaces and
    parentheses): [0] is the state, [1] the parent's pid, [11:15] utime, stime, cutime, cstime."""
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (kB) and Threads of a live process."""
    found: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for row in f:
            if row.startswith(("VmRSS:", "VmHWM:", "Threads:")):
                name, value = row.split(":", 1)
                found[name] = int(value.split()[0])
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a live process so far."""
    fields = _stat(f"/proc/{pid}/stat")
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def proc_cpu(pid: int, tid: int | None = None, *, children: bool = False) -> float | None:
    """CPU seconds (user + system) of a process or of one of its threads, from /proc (None when
    it is gone); ``children`` adds those of its reaped children."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        fields = _stat(path)
    except OSError:
        return None
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    if children:
        ticks += int(fields[13]) + int(fields[14])  # cutime, cstime (reaped children)
    return ticks / _CLK_TCK


def thread_cpu(pid: int) -> tuple[float, float]:
    """(main thread, all other threads) CPU seconds: the main thread runs the event loop."""
    main = other = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            fields = _stat(task / "stat")
            used = (int(fields[11]) + int(fields[12])) / _CLK_TCK
            if int(task.name) == pid:
                main += used
            else:
                other += used
    return main, other


def tree_cpu(pid: int) -> float:
    """CPU of a process and its children, live (read from /proc) and reaped (its cutime and
    cstime): a postmaster and its backends, say."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = _stat(entry / "stat")
            if int(entry.name) == pid:
                total += sum(int(v) for v in fields[11:15]) / _CLK_TCK
            elif int(fields[1]) == pid:
                total += (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return total


def proc_ppid(pid: int) -> int | None:
    """The parent of a live process (None when it is gone)."""
    try:
        return int(_stat(f"/proc/{pid}/stat")[1])
    except (OSError, ValueError, IndexError):
        return None


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (a supervisor's workers, in sessions of their own)."""
    return [
        int(entry.name) for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and proc_ppid(int(entry.name)) == pid
    ]  # fmt: skip


def machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine since boot, from /proc/stat: the busy share
    over a window says whether the cores were saturated (by us or by other work)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # guest time is already counted in user
    return total - idle, total


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The machine's busy fraction between two ``machine_ticks`` readings (1.0: every core)."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total else math.nan


# --- threads started, by family ------------------------------------------------------------------

thread_starts: Counter[str] = Counter()
"""Threads started since ``count_thread_starts``, by family."""
_THREAD_KIND = re.compile(r"[-_]?\d+(?: \(.*\))?$")


def thread_kind(name: str) -> str:
    """A thread's family: ``TurnActor-17`` -> ``TurnActor``, ``asyncio_3`` -> ``asyncio``."""
    return _THREAD_KIND.sub("", name) or name


def count_thread_starts() -> None:
    """Count every thread started from now on, by family (a wrapper around Thread.start)."""
    original = threading.Thread.start

    def start(self: threading.Thread) -> None:
        thread_starts[thread_kind(self.name)] += 1
        original(self)

    threading.Thread.start = start  # type: ignore[method-assign]

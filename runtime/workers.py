"""``dispach serve --workers N``: N node processes behind one port, sharing one Postgres and one
NATS, so one machine's cores all serve.

The parent is a supervisor, not a node: it takes the data directory, binds the port, starts the
embedded services when no DATABASE_URL / NATS_URL is given, then runs N children
(``python -m runtime serve``) that see external URLs, so none of them locks the data directory or
starts a service. Each child is a full node with its own id (``<parent id>-w<i>``).

The listening socket is bound once, here, and inherited by every child (``pass_fds``, its number
in ``DISPACH_LISTEN_FD``) rather than bound by each child with SO_REUSEPORT: a port conflict then
fails before anything starts; connections waiting in the one accept queue survive a worker's
``kill -9`` (with SO_REUSEPORT the queue of the dead worker's socket is reset); and no other
process can join the port. uvicorn serves pre-bound sockets (``Server.serve(sockets=...)``).

Children run in their own session, so a Ctrl-C at the terminal reaches only the parent, which
forwards one SIGTERM to each: they drain as one node does. They get PR_SET_PDEATHSIG (SIGTERM), so
a parent killed outright does not leave them running.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, MutableMapping
from types import FrameType

import structlog

from runtime.config import Settings
from runtime.embedded import EmbeddedServices
from runtime.errors import ConfigError, RuntimeFailure
from runtime.logs import redact_url

log = structlog.get_logger("dispach.workers")

LISTEN_FD = "DISPACH_LISTEN_FD"
"""The inherited listening socket's file descriptor, set by the parent for its children only."""

BACKLOG = 2048  # uvicorn's default
STABLE_SECONDS = 30.0
"""A worker that ran at least this long before it exited was not crash-looping."""
MAX_CRASHES = 5
"""Consecutive short runs of one worker after which the parent gives up and stops them all."""
FIRST_DELAY, MAX_DELAY = 0.5, 30.0

_PR_SET_PDEATHSIG = 1


class ListenFailed(RuntimeFailure):
    code = "listen_failed"


# --- decisions (pure) --------------------------------------------------------------------------


def node_id(parent: str, slot: int) -> str:
    """A worker's node id, the same for every run of its slot: the parent restarts a worker only
    after it reaped the old process, so two live processes never share an id, and the new one
    adopts the old one's leases at once instead of waiting a lease TTL for them to expire
    (docs/architecture.md, "Ownership")."""
    return f"{parent}-w{slot}"


def crashes_after(previous: int, ran_seconds: float) -> int:
    """Consecutive short runs of a worker slot, counting the exit that just happened."""
    return previous + 1 if ran_seconds < STABLE_SECONDS else 1


def restart_delay(crashes: int) -> float:
    """Seconds before a worker is started again: 0.5 s, doubling per consecutive crash, 30 s at
    most, so a worker that dies at once does not spin."""
    return float(min(MAX_DELAY, FIRST_DELAY * 2 ** max(0, crashes - 1)))


def exit_status(last: Iterable[int | None], gave_up: bool) -> int:
    """0 when every worker's last run ended cleanly, else 1. Clean: 0, never started (None), or
    killed by the drain's SIGTERM itself, which only happens to a worker that had not yet
    installed its handler, so had started nothing (a node catches SIGTERM and drains)."""
    clean = (0, None, -signal.SIGTERM)
    return 1 if gave_up or any(status not in clean for status in last) else 0


def worker_env(
    base: Mapping[str, str],
    settings: Settings,
    *,
    database_url: str,
    nats_url: str,
    node: str,
    fd: int,
) -> dict[str, str]:
    """A child's environment: the parent's, with the shared services as external URLs (so the
    child neither locks the data directory nor starts a service) and the flags the parent was
    given on its command line (they override the environment there, so they must here too)."""
    env = {k: v for k, v in base.items() if k != LISTEN_FD}
    env |= {
        "DATABASE_URL": database_url,
        "NATS_URL": nats_url,
        "DISPACH_NODE_ID": node,
        "DISPACH_WORKERS": "1",
        "DISPACH_HOST": settings.host,
        "DISPACH_PORT": str(settings.port),
        "DISPACH_HOME": str(settings.home),
        LISTEN_FD: str(fd),
    }
    if settings.agents_dir is not None:
        env["DISPACH_AGENTS"] = str(settings.agents_dir)
    return env


# --- sockets -----------------------------------------------------------------------------------


def listen(host: str, port: int) -> socket.socket:
    """Bind and listen on ``host:port`` the way uvicorn would (SO_REUSEADDR, first address)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise ListenFailed(
            f"cannot resolve the bind address {host!r}: {e.strerror}",
            "set DISPACH_HOST (or --host) to an address of this machine, e.g. 127.0.0.1",
            "DISPACH_HOST",
        ) from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        raise ListenFailed(
            f"cannot listen on {host}:{port}: {e.strerror}",
            "stop whatever holds the port, or choose another with DISPACH_PORT (or --port)",
            "DISPACH_PORT",
        ) from None
    return sock


def inherited_socket(env: MutableMapping[str, str] = os.environ) -> socket.socket | None:
    """The listening socket a parent passed to this worker, or None (a node of its own). The
    variable is removed, so nothing this process starts inherits the claim."""
    raw = env.pop(LISTEN_FD, None)
    if not raw:
        return None
    try:
        sock = socket.socket(fileno=int(raw))
    except (ValueError, OSError):
        raise ConfigError(
            f"{LISTEN_FD}={raw!r} is not an open socket",
            f"{LISTEN_FD} is set by `dispach serve --workers` for its workers; unset it",
            LISTEN_FD,
        ) from None
    sock.set_inheritable(False)
    return sock


# --- the supervisor ----------------------------------------------------------------------------


class _Worker:
    """One worker slot: the process running in it now (if any) and its history."""

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.restarts = 0
        self.crashes = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.node = ""
        self.started = 0.0
        self.due: float | None = 0.0  # when to start it next; None: not to be started
        self.last: int | None = None


def supervise(settings: Settings) -> int:
    """Run ``settings.workers`` nodes on one port until SIGTERM or SIGINT; the exit status."""
    services = EmbeddedServices(settings.home, settings.database_url, settings.nats_url)
    if services.needed:
        services.datadir.lock()  # refuse a data directory another node holds before binding
    try:
        sock = listen(settings.host, settings.port)
    except ListenFailed:
        services.datadir.unlock()
        raise
    with _Signals() as signals:
        try:
            if services.needed:
                services.start()  # a signal meanwhile is kept and acted on once it returns
            if settings.secret is None:
                services.datadir.secret()  # made once here, read by every worker
            assert services.database_url is not None and services.nats_url is not None
            log.info(
                "workers_starting",
                node=settings.node_id,
                workers=settings.workers,
                url=f"http://{settings.host}:{settings.port}",
                postgres=redact_url(services.database_url),
                nats=redact_url(services.nats_url),
            )
            return _Supervisor(
                settings, sock, signals, services.database_url, services.nats_url
            ).run()
        finally:
            sock.close()
            services.stop()  # only now: every worker has exited


class _Supervisor:
    def __init__(
        self,
        settings: Settings,
        sock: socket.socket,
        signals: _Signals,
        database_url: str,
        nats_url: str,
    ) -> None:
        self.settings = settings
        self.sock = sock
        self.signals = signals
        self.database_url = database_url
        self.nats_url = nats_url
        self.workers = [_Worker(slot) for slot in range(1, settings.workers + 1)]
        self.stops = 0  # SIGTERM / SIGINT received
        self.gave_up = False

    def run(self) -> int:
        while True:
            for sig in self.signals.take(self._timeout()):
                if sig in (signal.SIGTERM, signal.SIGINT):
                    self._on_stop(signal.Signals(sig))
            now = time.monotonic()
            for worker in self.workers:
                if worker.proc is not None and (status := worker.proc.poll()) is not None:
                    self._on_exit(worker, status, now)
            if self.stops and all(w.proc is None for w in self.workers):
                break
            for worker in self.workers:
                if not self.stops and worker.due is not None and worker.due <= now:
                    self._start(worker)
        status = exit_status((w.last for w in self.workers), self.gave_up)
        log.info("workers_stopped", node=self.settings.node_id, status=status)
        return status

    def _timeout(self) -> float | None:
        """Until the next worker is due to start; None: until a signal or a child's exit."""
        if self.stops:
            return None
        due = [w.due for w in self.workers if w.proc is None and w.due is not None]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _start(self, worker: _Worker) -> None:
        worker.node = node_id(self.settings.node_id, worker.slot)
        fd = self.sock.fileno()
        env = worker_env(
            os.environ, self.settings, database_url=self.database_url,
            nats_url=self.nats_url, node=worker.node, fd=fd,
        )  # fmt: skip
        parent = os.getpid()
        libc = ctypes.CDLL(None, use_errno=True)

        def die_with_parent() -> None:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the parent died before the line above ran
                os._exit(1)

        worker.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime", "serve"],
            env=env,
            stdin=subprocess.DEVNULL,
            pass_fds=(fd,),
            start_new_session=True,  # a terminal's Ctrl-C reaches the parent only
            preexec_fn=die_with_parent,  # noqa: PLW1509 - prctl must run in the child itself
        )
        worker.started = time.monotonic()
        worker.due = None
        event = "worker_started" if worker.restarts == 0 else "worker_restarted"
        log.info(event, worker=worker.slot, pid=worker.proc.pid, node=worker.node,
                 restarts=worker.restarts)  # fmt: skip

    def _on_exit(self, worker: _Worker, status: int, now: float) -> None:
        assert worker.proc is not None
        ran = now - worker.started
        fields: dict[str, object] = {
            "worker": worker.slot, "pid": worker.proc.pid, "node": worker.node,
            "status": status, "ran_s": round(ran, 3),
        }  # fmt: skip
        if status < 0:
            fields["signal"] = signal.Signals(-status).name
        worker.proc = None
        worker.last = status
        if self.stops:
            log.info("worker_exited", **fields)
            return
        worker.crashes = crashes_after(worker.crashes, ran)
        if worker.crashes > MAX_CRASHES:
            log.error("worker_exited", **fields, action="give_up", crashes=worker.crashes)
            log.error(
                "workers_crash_loop",
                code="worker_crash_loop",
                error=f"worker {worker.slot} exited {worker.crashes} times in a row, each "
                f"within {STABLE_SECONDS:g} s of its start",
                hint="see the worker's node_start_failed line above; stopping every worker",
            )
            self.gave_up = True
            self._drain()
            return
        delay = restart_delay(worker.crashes)
        worker.restarts += 1
        worker.due = now + delay
        log.warning("worker_exited", **fields, action="restart", restart_in_s=delay)

    def _on_stop(self, sig: signal.Signals) -> None:
        self.stops += 1
        if self.stops == 1:
            log.info("signal", signal=sig.name, action="drain", node=self.settings.node_id)
            self._drain()
        elif self.stops == 2:
            # A node's second signal stops it waiting for open connections (runtime/node.py).
            log.info("signal", signal=sig.name, action="force", node=self.settings.node_id)
            self._signal_all(signal.SIGTERM)
        else:
            log.warning("signal", signal=sig.name, action="kill", node=self.settings.node_id)
            self._signal_all(signal.SIGKILL)

    def _drain(self) -> None:
        """Stop starting workers, close the parent's copy of the port (once the workers close
        theirs, new connections are refused instead of queued for no one), SIGTERM each."""
        self.stops = max(self.stops, 1)
        for worker in self.workers:
            worker.due = None
        self.sock.close()
        self._signal_all(signal.SIGTERM)

    def _signal_all(self, sig: signal.Signals) -> None:
        for worker in self.workers:
            if worker.proc is not None and worker.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.send_signal(sig)


class _Signals:
    """SIGTERM, SIGINT and SIGCHLD as bytes on a pipe (``signal.set_wakeup_fd``), so the
    supervisor's one loop waits on them and on its restart timers with one ``select``, and no
    handler runs logic between two bytecodes of whatever the loop was doing."""

    _HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)

    def __enter__(self) -> _Signals:
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._previous = {sig: signal.signal(sig, _noted) for sig in self._HANDLED}
        self._wakeup = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        return self

    def __exit__(self, *_: object) -> None:
        signal.set_wakeup_fd(self._wakeup)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        os.close(self._read)
        os.close(self._write)

    def take(self, timeout: float | None) -> list[int]:
        """The signals received, waiting up to ``timeout`` (None: until one) for the first."""
        select.select([self._read], [], [], timeout)
        received: list[int] = []
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self._read, 256):
                received.extend(chunk)
        return received


def _noted(signum: int, frame: FrameType | None) -> None:
    """The handler of the three signals: the wakeup byte is the whole effect."""

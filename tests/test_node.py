"""``dispach serve`` as a user runs it: a real process on its own data directory."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from eventstore import NO_STREAM, EventStore, Metadata, NewEvent
from eventstore.catalogue import TurnStart
from tests.storeops import append

DISPACH = str(Path(sys.executable).parent / "dispach")
pytestmark = pytest.mark.slow


_PORT_BASE = 16000
_PORTS_PER_PROCESS = 500
_next_port = itertools.count(random.randrange(_PORTS_PER_PROCESS))


def free_port() -> int:
    """A free loopback port for a server a test starts on it in a moment (or starts again on it,
    after killing it). Taken from a block of this pytest process's own (``gw0``: the second,
    ``gw1``: the third; xdist's PYTEST_XDIST_WORKER), below the kernel's ephemeral range
    (32768-60999): a port the kernel picked would be free for anyone between this check and the
    server's bind, and another worker's pick or any outgoing connection could take it then."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) + 1 if worker.startswith("gw") else 0
    base = _PORT_BASE + index * _PORTS_PER_PROCESS
    for _ in range(_PORTS_PER_PROCESS):
        port = base + next(_next_port) % _PORTS_PER_PROCESS
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise AssertionError(f"no free loopback port in {base}-{base + _PORTS_PER_PROCESS - 1}")


class Serve:
    def __init__(self, home: Path, **env: str) -> None:
        self.home = home
        self.port = free_port()
        self.log = home.parent / f"serve-{self.port}.log"
        full_env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "NATS_URL")}
        full_env |= {
            "DISPACH_HOME": str(home),
            "DISPACH_PORT": str(self.port),
            "DISPACH_LOG_FORMAT": "json",
        } | env
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [DISPACH, "serve"], env=full_env, stdout=out, stderr=subprocess.STDOUT
            )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 60) -> list[int]:
        """Poll /v1/ready until 200; returns every status seen on the way."""
        statuses: list[int] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                response = httpx.get(f"{self.url}/v1/ready", timeout=2)
            except httpx.TransportError:
                time.sleep(0.02)
                continue
            statuses.append(response.status_code)
            if response.status_code == 200:
                return statuses
            assert response.json()["error"]["code"] == "not_ready"
            time.sleep(0.02)
        raise AssertionError(f"not ready in {timeout} s: {self.output()}")

    def state(self) -> dict[str, object]:
        state: dict[str, object] = json.loads((self.home / "services.json").read_text())
        return state

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def nodes() -> Iterator[list[Serve]]:
    started: list[Serve] = []
    yield started
    for node in started:
        if node.proc.poll() is None:
            node.proc.kill()
            node.proc.wait(30)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.split(") ", 1)[1][0] != "Z"


def test_serve_starts_its_own_postgres_and_nats_and_drains_on_sigterm(
    home: Path, nodes: list[Serve]
) -> None:
    node = Serve(home)
    nodes.append(node)
    statuses = node.wait_ready()
    assert 503 in statuses, "readiness should answer 503 while the services start"
    health = httpx.get(f"{node.url}/v1/health").json()
    assert health["status"] == "ok"
    state = node.state()
    assert str(state["database_url"]).startswith("postgresql://postgres@127.0.0.1:")
    assert str(state["nats_url"]).startswith("nats://127.0.0.1:")
    postgres_pid = int((home / "postgres" / "postmaster.pid").read_text().split()[0])
    assert node.stop() == 0, node.output()
    assert "node_stopped" in node.output()
    assert not alive(postgres_pid)
    assert not alive(int(str(state["nats_pid"])))


def test_a_second_serve_on_the_same_data_directory_refuses(home: Path, nodes: list[Serve]) -> None:
    first = Serve(home)
    nodes.append(first)
    first.wait_ready()
    second = Serve(home)
    nodes.append(second)
    assert second.proc.wait(30) == 1
    assert "data_dir_in_use" in second.output()
    assert httpx.get(f"{first.url}/v1/ready").status_code == 200  # the first is unharmed


def test_kill_9_then_restart_on_the_same_data_directory_keeps_every_event(
    home: Path, nodes: list[Serve]
) -> None:
    node = Serve(home)
    nodes.append(node)
    node.wait_ready()
    database_url = str(node.state()["database_url"])
    store = EventStore(database_url)
    store.open()
    meta = Metadata(agent_id="a", session_key="api:default", turn_id="t_k")
    written = append(
        store,
        "turn-t_k",
        [NewEvent(event=TurnStart(source="api", input="before the crash"), metadata=meta)],
    )
    store.close()
    postgres_pid = int((home / "postgres" / "postmaster.pid").read_text().split()[0])

    node.proc.kill()
    node.proc.wait(10)
    restarted = Serve(home)
    nodes.append(restarted)
    restarted.wait_ready()
    assert not alive(postgres_pid), "the old Postgres must not survive its node"
    store = EventStore(str(restarted.state()["database_url"]))
    store.open()
    try:
        [event] = store.read_stream("turn-t_k")
        assert event.event_id == written.events[0].event_id
        assert append(store, "turn-t_k", [NewEvent(event=TurnStart(source="api"))], 0).version == 1
        with pytest.raises(Exception, match="wrong_expected_version"):
            append(store, "turn-t_k", [NewEvent(event=TurnStart(source="api"))], NO_STREAM)
    finally:
        store.close()
    assert restarted.stop() == 0


def test_a_non_loopback_bind_without_a_token_refuses_to_start(
    home: Path, nodes: list[Serve]
) -> None:
    node = Serve(home, DISPACH_HOST="0.0.0.0")
    nodes.append(node)
    assert node.proc.wait(30) != 0
    assert "invalid_config" in node.output() and "DISPACH_API_TOKEN" in node.output()
    assert not (home / "postgres").exists()  # refused before starting anything

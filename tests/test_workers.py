"""``dispach serve --workers N``: N real node processes behind one port, supervised by a parent
that owns the port and the embedded services; and the decisions it makes, table by table."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from runtime import workers
from runtime.cli import main, serve_settings
from runtime.config import from_env
from runtime.errors import ConfigError
from tests.cluster import children_of
from tests.conftest import ROOT, Servers
from tests.test_node import alive, free_port

DISPACH = str(Path(sys.executable).parent / "dispach")
slow = pytest.mark.slow


class Supervisor:
    """A ``dispach serve --workers N`` process, its JSON log, and its children in /proc."""

    def __init__(self, env: dict[str, str], count: int, log: Path, group: bool = False) -> None:
        """``group``: in a process group of its own, as a shell runs a job at a terminal."""
        self.log = log
        self.port = int(env["DISPACH_PORT"])
        self.url = f"http://127.0.0.1:{self.port}"
        with log.open("ab") as out:  # append: the children write to the same file
            self.proc = subprocess.Popen(
                [DISPACH, "serve", "--workers", str(count)],
                env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0 if group else None,
            )  # fmt: skip

    def lines(self, event: str) -> list[dict[str, Any]]:
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("event") == event:
                found.append(record)
        return found

    def wait(self, what: str, check: Callable[[], bool], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if self.proc.poll() is not None:
                raise AssertionError(f"the parent exited ({self.proc.returncode}) before {what}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {self.output()}")
            time.sleep(0.05)

    def wait_lines(self, event: str, count: int, timeout: float = 60) -> list[dict[str, Any]]:
        self.wait(f"{count} {event}", lambda: len(self.lines(event)) >= count, timeout)
        return self.lines(event)

    def children(self) -> set[int]:
        return children_of(self.proc.pid)

    def health_node(self) -> str:
        """Which worker answered GET /v1/health, on a new connection (so any may accept it)."""
        response = httpx.get(f"{self.url}/v1/health", timeout=10)
        assert response.status_code == 200, response.text
        node: str = response.json()["nodeId"]
        return node

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@pytest.fixture
def supervisors() -> Iterator[list[Supervisor]]:
    started: list[Supervisor] = []
    yield started
    for supervisor in started:
        if supervisor.proc.poll() is None:
            supervisor.proc.kill()  # its workers get SIGTERM from PR_SET_PDEATHSIG
            supervisor.proc.wait(30)
        # A worker whose drain hangs would outlive the test: the pids are in the log.
        for line in supervisor.lines("worker_started") + supervisor.lines("worker_restarted"):
            if alive(line["pid"]):
                os.kill(line["pid"], signal.SIGKILL)


def base_env(tmp_path: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ANTHROPIC_", "DISPACH_")) and k not in ("DATABASE_URL", "NATS_URL")
    }
    return env | {
        "DISPACH_HOME": str(tmp_path / "home"),
        "DISPACH_PORT": str(free_port()),
        "DISPACH_LOG_FORMAT": "json",
        "DISPACH_DRAIN_SECONDS": "5",
        "PYTHONPATH": str(ROOT),
    }


def external(servers: Servers, schema: str, tmp_path: Path) -> dict[str, str]:
    return base_env(tmp_path) | {
        "DATABASE_URL": servers.database_url,
        "NATS_URL": servers.nats_url,
        "DISPACH_DB_SCHEMA": schema,
        "DISPACH_CLUSTER": schema,
        "DISPACH_NODE_ID": "box",
    }


@slow
def test_two_workers_share_the_port_a_killed_one_is_restarted_and_sigterm_drains_them(
    servers: Servers, schema: str, tmp_path: Path, supervisors: list[Supervisor]
) -> None:
    parent = Supervisor(external(servers, schema, tmp_path), 2, tmp_path / "serve.log")
    supervisors.append(parent)
    started = parent.wait_lines("worker_started", 2)
    pids = {line["node"]: line["pid"] for line in started}
    assert set(pids) == {"box-w1", "box-w2"}
    assert parent.children() == set(pids.values())
    ready = parent.wait_lines("node_ready", 2)
    assert {line["node"] for line in ready} == {"box-w1", "box-w2"}

    seen: set[str] = set()

    def both_answered() -> bool:
        seen.add(parent.health_node())
        return len(seen) == 2

    parent.wait("both workers to answer on the one port", both_answered)
    assert seen == {"box-w1", "box-w2"}

    os.kill(pids["box-w1"], signal.SIGKILL)
    [exited] = parent.wait_lines("worker_exited", 1)
    reaped = time.monotonic()  # the parent has reaped it: whatever answers as box-w1 is new
    assert exited["node"] == "box-w1" and exited["signal"] == "SIGKILL"
    assert exited["status"] == -signal.SIGKILL and exited["action"] == "restart"
    # The other worker holds the port alone until the new one is up: nothing is refused.
    assert {parent.health_node() for _ in range(20)} <= {"box-w1", "box-w2"}
    [restarted] = parent.wait_lines("worker_restarted", 1)
    assert restarted["node"] == "box-w1" and restarted["worker"] == 1
    assert restarted["restarts"] == 1 and restarted["pid"] != pids["box-w1"]
    assert parent.children() == {pids["box-w2"], restarted["pid"]}
    parent.wait_lines("node_ready", 3)

    def the_new_one_answers() -> bool:
        health = httpx.get(f"{parent.url}/v1/health", timeout=10).json()
        # Up for less time than has passed since the old one died: a new process.
        return bool(
            health["nodeId"] == "box-w1" and health["uptimeMs"] < (time.monotonic() - reaped) * 1000
        )

    parent.wait("the restarted worker to answer", the_new_one_answers)

    parent.proc.send_signal(signal.SIGTERM)
    assert parent.proc.wait(60) == 0, parent.output()
    for pid in (pids["box-w2"], restarted["pid"]):
        assert not alive(pid), f"worker {pid} outlived its parent"
    stopped = sorted(line["node"] for line in parent.lines("node_stopped"))
    assert stopped == ["box-w1", "box-w2"]  # the killed one never got to log it
    [done] = parent.lines("workers_stopped")
    assert done["status"] == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{parent.url}/v1/health", timeout=2)  # the port is closed, not left queuing


@slow
def test_ctrl_c_at_a_terminal_reaches_the_parent_only_which_drains_each_worker_once(
    servers: Servers, schema: str, tmp_path: Path, supervisors: list[Supervisor]
) -> None:
    env = external(servers, schema, tmp_path)
    parent = Supervisor(env, 2, tmp_path / "serve.log", group=True)
    supervisors.append(parent)
    parent.wait_lines("node_ready", 2)
    assert os.getpgid(parent.proc.pid) == parent.proc.pid != os.getpgid(0)
    # A terminal's Ctrl-C is SIGINT to the whole foreground process group.
    os.killpg(parent.proc.pid, signal.SIGINT)
    assert parent.proc.wait(60) == 0, parent.output()
    seen = {(line["node"], line["signal"], line["action"]) for line in parent.lines("signal")}
    assert seen == {
        ("box", "SIGINT", "drain"),
        ("box-w1", "SIGTERM", "drain"),  # forwarded once; the workers never saw the SIGINT
        ("box-w2", "SIGTERM", "drain"),
    }


@slow
def test_workers_do_not_outlive_a_parent_killed_outright(
    servers: Servers, schema: str, tmp_path: Path, supervisors: list[Supervisor]
) -> None:
    parent = Supervisor(external(servers, schema, tmp_path), 2, tmp_path / "serve.log")
    supervisors.append(parent)
    ready = parent.wait_lines("node_ready", 2)
    pids = {line["pid"] for line in parent.lines("worker_started")}
    parent.proc.kill()
    parent.proc.wait(10)
    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in pids), parent.output()
    stopped = {line["node"] for line in parent.lines("node_stopped")}
    assert stopped == {line["node"] for line in ready}  # they drained (SIGTERM), not died


@slow
def test_workers_share_the_parents_embedded_services_which_outlive_their_drain(
    tmp_path: Path, supervisors: list[Supervisor]
) -> None:
    env = base_env(tmp_path)
    home = Path(env["DISPACH_HOME"])
    parent = Supervisor(env, 2, tmp_path / "serve.log")
    supervisors.append(parent)
    ready = parent.wait_lines("node_ready", 2, timeout=90)
    state = json.loads((home / "services.json").read_text())
    assert state["pid"] == parent.proc.pid  # the parent runs the services, not a worker
    assert (home / "dispach.lock").read_text().strip() == f"dispach pid {parent.proc.pid}"
    assert {line["postgres"] for line in ready} == {state["database_url"]}
    assert {line["nats"] for line in ready} == {state["nats_url"]}
    postgres_pid = int((home / "postgres" / "postmaster.pid").read_text().split()[0])
    nats_pid = int(state["nats_pid"])
    workers_pids = {line["pid"] for line in parent.lines("worker_started")}
    assert workers_pids | {postgres_pid, nats_pid} == parent.children()

    accepted = httpx.post(
        f"{parent.url}/v1/agents/assistant/messages",
        json={"text": "calculate 6*7", "sessionKey": "workers"}, timeout=30,
    )  # fmt: skip
    assert accepted.status_code == 202, accepted.text
    turn_url = f"{parent.url}/v1/agents/assistant/turns/{accepted.json()['turnId']}"
    parent.wait("the turn to end", lambda: httpx.get(turn_url).json()["status"] != "running")
    assert httpx.get(turn_url).json()["status"] == "final"

    parent.proc.send_signal(signal.SIGTERM)
    assert parent.proc.wait(60) == 0, parent.output()
    assert len(parent.lines("node_stopped")) == 2
    errors = [
        line
        for line in parent.output().splitlines()
        if '"level": "error"' in line or '"level": "warning"' in line
    ]
    assert errors == [], "a worker's drain met stopped services"
    for pid in (*workers_pids, postgres_pid, nats_pid):
        assert not alive(pid)


@slow
def test_a_worker_that_never_starts_makes_the_parent_give_up_and_exit_1(
    servers: Servers, schema: str, tmp_path: Path, supervisors: list[Supervisor]
) -> None:
    agents = tmp_path / "agents"
    agents.mkdir()
    (agents / "broken.yaml").write_text("id: broken\nmodel: {provider: nowhere}\n")
    env = base_env(tmp_path) | {
        "DATABASE_URL": servers.database_url,
        "NATS_URL": servers.nats_url,
        "DISPACH_DB_SCHEMA": schema,
        "DISPACH_CLUSTER": schema,
        "DISPACH_AGENTS": str(agents),
    }
    parent = Supervisor(env, 2, tmp_path / "serve.log")
    supervisors.append(parent)
    assert parent.proc.wait(100) == 1, parent.output()
    assert parent.lines("node_start_failed")
    [loop] = parent.lines("workers_crash_loop")
    assert loop["code"] == "worker_crash_loop" and loop["hint"]
    restarts = [
        line["restart_in_s"] for line in parent.lines("worker_exited") if "restart_in_s" in line
    ]
    assert sorted(set(restarts)) == [0.5, 1.0, 2.0, 4.0, 8.0]
    started = parent.lines("worker_started") + parent.lines("worker_restarted")
    assert len(started) >= 6
    assert not any(alive(line["pid"]) for line in started)


@slow
def test_a_port_in_use_fails_before_anything_starts(tmp_path: Path) -> None:
    env = base_env(tmp_path)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        env["DISPACH_PORT"] = str(holder.getsockname()[1])
        done = subprocess.run(
            [DISPACH, "serve", "--workers", "2"],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert done.returncode == 1
    assert "listen_failed: cannot listen on 127.0.0.1" in done.stderr
    assert "Address already in use" in done.stderr and "hint: " in done.stderr
    assert "worker_started" not in done.stdout + done.stderr
    assert not (Path(env["DISPACH_HOME"]) / "postgres").exists()  # no Postgres was started


# --- the --workers option ----------------------------------------------------------------------


def test_workers_option_reads_a_number_or_auto_and_overrides_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DISPACH_WORKERS", "3")
    assert serve_settings(None, None, None, None, None).workers == 3
    assert serve_settings(None, None, None, None, "2").workers == 2
    assert serve_settings(None, None, None, None, "auto").workers == max(1, os.cpu_count() or 1)
    assert serve_settings(None, None, None, None, " AUTO ").workers == max(1, os.cpu_count() or 1)
    monkeypatch.setenv("DISPACH_WORKERS", "auto")
    assert serve_settings(None, None, None, None, None).workers == max(1, os.cpu_count() or 1)


@pytest.mark.parametrize(
    ("value", "message", "hint"),
    [
        ("0", "0 workers is out of range", "use 1-64 worker processes, or 'auto'"),
        ("-2", "-2 workers is out of range", "use 1-64 worker processes, or 'auto'"),
        ("65", "65 workers is out of range", "use 1-64 worker processes, or 'auto'"),
        ("many", "'many' is not a worker count", "use a whole number, or 'auto'"),
    ],
)
def test_workers_option_refuses_what_is_not_a_worker_count(
    value: str, message: str, hint: str
) -> None:
    result = CliRunner().invoke(main, ["serve", "--workers", value])
    assert result.exit_code == 1
    assert f"invalid_config: {message}" in result.output
    assert f"hint: {hint}" in result.output
    with pytest.raises(ConfigError) as refused:
        serve_settings(None, None, None, None, value)
    assert refused.value.field == "DISPACH_WORKERS"


def test_serve_help_names_the_workers_option() -> None:
    result = CliRunner().invoke(main, ["serve", "--help"])
    assert result.exit_code == 0
    assert "--workers N|auto" in result.output and "DISPACH_WORKERS" in result.output


# --- decisions ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("crashes", "delay"), [(0, 0.5), (1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 8.0), (7, 30.0)]
)
def test_restart_delay_doubles_from_half_a_second_up_to_30(crashes: int, delay: float) -> None:
    assert workers.restart_delay(crashes) == delay


@pytest.mark.parametrize(
    ("previous", "ran", "crashes"), [(0, 1.0, 1), (3, 29.9, 4), (4, 30.0, 1), (5, 3600.0, 1)]
)
def test_only_short_runs_count_as_consecutive_crashes(
    previous: int, ran: float, crashes: int
) -> None:
    assert workers.crashes_after(previous, ran) == crashes


@pytest.mark.parametrize(
    ("last", "gave_up", "status"),
    [
        ([0, 0], False, 0),
        ([0, None], False, 0),  # never started: a signal came first
        ([0, -signal.SIGTERM], False, 0),  # SIGTERMed before its handler: it had started nothing
        ([0, 1], False, 1),
        ([0, -signal.SIGKILL], False, 1),
        ([0, 0], True, 1),
    ],
)
def test_the_parent_exits_0_only_when_every_worker_ended_cleanly(
    last: list[int | None], gave_up: bool, status: int
) -> None:
    assert workers.exit_status(last, gave_up) == status


def test_a_worker_keeps_its_node_id_across_restarts() -> None:
    assert workers.node_id("box", 1) == "box-w1"
    assert workers.node_id("host-12", 3) == "host-12-w3"


def test_a_workers_environment_points_it_at_the_shared_services(tmp_path: Path) -> None:
    settings = from_env(
        {"DISPACH_HOME": str(tmp_path), "DISPACH_AGENTS": str(tmp_path / "a")},
        host="127.0.0.2", port=7777,
    )  # fmt: skip
    base = {"PATH": "/bin", "DISPACH_WORKERS": "4", "DISPACH_PORT": "1", workers.LISTEN_FD: "9"}
    env = workers.worker_env(
        base, settings, database_url="postgresql://db", nats_url="nats://n", node="box-w2", fd=5
    )
    assert env == {
        "PATH": "/bin",
        "DATABASE_URL": "postgresql://db",
        "NATS_URL": "nats://n",
        "DISPACH_NODE_ID": "box-w2",
        "DISPACH_WORKERS": "1",
        "DISPACH_HOST": "127.0.0.2",
        "DISPACH_PORT": "7777",
        "DISPACH_HOME": str(tmp_path),
        "DISPACH_AGENTS": str(tmp_path / "a"),
        workers.LISTEN_FD: "5",
    }
    child = from_env(env)
    assert not child.embedded_postgres and not child.embedded_nats and child.workers == 1


def test_an_inherited_socket_is_adopted_once_and_a_bad_one_refused() -> None:
    with workers.listen("127.0.0.1", free_port()) as sock:
        env = {workers.LISTEN_FD: str(os.dup(sock.fileno()))}
        adopted = workers.inherited_socket(env)
        assert adopted is not None and workers.LISTEN_FD not in env
        with adopted:
            assert adopted.getsockname() == sock.getsockname()
            assert not adopted.get_inheritable()
    assert workers.inherited_socket({}) is None
    with pytest.raises(ConfigError, match="is not an open socket"):
        workers.inherited_socket({workers.LISTEN_FD: "x"})


def test_listen_refuses_a_taken_port_with_a_code_and_a_hint() -> None:
    with workers.listen("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        with pytest.raises(workers.ListenFailed) as refused:
            workers.listen("127.0.0.1", port)
    assert refused.value.code == "listen_failed"
    assert refused.value.field == "DISPACH_PORT" and "DISPACH_PORT" in refused.value.hint

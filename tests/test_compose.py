"""compose.yaml, deploy/haproxy.cfg and the Dockerfile agree with each other and with what the
node reads.

No container engine runs here, so the files are parsed and cross-checked: the compose
environment is interpolated the way ``docker compose`` does and fed to ``runtime.config``; the
HAProxy configuration is checked by ``haproxy -c`` where HAProxy is installed; and the three NATS
servers' commands are run as real nats-server processes, which must form a JetStream cluster.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import re
import shutil
import signal
import subprocess
import time
import tomllib
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats
import pytest
import yaml

from gateways.streams import sse, ws
from runtime.config import from_env, is_loopback
from runtime.embedded import _nats_binary
from runtime.errors import ConfigError
from tests.test_node import free_port

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
HAPROXY_CFG = ROOT / "deploy" / "haproxy.cfg"
CONFIG_SOURCE = ROOT / "runtime" / "config.py"

TOKEN = "t" * 32
"""Stands in for the operator's DISPACH_API_TOKEN when compose interpolates the file."""
SECRET = "s" * 48
"""Stands in for the operator's DISPACH_SECRET."""

_VARIABLE = re.compile(
    r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
)


class MissingVariable(ValueError):
    """A ``${NAME:?message}`` variable is unset, so ``docker compose`` refuses the file."""


# --- helpers -----------------------------------------------------------------------------


def _mapping(value: object, what: str) -> dict[str, Any]:
    assert isinstance(value, dict), f"{what} is not a mapping: {value!r}"
    return {str(k): v for k, v in value.items()}


def _compose() -> dict[str, Any]:
    with COMPOSE.open(encoding="utf-8") as f:
        return _mapping(yaml.safe_load(f), "compose.yaml")


def _service(name: str) -> dict[str, Any]:
    services = _mapping(_compose().get("services"), "services")
    return _mapping(services.get(name), f"service {name}")


def _interpolate(text: str, env: Mapping[str, str]) -> str:
    """Resolve ``$$``, ``${X}``, ``${X:-d}``, ``${X-d}``, ``${X:?e}``, ``${X?e}`` like compose."""

    def resolve(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group("name"), match.group("op"), match.group("arg")
        value = env.get(name)
        if op is None:
            return value or ""
        unset = value is None or (op.startswith(":") and value == "")
        if not unset:
            assert value is not None
            return value
        if op.endswith("-"):
            return arg
        raise MissingVariable(f"{name}: {arg}")

    return _VARIABLE.sub(resolve, text)


def _environment(service: str, host_env: Mapping[str, str]) -> dict[str, str]:
    """The service's environment after interpolation with ``host_env``."""
    raw = _service(service).get("environment", {})
    pairs: dict[str, str] = {}
    if isinstance(raw, list):
        for item in raw:
            name, sep, value = str(item).partition("=")
            assert sep, f"{service}: environment entry {item!r} has no value"
            pairs[name] = value
    else:
        for name, value in _mapping(raw, f"{service}.environment").items():
            assert value is not None, f"{service}: {name} has no value"
            assert not isinstance(value, (dict, list)), f"{service}: {name} is not a scalar"
            pairs[name] = str(value).lower() if isinstance(value, bool) else str(value)
    return {name: _interpolate(value, host_env) for name, value in pairs.items()}


def _dispach_env(token: str | None = TOKEN, secret: str | None = SECRET) -> dict[str, str]:
    host_env = {"DISPACH_API_TOKEN": token, "DISPACH_SECRET": secret}
    return _environment("dispach", {k: v for k, v in host_env.items() if v is not None})


def _healthcheck_command(service: str) -> list[str]:
    healthcheck = _mapping(_service(service).get("healthcheck"), f"{service}.healthcheck")
    assert healthcheck.get("disable") is not True, f"{service}: healthcheck is disabled"
    test = healthcheck.get("test")
    if isinstance(test, str):
        return ["CMD-SHELL", test]
    assert isinstance(test, list), f"{service}: healthcheck.test is {test!r}"
    command = [str(part) for part in test]
    assert command[0] in ("CMD", "CMD-SHELL"), f"{service}: healthcheck.test is {command!r}"
    return command


def _command(service: str) -> list[str]:
    command = _service(service).get("command", [])
    if isinstance(command, str):
        return command.split()
    assert isinstance(command, list)
    return [str(part) for part in command]


def _flag(command: list[str], *names: str) -> str:
    """The value after the first of ``names`` in ``command``."""
    for name in names:
        if name in command:
            return command[command.index(name) + 1]
    raise AssertionError(f"{' or '.join(names)} missing from {command}")


def _nats_services() -> list[str]:
    services = _mapping(_compose().get("services"), "services")
    return sorted(n for n, s in services.items() if str(s.get("image", "")).startswith("nats:"))


def _volume_mounts(service: str) -> dict[str, str]:
    """target -> source of a service's short-syntax volumes."""
    mounts = {}
    for volume in _service(service).get("volumes", []):
        source, target = str(volume).split(":")[:2]
        mounts[target] = source
    return mounts


def _published_ports(service: str) -> list[tuple[int, int]]:
    """(published, target) pairs of a service's ``ports``, short or long syntax."""
    pairs: list[tuple[int, int]] = []
    for entry in _service(service).get("ports", []):
        if isinstance(entry, dict):
            pairs.append((int(entry["published"]), int(entry["target"])))
            continue
        spec = str(entry).split("/")[0]
        parts = spec.split(":")
        assert len(parts) >= 2, f"{service}: port {entry!r} is not published on the host"
        pairs.append((int(parts[-2]), int(parts[-1])))
    return pairs


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and continuations joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, args = (pending + stripped).partition(" ")
        instructions.append((keyword.upper(), args.strip()))
        pending = ""
    assert not pending, "Dockerfile ends inside a line continuation"
    return instructions


def _instructions(keyword: str) -> list[str]:
    return [args for kw, args in _dockerfile() if kw == keyword]


def _pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def _declared_volumes() -> set[str]:
    return set(_mapping(_compose().get("volumes"), "volumes"))


def _haproxy() -> dict[str, list[list[str]]]:
    """Section header (``backend nodes``) -> its lines split into words, comments dropped."""
    sections: dict[str, list[list[str]]] = {}
    current: list[list[str]] = []
    for raw in HAPROXY_CFG.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if not line[0].isspace():
            current = sections.setdefault(" ".join(line.split()), [])
        else:
            current.append(line.split())
    return sections


def _directives(section: str, keyword: str) -> list[list[str]]:
    """The lines of ``section`` that start with ``keyword`` (one or more words), minus it."""
    words = keyword.split()
    lines = _haproxy()[section]
    return [line[len(words) :] for line in lines if line[: len(words)] == words]


def _seconds(value: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = re.fullmatch(r"(\d+)(ms|s|m|h|d)?", value).groups()  # type: ignore[union-attr]
    return int(number) * units[unit or "ms"]


def _names_read_by_config() -> set[str]:
    source = CONFIG_SOURCE.read_text(encoding="utf-8")
    return set(re.findall(r"[\"'](DISPACH_[A-Z0-9_]+|DATABASE_URL|NATS_URL)[\"']", source))


# --- compose.yaml: the services ------------------------------------------------------------


def test_services_exist_and_each_has_a_healthcheck() -> None:
    services = _mapping(_compose().get("services"), "services")
    assert {"postgres", "dispach", "lb"} <= set(services)
    assert _nats_services() == ["nats-1", "nats-2", "nats-3"]
    for name in services:
        assert len(_healthcheck_command(name)) >= 2, name


def test_postgres_is_checked_with_pg_isready_and_keeps_its_data() -> None:
    command = " ".join(_healthcheck_command("postgres"))
    assert "pg_isready" in command
    user = _environment("postgres", {})["POSTGRES_USER"]
    assert re.search(rf"-U\s+{re.escape(user)}\b", command), command
    volumes = [str(v) for v in _service("postgres").get("volumes", [])]
    assert any(v.split(":")[0] in _declared_volumes() for v in volumes), volumes


def test_each_nats_server_runs_jetstream_on_a_volume_of_its_own() -> None:
    sources = []
    for name in _nats_services():
        command = _command(name)
        assert "-js" in command or "--jetstream" in command, name
        store = _flag(command, "-sd", "--store_dir")
        source = _volume_mounts(name).get(store)
        assert source in _declared_volumes(), (name, store, source)
        sources.append(source)
        monitor = _flag(command, "-m", "--http_port")
        health = " ".join(_healthcheck_command(name))
        # The whole healthz (not js-enabled-only): 200 once JetStream has a meta leader.
        assert f"127.0.0.1:{monitor}/healthz" in health and "js-enabled-only" not in health
        image = str(_service(name).get("image"))
        assert image.startswith("nats:") and "alpine" in image, "the check needs wget"
    assert len(set(sources)) == len(sources), f"NATS servers share a store: {sources}"


def test_the_nats_servers_route_to_each_other_as_one_named_cluster() -> None:
    names = _nats_services()
    clusters = {_flag(_command(n), "--cluster_name") for n in names}
    assert len(clusters) == 1, clusters
    for name in names:
        command = _command(name)
        # JetStream in a cluster needs a stable, unique server name: the service's.
        assert _flag(command, "--server_name", "-n", "--name") == name
        listen = urlsplit(_flag(command, "--cluster"))
        assert listen.hostname == "0.0.0.0"
        routes = {urlsplit(r.strip()) for r in _flag(command, "--routes").split(",")}
        assert {(r.scheme, r.hostname, r.port) for r in routes} == {
            ("nats", other, listen.port) for other in names
        }


def test_dispach_builds_from_the_repository_dockerfile() -> None:
    build = _service("dispach").get("build")
    if isinstance(build, str):
        context, dockerfile = build, "Dockerfile"
    else:
        spec = _mapping(build, "dispach.build")
        context, dockerfile = (
            str(spec.get("context", ".")),
            str(spec.get("dockerfile", "Dockerfile")),
        )
    assert context == "."
    assert (ROOT / context / dockerfile).resolve() == DOCKERFILE
    assert DOCKERFILE.is_file()


def test_dispach_waits_for_healthy_postgres_and_every_nats_server() -> None:
    depends_on = _mapping(_service("dispach").get("depends_on"), "dispach.depends_on")
    for name in ("postgres", *_nats_services()):
        condition = _mapping(depends_on.get(name), f"depends_on.{name}").get("condition")
        assert condition == "service_healthy", (name, condition)


def test_nodes_are_three_interchangeable_replicas_with_no_host_port_or_disk_of_their_own() -> None:
    service = _service("dispach")
    deploy = _mapping(service.get("deploy"), "dispach.deploy")
    assert deploy.get("replicas") == 3
    # Each of these would stop `--scale` from working (a second replica could not bind the
    # host port, or would share one data directory and be refused data_dir_in_use).
    assert "ports" not in service and "container_name" not in service
    assert "volumes" not in service
    port = int(_dispach_env()["DISPACH_PORT"])
    assert [int(str(p)) for p in service.get("expose", [])] == [port]
    health = _healthcheck_command("dispach")
    assert health[1] == "python"
    assert f"127.0.0.1:{port}/v1/ready" in " ".join(health)


def test_database_url_points_at_the_postgres_service() -> None:
    postgres = _environment("postgres", {})
    url = urlsplit(_dispach_env()["DATABASE_URL"])
    assert url.scheme in ("postgres", "postgresql")
    assert url.hostname == "postgres"
    assert url.port in (None, 5432)
    assert url.username == postgres["POSTGRES_USER"]
    assert url.password == postgres["POSTGRES_PASSWORD"]
    assert url.path.lstrip("/") == postgres["POSTGRES_DB"]


def test_database_password_follows_the_host_override_in_both_services() -> None:
    host_env = {"DISPACH_API_TOKEN": TOKEN, "DISPACH_SECRET": SECRET, "POSTGRES_PASSWORD": "pw-2"}
    url = urlsplit(_environment("dispach", host_env)["DATABASE_URL"])
    assert url.password == _environment("postgres", host_env)["POSTGRES_PASSWORD"] == "pw-2"


def test_nats_url_lists_every_nats_server_at_its_client_port() -> None:
    urls = [urlsplit(u.strip()) for u in _dispach_env()["NATS_URL"].split(",")]
    assert sorted(u.hostname or "" for u in urls) == _nats_services()
    assert {(u.scheme, u.port) for u in urls} == {("nats", 4222)}
    for name in _nats_services():
        assert "-p" not in _command(name) and "--port" not in _command(name)  # so 4222


def test_the_lease_bucket_is_replicated_on_every_nats_server() -> None:
    settings = from_env(_dispach_env())
    assert settings.replicas == len(_nats_services()) == 3
    assert settings.cluster == "dispach"
    assert settings.partitions == 64
    assert settings.lease_ttl_seconds == 10
    named = _environment("dispach", {"DISPACH_API_TOKEN": TOKEN, "DISPACH_SECRET": SECRET,
                                     "DISPACH_CLUSTER": "staging"})  # fmt: skip
    assert from_env(named).cluster == "staging"


def test_dispach_is_configured_by_environment_only() -> None:
    service = _service("dispach")
    assert "env_file" not in service
    assert "configs" not in service
    assert "volumes" not in service


def test_dispach_sets_only_variables_the_node_reads() -> None:
    read = _names_read_by_config()
    assert {"DATABASE_URL", "NATS_URL", "DISPACH_HOST", "DISPACH_API_TOKEN"} <= read
    assert set(_dispach_env()) <= read, set(_dispach_env()) - read


def test_non_loopback_bind_comes_with_a_token_the_node_accepts() -> None:
    env = _dispach_env()
    assert not is_loopback(env["DISPACH_HOST"])
    settings = from_env(env)
    assert settings.tokens == (TOKEN,)
    assert settings.secret == SECRET
    assert settings.host == env["DISPACH_HOST"]
    assert settings.port == 7420
    assert settings.log_format == "json"
    assert settings.max_connections_per_client == 0  # HAProxy keeps the cap per real client
    assert not settings.embedded_postgres
    assert not settings.embedded_nats


def test_the_node_refuses_the_compose_environment_without_a_token() -> None:
    env = {k: v for k, v in _dispach_env().items() if k != "DISPACH_API_TOKEN"}
    with pytest.raises(ConfigError) as caught:
        from_env(env)
    assert caught.value.field == "DISPACH_API_TOKEN"
    with pytest.raises(ConfigError, match="shorter than 16"):
        from_env(_dispach_env(token="short"))
    with pytest.raises(ConfigError, match="shorter than 32"):
        from_env(_dispach_env(secret="short"))


def test_compose_requires_the_token_and_the_shared_secret_from_the_host() -> None:
    for token in (None, ""):
        with pytest.raises(MissingVariable, match="DISPACH_API_TOKEN"):
            _dispach_env(token=token)
    # Nodes that signed stream tokens with secrets of their own would refuse each other's.
    for secret in (None, ""):
        with pytest.raises(MissingVariable, match=r"DISPACH_SECRET: .*the same for every node"):
            _dispach_env(secret=secret)


def test_interpolation_follows_compose_rules() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert _interpolate("${SET:-d}/${EMPTY:-d}/${EMPTY-d}/${UNSET-d}", env) == "v/d//d"
    assert _interpolate("$${SET}/${SET}/${UNSET}", env) == "${SET}/v/"
    assert _interpolate("${EMPTY?e}", env) == ""
    with pytest.raises(MissingVariable, match="EMPTY: e"):
        _interpolate("${EMPTY:?e}", env)


# --- the load balancer ---------------------------------------------------------------------


def test_the_load_balancer_publishes_the_api_port_and_mounts_the_repository_config() -> None:
    lb = _service("lb")
    assert str(lb.get("image")).startswith("haproxy:")
    [(published, target)] = _published_ports("lb")
    assert published == 7420
    [bind] = _directives("frontend dispach", "bind")
    assert bind == [f":{target}"]
    config = "/usr/local/etc/haproxy/haproxy.cfg"
    [volume] = [str(v) for v in lb.get("volumes", [])]
    assert volume.split(":") == ["./deploy/haproxy.cfg", config, "ro"]
    assert (ROOT / volume.split(":")[0]).resolve() == HAPROXY_CFG
    depends_on = _mapping(lb.get("depends_on"), "lb.depends_on")
    assert "dispach" in depends_on
    [monitor] = _directives("frontend health", "monitor-uri")
    [health_bind] = _directives("frontend health", "bind")
    assert f"127.0.0.1{health_bind[0]}{monitor[0]}" in " ".join(_healthcheck_command("lb"))


def test_haproxy_finds_every_replica_through_dockers_dns() -> None:
    [nameserver] = _directives("resolvers docker", "nameserver")
    assert nameserver[1] == "127.0.0.11:53"  # Docker's embedded DNS server
    [template] = _directives("backend nodes", "server-template")
    _, count, address = template[:3]
    assert re.fullmatch(r"1-(\d+)", count) and int(count[2:]) >= 3 * 3, "room for --scale"
    host, _, port = address.partition(":")
    assert host == "dispach" and host in _mapping(_compose()["services"], "services")
    assert port == _dispach_env()["DISPACH_PORT"]
    [defaults] = _directives("backend nodes", "default-server")
    options = defaults + template[3:]
    assert "check" in options
    assert options[options.index("resolvers") + 1] == "docker"
    assert options[options.index("init-addr") + 1] == "none"  # start before any node resolves


def test_haproxy_balances_round_robin_over_the_nodes_that_are_ready() -> None:
    assert _directives("backend nodes", "balance") == [["roundrobin"]]
    assert ["httpchk"] in _directives("backend nodes", "option")
    [send] = _directives("backend nodes", "http-check send")
    assert send[send.index("meth") + 1] == "GET" and send[send.index("uri") + 1] == "/v1/ready"
    assert _directives("backend nodes", "http-check expect") == [["status", "200"]]
    assert _directives("defaults", "mode") == [["http"]]  # HTTP mode passes WebSocket upgrades


def test_haproxy_keeps_streams_open_past_their_heartbeats() -> None:
    timeouts = {line[0]: _seconds(line[1]) for line in _directives("defaults", "timeout")}
    heartbeat = max(sse.HEARTBEAT_S, ws.HEARTBEAT_S)
    assert timeouts["client"] > 2 * heartbeat and timeouts["server"] > 2 * heartbeat
    assert timeouts["tunnel"] >= 3600  # an upgraded WebSocket


def test_haproxy_caps_connections_per_client_as_a_lone_node_would() -> None:
    [reject] = _directives("frontend dispach", "tcp-request connection reject")
    assert reject[:2] == ["if", "{"] and reject[2:4] == ["sc0_conn_cur", "gt"]
    lone_node = from_env({"DISPACH_HOME": "/nowhere"})
    assert int(reject[4]) == lone_node.max_connections_per_client == 256
    assert ["track-sc0", "src"] in _directives("frontend dispach", "tcp-request connection")


def test_haproxy_accepts_the_config() -> None:
    binary = shutil.which("haproxy")
    if binary is None:
        pytest.skip("haproxy is not installed (apt-get install haproxy to check the config)")
    done = subprocess.run(
        [binary, "-c", "-f", str(HAPROXY_CFG)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


# --- the NATS cluster, run ------------------------------------------------------------------


class NatsCluster:
    """The compose file's three NATS commands run as local processes: service names become
    127.0.0.1 with a port each, the store a temporary directory; every other flag is as written."""

    def __init__(self, root: Path) -> None:
        names = _nats_services()
        self.route = {n: free_port() for n in names}
        self.client = {n: free_port() for n in names}
        self.monitor = {n: free_port() for n in names}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for name in names:
            argv = [_nats_binary(), "-a", "127.0.0.1", "-p", str(self.client[name])]
            local = {
                "-sd": str(root / name),
                "-m": str(self.monitor[name]),
                "--cluster": f"nats://127.0.0.1:{self.route[name]}",
                "--routes": ",".join(f"nats://127.0.0.1:{self.route[n]}" for n in names),
            }
            command = _command(name)
            for i, part in enumerate(command):
                argv.append(local.get(command[i - 1], part) if i else part)
            log = (root / f"{name}.log").open("wb")
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
            log.close()

    def url(self, name: str) -> str:
        return f"nats://127.0.0.1:{self.client[name]}"

    def healthy(self, name: str) -> bool:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.monitor[name]}/healthz", timeout=2
            ) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    def stop(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    cluster = NatsCluster(tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not all(cluster.healthy(n) for n in cluster.procs):
            assert all(p.poll() is None for p in cluster.procs.values()), "a nats-server exited"
            assert time.monotonic() < deadline, "the NATS cluster did not become healthy"
            time.sleep(0.1)
        yield cluster
    finally:
        for name in cluster.procs:
            cluster.stop(name)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_nats_commands_form_a_cluster_whose_replicated_bucket_survives_a_server(
    nats_cluster: NatsCluster,
) -> None:
    names = _nats_services()
    replicas = from_env(_dispach_env()).replicas
    nc = await nats.connect([nats_cluster.url(n) for n in names])
    other = await nats.connect(nats_cluster.url(names[-1]))
    try:
        kv = await nc.jetstream().create_key_value(bucket="compose-leases", replicas=replicas)
        await kv.put("p.1", b"first")
        info = await nc.jetstream().stream_info("KV_compose-leases")
        assert info.config.num_replicas == 3
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2
        seen = await other.jetstream().key_value("compose-leases")
        assert (await seen.get("p.1")).value == b"first"  # written through one, read on another
        leader = info.cluster.leader
        assert leader in names
        await asyncio.to_thread(nats_cluster.stop, leader)  # a quorum of two remains
        deadline = time.monotonic() + 30
        while True:
            try:
                await seen.put("p.1", b"after")
                break
            except nats.errors.Error:
                assert time.monotonic() < deadline, "the bucket did not get a new leader"
                await asyncio.sleep(0.2)
        assert (await seen.get("p.1")).value == b"after"
    finally:
        await nc.close()
        await other.close()


# --- Dockerfile ----------------------------------------------------------------------------


def test_dockerfile_runs_dispach_serve_as_a_non_root_user() -> None:
    (base,) = _instructions("FROM")
    assert base.startswith("python:3.11"), base
    (cmd,) = _instructions("CMD")
    assert json.loads(cmd) == ["dispach", "serve"]
    assert "dispach" in _pyproject()["project"]["scripts"]
    assert _instructions("STOPSIGNAL") == ["SIGTERM"]
    users = _instructions("USER")
    assert users, "the image runs as root"
    assert users[-1].split(":")[0] not in ("root", "0")
    exposed = {port.split("/")[0] for args in _instructions("EXPOSE") for port in args.split()}
    assert _dispach_env()["DISPACH_PORT"] in exposed


def test_dockerfile_installs_the_package_from_its_sources() -> None:
    copied: set[str] = set()
    for args in _instructions("COPY"):
        parts = [p for p in args.split() if not p.startswith("--")]
        sources = parts[:-1]
        copied.update(s.rstrip("/") for s in sources)
    project = _pyproject()
    packages = top_level_packages(project)
    assert set(packages) == {"runtime", "actors", "eventstore", "gateways"}
    needed = {"pyproject.toml", project["project"]["readme"], *packages}
    assert needed <= copied, needed - copied
    missing = sorted(s for s in copied if not (ROOT / s).exists())
    assert not missing, f"COPY sources missing from the repository: {missing}"
    assert any(re.search(r"\bpip install\b.*(\s|^)\.(\s|$)", run) for run in _instructions("RUN"))


def test_dockerignore_keeps_the_build_sources_and_drops_local_state() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for ignored in (".venv", ".git"):
        assert any(fnmatch.fnmatch(ignored, p) for p in patterns), ignored
    project = _pyproject()
    kept = [
        "pyproject.toml",
        project["project"]["readme"],
        *top_level_packages(project),
    ]
    for name in kept:
        assert not any(fnmatch.fnmatch(name, p) for p in patterns), name


def top_level_packages(project: dict[str, Any]) -> list[str]:
    """The installed top-level packages: `packages.find.include` patterns such as `actors*`."""
    found = project["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted({pattern.rstrip("*").split(".")[0] for pattern in found})

"""compose.yaml and the Dockerfile agree with each other and with what the node reads.

No container engine runs here, so the files are parsed and cross-checked: the compose
environment is interpolated the way ``docker compose`` does and fed to ``runtime.config``.
"""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from runtime.config import from_env, is_loopback
from runtime.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
CONFIG_SOURCE = ROOT / "runtime" / "config.py"

TOKEN = "t" * 32
"""Stands in for the operator's DISPACH_API_TOKEN when compose interpolates the file."""

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


def _dispach_env(token: str | None = TOKEN) -> dict[str, str]:
    return _environment("dispach", {} if token is None else {"DISPACH_API_TOKEN": token})


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


def _names_read_by_config() -> set[str]:
    source = CONFIG_SOURCE.read_text(encoding="utf-8")
    return set(re.findall(r"[\"'](DISPACH_[A-Z0-9_]+|DATABASE_URL|NATS_URL)[\"']", source))


# --- compose.yaml --------------------------------------------------------------------------


def test_services_exist_and_each_has_a_healthcheck() -> None:
    services = _mapping(_compose().get("services"), "services")
    assert {"postgres", "nats", "dispach"} <= set(services)
    for name in ("postgres", "nats", "dispach"):
        assert len(_healthcheck_command(name)) >= 2


def test_postgres_is_checked_with_pg_isready_and_keeps_its_data() -> None:
    command = " ".join(_healthcheck_command("postgres"))
    assert "pg_isready" in command
    user = _environment("postgres", {})["POSTGRES_USER"]
    assert re.search(rf"-U\s+{re.escape(user)}\b", command), command
    volumes = [str(v) for v in _service("postgres").get("volumes", [])]
    assert any(v.split(":")[0] in _declared_volumes() for v in volumes), volumes


def test_nats_enables_jetstream_with_a_store_and_a_health_endpoint() -> None:
    command = _command("nats")
    assert "-js" in command or "--jetstream" in command
    store = command[command.index("-sd") + 1]
    volumes = [str(v) for v in _service("nats").get("volumes", [])]
    assert any(v.split(":")[1] == store for v in volumes), (store, volumes)
    assert "-m" in command
    monitor = command[command.index("-m") + 1]
    health = " ".join(_healthcheck_command("nats"))
    assert f":{monitor}/healthz" in health
    assert "js-enabled-only=true" in health
    image = str(_service("nats").get("image"))
    assert image.startswith("nats:")
    assert "alpine" in image, "the healthcheck needs an image with a shell and wget"


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


def test_dispach_waits_for_healthy_postgres_and_nats() -> None:
    depends_on = _mapping(_service("dispach").get("depends_on"), "dispach.depends_on")
    for name in ("postgres", "nats"):
        condition = _mapping(depends_on.get(name), f"depends_on.{name}").get("condition")
        assert condition == "service_healthy", (name, condition)


def test_dispach_publishes_its_port_and_checks_readiness_on_it() -> None:
    env = _dispach_env()
    port = int(env["DISPACH_PORT"])
    assert port == 7420
    assert (7420, port) in _published_ports("dispach")
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
    host_env = {"DISPACH_API_TOKEN": TOKEN, "POSTGRES_PASSWORD": "s3cret-pw"}
    url = urlsplit(_environment("dispach", host_env)["DATABASE_URL"])
    assert url.password == _environment("postgres", host_env)["POSTGRES_PASSWORD"] == "s3cret-pw"


def test_nats_url_points_at_the_nats_service() -> None:
    url = urlsplit(_dispach_env()["NATS_URL"])
    assert url.scheme == "nats"
    assert url.hostname == "nats"
    assert url.port == 4222


def test_dispach_is_configured_by_environment_only() -> None:
    service = _service("dispach")
    assert "env_file" not in service
    assert "configs" not in service
    for volume in service.get("volumes", []):
        source = str(volume).split(":")[0] if not isinstance(volume, dict) else volume["source"]
        assert source in _declared_volumes(), f"dispach mounts a host path: {volume!r}"


def test_dispach_sets_only_variables_the_node_reads() -> None:
    read = _names_read_by_config()
    assert {"DATABASE_URL", "NATS_URL", "DISPACH_HOST", "DISPACH_API_TOKEN"} <= read
    assert set(_dispach_env()) <= read, set(_dispach_env()) - read


def test_non_loopback_bind_comes_with_a_token_the_node_accepts() -> None:
    env = _dispach_env()
    assert not is_loopback(env["DISPACH_HOST"])
    settings = from_env(env)
    assert settings.tokens == (TOKEN,)
    assert settings.host == env["DISPACH_HOST"]
    assert settings.port == 7420
    assert settings.log_format == "json"
    assert not settings.embedded_postgres
    assert not settings.embedded_nats


def test_the_node_refuses_the_compose_environment_without_a_token() -> None:
    env = {k: v for k, v in _dispach_env().items() if k != "DISPACH_API_TOKEN"}
    with pytest.raises(ConfigError) as caught:
        from_env(env)
    assert caught.value.field == "DISPACH_API_TOKEN"
    with pytest.raises(ConfigError, match="shorter than 16"):
        from_env(_dispach_env(token="short"))


def test_compose_requires_the_token_from_the_host() -> None:
    with pytest.raises(MissingVariable, match="DISPACH_API_TOKEN"):
        _dispach_env(token=None)
    with pytest.raises(MissingVariable, match="DISPACH_API_TOKEN"):
        _dispach_env(token="")


def test_interpolation_follows_compose_rules() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert _interpolate("${SET:-d}/${EMPTY:-d}/${EMPTY-d}/${UNSET-d}", env) == "v/d//d"
    assert _interpolate("$${SET}/${SET}/${UNSET}", env) == "${SET}/v/"
    assert _interpolate("${EMPTY?e}", env) == ""
    with pytest.raises(MissingVariable, match="EMPTY: e"):
        _interpolate("${EMPTY:?e}", env)


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

"""Settings from the environment, validated with a code, a message and a hint."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config import from_env, is_loopback
from runtime.errors import ConfigError
from runtime.logs import redact_url

TOKEN = "x" * 32


def test_defaults_use_embedded_services_on_loopback() -> None:
    settings = from_env({})
    assert settings.embedded_postgres and settings.embedded_nats
    assert (settings.host, settings.port) == ("127.0.0.1", 7420)
    assert settings.home == Path("~/.dispach").expanduser()


def test_external_urls_and_home_are_taken_from_the_environment() -> None:
    settings = from_env(
        {"DATABASE_URL": "postgresql://u@db/x", "NATS_URL": "nats://n:4222", "DISPACH_HOME": "/d"}
    )
    assert not settings.embedded_postgres and not settings.embedded_nats
    assert settings.home == Path("/d")


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.4", "example.com"])
def test_a_non_loopback_bind_needs_a_token(host: str) -> None:
    with pytest.raises(ConfigError) as caught:
        from_env({"DISPACH_HOST": host})
    assert caught.value.field == "DISPACH_API_TOKEN" and caught.value.hint
    assert from_env({"DISPACH_HOST": host, "DISPACH_API_TOKEN": TOKEN}).tokens == (TOKEN,)


def test_tokens_are_long_and_may_be_several() -> None:
    with pytest.raises(ConfigError):
        from_env({"DISPACH_API_TOKEN": "short"})
    assert len(from_env({"DISPACH_API_TOKEN": f"{TOKEN}, {TOKEN}y"}).tokens) == 2


@pytest.mark.parametrize(
    ("name", "value"),
    [("DISPACH_PORT", "seventy"), ("DISPACH_PORT", "70000"), ("DISPACH_LOG_FORMAT", "xml")],
)
def test_bad_values_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        from_env({name: value})
    assert caught.value.field == name
    assert caught.value.code == "invalid_config"


def test_loopback_detection() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.1")


def test_urls_are_logged_without_their_password() -> None:
    assert redact_url("postgresql://u:secret@db:5432/x") == "postgresql://u:***@db:5432/x"
    assert redact_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"

"""Settings from the environment, validated with a code, a message and a hint."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.prices import PriceError
from runtime.config import from_env, is_loopback, nats_servers
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
    [
        ("DISPACH_PORT", "seventy"),
        ("DISPACH_PORT", "70000"),
        ("DISPACH_LOG_FORMAT", "xml"),
        ("DISPACH_CLUSTER", "Prod.East"),  # a subject token and a bucket name: no dots, lower
        ("DISPACH_CLUSTER", "x" * 33),
        ("DISPACH_PARTITIONS", "0"),
        ("DISPACH_LEASE_TTL_SECONDS", "0.5"),
        ("DISPACH_LEASE_TTL_SECONDS", "nan"),
        ("DISPACH_LEASE_TTL_SECONDS", "soon"),
        ("DISPACH_KV_REPLICAS", "7"),
        ("DISPACH_WORKERS", "many"),
        ("DISPACH_WEBHOOK_MAX_ATTEMPTS", "0"),
        ("DISPACH_WEBHOOK_MAX_ATTEMPTS", "eight"),
        ("DISPACH_WEBHOOK_BACKOFF_SECONDS", "0"),
        ("DISPACH_WEBHOOK_TIMEOUT_SECONDS", "600"),
    ],
)
def test_bad_values_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        from_env({name: value})
    assert caught.value.field == name
    assert caught.value.code == "invalid_config"


def test_the_cluster_settings_and_a_list_of_nats_servers() -> None:
    settings = from_env({"DISPACH_CLUSTER": "prod-east", "DISPACH_LEASE_TTL_SECONDS": "2.5",
                         "DISPACH_PARTITIONS": "16", "DISPACH_WORKERS": "auto"})  # fmt: skip
    assert (settings.cluster, settings.lease_ttl_seconds, settings.partitions) == (
        "prod-east", 2.5, 16,
    )  # fmt: skip
    assert settings.workers >= 1
    assert nats_servers(" nats://a:4222,nats://b:4222 ,") == ["nats://a:4222", "nats://b:4222"]


def test_the_prices_and_the_webhook_policy_are_read_with_the_rest() -> None:
    """Read at start with every other setting: a bad override stops the node before it opens
    anything, naming the variable."""
    settings = from_env({"DISPACH_PRICES": '{"house": {"input": 1, "output": 2}}',
                         "DISPACH_WEBHOOK_ALLOW": "hooks.internal, 10.0.0.0/8"})  # fmt: skip
    assert settings.prices.prices["house"].output == 2
    assert settings.webhook_policy.hosts == {"hooks.internal"}
    assert [str(n) for n in settings.webhook_policy.networks] == ["10.0.0.0/8"]
    assert not from_env({}).webhook_policy.allow_private
    with pytest.raises(PriceError) as bad:
        from_env({"DISPACH_PRICES": "{not json"})
    assert bad.value.code == "prices_invalid" and "DISPACH_PRICES" in bad.value.message


def test_loopback_detection() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.1")


def test_urls_are_logged_without_their_password() -> None:
    assert redact_url("postgresql://u:secret@db:5432/x") == "postgresql://u:***@db:5432/x"
    assert redact_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"

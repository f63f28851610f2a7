"""The channel kinds' registry (gateways/channels/kinds.py): the manifest's ``channels`` union and
``build`` come from it, and no module but a kind's own and the registry names a kind's types."""

from __future__ import annotations

import ast
import asyncio
import typing
from typing import Any

import msgspec
import pytest

from gateways.channels import KINDS, ChannelConfig, ChannelError, build
from gateways.channels.telegram import TelegramChannel
from gateways.channels.webhook import WebhookChannel
from tests.conftest import ROOT

SAMPLES: dict[str, dict[str, Any]] = {
    "telegram": {"type": "telegram", "id": "bot"},
    "webhook": {"type": "webhook", "id": "hooks", "url": "http://127.0.0.1:9/"},
}
ENV = {"TELEGRAM_BOT_TOKEN": "123:abc", "DISPACH_WEBHOOK_SECRET": "s3cret"}
BUILT = {"telegram": TelegramChannel, "webhook": WebhookChannel}


def test_each_kind_has_its_own_tag_and_the_manifest_union_is_the_kinds() -> None:
    assert [kind.type for kind in KINDS] == sorted(SAMPLES)
    assert typing.get_args(ChannelConfig) == tuple(kind.config for kind in KINDS)
    for kind in KINDS:
        assert type(msgspec.convert(SAMPLES[kind.type], ChannelConfig)) is kind.config
    with pytest.raises(msgspec.ValidationError, match=r"Invalid value 'slack' - at `\$.type`"):
        msgspec.convert({"type": "slack", "id": "x"}, ChannelConfig)


def test_build_makes_each_kind_by_its_own_factory() -> None:
    # Built off the event loop: making the clients' SSL contexts is slow on a loaded machine.
    for kind in KINDS:
        config = msgspec.convert(SAMPLES[kind.type], ChannelConfig)
        channel = build("a", config, ENV)
        try:
            assert isinstance(channel, BUILT[kind.type])
            assert (channel.id, channel.type) == (config.id, kind.type)
        finally:
            asyncio.run(channel.aclose())
        with pytest.raises(ChannelError, match="which is not set") as refused:
            build("a", config, {})
        assert refused.value.code == "invalid_channel"


def test_no_module_but_a_kinds_own_and_the_registry_names_its_types() -> None:
    named = {kind.config.__name__: kind.config.__module__ for kind in KINDS}
    named |= {cls.__name__: cls.__module__ for cls in BUILT.values()}
    allowed = {"gateways/channels/kinds.py"}
    found = []
    for package in ("eventstore", "actors", "gateways", "runtime"):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = str(path.relative_to(ROOT))
            module = relative.removesuffix(".py").replace("/", ".")
            for node in ast.walk(ast.parse(path.read_text())):
                name = node.id if isinstance(node, ast.Name) else (
                    node.attr if isinstance(node, ast.Attribute) else None)  # fmt: skip
                if name in named and named[name] != module and relative not in allowed:
                    found.append(f"{relative} names {name}")
    assert found == []

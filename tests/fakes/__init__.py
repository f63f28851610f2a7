"""Fakes of external services for tests: a real-socket fake of the Anthropic Messages API.

``fake_anthropic`` is a pytest fixture; a conftest (or a test module) makes it available with
``from tests.fakes import fake_anthropic``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.fakes._local_server import isolate_from_environment
from tests.fakes.anthropic_server import (
    FakeAnthropic,
    HttpError,
    Item,
    Recorded,
    Reply,
    StreamFault,
    ToolUse,
    estimate_input_tokens,
)

__all__ = [
    "FakeAnthropic",
    "HttpError",
    "Item",
    "Recorded",
    "Reply",
    "StreamFault",
    "ToolUse",
    "anthropic_client_kwargs",
    "estimate_input_tokens",
    "fake_anthropic",
]


def anthropic_client_kwargs(fake: FakeAnthropic) -> dict[str, Any]:
    """Constructor arguments that point an ``Anthropic``/``AsyncAnthropic`` client at ``fake``
    (retries are left at the SDK's default)."""
    return {"api_key": "test", "base_url": fake.url}


@pytest.fixture
def fake_anthropic(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAnthropic]:
    """A running ``FakeAnthropic`` for one test, with no ``ANTHROPIC_*`` or proxy settings
    leaking in from the environment. Fails the test if the fake itself hit an internal error."""
    isolate_from_environment(monkeypatch, "ANTHROPIC_")
    with FakeAnthropic() as fake:
        yield fake
    assert fake.errors == [], f"the fake Anthropic server failed internally: {fake.errors!r}"

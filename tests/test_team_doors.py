"""A team's member takes work only from its supervisor's handoff, at every door (issue 36): HTTP
and the WebSocket refuse it ``agent_not_addressable``, and so do the NATS ingress subject, the
schedule routes, a schedule's ticks (``schedule.skipped``) and a channel's messages
(``channel.rejected``); no
producer may claim to be a handoff. ``GET /v1/agents`` lists the member, marked not addressable
and a member of its supervisor. Real Postgres, NATS and a node; Telegram is the fake Bot API."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from eventstore import streams, subjects
from eventstore.catalogue import ChannelRejected, ScheduleSkipped
from tests.conftest import ApiFactory
from tests.fakes.telegram_server import FakeTelegram
from tests.test_api_http import client_of, error_of, post
from tests.test_live_agents import until

TOKEN = "123456:TEST-fake-bot-token_AbCdEfGhIjKlMnOpQrStUvWxYz"

BOSS = """
id: boss
model: {provider: scripted}
members:
  helper:
    description: Helps.
    artifact: {type: object}
"""


def helper(url: str) -> str:
    return f"""
id: helper
model: {{provider: scripted}}
channels:
  - {{id: telegram, type: telegram, api_base_url: "{url}", allow_from: ["*"], mode: longpoll,
     poll_timeout_s: 1, backoff_s: [0.05, 0.1]}}
schedules:
  - {{id: tick, kind: every, expr: 1s, task: ping, deliver: none}}
"""


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeTelegram]:
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", TOKEN)
    with FakeTelegram(TOKEN) as f:
        yield f
    assert f.errors == []


@pytest.mark.asyncio
async def test_a_member_is_refused_at_every_door_and_listed_as_its_supervisors(
    api_factory: ApiFactory, fake: FakeTelegram
) -> None:
    api_factory.write_agent("boss", BOSS)
    api_factory.write_agent("helper", helper(fake.url))
    api = await api_factory.start()
    store = api.node.store
    nc = api.node.nc
    assert store is not None and nc is not None
    async with client_of(api) as http:
        # HTTP, as before.
        error_of(await post(http, "hi", agent="helper", sessionKey="s"), 403,
                 "agent_not_addressable")  # fmt: skip

        # The NATS ingress subject; and no producer may say it is a handoff.
        answer = await nc.request(subjects.ingress("helper"), b'{"text": "hi"}', timeout=10)
        refused = msgspec.json.decode(answer.data)["error"]
        assert refused["code"] == "agent_not_addressable", refused
        assert "handoff" in refused["message"] and "supervisor" in refused["hint"]
        claimed = b'{"text": "hi", "source": "handoff"}'
        answer = await nc.request(subjects.ingress("helper"), claimed, timeout=10)
        assert msgspec.json.decode(answer.data)["error"]["code"] == "source_reserved"
        answer = await nc.request(subjects.ingress("boss"), claimed, timeout=10)
        assert msgspec.json.decode(answer.data)["error"]["code"] == "source_reserved"

        # A schedule: the API makes none for a member, nor runs one out of band; the ticks of
        # one its manifest declares are skipped on the record, never fired.
        tock = {"id": "tock", "kind": "every", "expr": "1s", "task": "ping", "deliver": "none"}
        error_of(await http.post("/v1/agents/helper/schedules", json=tock), 403,
                 "agent_not_addressable")  # fmt: skip
        error_of(await http.put("/v1/agents/helper/schedules/tick", json=tock), 403,
                 "agent_not_addressable")  # fmt: skip
        error_of(await http.post("/v1/agents/helper/schedules/tick/run"), 403,
                 "agent_not_addressable")  # fmt: skip

        async def schedule() -> list[Any]:
            return [e.data for e in await store.aread_stream(streams.schedule("helper", "tick"))]

        async def skipped() -> bool:
            return any(isinstance(e, ScheduleSkipped) and e.reason == "agent_not_addressable"
                       for e in await schedule())  # fmt: skip

        await until(skipped, "a tick skipped as not addressable")
        assert not any(type(e).__name__ == "ScheduleFired" for e in await schedule())

        # A channel: the message is rejected on the record, and no reply goes out.
        fake.push_message(5001, "hello", from_id=5001, username="ada")
        channel = streams.channel("helper", "telegram")

        async def rejected() -> list[Any]:
            return [e.data for e in await store.aread_stream(channel)]

        async def any_rejected() -> bool:
            return bool(await rejected())

        await until(any_rejected, "the channel message to be rejected")
        [rejection] = await rejected()
        assert isinstance(rejection, ChannelRejected)
        assert rejection.reason == "refused" and "only by handoff" in rejection.message
        turns = (await http.get("/v1/agents/helper/turns")).json()
        assert turns["turns"] == [] and fake.sent == []

        # Listed, marked as the boss's member and not addressable; the boss is addressable.
        listed = {a["id"]: a for a in (await http.get("/v1/agents")).json()}
        assert listed["helper"]["addressable"] is False
        assert listed["helper"]["memberOf"] == ["boss"]
        assert listed["boss"].get("addressable", True) is True
        assert listed["boss"].get("memberOf", []) == []
        detail = (await http.get("/v1/agents/helper")).json()
        assert detail["addressable"] is False and detail["memberOf"] == ["boss"]

        # The supervisor itself takes messages at every door.
        answer = await nc.request(subjects.ingress("boss"), b'{"text": "hi"}', timeout=10)
        assert "turnId" in msgspec.json.decode(answer.data)

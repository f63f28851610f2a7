"""A send whose outcome is in doubt: the request may have reached the provider, but no answer
says whether it was taken (the connection dropped after the request, or the answer came after
the client's timeout). That is the same doubt as a node dying in its send window, and it is
treated the same: the item gets ``delivery.uncertain`` and follows the channel's
``on_uncertain`` (``resend``: sent again, flagged; ``skip``: settled as uncertain, never sent
again), never a silent retry. Only failures that prove the request was not taken (a refused
connection, a DNS failure, Telegram's 429 and its front's 502/503/504) are retried blindly.

The channels run against the local fakes of their providers (real sockets, the real wire); the
end-to-end cases run a real node (Postgres, NATS, uvicorn)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any, Literal

import httpx
import pytest

from actors.outbox import Outbound, SendResult
from actors.outbox.plan import Item, settle
from eventstore import RecordedEvent
from eventstore.catalogue import DeliveryRetry, DeliverySent, DeliveryUncertain
from gateways.channels.telegram import TelegramChannel, TelegramConfig
from gateways.channels.webhook import WebhookChannel, WebhookConfig
from tests.conftest import ApiFactory, ApiServer
from tests.fakes.telegram_server import FakeTelegram
from tests.fakes.webhook_receiver import WebhookReceiver
from tests.test_node import free_port  # a loopback port nobody listens on (until a fake is)
from tests.test_telegram import TOKEN, one_turn, sent, turn_until, wait_for

AGENT, CHANNEL, CHAT = "tg", "telegram", 5020
SECRET = "test-webhook-secret"
_TIMEOUT = "timeout_s: 0.5"


def telegram_agent(url: str, *, on_uncertain: str = "resend", backoff: str = "[0.05, 0.1]") -> str:
    return f"""
id: {AGENT}
model: {{provider: scripted}}
channels:
  - {{id: {CHANNEL}, type: telegram, api_base_url: "{url}", allow_from: ["*"],
     poll_timeout_s: 1, backoff_s: {backoff}, on_uncertain: {on_uncertain}, {_TIMEOUT}}}
"""


def webhook_agent(url: str) -> str:
    return f"""
id: hooked
model: {{provider: scripted}}
channels:
  - {{id: hooks, type: webhook, url: "{url}", backoff_s: [0.05, 0.1, 0.2]}}
"""


@pytest.fixture
def fake() -> Iterator[FakeTelegram]:
    with FakeTelegram(TOKEN) as f:
        yield f
    assert f.errors == []


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver(SECRET) as r:
        yield r
    assert r.errors == []


@pytest.fixture(autouse=True)
def _secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", TOKEN)
    monkeypatch.setenv("DISPACH_WEBHOOK_SECRET", SECRET)


def outbound(uncertain: bool = False) -> Outbound:
    return Outbound(key="o_0000000000000000000000001", agent_id=AGENT, session_key="s",
                    turn_id="t_1", to=str(CHAT), thread=None, text="hello", chunk_index=0,
                    chunk_total=1, attempt=1, uncertain=uncertain)  # fmt: skip


async def deliveries(api: ApiServer, agent: str, turn_id: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=api.url, headers=api.headers) as client:
        r = await client.get(f"/v1/agents/{agent}/turns/{turn_id}")
    assert r.status_code == 200, r.text
    found: list[dict[str, Any]] = r.json()["deliveries"]
    return found


def of(events: list[RecordedEvent], kind: type[Any]) -> list[Any]:
    return [e.data for e in events if isinstance(e.data, kind)]


def delivery_types(events: list[RecordedEvent]) -> list[str]:
    return [e.type for e in events if e.type.startswith("delivery.")]


# --- Telegram: what a send's failure proves ---------------------------------------------------

ARRANGE: dict[str, Callable[[FakeTelegram], None]] = {
    "dropped after the request": lambda f: f.drop_next("sendMessage"),
    "answered after the timeout": lambda f: f.hold_next("sendMessage", 10.0),
    "a 500 from the Bot API": lambda f: f.fail_next("sendMessage", 500, "Internal Server Error"),
    "a 502 page from the front": lambda f: f.front_error_next("sendMessage", 502),
    "a 504 from the front": lambda f: f.fail_next("sendMessage", 504, "Gateway Timeout"),
    "flood control": lambda f: f.fail_next("sendMessage", 429, "Too Many Requests: retry after 3",
                                           retry_after=3),
    "a 400": lambda f: f.fail_next("sendMessage", 400, "Bad Request: chat not found"),
}  # fmt: skip
# case -> (in doubt, retryable, code)
EXPECTED: dict[str, tuple[bool, bool, str]] = {
    "dropped after the request": (True, True, "delivery_connection_lost"),
    "answered after the timeout": (True, True, "delivery_timeout"),
    "a 500 from the Bot API": (True, True, "telegram_500"),
    "a 502 page from the front": (False, True, "telegram_502"),
    "a 504 from the front": (False, True, "telegram_504"),
    "flood control": (False, True, "telegram_429"),
    "a 400": (False, False, "telegram_400"),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(ARRANGE))
async def test_telegram_says_which_failures_leave_a_send_in_doubt(
    fake: FakeTelegram, case: str
) -> None:
    ARRANGE[case](fake)
    config = TelegramConfig(id=CHANNEL, api_base_url=fake.url, timeout_s=0.5)
    channel = TelegramChannel(config, TOKEN, None)
    try:
        result = await channel.send(outbound())
    finally:
        await channel.aclose()
    in_doubt, retryable, code = EXPECTED[case]
    assert (result.ok, result.in_doubt, result.retryable, result.code) == (
        False, in_doubt, retryable, code), result  # fmt: skip
    assert result.retry_after_s == (3.0 if case == "flood control" else None)
    carried_out = case in ("dropped after the request", "answered after the timeout")
    assert len(fake.sent) == int(carried_out) and len(fake.calls("sendMessage")) == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["a refused connection", "a name that does not resolve"])
async def test_telegram_failures_before_the_request_are_not_in_doubt(where: str) -> None:
    url = f"http://127.0.0.1:{free_port()}" if where == "a refused connection" else (
        "http://api.telegram.invalid")  # fmt: skip
    channel = TelegramChannel(
        TelegramConfig(id=CHANNEL, api_base_url=url, timeout_s=2), TOKEN, None
    )
    try:
        result = await channel.send(outbound())
    finally:
        await channel.aclose()
    assert (result.ok, result.in_doubt, result.retryable) == (False, False, True), result
    assert result.code == "delivery_unreachable" and TOKEN not in result.error


# --- Telegram end to end ----------------------------------------------------------------------

DOUBTS: dict[str, Callable[[FakeTelegram], None]] = {
    "the connection drops after the request": lambda f: f.drop_next("sendMessage"),
    "the answer comes after the client's timeout": lambda f: f.hold_next("sendMessage", 10.0),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("doubt", list(DOUBTS))
async def test_a_telegram_send_in_doubt_is_resent_flagged_uncertain(
    fake: FakeTelegram, api_factory: ApiFactory, doubt: str
) -> None:
    DOUBTS[doubt](fake)  # Telegram takes the message, the answer is lost
    api_factory.write_agent(AGENT, telegram_agent(fake.url, on_uncertain="resend"))
    api = await api_factory.start()
    fake.push_message(CHAT, "hello", from_id=CHAT)
    events = await one_turn(api, "delivery.sent")

    first, second = await sent(fake, 2)  # on_uncertain: resend says a duplicate beats silence
    assert first["text"] == second["text"] and "hello" in first["text"]
    assert "x-dispach-uncertain" not in first["headers"]
    assert second["headers"].get("x-dispach-uncertain") == "1"
    assert delivery_types(events) == [
        "delivery.enqueued",
        "delivery.attempted",
        "delivery.uncertain",
        "delivery.attempted",
        "delivery.sent",
    ]
    (flag,) = of(events, DeliveryUncertain)
    assert (flag.attempts, flag.resend, flag.idempotent_send) == (1, True, False)
    assert flag.code in ("delivery_connection_lost", "delivery_timeout") and flag.error
    (done,) = of(events, DeliverySent)
    assert (done.attempts, done.uncertain) == (2, True)
    turn_id = events[0].metadata.turn_id
    assert turn_id is not None
    assert await deliveries(api, AGENT, turn_id) == [
        {"channel": CHANNEL, "to": str(CHAT), "status": "sent", "chunks": 1, "sent": 1,
         "attempts": 2, "uncertain": True}]  # fmt: skip
    assert len(fake.sent) == 2


@pytest.mark.asyncio
@pytest.mark.parametrize("doubt", list(DOUBTS))
async def test_a_telegram_send_in_doubt_on_a_skip_channel_is_never_resent(
    fake: FakeTelegram, api_factory: ApiFactory, doubt: str
) -> None:
    DOUBTS[doubt](fake)
    api_factory.write_agent(AGENT, telegram_agent(fake.url, on_uncertain="skip"))
    api = await api_factory.start()
    fake.push_message(CHAT, "first", from_id=CHAT)
    events = await one_turn(api, "delivery.uncertain")
    turn_id = events[0].metadata.turn_id
    assert turn_id is not None
    # The chat's line moves on past the settled item: the next reply comes after it, and the
    # first is never sent again.
    fake.push_message(CHAT, "second", from_id=CHAT)
    messages = await sent(fake, 2)
    assert ["first" in m["text"] for m in messages] == [True, False], messages
    assert "second" in messages[1]["text"]
    assert all("x-dispach-uncertain" not in m["headers"] for m in messages)
    store = api.node.store
    assert store is not None

    async def second_sent() -> list[Any]:
        rows = await store.afetch(b"SELECT status FROM outbox WHERE turn_id <> %s", [turn_id])
        return rows if rows and rows[0][0] == "sent" else []

    await wait_for(second_sent, "the second reply recorded as sent")
    events = await turn_until(api, turn_id, "delivery.uncertain")
    assert delivery_types(events) == ["delivery.enqueued", "delivery.attempted",
                                      "delivery.uncertain"]  # fmt: skip
    (flag,) = of(events, DeliveryUncertain)
    assert (flag.attempts, flag.resend, flag.idempotent_send) == (1, False, False)
    assert await deliveries(api, AGENT, turn_id) == [
        {"channel": CHANNEL, "to": str(CHAT), "status": "uncertain", "chunks": 1, "sent": 0,
         "attempts": 1, "uncertain": True}]  # fmt: skip
    assert len(fake.sent) == 2 and len(fake.calls("sendMessage")) == 2


@pytest.mark.asyncio
async def test_a_refused_telegram_connection_is_retried_blindly_and_sent_once(
    api_factory: ApiFactory,
) -> None:
    port = free_port()  # nothing listens there yet: every connection is refused
    url = f"http://127.0.0.1:{port}"
    api_factory.write_agent(AGENT, telegram_agent(url, backoff="[0.3, 0.3, 0.3, 0.3, 0.3]"))
    api = await api_factory.start()
    async with httpx.AsyncClient(base_url=api.url, headers=api.headers) as client:
        deliver = {"channel": CHANNEL, "to": str(CHAT)}
        r = await client.post(f"/v1/agents/{AGENT}/messages",
                              json={"text": "hello", "deliver": deliver})  # fmt: skip
    assert r.status_code == 202, r.text
    turn_id = r.json()["turnId"]
    events = await turn_until(api, turn_id, "delivery.retry")
    (retry,) = of(events, DeliveryRetry)
    assert retry.code == "delivery_unreachable" and TOKEN not in retry.error
    with FakeTelegram(TOKEN, port=port) as fake:  # Telegram is reachable again
        events = await turn_until(api, turn_id, "delivery.sent")
        (message,) = await sent(fake, 1)
        assert "x-dispach-uncertain" not in message["headers"]
        assert of(events, DeliveryUncertain) == []
        (done,) = of(events, DeliverySent)
        assert done.attempts == len(of(events, DeliveryRetry)) + 1 >= 2
        assert done.uncertain is False
        (info,) = await deliveries(api, AGENT, turn_id)
        assert (info["status"], info.get("uncertain", False)) == ("sent", False)
    assert fake.errors == []


# --- the webhook channel ----------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "case", ["dropped after the request", "answered after the timeout", "a refused connection",
             "a 503"])  # fmt: skip
async def test_the_webhook_channel_says_which_failures_leave_a_send_in_doubt(
    receiver: WebhookReceiver, case: str
) -> None:
    url = receiver.url
    if case == "dropped after the request":
        receiver.drop_next()
    elif case == "answered after the timeout":
        receiver.hold_next(10.0)
    elif case == "a refused connection":
        url = f"http://127.0.0.1:{free_port()}/hooks"
    else:
        receiver.fail_next(503)
    channel = WebhookChannel(WebhookConfig(id="hooks", url=url, timeout_s=0.5), SECRET)
    try:
        result = await channel.send(outbound())
    finally:
        await channel.aclose()
    expected = {
        "dropped after the request": (True, "delivery_connection_lost"),
        "answered after the timeout": (True, "delivery_timeout"),
        "a refused connection": (False, "delivery_unreachable"),
        "a 503": (False, "delivery_http_503"),
    }[case]
    assert (result.ok, result.retryable, result.in_doubt, result.code) == (
        False, True, *expected), result  # fmt: skip


@pytest.mark.asyncio
async def test_a_webhook_send_in_doubt_is_resent_with_its_key_and_flagged(
    api_factory: ApiFactory, receiver: WebhookReceiver
) -> None:
    api_factory.write_agent("hooked", webhook_agent(receiver.url))
    api = await api_factory.start()
    receiver.drop_next()  # kept, then the connection closes with no answer
    async with httpx.AsyncClient(base_url=api.url, headers=api.headers) as client:
        r = await client.post(
            "/v1/agents/hooked/messages",
            json={"text": "hello", "deliver": {"channel": "hooks", "to": "ops"}},
        )
    assert r.status_code == 202, r.text
    turn_id = r.json()["turnId"]
    events = await turn_until(api, turn_id, "delivery.sent")

    first, second = receiver.received
    assert first.idempotency_key == second.idempotency_key and first.raw == second.raw
    assert [first.duplicate, second.duplicate] == [False, True]  # the receiver keeps one
    assert "x-dispach-uncertain" not in first.headers
    assert second.headers.get("x-dispach-uncertain") == "1"
    assert list(receiver.kept) == [first.idempotency_key]
    (flag,) = of(events, DeliveryUncertain)
    assert (flag.resend, flag.idempotent_send, flag.code) == (
        True, True, "delivery_connection_lost")  # fmt: skip
    (done,) = of(events, DeliverySent)
    assert (done.attempts, done.uncertain) == (2, True)
    assert await deliveries(api, "hooked", turn_id) == [
        {"channel": "hooks", "to": "ops", "status": "sent", "chunks": 1, "sent": 1,
         "attempts": 2, "uncertain": True}]  # fmt: skip


# --- the plan ---------------------------------------------------------------------------------


def item(attempts: int = 1) -> Item:
    return Item(item_id="o_1", agent_id=AGENT, session_key="s", turn_id="t_1",
                channel_id="hooks", recipient="ops", thread=None, chunk_index=0, chunk_total=1,
                body="hello", status="inflight", attempts=attempts, uncertain=False,
                version=1)  # fmt: skip


def doubtful() -> SendResult:
    return SendResult(ok=False, retryable=True, in_doubt=True, code="delivery_timeout",
                      error="no answer in 0.5 s")  # fmt: skip


@pytest.mark.parametrize(
    ("on_uncertain", "attempt", "resend", "delayed"),
    [("resend", 1, True, True),    # sent again after the usual pause, flagged
     ("skip", 1, False, False),    # settled as uncertain: never sent again
     ("resend", 4, False, False)],  # out of attempts: settled as uncertain, not failed
)  # fmt: skip
def test_the_plan_records_a_send_in_doubt_as_uncertain(
    on_uncertain: Literal["resend", "skip"], attempt: int, resend: bool, delayed: bool
) -> None:
    config = WebhookConfig(id="hooks", url="http://127.0.0.1:9/", backoff_s=[1.0, 2.0, 4.0],
                           on_uncertain=on_uncertain)  # fmt: skip
    channel = WebhookChannel(config, SECRET)
    event = settle(item(attempt), channel, attempt, doubtful(), random.Random(7))
    assert isinstance(event, DeliveryUncertain), event
    assert (event.attempts, event.resend, event.idempotent_send) == (attempt, resend, True)
    assert (event.code, event.error) == ("delivery_timeout", "no answer in 0.5 s")
    assert (800 <= event.delay_ms <= 1200) if delayed else event.delay_ms == 0


def test_the_plan_retries_a_failure_that_proves_nothing_was_taken() -> None:
    channel = WebhookChannel(WebhookConfig(id="hooks", url="http://127.0.0.1:9/"), SECRET)
    refused = SendResult(ok=False, retryable=True, code="delivery_unreachable", error="refused")
    event = settle(item(), channel, 1, refused, random.Random(7))
    assert isinstance(event, DeliveryRetry) and event.code == "delivery_unreachable"

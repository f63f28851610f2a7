"""The Telegram channel end to end: a real node (Postgres, NATS, uvicorn) talks to the fake Bot
API as it would to Telegram. Messages come in by long polling or webhook and become one turn
each (a duplicate update is refused on the record, not run twice); replies go back to the chat
and forum topic they came from, cut to Telegram's 4,096 UTF-16 units, with retries as the Bot
API asks; senders off the allow-list are refused with the line to add; the token stays secret."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import httpx
import msgspec
import pytest

from actors.outbox import utf16_len
from eventstore import START, RecordedEvent, streams
from eventstore.catalogue import Deliver, Sender
from tests.conftest import ApiFactory, ApiServer
from tests.fakes.telegram_server import FakeTelegram

TOKEN = "123456:TEST-fake-bot-token_AbCdEfGhIjKlMnOpQrStUvWxYz"
WEBHOOK_SECRET = "tg-webhook-secret-0123456789"
AGENT, CHANNEL = "tg", "telegram"
# About 10,000 characters of words with emoji among them: Telegram counts an emoji as two units.
LONG = " ".join(f"w{i:04d}" if i % 7 else "\U0001f600ok" for i in range(1700))

T = TypeVar("T")


def manifest(url: str, *, allow: str = '["*"]', mode: str = "longpoll") -> str:
    extra = ", secret_token_env: TG_SECRET" if mode == "webhook" else ""
    return f"""
id: {AGENT}
model:
  provider: scripted
  script:
    - {{match: "^long$", reply: "{LONG}"}}
channels:
  - {{id: {CHANNEL}, type: telegram, api_base_url: "{url}", allow_from: {allow}, mode: {mode},
     poll_timeout_s: 1, backoff_s: [0.05, 0.1]{extra}}}
"""


@pytest.fixture
def fake() -> Iterator[FakeTelegram]:
    with FakeTelegram(TOKEN) as f:
        yield f
    assert f.errors == []


@pytest.fixture(autouse=True)
def _secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", TOKEN)
    monkeypatch.setenv("TG_SECRET", WEBHOOK_SECRET)


async def start(api_factory: ApiFactory, fake: FakeTelegram, **kw: Any) -> ApiServer:
    tokens = kw.pop("tokens", ())
    api_factory.write_agent(AGENT, manifest(fake.url, **kw))
    return await api_factory.start(tokens=tokens)


async def wait_for(check: Callable[[], Awaitable[T]], what: str, timeout: float = 8.0) -> T:
    """Poll ``check`` until it returns something truthy."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        got = await check()
        if got:
            return got
        assert loop.time() < deadline, f"timed out waiting for {what}: last saw {got!r}"
        await asyncio.sleep(0.02)


async def all_events(api: ApiServer) -> list[RecordedEvent]:
    store = api.node.store
    assert store is not None
    events: list[RecordedEvent] = []
    after = START
    while page := await store.aread_all(after, 1000):
        events += page
        after = page[-1].checkpoint
    return events


async def of_type(api: ApiServer, event_type: str) -> list[RecordedEvent]:
    return [e for e in await all_events(api) if e.type == event_type]


async def turn_until(api: ApiServer, turn_id: str, event_type: str) -> list[RecordedEvent]:
    """The turn's events (its deliveries too) once one of them is ``event_type``."""
    store = api.node.store
    assert store is not None

    async def check() -> list[RecordedEvent]:
        events = await store.aread_turn(turn_id)
        return events if any(e.type == event_type for e in events) else []

    return await wait_for(check, f"{event_type} in turn {turn_id}")


async def one_turn(api: ApiServer, until: str = "delivery.sent") -> list[RecordedEvent]:
    """The events of the only turn so far, once it reached ``until``."""
    (start_event,) = await wait_for(lambda: of_type(api, "turn.start"), "a turn")
    turn_id = start_event.metadata.turn_id
    assert turn_id is not None
    return await turn_until(api, turn_id, until)


async def rejections(api: ApiServer, n: int) -> list[Any]:
    stream = streams.channel(AGENT, CHANNEL)

    async def check() -> list[Any]:
        events = [e for e in await all_events(api) if e.stream == stream]
        return [e.data for e in events] if len(events) >= n else []

    return await wait_for(check, f"{n} channel.rejected")


async def sent(fake: FakeTelegram, n: int) -> list[dict[str, Any]]:
    async def check() -> list[dict[str, Any]]:
        return fake.sent if len(fake.sent) >= n else []

    return await wait_for(check, f"{n} messages sent")


async def stop(api_factory: ApiFactory, api: ApiServer) -> None:
    """Stop one node of the test now (the fixtures then leave it alone)."""
    await api.node.stop()  # first: its channels stop polling at once
    await api.stop()
    api_factory.started.remove(api)
    api_factory.nodes.started.remove(api.node)


# --- inbound ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_polled_message_is_one_turn_answered_in_its_chat(
    fake: FakeTelegram, api_factory: ApiFactory
) -> None:
    api = await start(api_factory, fake)
    fake.push_message(5001, "hello", from_id=5001, username="ada")
    events = await one_turn(api)
    turn_start = next(e for e in events if e.type == "turn.start")
    assert turn_start.metadata.session_key == f"{CHANNEL}:5001"
    assert turn_start.data.source == CHANNEL  # type: ignore[union-attr]
    sender = turn_start.data.sender  # type: ignore[union-attr]
    assert sender is not None and (sender.id, sender.name) == ("5001", "ada")
    assert turn_start.data.deliver == Deliver(channel=CHANNEL, to="5001")  # type: ignore[union-attr]
    (message,) = fake.sent
    assert message["chat_id"] == 5001 and message["message_thread_id"] is None
    assert "hello" in message["text"] and "x-dispach-uncertain" not in message["headers"]
    delivered = next(e for e in events if e.type == "delivery.sent")
    assert delivered.data.provider_message_id == str(message["message_id"])  # type: ignore[union-attr]
    assert len(await of_type(api, "turn.start")) == 1 and len(fake.sent) == 1


@pytest.mark.asyncio
async def test_an_update_fetched_again_after_a_restart_is_a_duplicate(
    fake: FakeTelegram, api_factory: ApiFactory
) -> None:
    # The first poll hands the update over; the next ones, which would confirm it, never reach
    # the provider (the poller pauses 1 s, then 2 s): a node stopped meanwhile leaves the update
    # unconfirmed, as a crash would.
    fake.hold_next("getUpdates", 0.0)
    fake.drop_next("getUpdates", count=2, processed=False)
    update = fake.push_message(5002, "once", from_id=5002)
    first = await start(api_factory, fake)

    async def dropped() -> bool:
        return len(fake.calls("getUpdates")) >= 2

    await wait_for(dropped, "the confirming poll")
    await stop(api_factory, first)
    assert fake.updates_confirmed <= update["update_id"], "confirmed before the node stopped"
    second = await api_factory.start()
    (rejected,) = await rejections(second, 1)
    (turn_start,) = await of_type(second, "turn.start")
    assert rejected.reason == "duplicate" and rejected.turn_id == turn_start.metadata.turn_id
    assert rejected.update_id == f"123456:{update['update_id']}"
    await turn_until(second, rejected.turn_id, "delivery.sent")
    await wait_for(lambda: _confirmed(fake, update["update_id"] + 1), "the update confirmed")
    assert len(fake.sent) == 1 and len(await of_type(second, "turn.start")) == 1


async def _confirmed(fake: FakeTelegram, offset: int) -> bool:
    return fake.updates_confirmed >= offset


@pytest.mark.asyncio
async def test_a_malformed_update_does_not_stop_the_poller(
    fake: FakeTelegram, api_factory: ApiFactory
) -> None:
    api = await start(api_factory, fake)
    # A sender that is not an object reads as the chat itself; a chat that is not one, as no
    # message at all.
    fake.push_update({"message": {"message_id": 1, "date": 0, "text": "odd", "from": "garbage",
                                  "chat": {"id": 5008, "type": "private"}}})  # fmt: skip
    fake.push_update({"message": {"message_id": 2, "date": 0, "chat": ["not", "a", "chat"]}})
    fake.push_message(5009, "after the odd ones", from_id=5009)
    messages = await sent(fake, 2)
    assert [m["chat_id"] for m in messages] == [5008, 5009]
    starts = await of_type(api, "turn.start")
    assert [e.data.sender for e in starts] == [Sender(id="5008"), Sender(id="5009", name="Ada")]  # type: ignore[union-attr]


@pytest.mark.asyncio
async def test_the_allow_list_refuses_strangers_and_matches_handles_in_any_case(
    fake: FakeTelegram, api_factory: ApiFactory
) -> None:
    api = await start(api_factory, fake, allow='["@Ada_Lovelace", "777"]')
    fake.push_message(555, "let me in", from_id=555, username="mallory")
    fake.push_message(556, "hi from ada", from_id=556, username="ada_LOVELACE")
    fake.push_message(777, "hi from 777", from_id=777)
    (denied,) = await rejections(api, 1)
    assert denied.reason == "denied" and denied.sender_id == "555"
    assert "@mallory" in denied.message and '"555"' in denied.hint
    assert "allow_from" in denied.hint and f"agents/{AGENT}.yaml" in denied.hint
    messages = await sent(fake, 2)
    assert sorted(m["chat_id"] for m in messages) == [556, 777]
    starts = await of_type(api, "turn.start")
    assert sorted(e.metadata.session_key or "" for e in starts) == [
        f"{CHANNEL}:556", f"{CHANNEL}:777"]  # fmt: skip
    await wait_for(lambda: _confirmed(fake, 1003), "all three updates taken")
    assert len(await rejections(api, 1)) == 1 and len(fake.sent) == 2


@pytest.mark.asyncio
async def test_a_forum_topic_is_its_own_session_and_gets_the_reply(
    fake: FakeTelegram, api_factory: ApiFactory
) -> None:
    api = await start(api_factory, fake)
    fake.push_message(-100123, "in a topic", from_id=42, chat_type="supergroup",
                      message_thread_id=77)  # fmt: skip
    events = await one_turn(api)
    turn_start = next(e for e in events if e.type == "turn.start")
    assert turn_start.metadata.session_key == f"{CHANNEL}:-100123:77"
    assert turn_start.data.sender.id == "42"  # type: ignore[union-attr]
    (message,) = fake.sent
    assert (message["chat_id"], message["message_thread_id"]) == (-100123, 77)


# --- outbound ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_long_reply_arrives_in_order_in_chunks_telegram_can_hold(
    fake: FakeTelegram, api_factory: ApiFactory
) -> None:
    api = await start(api_factory, fake)
    fake.push_message(5003, "long", from_id=5003)
    events = await one_turn(api, "turn.end")
    reply = next(e for e in events if e.type == "turn.end").data.text  # type: ignore[union-attr]
    assert reply.endswith(LONG) and utf16_len(reply) > 2 * 4096
    total = next(e for e in events if e.type == "delivery.enqueued").data.chunk_total  # type: ignore[union-attr]
    assert total >= 3
    messages = await sent(fake, total)
    assert all(utf16_len(m["text"]) <= 4096 and m["chat_id"] == 5003 for m in messages)
    assert " ".join(m["text"] for m in messages) == reply  # the spaces at the cuts are dropped
    assert len(fake.sent) == total


@pytest.mark.asyncio
async def test_a_failing_middle_chunk_abandons_the_rest(
    fake: FakeTelegram, api_factory: ApiFactory
) -> None:
    fake.hold_next("sendMessage", 0.0)  # the first chunk goes through, the second is refused
    fake.fail_next("sendMessage", 400, "Bad Request: can't parse entities")
    api = await start(api_factory, fake)
    fake.push_message(5004, "long", from_id=5004)
    events = await one_turn(api, "delivery.failed")
    (failed,) = [e.data for e in events if e.type == "delivery.failed"]
    total = failed.chunk_total  # type: ignore[union-attr]
    assert (failed.chunk_index, failed.attempts, failed.exhausted) == (1, 1, False)  # type: ignore[union-attr]
    assert failed.abandoned == total - 2 >= 1 and failed.code == "telegram_400"  # type: ignore[union-attr]
    assert "can't parse entities" in failed.error  # type: ignore[union-attr]
    store = api.node.store
    assert store is not None
    turn_id = events[0].metadata.turn_id

    async def settled() -> list[tuple[Any, ...]]:
        rows = await store.afetch(
            b"SELECT chunk_index, status, error_code FROM outbox WHERE turn_id = %s"
            b" ORDER BY chunk_index", [turn_id])  # fmt: skip
        return rows if all(r[1] != "pending" for r in rows) else []

    rows = await wait_for(settled, "the outbox rows settled")
    assert rows[:2] == [(0, "sent", None), (1, "failed", "telegram_400")]
    assert rows[2:] == [(i, "failed", "delivery_chunk_abandoned") for i in range(2, total)]
    assert len(fake.sent) == 1 and len(fake.calls("sendMessage")) == 2


RETRIES: dict[str, tuple[Callable[[FakeTelegram], None], int, str]] = {
    "flood control": (lambda f: f.fail_next("sendMessage", 429, "Too Many Requests: retry after 1",
                                            retry_after=1), 1, "delivery.sent"),
    "server errors": (lambda f: f.fail_next("sendMessage", 502, "Bad Gateway", count=2), 2,
                      "delivery.sent"),
    "blocked by the user": (lambda f: f.forbid_chat(5005), 0, "delivery.failed"),
}  # fmt: skip


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(RETRIES))
async def test_a_send_is_retried_as_the_provider_asks(
    fake: FakeTelegram, api_factory: ApiFactory, case: str
) -> None:
    arrange, retries, outcome = RETRIES[case]
    arrange(fake)
    api = await start(api_factory, fake)
    fake.push_message(5005, "hello", from_id=5005)
    events = await one_turn(api, outcome)
    types = [e.type for e in events if e.type.startswith("delivery.")]
    assert types == ["delivery.enqueued"] + ["delivery.attempted", "delivery.retry"] * retries + [
        "delivery.attempted", outcome]  # fmt: skip
    final = events[-1].data
    assert final.attempts == retries + 1  # type: ignore[union-attr]
    delays = [e.data.delay_ms for e in events if e.type == "delivery.retry"]  # type: ignore[union-attr]
    if case == "flood control":
        assert delays == [1000]  # Telegram's retry_after, kept exactly
        assert len(fake.sent) == 1
    elif case == "server errors":
        assert all(40 <= d <= 120 for d in delays) and len(fake.sent) == 1
    else:
        assert final.code == "telegram_403" and final.exhausted is False  # type: ignore[union-attr]
        assert "blocked" in final.error and fake.sent == []  # type: ignore[union-attr]


@pytest.mark.asyncio
async def test_replies_to_one_chat_arrive_in_order_even_when_the_first_must_wait(
    fake: FakeTelegram, api_factory: ApiFactory
) -> None:
    # The first reply meets flood control (retry in 1 s); the second turn ends meanwhile. A chat
    # shows replies in the order they were promised: the second waits for the first.
    fake.fail_next("sendMessage", 429, "Too Many Requests: retry after 1", retry_after=1)
    api = await start(api_factory, fake)
    fake.push_message(5006, "first", from_id=5006)
    await wait_for(lambda: _n(of_type(api, "delivery.retry"), 1), "the first reply's retry")
    fake.push_message(5006, "second", from_id=5006)
    await wait_for(lambda: _n(of_type(api, "turn.end"), 2), "the second turn's end")
    messages = await sent(fake, 2)
    assert ["first" in m["text"] for m in messages] == [True, False]
    assert "second" in messages[1]["text"]


# --- webhook mode -----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_webhook_updates_need_the_secret_but_no_bearer_token(
    fake: FakeTelegram, api_factory: ApiFactory
) -> None:
    api = await start(api_factory, fake, mode="webhook", tokens=["s3cret"])
    update = {"update_id": 9001, "message": {
        "message_id": 1, "date": 0, "text": "via webhook",
        "from": {"id": 6001, "is_bot": False, "first_name": "Ada", "username": "ada"},
        "chat": {"id": 6001, "type": "private", "first_name": "Ada"}}}  # fmt: skip
    path = f"/v1/channels/{CHANNEL}/webhook/{AGENT}"
    right = {"X-Telegram-Bot-Api-Secret-Token": WEBHOOK_SECRET}
    async with httpx.AsyncClient(base_url=api.url) as client:
        for headers in ({"X-Telegram-Bot-Api-Secret-Token": "wrong"}, {}):
            r = await client.post(path, json=update, headers=headers)
            assert r.status_code == 401, r.text
            error = r.json()["error"]
            assert error["code"] == "unauthorized" and error["message"] and error["hint"]
        for other in (
            f"/v1/channels/{CHANNEL}/webhook/nobody",
            f"/v1/channels/sms/webhook/{AGENT}",
        ):
            r = await client.post(other, json=update, headers=right)
            assert r.status_code == 404 and r.json()["error"]["code"] == "webhook_not_found"
        assert await of_type(api, "turn.start") == []
        r = await client.post(path, json=update, headers=right)
        assert r.status_code == 200 and r.json() == {"ok": True}
        events = await one_turn(api)
        assert events[0].metadata.session_key == f"{CHANNEL}:6001"
        # Telegram posts an update again when it missed the answer: still one turn.
        r = await client.post(path, json=update, headers=right)
        assert r.status_code == 200
        (rejected,) = await rejections(api, 1)
        assert rejected.reason == "duplicate"
        # The rest of the API still wants its token.
        r = await client.get(f"/v1/agents/{AGENT}/turns")
        assert r.status_code == 401
    (message,) = fake.sent
    assert message["chat_id"] == 6001 and "via webhook" in message["text"]
    assert fake.calls("getUpdates") == []
    assert len(await of_type(api, "turn.start")) == 1


# --- secrecy ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_bot_token_is_never_logged_nor_recorded(
    fake: FakeTelegram,
    api_factory: ApiFactory,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)
    fake.fail_next("getUpdates", 502, "Bad Gateway")  # a poll failure is logged
    fake.fail_next("sendMessage", 503, "Service Unavailable")  # a retry is recorded
    fake.forbid_chat(5007)  # and so is a failure
    api = await start(api_factory, fake)
    fake.push_message(5006, "hello", from_id=5006)
    await one_turn(api)
    fake.push_message(5007, "hello", from_id=5007)
    turns = await wait_for(lambda: _n(of_type(api, "turn.start"), 2), "the second turn")
    turn_id = turns[-1].metadata.turn_id
    assert turn_id is not None
    await turn_until(api, turn_id, "delivery.failed")
    records = await all_events(api)
    assert {"delivery.retry", "delivery.failed"} <= {e.type for e in records}
    for event in records:
        assert TOKEN not in msgspec.json.encode([event.data, event.metadata]).decode(), event.type
    logged = "\n".join(r.getMessage() + repr(r.__dict__) for r in caplog.records)
    out, err = capfd.readouterr()
    assert "telegram_poll_failed" in logged + out + err  # the capture did see the node's lines
    assert "/bot<token>/sendMessage" in logged  # httpx2 logs each URL: masked
    assert TOKEN not in logged and TOKEN not in out and TOKEN not in err


@pytest.mark.asyncio
async def test_a_recipient_telegram_cannot_reach_is_refused_when_the_message_is_sent(
    api_factory: ApiFactory, fake: FakeTelegram
) -> None:
    api = await start(api_factory, fake)
    async with httpx.AsyncClient(base_url=api.url) as client:
        bad = [{"channel": "telegram", "to": "bob"},
               {"channel": "telegram", "to": "42", "thread": "general"}]  # fmt: skip
        answers = [await client.post("/v1/agents/tg/messages", json={"text": "hi", "deliver": d})
                   for d in bad]  # fmt: skip
        channel = {"channel": "telegram", "to": "@news_channel"}
        good = await client.post("/v1/agents/tg/messages", json={"text": "hi", "deliver": channel})
    assert [a.status_code for a in answers] == [400, 400]
    assert all(a.json()["error"]["code"] == "deliver_invalid" for a in answers)
    assert answers[0].json()["error"]["field"] == "deliver.to"
    assert good.status_code == 202, good.text


async def _n(events: Awaitable[list[RecordedEvent]], n: int) -> list[RecordedEvent]:
    got = await events
    return got if len(got) >= n else []


# --- a stopped agent ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_stopped_agents_long_poll_pauses_and_resumes_on_start_losing_no_update(
    fake: FakeTelegram, api_factory: ApiFactory
) -> None:
    api = await start(api_factory, fake)
    await wait_for(lambda: _polled(fake, 1), "the first getUpdates")
    async with httpx.AsyncClient(base_url=api.url) as http:
        stopped = await http.post(f"/v1/agents/{AGENT}/stop", json={"reason": "quiet"})
        assert stopped.status_code == 200, stopped.text
        await asyncio.sleep(0.2)  # a poll cancelled as it was answered is counted before this
        polls = len(fake.calls("getUpdates"))
        fake.push_message(5001, "while stopped", from_id=5001, username="ada")
        await asyncio.sleep(3)  # three poll timeouts: a poller would have asked again by now
        assert len(fake.calls("getUpdates")) == polls, "no getUpdates while the agent is stopped"
        assert await of_type(api, "turn.start") == []
        assert await of_type(api, "channel.rejected") == []

        started = await http.post(f"/v1/agents/{AGENT}/start")
        assert started.status_code == 200, started.text
        events = await one_turn(api)
    turn_start = next(e for e in events if e.type == "turn.start")
    assert turn_start.data.input == "while stopped"  # type: ignore[union-attr]
    (message,) = fake.sent
    assert message["chat_id"] == 5001 and "while stopped" in message["text"]
    assert len(fake.calls("getUpdates")) > polls
    assert await of_type(api, "channel.rejected") == []


async def _polled(fake: FakeTelegram, n: int) -> bool:
    return len(fake.calls("getUpdates")) >= n

"""The fake Telegram Bot API and the webhook receiver, proven over real sockets with httpx.

Delivery tests trust these fakes to behave like the remote ends: what passes here (offset
confirmation, long polls, flood-control answers, lost answers, signatures, idempotency keys) is
what the channel adapters will meet.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.fakes.telegram_server import FakeTelegram
from tests.fakes.webhook_receiver import WebhookReceiver, sign

TOKEN = "123456:test-token"
SECRET = "whsec-test"


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(trust_env=False, timeout=5.0) as http:
        yield http


@pytest.fixture
def telegram() -> Iterator[FakeTelegram]:
    with FakeTelegram(TOKEN) as fake:
        yield fake
    assert fake.errors == []


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver(SECRET) as fake:
        yield fake
    assert fake.errors == []


def call(client: httpx.Client, fake: FakeTelegram, method: str, **params: Any) -> httpx.Response:
    return client.post(f"{fake.url}/bot{TOKEN}/{method}", json=params)


def result(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["ok"] is True
    return body["result"]


# --------------------------------------------------------------------------------------------
# Telegram


def test_get_me_and_the_token_check(client: httpx.Client, telegram: FakeTelegram) -> None:
    me = result(client.get(f"{telegram.url}/bot{TOKEN}/getMe"))
    assert me["is_bot"] is True and me["username"]
    wrong = client.get(f"{telegram.url}/bot123456:wrong/getMe")
    assert wrong.status_code == 401
    assert wrong.json() == {"ok": False, "error_code": 401, "description": "Unauthorized"}
    assert client.get(f"{telegram.url}/bot{TOKEN}/noSuchMethod").status_code == 404
    assert result(client.get(f"{telegram.url}/bot{TOKEN}/getme"))["id"] == me["id"]


def test_updates_come_back_until_an_offset_confirms_them(
    client: httpx.Client, telegram: FakeTelegram
) -> None:
    first = telegram.push_message(42, "one", username="ada")
    second = telegram.push_message(42, "two")
    assert second["update_id"] == first["update_id"] + 1
    assert second["message"]["message_id"] == first["message"]["message_id"] + 1
    assert first["message"]["from"] == {
        "id": 42,
        "is_bot": False,
        "first_name": "Ada",
        "username": "ada",
    }
    assert first["message"]["chat"]["type"] == "private"

    assert result(call(client, telegram, "getUpdates")) == [first, second]
    assert result(call(client, telegram, "getUpdates")) == [first, second]  # not confirmed yet
    assert result(call(client, telegram, "getUpdates", limit=1)) == [first]
    offset = first["update_id"] + 1
    assert result(call(client, telegram, "getUpdates", offset=offset)) == [second]
    assert telegram.updates_confirmed == offset
    assert result(call(client, telegram, "getUpdates")) == [second]  # the first is forgotten


def test_a_raw_update_is_delivered_again_while_unconfirmed(
    client: httpx.Client, telegram: FakeTelegram
) -> None:
    update = telegram.push_message(7, "hello")
    telegram.push_update(update)  # the same update_id twice
    assert [u["update_id"] for u in result(call(client, telegram, "getUpdates"))] == [
        update["update_id"],
        update["update_id"],
    ]
    confirm = update["update_id"] + 1
    assert result(call(client, telegram, "getUpdates", offset=confirm, timeout=0)) == []


def test_a_long_poll_returns_as_soon_as_an_update_arrives(
    client: httpx.Client, telegram: FakeTelegram
) -> None:
    timer = threading.Timer(0.2, telegram.push_message, args=(5, "late"))
    started = time.monotonic()
    timer.start()
    updates = result(call(client, telegram, "getUpdates", timeout=5))
    assert [u["message"]["text"] for u in updates] == ["late"]
    assert 0.15 < time.monotonic() - started < 2.0


def test_a_long_poll_ends_empty_at_its_timeout_or_at_stop(client: httpx.Client) -> None:
    with FakeTelegram(TOKEN) as fake:
        started = time.monotonic()
        assert result(call(client, fake, "getUpdates", timeout=0.3)) == []
        assert 0.25 < time.monotonic() - started < 2.0

        outcome: list[Any] = []

        def poll() -> None:
            try:
                outcome.append(call(client, fake, "getUpdates", timeout=25))
            except httpx.HTTPError as error:
                outcome.append(error)

        poller = threading.Thread(target=poll)
        poller.start()
        time.sleep(0.2)
        started = time.monotonic()
        fake.stop()
        poller.join(5.0)
        assert time.monotonic() - started < 2.0 and len(outcome) == 1


def test_a_newer_poll_terminates_the_waiting_one(
    client: httpx.Client, telegram: FakeTelegram
) -> None:
    answers: list[httpx.Response] = []
    poller = threading.Thread(
        target=lambda: answers.append(call(client, telegram, "getUpdates", timeout=10))
    )
    poller.start()
    time.sleep(0.2)
    assert result(call(client, telegram, "getUpdates")) == []
    poller.join(5.0)
    assert answers[0].status_code == 409
    assert answers[0].json()["description"].startswith("Conflict: terminated by other getUpdates")


def test_a_webhook_blocks_get_updates_until_deleted(
    client: httpx.Client, telegram: FakeTelegram
) -> None:
    assert result(call(client, telegram, "setWebhook", url="https://example.test/hook")) is True
    assert call(client, telegram, "getUpdates").status_code == 409
    assert result(call(client, telegram, "deleteWebhook")) is True
    assert result(call(client, telegram, "getUpdates")) == []
    assert [c.params["url"] for c in telegram.calls("setWebhook")] == ["https://example.test/hook"]


def test_send_message_numbers_messages_per_chat_and_records_them(
    client: httpx.Client, telegram: FakeTelegram
) -> None:
    incoming = telegram.push_message(-1001, "hi", chat_type="supergroup", message_thread_id=9)
    assert incoming["message"]["is_topic_message"] is True
    reply = {"message_id": incoming["message"]["message_id"]}
    params = {"chat_id": "-1001", "text": "hello", "message_thread_id": 9, "parse_mode": "HTML"}
    params["reply_parameters"] = reply
    url = f"{telegram.url}/bot{TOKEN}/sendMessage"
    sent = result(client.post(url, json=params, headers={"x-trace": "abc"}))
    assert sent["message_id"] == 2 and sent["chat"]["id"] == -1001
    assert sent["message_thread_id"] == 9 and sent["text"] == "hello"
    result(client.post(url, data={"chat_id": "77", "text": "by form"}))
    result(client.post(f"{url}?chat_id=77&text=by%20query"))
    records = telegram.wait_for_sent(3, timeout=1.0)
    assert [(r["chat_id"], r["message_id"], r["text"]) for r in records] == [
        (-1001, 2, "hello"),
        (77, 1, "by form"),
        (77, 2, "by query"),
    ]
    assert records[0]["reply_to_message_id"] == 1 and records[0]["headers"]["x-trace"] == "abc"
    with pytest.raises(TimeoutError):
        telegram.wait_for_sent(4, timeout=0.05)


@pytest.mark.parametrize(
    ("text", "status", "description"),
    [
        ("x" * 4096, 200, None),
        ("x" * 4097, 400, "Bad Request: message is too long"),
        ("", 400, "Bad Request: message text is empty"),
    ],
)
def test_send_message_text_limits(
    client: httpx.Client, telegram: FakeTelegram, text: str, status: int, description: str | None
) -> None:
    response = call(client, telegram, "sendMessage", chat_id=1, text=text)
    assert response.status_code == status
    assert response.json().get("description") == description


def test_a_blocked_chat_is_forbidden(client: httpx.Client, telegram: FakeTelegram) -> None:
    telegram.forbid_chat(13)
    response = call(client, telegram, "sendMessage", chat_id=13, text="hi")
    assert response.status_code == 403
    assert response.json()["description"] == "Forbidden: bot was blocked by the user"
    assert result(call(client, telegram, "sendChatAction", chat_id=14, action="typing")) is True
    assert telegram.sent == []


def test_flood_control_answers_in_the_real_429_shape(
    client: httpx.Client, telegram: FakeTelegram
) -> None:
    telegram.fail_next("sendMessage", 429, "Too Many Requests: retry after 3", retry_after=3)
    refused = call(client, telegram, "sendMessage", chat_id=1, text="a")
    assert refused.status_code == 429
    assert refused.json() == {
        "ok": False,
        "error_code": 429,
        "description": "Too Many Requests: retry after 3",
        "parameters": {"retry_after": 3},
    }
    assert result(call(client, telegram, "getMe"))  # faults are per method
    assert result(call(client, telegram, "sendMessage", chat_id=1, text="a"))["message_id"] == 1
    assert len(telegram.calls("sendMessage")) == 2 and len(telegram.sent) == 1


def test_a_dropped_answer_loses_the_reply_but_not_the_message(
    client: httpx.Client, telegram: FakeTelegram
) -> None:
    telegram.drop_next("sendMessage")
    telegram.drop_next("sendMessage", processed=False)
    for _ in range(2):
        with pytest.raises(httpx.RemoteProtocolError):
            call(client, telegram, "sendMessage", chat_id=3, text="once")
    assert [r["text"] for r in telegram.sent] == ["once"]  # sent, though nobody heard back
    assert result(call(client, telegram, "sendMessage", chat_id=3, text="again"))["message_id"] == 2


def test_a_held_answer_comes_late(client: httpx.Client, telegram: FakeTelegram) -> None:
    telegram.hold_next("sendMessage", 0.3)
    started = time.monotonic()
    assert result(call(client, telegram, "sendMessage", chat_id=3, text="slow"))
    assert time.monotonic() - started >= 0.3


# --------------------------------------------------------------------------------------------
# The webhook receiver


def deliver(
    client: httpx.Client,
    receiver: WebhookReceiver,
    body: Any,
    key: str | None = "k-1",
    *,
    secret: str = SECRET,
    timestamp: int | None = None,
) -> httpx.Response:
    raw = json.dumps(body).encode()
    sent_at = str(timestamp if timestamp is not None else int(time.time()))
    headers = {"content-type": "application/json", "x-dispach-timestamp": sent_at}
    headers["x-dispach-signature"] = sign(secret, sent_at, raw)
    if key is not None:
        headers["idempotency-key"] = key
    return client.post(receiver.url, content=raw, headers=headers)


def test_a_signed_delivery_is_kept(client: httpx.Client, receiver: WebhookReceiver) -> None:
    response = deliver(client, receiver, {"text": "hi"})
    assert response.status_code == 200 and response.json()["id"].startswith("rcv_")
    assert receiver.wait_for(1, timeout=1.0) == {"k-1": {"text": "hi"}}
    (received,) = receiver.received
    assert received.signature_ok and not received.duplicate and received.status == 200
    assert received.raw == b'{"text": "hi"}' and received.headers["idempotency-key"] == "k-1"


@pytest.mark.parametrize(
    ("change", "status"),
    [
        ({"secret": "wrong"}, 401),
        ({"timestamp": int(time.time()) - 3600}, 401),
        ({"key": None}, 400),
    ],
)
def test_a_bad_delivery_is_refused(
    client: httpx.Client, receiver: WebhookReceiver, change: dict[str, Any], status: int
) -> None:
    assert deliver(client, receiver, {"text": "hi"}, **change).status_code == status
    assert receiver.kept == {}


def test_a_missing_signature_is_refused_and_a_rotated_one_accepted(
    client: httpx.Client, receiver: WebhookReceiver
) -> None:
    bare = client.post(receiver.url, json={"a": 1}, headers={"idempotency-key": "k"})
    assert bare.status_code == 401 and not receiver.received[0].signature_ok
    raw, now = b'{"a": 1}', str(int(time.time()))
    signatures = f"{sign('old-secret', now, raw)}, {sign(SECRET, now, raw)}"
    headers = {"idempotency-key": "k", "x-dispach-timestamp": now}
    rotated = client.post(
        receiver.url, content=raw, headers=headers | {"x-dispach-signature": signatures}
    )
    assert rotated.status_code == 200


def test_a_repeated_key_is_kept_once(client: httpx.Client, receiver: WebhookReceiver) -> None:
    first = deliver(client, receiver, {"n": 1}, "same")
    again = deliver(client, receiver, {"n": 1}, "same")
    assert again.status_code == 200 and again.json() == first.json()
    assert deliver(client, receiver, {"n": 2}, "same").status_code == 422
    deliver(client, receiver, {"n": 3}, "other")
    assert receiver.kept == {"same": {"n": 1}, "other": {"n": 3}}
    assert [r.duplicate for r in receiver.received] == [False, True, True, False]


def test_scripted_failures_carry_retry_after(
    client: httpx.Client, receiver: WebhookReceiver
) -> None:
    receiver.fail_next(503, count=2, retry_after=7)
    receiver.fail_next(400, body={"error": "no such user"})
    for _ in range(2):
        busy = deliver(client, receiver, {"n": 1})
        assert busy.status_code == 503 and busy.headers["retry-after"] == "7"
    refused = deliver(client, receiver, {"n": 1})
    assert refused.status_code == 400 and refused.json() == {"error": "no such user"}
    assert receiver.kept == {}
    assert deliver(client, receiver, {"n": 1}).status_code == 200
    assert [r.status for r in receiver.received] == [503, 503, 400, 200]


def test_a_dropped_answer_is_kept_and_its_retry_is_a_duplicate(
    client: httpx.Client, receiver: WebhookReceiver
) -> None:
    receiver.drop_next()
    with pytest.raises(httpx.RemoteProtocolError):
        deliver(client, receiver, {"n": 1})
    assert receiver.kept == {"k-1": {"n": 1}} and receiver.received[0].status is None
    assert deliver(client, receiver, {"n": 1}).status_code == 200
    assert receiver.received[1].duplicate


def test_a_held_answer_is_kept_before_it_is_answered(
    client: httpx.Client, receiver: WebhookReceiver
) -> None:
    receiver.hold_next(5.0)  # stop() ends the hold
    with httpx.Client(trust_env=False, timeout=0.3) as impatient, pytest.raises(httpx.ReadTimeout):
        deliver(impatient, receiver, {"n": 1})
    assert receiver.wait_for(1, timeout=0.1) == {"k-1": {"n": 1}}

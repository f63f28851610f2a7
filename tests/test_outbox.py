"""The outbox end to end: a turn's reply with a `deliver` target reaches a real local webhook
receiver; chunks arrive in order; failures retry with backoff or fail at once; a failing chunk
abandons the rest of its reply; every step is an event in the log."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from eventstore import streams, subjects
from tests.conftest import ApiFactory, ApiServer
from tests.fakes.webhook_receiver import WebhookReceiver
from tests.storeops import append

SECRET = "test-webhook-secret"


def hooked(url: str, *, backoff: str = "[0.05, 0.1, 0.2]", extra: str = "") -> str:
    return f"""
id: hooked
model:
  provider: scripted
  script:
    - {{match: "^long (\\\\d+)$", reply: "{{1}}"}}
channels:
  - {{id: hooks, type: webhook, url: "{url}", backoff_s: {backoff}, max_message_chars: 1000}}
{extra}
"""


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver(SECRET) as r:
        yield r


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISPACH_WEBHOOK_SECRET", SECRET)


async def send(api: ApiServer, text: str, **body: Any) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=api.url, headers=api.headers) as client:
        r = await client.post("/v1/agents/hooked/messages",
                              json={"text": text, "deliver": {"channel": "hooks", "to": "ops"},
                                    **body})  # fmt: skip
        assert r.status_code == 202, r.text
        answer: dict[str, Any] = r.json()
        return answer


async def turn_events(
    api: ApiServer, turn_id: str, until: str, count: int = 1, timeout: float = 10.0
) -> list[Any]:
    """The turn's events (its delivery events included) once ``count`` of type ``until`` are
    stored."""
    store = api.node.store
    assert store is not None
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        events = await store.aread_turn(turn_id)
        if sum(e.type == until for e in events) >= count:
            return events
        assert asyncio.get_running_loop().time() < deadline, [e.type for e in events]
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_a_reply_is_delivered_once_with_its_key(
    api_factory: ApiFactory, receiver: WebhookReceiver
) -> None:
    api_factory.write_agent("hooked", hooked(receiver.url))
    api = await api_factory.start()
    accepted = await send(api, "hello")
    kept = await asyncio.to_thread(receiver.wait_for, 1, 10.0)
    ((key, body),) = kept.items()
    assert body["turnId"] == accepted["turnId"] and body["to"] == "ops"
    assert "hello" in body["text"] and body["chunk"] == {"index": 0, "total": 1}
    events = await turn_events(api, accepted["turnId"], "delivery.sent")
    types = [e.type for e in events]
    assert types.index("delivery.enqueued") < types.index("turn.end") < types.index(
        "delivery.attempted") < types.index("delivery.sent")  # fmt: skip
    sent = next(e for e in events if e.type == "delivery.sent")
    assert sent.stream == streams.outbox(key) and sent.data.provider_message_id
    assert sent.data.uncertain is False


def paragraphs(n: int, size: int = 300) -> str:
    """``n`` numbered paragraphs of about ``size`` characters (breakable at blank lines)."""
    return "\n\n".join(f"p{i:03d} " + "word " * ((size - 5) // 5) for i in range(n))


async def outbox_rows(api: ApiServer, turn_id: str) -> list[tuple[Any, ...]]:
    store = api.node.store
    assert store is not None
    return await store.afetch(
        b"""SELECT chunk_index, status, attempts, error_code, uncertain FROM outbox
             WHERE turn_id = %s ORDER BY chunk_index""",
        [turn_id],
    )


@pytest.mark.asyncio
async def test_a_long_reply_arrives_as_ordered_chunks(
    api_factory: ApiFactory, receiver: WebhookReceiver
) -> None:
    api_factory.write_agent("hooked", hooked(receiver.url))
    api = await api_factory.start()
    text = paragraphs(12)
    accepted = await send(api, text)
    await turn_events(api, accepted["turnId"], "turn.end")
    rows = await outbox_rows(api, accepted["turnId"])
    total = len(rows)
    assert total >= 4
    kept = await asyncio.to_thread(receiver.wait_for, total, 10.0)
    bodies = list(kept.values())
    assert [b["chunk"] for b in bodies] == [{"index": i, "total": total} for i in range(total)]
    assert all(len(b["text"]) <= 1000 for b in bodies)
    joined = "\n\n".join(b["text"] for b in bodies)
    assert all(f"p{i:03d}" in joined for i in range(12))
    # Each chunk was sent only after the one before it was recorded as sent.
    events = await turn_events(api, accepted["turnId"], "delivery.sent", total)
    steps = ("delivery.attempted", "delivery.sent")
    order = [(e.type, e.data.chunk_index) for e in events if e.type in steps]
    assert order == [(t, i) for i in range(total) for t in steps]


@pytest.mark.asyncio
async def test_a_provider_that_is_down_for_a_while_gets_retries_then_the_delivery(
    api_factory: ApiFactory, receiver: WebhookReceiver
) -> None:
    api_factory.write_agent("hooked", hooked(receiver.url, backoff="[0.05, 0.05, 0.05, 0.05]"))
    api = await api_factory.start()
    receiver.fail_next(503, count=2)
    accepted = await send(api, "hello")
    events = await turn_events(api, accepted["turnId"], "delivery.sent")
    retries = [e.data for e in events if e.type == "delivery.retry"]
    assert [r.attempts for r in retries] == [1, 2]
    assert all(r.code == "delivery_http_503" and 30 <= r.delay_ms <= 70 for r in retries)
    sent = next(e.data for e in events if e.type == "delivery.sent")
    assert sent.attempts == 3
    assert len(receiver.kept) == 1


@pytest.mark.asyncio
async def test_retry_after_is_honoured(api_factory: ApiFactory, receiver: WebhookReceiver) -> None:
    api_factory.write_agent("hooked", hooked(receiver.url))
    api = await api_factory.start()
    receiver.fail_next(429, retry_after=1)
    accepted = await send(api, "hello")
    events = await turn_events(api, accepted["turnId"], "delivery.sent")
    retry = next(e for e in events if e.type == "delivery.retry")
    sent = next(e for e in events if e.type == "delivery.sent")
    assert retry.data.delay_ms == 1000
    assert (sent.recorded_at - retry.recorded_at).total_seconds() >= 0.95


@pytest.mark.asyncio
async def test_a_permanent_error_fails_at_once_and_abandons_the_rest_of_the_reply(
    api_factory: ApiFactory, receiver: WebhookReceiver
) -> None:
    api_factory.write_agent("hooked", hooked(receiver.url))
    api = await api_factory.start()
    receiver.fail_next(400)
    accepted = await send(api, paragraphs(6))  # 2+ chunks: the first fails
    events = await turn_events(api, accepted["turnId"], "delivery.failed")
    failed = [e.data for e in events if e.type == "delivery.failed"]
    rows = await outbox_rows(api, accepted["turnId"])
    assert len(failed) == 1  # reported once, with the count
    assert failed[0].attempts == 1 and failed[0].exhausted is False
    assert failed[0].abandoned == len(rows) - 1 >= 1
    assert rows[0][1:4] == ("failed", 1, "delivery_http_400")
    assert all(r[1] == "failed" and r[3] == "delivery_chunk_abandoned" for r in rows[1:])
    await asyncio.sleep(0.3)
    assert receiver.kept == {} and not any(e.type == "delivery.sent" for e in events)


@pytest.mark.asyncio
async def test_attempts_are_bounded(api_factory: ApiFactory, receiver: WebhookReceiver) -> None:
    api_factory.write_agent("hooked", hooked(receiver.url, backoff="[0.02, 0.02]"))
    api = await api_factory.start()
    receiver.fail_next(503, count=10)
    accepted = await send(api, "hello")
    events = await turn_events(api, accepted["turnId"], "delivery.failed")
    failed = next(e.data for e in events if e.type == "delivery.failed")
    assert failed.attempts == 3 and failed.exhausted is True
    assert sum(e.type == "delivery.attempted" for e in events) == 3


@pytest.mark.asyncio
async def test_delivery_to_a_channel_the_agent_lacks_is_refused_at_once(
    api_factory: ApiFactory, receiver: WebhookReceiver
) -> None:
    api_factory.write_agent("hooked", hooked(receiver.url))
    api = await api_factory.start()
    async with httpx.AsyncClient(base_url=api.url) as client:
        body = {"text": "hi", "deliver": {"channel": "sms", "to": "x"}}
        r = await client.post("/v1/agents/hooked/messages", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "deliver_invalid" and "hooks" in error["hint"]
    assert error["field"] == "deliver.channel"


@pytest.mark.asyncio
async def test_the_turn_stream_replays_its_deliveries(
    api_factory: ApiFactory, receiver: WebhookReceiver
) -> None:
    api_factory.write_agent("hooked", hooked(receiver.url))
    api = await api_factory.start()
    accepted = await send(api, "hello")
    await turn_events(api, accepted["turnId"], "delivery.sent")
    async with httpx.AsyncClient(base_url=api.url) as client:
        r = await client.get(f"/v1/agents/hooked/turns/{accepted['turnId']}/events")
    assert r.status_code == 200
    types = [e["type"] for e in r.json()["events"]]
    assert {"delivery.enqueued", "delivery.attempted", "delivery.sent"} <= set(types)


def test_item_keys_are_derived_and_stable() -> None:
    from actors.outbox.plan import item_key
    from eventstore.catalogue import Deliver

    target = Deliver(channel="hooks", to="ops")
    key = item_key("a", "s", "t_1", target, 0)
    assert key == item_key("a", "s", "t_1", target, 0)
    assert key != item_key("a", "s", "t_1", target, 1)
    assert key != item_key("a", "s", "t_1", Deliver(channel="hooks", to="ops", thread="7"), 0)
    assert key.startswith("o_") and len(key) == 27 and key.isascii()


@pytest.mark.asyncio
async def test_outboxes_on_other_nodes_are_woken_over_nats(
    api_factory: ApiFactory, receiver: WebhookReceiver, servers: Any, schema: str
) -> None:
    """A node that promises a reply tells the other nodes' outboxes on `dispach.outbox.<channel>`
    (they need not wait for their poll); an outbox woken that way sends at once."""
    import nats

    from actors.outbox.plan import item_key
    from eventstore import EventStore, Metadata, NewEvent
    from eventstore.catalogue import Deliver, DeliveryEnqueued
    from eventstore.projections import INLINE

    api_factory.write_agent("hooked", hooked(receiver.url))
    api = await api_factory.start(outbox_poll_seconds=60.0)  # only a kick can wake it
    other_node = await nats.connect(servers.nats_url)
    kicks: list[str] = []

    async def heard(msg: Any) -> None:
        kicks.append(msg.subject)

    await other_node.subscribe(subjects.outbox_all(), cb=heard)
    try:
        # This node's own promise goes out to the others.
        await send(api, "hello")
        await asyncio.to_thread(receiver.wait_for, 1, 10.0)
        for _ in range(100):
            if kicks:
                break
            await asyncio.sleep(0.02)
        assert kicks == [subjects.outbox("hooks")]
        # Another node's promise (appended by a store of its own) reaches this node's outbox.
        store = EventStore(servers.database_url, schema=schema, inline=INLINE)
        await asyncio.to_thread(store.open)
        try:
            target = Deliver(channel="hooks", to="ops")
            meta = Metadata(agent_id="hooked", session_key="elsewhere", turn_id="t_elsewhere")
            event = DeliveryEnqueued(channel_id="hooks", to="ops", chunk_index=0, chunk_total=1,
                                     key=item_key("hooked", "elsewhere", "t_elsewhere", target, 0),
                                     text="from another node")  # fmt: skip
            await asyncio.to_thread(
                append, store, "turn-t_elsewhere", [NewEvent(event=event, metadata=meta)]
            )
        finally:
            await asyncio.to_thread(store.close)
        await other_node.publish(subjects.outbox("hooks"), b"")
        kept = await asyncio.to_thread(receiver.wait_for, 2, 5.0)
        assert any(body["text"] == "from another node" for body in kept.values())
    finally:
        await other_node.close()


@pytest.mark.asyncio
async def test_a_slow_channels_backlog_does_not_starve_another_channel(
    api_factory: ApiFactory, receiver: WebhookReceiver, servers: Any, schema: str
) -> None:
    from actors.outbox.plan import item_key
    from eventstore import EventStore, Metadata, NewEvent
    from eventstore.catalogue import Deliver, DeliveryEnqueued
    from eventstore.projections import INLINE

    with WebhookReceiver(SECRET) as slow_receiver:
        for _ in range(400):
            slow_receiver.hold_next(0.2)
        api_factory.write_agent("two", f"""
id: two
model: {{provider: scripted}}
channels:
  - {{id: slow, type: webhook, url: "{slow_receiver.url}", concurrency: 1}}
  - {{id: fast, type: webhook, url: "{receiver.url}"}}
""")  # fmt: skip
        api = await api_factory.start()
        store = EventStore(servers.database_url, schema=schema, inline=INLINE)
        await asyncio.to_thread(store.open)
        try:
            # 300 replies for the slow channel first (due first), then 5 for the fast one.
            for n, channel in [*((n, "slow") for n in range(300)),
                               *((n, "fast") for n in range(300, 305))]:  # fmt: skip
                turn_id = f"t_s{n}"
                meta = Metadata(agent_id="two", session_key="s", turn_id=turn_id)
                key = item_key("two", "s", turn_id, Deliver(channel=channel, to="x"), 0)
                event = DeliveryEnqueued(channel_id=channel, to="x", key=key, chunk_index=0,
                                         chunk_total=1, text=f"{channel} {n}")  # fmt: skip
                await asyncio.to_thread(
                    append, store, f"turn-{turn_id}", [NewEvent(event=event, metadata=meta)]
                )
        finally:
            await asyncio.to_thread(store.close)
        started = asyncio.get_running_loop().time()
        kept = await asyncio.to_thread(receiver.wait_for, 5, 15.0)
        took = asyncio.get_running_loop().time() - started
        assert len(kept) == 5
        # The slow channel sends one at a time, 0.2 s each: its backlog takes a minute; the
        # fast channel's replies went out beside it, not after it.
        assert took < 5.0, took
        assert len(slow_receiver.kept) < 100
        await api.stop()


@pytest.mark.asyncio
async def test_the_turn_resource_shows_where_its_reply_went(
    api_factory: ApiFactory, receiver: WebhookReceiver
) -> None:
    api_factory.write_agent("hooked", hooked(receiver.url))
    api = await api_factory.start()
    receiver.fail_next(400)
    failed = await send(api, "this one is refused")
    delivered = await send(api, paragraphs(6))
    plain = await send(api, "no delivery", deliver=None)
    await turn_events(api, failed["turnId"], "delivery.failed")
    rows = await outbox_rows(api, delivered["turnId"])
    await turn_events(api, delivered["turnId"], "delivery.sent", len(rows))
    async with httpx.AsyncClient(base_url=api.url) as client:
        one = (await client.get(f"/v1/agents/hooked/turns/{delivered['turnId']}")).json()
        bad = (await client.get(f"/v1/agents/hooked/turns/{failed['turnId']}")).json()
        none = (await client.get(f"/v1/agents/hooked/turns/{plain['turnId']}")).json()
        page = (await client.get("/v1/agents/hooked/turns")).json()
    n = len(rows)
    assert one["deliveries"] == [{"channel": "hooks", "to": "ops", "status": "sent",
                                  "chunks": n, "sent": n, "attempts": 1}]  # fmt: skip
    assert bad["deliveries"] == [{"channel": "hooks", "to": "ops", "status": "failed",
                                  "chunks": 1, "sent": 0, "attempts": 1,
                                  "errorCode": "delivery_http_400"}]  # fmt: skip
    assert "deliveries" not in none  # v1 clients see the v1 shape
    listed = {t["turnId"]: t.get("deliveries") for t in page["turns"]}
    assert listed[delivered["turnId"]] == one["deliveries"]

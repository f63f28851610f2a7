"""Event webhooks (issue 37): subscriptions, the fan-out through the outbox, signing, target
checks, a receiver killed mid-POST, a receiver that never recovers, the per-agent filter.

Real Postgres, NATS and nodes behind uvicorn; the receiver is a real HTTP server on loopback
(tests/fakes/event_receiver.py), allowed by ``DISPACH_WEBHOOK_ALLOW`` where a test delivers.
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Any

import httpx
import pytest

from actors.webhooks.plan import backoff_schedule, item_key, matches, pattern_problem
from eventstore import START
from eventstore.catalogue import WebhookCreated
from eventstore.envelope import RecordedEvent
from gateways.webhooks.target import TargetPolicy, refusal, url_problem
from tests.conftest import ApiFactory, ApiServer
from tests.fakes.event_receiver import EventReceiver, Got, verify

LOOPBACK = TargetPolicy.from_env({"DISPACH_WEBHOOK_ALLOW": "127.0.0.0/8"})
"""The receivers listen on loopback, an internal address: allowed as DISPACH_WEBHOOK_ALLOW would."""
FAST: dict[str, Any] = {
    "webhook_policy": LOOPBACK,
    "webhook_backoff_seconds": 0.2,
    "webhook_max_attempts": 30,
}


# --- pure rules -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "code"),
    [
        ("turn.end", None),
        ("turn.*", None),
        ("*", None),
        ("model.*", None),
        ("model.chunk", "webhook_type_refused"),
        ("turn.strat", "webhook_type_invalid"),
        ("nothing.*", "webhook_type_invalid"),
    ],
)
def test_which_types_may_be_named(pattern: str, code: str | None) -> None:
    problem = pattern_problem(pattern)
    assert (problem[0] if problem else None) == code


def test_model_chunk_is_never_matched_even_by_a_wildcard() -> None:
    assert not matches(["*"], "model.chunk")
    assert not matches(["model.*"], "model.chunk")
    assert matches(["model.*"], "model.call")
    assert matches(["turn.*"], "turn.end")
    assert not matches(["turn.*"], "tool.call")


@pytest.mark.parametrize(
    ("env", "host", "addresses", "refused"),
    [
        ({}, "hooks.example", ["93.184.216.34"], False),
        ({}, "localhost", ["127.0.0.1"], True),
        ({}, "x", ["10.1.2.3"], True),
        ({}, "x", ["169.254.169.254"], True),
        ({}, "x", ["224.0.0.1"], True),
        ({}, "x", ["0.0.0.0"], True),
        ({}, "x", ["::1"], True),
        ({}, "x", ["::ffff:127.0.0.1"], True),
        ({}, "x", ["93.184.216.34", "192.168.1.1"], True),  # any internal address refuses
        ({"DISPACH_WEBHOOK_ALLOW": "127.0.0.0/8"}, "x", ["127.0.0.1"], False),
        ({"DISPACH_WEBHOOK_ALLOW": "127.0.0.0/8"}, "x", ["10.0.0.1"], True),
        ({"DISPACH_WEBHOOK_ALLOW": "hooks.internal"}, "hooks.internal", ["10.0.0.1"], False),
        ({"DISPACH_WEBHOOK_ALLOW_PRIVATE": "1"}, "x", ["10.0.0.1"], False),
    ],
)
def test_target_policy(env: dict[str, str], host: str, addresses: list[str], refused: bool) -> None:
    assert (refusal(TargetPolicy.from_env(env), host, addresses) is not None) == refused


def test_urls_and_backoff_and_ids() -> None:
    assert url_problem("https://hooks.example/x") is None
    assert url_problem("ftp://hooks.example/x") is not None
    assert url_problem("http:///nohost") is not None
    assert url_problem("http://u:p@hooks.example/") is not None
    assert backoff_schedule(1.0, 4) == (1.0, 2.0, 4.0)
    assert backoff_schedule(1.0, 1) == ()
    assert item_key("wh_a", "e1") == item_key("wh_a", "e1") != item_key("wh_b", "e1")
    assert ipaddress.IPv6Address("::ffff:127.0.0.1").ipv4_mapped is not None


# --- over the API -----------------------------------------------------------------------------


async def _subscribe(http: httpx.AsyncClient, url: str, **body: Any) -> dict[str, Any]:
    answer = await http.post("/v1/webhooks", json={"url": url, **body})
    assert answer.status_code == 201, answer.text
    made: dict[str, Any] = answer.json()
    assert made["secret"].startswith("whsec_")
    return made


async def _turn(http: httpx.AsyncClient, text: str, agent: str = "assistant") -> str:
    accepted = await http.post(f"/v1/agents/{agent}/messages", json={"text": text})
    assert accepted.status_code == 202, accepted.text
    turn_id: str = accepted.json()["turnId"]
    for _ in range(300):
        turn = (await http.get(f"/v1/agents/{agent}/turns/{turn_id}")).json()
        if turn["status"] != "running":
            return turn_id
        await asyncio.sleep(0.05)
    raise AssertionError(f"turn {turn_id} did not end")


async def _log(api: ApiServer) -> list[RecordedEvent]:
    store = api.node.store
    assert store is not None
    events: list[RecordedEvent] = []
    after = START
    while page := await store.aread_all(after, 1000):
        events += page
        after = page[-1].checkpoint
    return events


async def _wait(receiver: EventReceiver, done: Any, timeout: float = 30) -> list[Got]:
    return await asyncio.to_thread(receiver.wait, done, timeout)


async def _deliveries(http: httpx.AsyncClient, webhook_id: str, **q: Any) -> list[Any]:
    answer = await http.get(f"/v1/webhooks/{webhook_id}/deliveries", params=q)
    assert answer.status_code == 200, answer.text
    found: list[Any] = answer.json()["deliveries"]
    return found


async def _all_delivered(http: httpx.AsyncClient, webhook_id: str, count: int) -> list[Any]:
    """The deliveries page once it shows ``count`` delivered (a receiver has a request before
    the node has recorded its answer)."""
    for _ in range(200):
        pages = await _deliveries(http, webhook_id)
        if len(pages) == count and all(d["status"] == "delivered" for d in pages):
            return pages
        await asyncio.sleep(0.05)
    raise AssertionError(f"not all delivered: {[d['status'] for d in pages]}")


@pytest.mark.asyncio
async def test_refusals_without_an_allowance(api_factory: ApiFactory) -> None:
    api = await api_factory.start()  # the default policy: no internal address
    with EventReceiver() as receiver:
        async with httpx.AsyncClient(base_url=api.url, timeout=30) as http:
            cases = [
                ({"url": receiver.url, "events": ["turn.end"]}, "webhook_target_refused"),
                ({"url": "http://localhost:9/x", "events": ["turn.end"]},
                 "webhook_target_refused"),
                ({"url": "https://hooks.example/x", "events": ["model.chunk"]},
                 "webhook_type_refused"),
                ({"url": "https://hooks.example/x", "events": ["turn.strat"]},
                 "webhook_type_invalid"),
                ({"url": "https://hooks.example/x", "events": []}, "webhook_types_required"),
                ({"url": "ftp://hooks.example/x", "events": ["turn.end"]},
                 "webhook_url_invalid"),
            ]  # fmt: skip
            for body, code in cases:
                answer = await http.post("/v1/webhooks", json=body)
                assert answer.status_code == 400, (body, answer.text)
                error = answer.json()["error"]
                assert error["code"] == code, (body, error)
                assert error["hint"]
            assert (await http.get("/v1/webhooks")).json() == {"webhooks": []}
            missing = await http.get("/v1/webhooks/wh_nope")
            assert missing.status_code == 404
            assert missing.json()["error"]["code"] == "webhook_not_found"
    assert receiver.received == []


@pytest.mark.asyncio
async def test_subscribed_events_arrive_in_order_signed_and_filtered(
    api_factory: ApiFactory,
) -> None:
    api = await api_factory.start(outbox_poll_seconds=0.1, **FAST)
    with EventReceiver() as receiver, EventReceiver() as elsewhere:
        async with httpx.AsyncClient(base_url=api.url, timeout=30) as http:
            sub = await _subscribe(http, receiver.url + "/a", events=["turn.*", "tool.call"],
                                   agents=["assistant"], description="ops")  # fmt: skip
            other = await _subscribe(http, elsewhere.url, events=["*"], agents=["nobody"])
            listed = (await http.get("/v1/webhooks")).json()["webhooks"]
            assert {w["webhookId"] for w in listed} == {sub["webhookId"], other["webhookId"]}
            assert all("secret" not in w for w in listed)
            shown = (await http.get(f"/v1/webhooks/{sub['webhookId']}")).json()
            assert shown["events"] == ["turn.*", "tool.call"] and shown["agents"] == ["assistant"]
            turns = [await _turn(http, "hello"), await _turn(http, "again")]
            log = await _log(api)
            created = next(
                e
                for e in log
                if isinstance(e.data, WebhookCreated) and e.data.webhook_id == sub["webhookId"]
            )
            wanted = [e for e in log if e.checkpoint > created.checkpoint
                      and (e.type.startswith("turn.") or e.type == "tool.call")
                      and e.metadata.agent_id == "assistant"]  # fmt: skip
            assert {e.metadata.turn_id for e in wanted} == set(turns)
            got = await _wait(receiver, lambda r: len(r) >= len(wanted))
            assert [g.body["event"]["id"] for g in got] == [str(e.event_id) for e in wanted]
            assert [g.body["type"] for g in got] == [e.type for e in wanted]
            for g in got:
                assert verify(sub["secret"], g.headers, g.raw)
                assert not verify(other["secret"], g.headers, g.raw)
                assert g.body["id"] == g.delivery and g.body["webhookId"] == sub["webhookId"]
                assert g.body["event"]["agentId"] == "assistant"
                assert g.body["event"]["cursor"] and "data" in g.body["event"]
                assert not g.redelivery and g.headers["webhook-attempt"] == "1"
            assert "model.chunk" not in {g.body["type"] for g in got}
            pages = await _all_delivered(http, sub["webhookId"], len(wanted))
            assert [d["eventId"] for d in reversed(pages)] == [str(e.event_id) for e in wanted]
            assert await _deliveries(http, other["webhookId"]) == []
            # The secret is nowhere in the log.
            assert all(sub["secret"] not in str(e.data) for e in log)
            gone = await http.delete(f"/v1/webhooks/{sub['webhookId']}")
            assert gone.status_code == 200 and gone.json()["deletedAt"]
            assert (await http.get(f"/v1/webhooks/{sub['webhookId']}")).status_code == 404
            await _turn(http, "after the delete")
            await asyncio.sleep(1.0)
    assert len(receiver.received) == len(wanted)
    assert elsewhere.received == []


@pytest.mark.asyncio
async def test_a_receiver_killed_mid_post_gets_every_event_once_and_the_resend_flagged(
    api_factory: ApiFactory,
) -> None:
    api = await api_factory.start(outbox_poll_seconds=0.1, **FAST)
    first = EventReceiver().start()
    port = first.port
    async with httpx.AsyncClient(base_url=api.url, timeout=30) as http:
        sub = await _subscribe(http, first.url, events=["turn.*", "model.result"])
        await _turn(http, "one")
        await _wait(first, lambda r: len(r) >= 2)
        first.die_next()
        await _turn(http, "two")
        await _wait(first, lambda r: first.died)
        first.stop()  # killed: the POST it read is never answered, and nothing listens
        await asyncio.sleep(1.0)  # the node retries against a closed port meanwhile
        # Meanwhile the cluster is not idle: its webhook deliveries wait, told apart from the
        # agents' (this agent delivers nothing).
        activity = (await http.get("/v1/activity")).json()
        hooks = activity["deliveries"]["webhooks"]
        assert hooks["pending"] + hooks["inflight"] >= 1 and not activity["idle"], activity
        assert activity["deliveries"]["outbox"] == {"pending": 0, "inflight": 0}, activity
        await _turn(http, "three")
        with EventReceiver(port=port) as second:
            log = await _log(api)
            created = next(e for e in log if e.type == "webhook.created")
            wanted = [str(e.event_id) for e in log if e.checkpoint > created.checkpoint
                      and (e.type.startswith("turn.") or e.type == "model.result")]  # fmt: skip
            seen = {g.body["event"]["id"] for g in first.received}
            got = await _wait(
                second, lambda r: seen | {g.body["event"]["id"] for g in r} >= set(wanted)
            )
            await asyncio.sleep(0.5)
            got = second.received
            everything = first.received + got
            ids = [g.body["event"]["id"] for g in everything]
            assert set(ids) == set(wanted)
            # In log order, by first arrival; the one repeat is the POST that was never
            # answered, and its resend says so.
            firsts = list(dict.fromkeys(ids))
            assert firsts == wanted
            repeats = [g for i, g in enumerate(everything) if ids.index(ids[i]) != i]
            assert len(repeats) == 1, [(g.body["type"], g.redelivery) for g in everything]
            assert repeats[0].redelivery and int(repeats[0].headers["webhook-attempt"]) > 1
            assert repeats[0].delivery == first.received[-1].delivery
            assert [g for g in everything if g.redelivery] == repeats
            pages = await _all_delivered(http, sub["webhookId"], len(wanted))
            assert [d["id"] for d in pages if d["redelivery"]] == [repeats[0].delivery]


@pytest.mark.asyncio
async def test_a_failing_receiver_goes_dead_after_the_bound_and_shows_it(
    api_factory: ApiFactory,
) -> None:
    api = await api_factory.start(outbox_poll_seconds=0.1, webhook_policy=LOOPBACK,
                                  webhook_backoff_seconds=0.05, webhook_max_attempts=3)  # fmt: skip
    with EventReceiver(status=500) as receiver:
        async with httpx.AsyncClient(base_url=api.url, timeout=30) as http:
            sub = await _subscribe(http, receiver.url, events=["turn.start", "turn.end"])
            await _turn(http, "doomed")
            await _wait(receiver, lambda r: len(r) >= 6)
            for _ in range(100):
                pages = await _deliveries(http, sub["webhookId"])
                if len(pages) == 2 and all(d["status"] == "dead" for d in pages):
                    break
                await asyncio.sleep(0.1)
            assert [d["eventType"] for d in pages] == ["turn.end", "turn.start"]
            for d in pages:
                assert d["status"] == "dead" and d["attempts"] == 3
                assert d["errorCode"] == "delivery_http_500" and d["lastError"]
            dead = await _deliveries(http, sub["webhookId"], status="dead")
            assert len(dead) == 2
            assert await _deliveries(http, sub["webhookId"], status="delivered") == []
    assert len(receiver.received) == 6  # three attempts each, then no more


@pytest.mark.asyncio
async def test_two_nodes_the_fan_out_moves_with_its_lease_and_nothing_repeats(
    api_factory: ApiFactory,
) -> None:
    first = await api_factory.start(outbox_poll_seconds=0.1, **FAST)
    second = await api_factory.start(outbox_poll_seconds=0.1, **FAST)
    with EventReceiver() as receiver:
        async with httpx.AsyncClient(base_url=first.url, timeout=30) as http:
            sub = await _subscribe(http, receiver.url, events=["turn.start", "turn.end"])
            await _turn(http, "on the first node")
        # The first node leaves (handing its leases over, the fan-out's among them).
        await first.stop()
        await first.node.stop()
        api_factory.started.remove(first)
        api_factory.nodes.started.remove(first.node)
        async with httpx.AsyncClient(base_url=second.url, timeout=30) as http:
            await _turn(http, "on the second node")
            await _turn(http, "and again")
            log = await _log(second)
            created = next(e for e in log if e.type == "webhook.created")
            wanted = [str(e.event_id) for e in log if e.checkpoint > created.checkpoint
                      and e.type in ("turn.start", "turn.end")]  # fmt: skip
            assert len(wanted) == 6
            await _wait(receiver, lambda r: len(r) >= len(wanted))
            await asyncio.sleep(1.0)
            got = receiver.received
            assert [g.body["event"]["id"] for g in got] == wanted
            assert not any(g.redelivery for g in got)
            await _all_delivered(http, sub["webhookId"], 6)

"""Kill -9 of a node at each point of a delivery, then a restart: a reply promised in the log is
delivered after the crash, and a send that may have happened is never silently repeated. It is
resent flagged ``uncertain`` (an idempotent receiver keeps one copy), or, on a channel that says
``on_uncertain: skip``, settled as uncertain with no resend.

The crash is armed with ``DISPACH_FAULTS`` on the first ``dispach serve`` only: the process
SIGKILLs itself at that point, so the kill lands exactly in the window under test. The channels'
providers (a fake Telegram Bot API, a webhook receiver) run in the test process and outlive both
nodes, as the real ones would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from eventstore import EventStore, RecordedEvent, streams
from eventstore.catalogue import DeliverySent, DeliveryUncertain
from tests.conftest import ROOT, Servers
from tests.fakes.telegram_server import FakeTelegram
from tests.fakes.webhook_receiver import WebhookReceiver
from tests.test_node import free_port
from tests.test_turn_crash import serve, wait_for

pytestmark = pytest.mark.slow

TOKEN = "7000000001:test-token"  # the fake Bot API's token
SECRET = "test-webhook-secret"  # signs requests to the local receiver only
CHAT = 4711
SETTLED = ("sent", "failed", "uncertain")
_OUTBOX = b"SELECT item_id, turn_id, status, uncertain FROM outbox ORDER BY created_at, item_id"

TELEGRAM_AGENT = """
id: teller
model: {{provider: scripted}}
channels:
  - id: tg
    type: telegram
    token_env: DISPACH_TEST_TELEGRAM_TOKEN
    api_base_url: "{url}"
    allow_from: ["*"]
    poll_timeout_s: 1
    backoff_s: [0.05, 0.1]
    on_uncertain: {on_uncertain}
"""

WEBHOOK_AGENT = """
id: hooked
model: {{provider: scripted}}
channels:
  - id: hooks
    type: webhook
    url: "{url}"
    secret_env: DISPACH_TEST_WEBHOOK_SECRET
    backoff_s: [0.05, 0.1]
"""


class Cluster:
    """``dispach serve`` processes, one after another, on the test's schema, sharing a log."""

    def __init__(self, servers: Servers, schema: str, tmp_path: Path, store: EventStore) -> None:
        self.store = store
        self.agents = tmp_path / "agents"
        self.agents.mkdir()
        self.log = tmp_path / "serve.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")} | {
            "DATABASE_URL": servers.database_url,
            "NATS_URL": servers.nats_url,
            "DISPACH_DB_SCHEMA": schema,
            "DISPACH_CLUSTER": schema,
            "DISPACH_HOME": str(tmp_path / "home"),
            "DISPACH_AGENTS": str(self.agents),
            "DISPACH_PORT": str(self.port),
            "DISPACH_LOG_FORMAT": "json",
            "DISPACH_DRAIN_SECONDS": "5",
            "DISPACH_OUTBOX_POLL_MS": "200",
            "DISPACH_TEST_TELEGRAM_TOKEN": TOKEN,
            "DISPACH_TEST_WEBHOOK_SECRET": SECRET,
            "PYTHONPATH": str(ROOT),
        }
        self.env.pop("DISPACH_FAULTS", None)
        self.procs: list[subprocess.Popen[bytes]] = []

    def write_agent(self, agent_id: str, manifest: str) -> None:
        (self.agents / f"{agent_id}.yaml").write_text(manifest)

    def tail(self) -> str:
        """The end of both nodes' output, for assertion messages."""
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else "(no log)"

    async def start(self, faults: str = "") -> subprocess.Popen[bytes]:
        """A node (dying at ``faults``, if given), once it answers ready."""
        env = self.env | ({"DISPACH_FAULTS": faults} if faults else {})
        proc = serve(env, self.log)
        self.procs.append(proc)
        async with httpx.AsyncClient(base_url=self.url) as client:

            async def ready() -> bool:
                assert proc.poll() is None, f"the node exited {proc.returncode}:\n{self.tail()}"
                with contextlib.suppress(httpx.TransportError):
                    return (await client.get("/v1/ready", timeout=2)).status_code == 200
                return False

            await self.wait(ready, 30, "the node to be ready")
        return proc

    @contextlib.asynccontextmanager
    async def dying_at(self, fault: str) -> AsyncIterator[None]:
        """A node armed to kill itself at ``fault``; the body leads it there, and the block ends
        once the node is dead by kill -9."""
        proc = await self.start(faults=fault)
        yield
        try:
            code = await asyncio.to_thread(proc.wait, 20)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the node did not reach its fault:\n{self.tail()}") from None
        assert code == -signal.SIGKILL, f"exit {code}, not a kill -9:\n{self.tail()}"

    async def recover(self, item_id: str) -> tuple[str, bool, list[RecordedEvent]]:
        """A second node, unarmed, until the item settles; then a clean stop (SIGTERM drains, so
        a send still in flight finishes). Returns the item's status and uncertain flag in the
        outbox table, and its events."""
        proc = await self.start()
        _, _, status, uncertain = await self.settled()
        events = await self.store.aread_stream(streams.outbox(item_id))
        await self.stop(proc)
        return status, uncertain, events

    async def stop(self, proc: subprocess.Popen[bytes]) -> None:
        """A clean stop (SIGTERM drains the outbox): exit status 0."""
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 30)
        assert code == 0, f"exit {code}:\n{self.tail()}"

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    async def wait(
        self, predicate: Callable[[], Awaitable[bool]], timeout: float, what: str
    ) -> None:
        try:
            await wait_for(predicate, timeout, what)
        except AssertionError as e:
            raise AssertionError(f"{e}:\n{self.tail()}") from None

    async def post(self, agent_id: str, text: str, channel: str, to: str) -> None:
        """Send a message whose reply goes to ``channel``. The node may kill itself before it
        answers (the turn is fast): the test finds the turn in the outbox table instead."""
        body = {"text": text, "deliver": {"channel": channel, "to": to}}
        async with httpx.AsyncClient(base_url=self.url) as client:
            with contextlib.suppress(httpx.TransportError):
                r = await client.post(f"/v1/agents/{agent_id}/messages", json=body, timeout=10)
                assert r.status_code == 202, r.text

    async def outbox(self) -> list[tuple[str, str, str, bool]]:
        """(item id, turn id, status, uncertain) of every outbox row."""
        return [(r[0], r[1], r[2], r[3]) for r in await self.store.afetch(_OUTBOX)]

    async def one_item(self) -> tuple[str, str, str, bool]:
        """The single outbox item (a one-chunk reply), once it exists."""

        async def enqueued() -> bool:
            return len(await self.outbox()) == 1

        await self.wait(enqueued, 20, "the reply to be enqueued")
        (row,) = await self.outbox()
        return row

    async def settled(self) -> tuple[str, str, str, bool]:
        """The single outbox item, once it is settled (sent, failed or uncertain)."""

        async def done() -> bool:
            rows = await self.outbox()
            return len(rows) == 1 and rows[0][2] in SETTLED

        await self.wait(done, 20, "the item to settle")
        (row,) = await self.outbox()
        return row

    async def turn_ends(self, agent_id: str) -> int:
        events = await self.store.aread_scoped(agent_id=agent_id, types=["turn.end"])
        return len(events)


@pytest_asyncio.fixture
async def cluster(servers: Servers, schema: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    store = EventStore(servers.database_url, schema=schema)
    await store.aopen()
    nodes = Cluster(servers, schema, tmp_path, store)
    try:
        yield nodes
    finally:
        await asyncio.to_thread(nodes.kill_all)
        await store.aclose()


@pytest.fixture
def telegram() -> Iterator[FakeTelegram]:
    with FakeTelegram(TOKEN) as fake:
        yield fake


@pytest.fixture
def receiver(cluster: Cluster) -> Iterator[WebhookReceiver]:
    """The receiver, with the agent ``hooked`` whose channel ``hooks`` posts to it."""
    with WebhookReceiver(SECRET) as r:
        cluster.write_agent("hooked", WEBHOOK_AGENT.format(url=r.url))
        yield r


def types(events: list[RecordedEvent]) -> list[str]:
    return [e.type for e in events]


def uncertain_flags(events: list[RecordedEvent]) -> list[DeliveryUncertain]:
    return [e.data for e in events if isinstance(e.data, DeliveryUncertain)]


def final_sent(events: list[RecordedEvent], tail: str) -> DeliverySent:
    assert events, tail
    last = events[-1].data
    assert isinstance(last, DeliverySent), (types(events), tail)
    return last


@pytest.mark.asyncio
async def test_telegram_reply_answered_then_kill_9_is_resent_flagged(
    cluster: Cluster, telegram: FakeTelegram
) -> None:
    cluster.write_agent("teller", TELEGRAM_AGENT.format(url=telegram.url, on_uncertain="resend"))
    async with cluster.dying_at("delivery.answered"):
        telegram.push_message(CHAT, "hello over telegram")
    assert len(telegram.sent) == 1, "the provider got the reply before the node died"
    item_id, _turn, status, _ = await cluster.one_item()
    assert status == "inflight", cluster.tail()

    status, uncertain, events = await cluster.recover(item_id)

    sent = [s for s in telegram.sent if s["chat_id"] == CHAT]
    assert len(sent) == 2, (sent, cluster.tail())
    assert sent[0]["text"] == sent[1]["text"] and "hello over telegram" in sent[0]["text"]
    assert "x-dispach-uncertain" not in sent[0]["headers"]
    assert sent[1]["headers"].get("x-dispach-uncertain") == "1"
    (flag,) = uncertain_flags(events)
    assert flag.resend is True and flag.idempotent_send is False
    assert final_sent(events, cluster.tail()).uncertain is True
    assert (status, uncertain) == ("sent", True)
    assert await cluster.turn_ends("teller") == 1, "the update fetched again is not a new turn"


@pytest.mark.asyncio
async def test_webhook_reply_answered_then_kill_9_is_resent_with_the_same_key(
    cluster: Cluster, receiver: WebhookReceiver
) -> None:
    async with cluster.dying_at("delivery.answered"):
        await cluster.post("hooked", "hello webhook", "hooks", "ops")
    assert len(receiver.received) == 1, cluster.tail()
    item_id, *_ = await cluster.one_item()

    status, uncertain, events = await cluster.recover(item_id)

    received = receiver.received
    assert len(received) == 2, (received, cluster.tail())
    assert received[0].idempotency_key == received[1].idempotency_key == item_id
    assert [r.duplicate for r in received] == [False, True]
    assert "x-dispach-uncertain" not in received[0].headers
    assert received[1].headers.get("x-dispach-uncertain") == "1"
    assert received[0].raw == received[1].raw, "a resend carries the same body"
    assert list(receiver.kept) == [item_id]
    (flag,) = uncertain_flags(events)
    assert flag.resend is True and flag.idempotent_send is True
    assert final_sent(events, cluster.tail()).uncertain is True
    assert (status, uncertain) == ("sent", True)


@pytest.mark.asyncio
async def test_kill_9_after_the_attempt_is_recorded_sends_once_flagged(
    cluster: Cluster, receiver: WebhookReceiver
) -> None:
    async with cluster.dying_at("delivery.attempted"):
        await cluster.post("hooked", "attempted only", "hooks", "ops")
    assert receiver.received == [], "the node died before sending a byte"
    item_id, _turn, status, _ = await cluster.one_item()
    assert status == "inflight", cluster.tail()

    status, uncertain, events = await cluster.recover(item_id)

    (request,) = receiver.received
    assert request.idempotency_key == item_id and not request.duplicate
    assert request.headers.get("x-dispach-uncertain") == "1"
    assert "attempted only" in request.body["text"]
    (flag,) = uncertain_flags(events)
    assert flag.resend is True
    assert final_sent(events, cluster.tail()).uncertain is True
    assert (status, uncertain) == ("sent", True)


@pytest.mark.asyncio
async def test_kill_9_between_turn_end_and_the_send_delivers_once(
    cluster: Cluster, receiver: WebhookReceiver
) -> None:
    async with cluster.dying_at("turn.ended"):
        await cluster.post("hooked", "ended, not sent", "hooks", "ops")
    assert receiver.received == [], "the node died before the outbox sent anything"
    item_id, _turn, status, _ = await cluster.one_item()
    assert status == "pending", cluster.tail()

    status, uncertain, events = await cluster.recover(item_id)

    (request,) = receiver.received
    assert request.idempotency_key == item_id and not request.duplicate
    assert "x-dispach-uncertain" not in request.headers
    assert "ended, not sent" in request.body["text"]
    assert uncertain_flags(events) == [], types(events)
    assert final_sent(events, cluster.tail()).uncertain is False
    assert (status, uncertain) == ("sent", False)
    assert await cluster.turn_ends("hooked") == 1


@pytest.mark.asyncio
async def test_on_uncertain_skip_settles_as_uncertain_without_a_resend(
    cluster: Cluster, telegram: FakeTelegram
) -> None:
    cluster.write_agent("teller", TELEGRAM_AGENT.format(url=telegram.url, on_uncertain="skip"))
    async with cluster.dying_at("delivery.answered"):
        telegram.push_message(CHAT, "say it at most once")
    assert len(telegram.sent) == 1, cluster.tail()
    item_id, *_ = await cluster.one_item()

    status, uncertain, events = await cluster.recover(item_id)  # any send in flight finishes

    assert len(telegram.sent) == 1, (telegram.sent, cluster.tail())
    assert (status, uncertain) == ("uncertain", True)
    (flag,) = uncertain_flags(events)
    assert flag.resend is False and flag.idempotent_send is False
    assert types(events)[-1] == "delivery.uncertain", types(events)
    assert not any(isinstance(e.data, DeliverySent) for e in events)
    assert await cluster.turn_ends("teller") == 1

"""Tracing (actors/tracing.py) on real nodes: the spans a turn leaves, their parents, and the
trace context carried through the log and across nodes. Spans are collected by the SDK's
in-memory exporter behind the node's real BatchSpanProcessor; one test sends them over real
OTLP/HTTP to a receiver in the test, decoding the protobuf."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from actors import tracing
from eventstore import RecordedEvent
from eventstore.catalogue import TurnEnd
from tests import fakes
from tests.conftest import ApiFactory, ApiServer
from tests.fakes import FakeAnthropic, Reply, StreamFault
from tests.fakes.webhook_receiver import WebhookReceiver
from tests.turns import wait_end

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{CALLER}-01"
ROUTE = "POST /v1/agents/{agent}/messages"

Spans = list[ReadableSpan]
fake_anthropic = fakes.fake_anthropic


class Collected:
    """Tracing on for one test, its spans kept in memory."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        handle = tracing.configure("test-node", environ={}, exporter=self.exporter)
        assert handle is not None, "tracing was on already"
        self.handle = handle

    def spans(self) -> Spans:
        self.handle.flush()
        return list(self.exporter.get_finished_spans())


@pytest.fixture
def collected() -> Iterator[Collected]:
    spans = Collected()
    try:
        yield spans
    finally:
        spans.handle.shutdown()


def one(spans: Spans, name: str) -> ReadableSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, sorted(s.name for s in spans))
    return found[0]


def children(spans: Spans, parent: ReadableSpan) -> Spans:
    assert parent.context is not None
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    found: int = span.context.span_id
    return found


def traceparent_of(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-01"


async def post(
    api: ApiServer, text: str, session: str, agent: str = "assistant", **headers: str
) -> str:
    async with httpx.AsyncClient(base_url=api.url, timeout=30) as http:
        body = {"text": text, "sessionKey": session}
        r = await http.post(f"/v1/agents/{agent}/messages", json=body, headers=headers)
    assert r.status_code == 202, r.text
    turn_id: str = r.json()["turnId"]
    return turn_id


async def turn_spans(collected: Collected, turn_id: str) -> Spans:
    """Every span once the turn's own has been exported (the runner ends it after turn.end)."""
    for _ in range(200):
        spans = collected.spans()
        if any(s.name == "dispach.turn" and (s.attributes or {}).get("dispach.turn.id") == turn_id
               for s in spans):  # fmt: skip
            return spans
        await asyncio.sleep(0.05)
    raise AssertionError(f"no dispach.turn span for {turn_id}")


def end_of(events: list[RecordedEvent]) -> TurnEnd:
    end = events[-1].data
    assert isinstance(end, TurnEnd)
    return end


@pytest.mark.asyncio
async def test_a_turn_is_a_tree_under_the_request_span_which_continues_the_callers_trace(
    api: ApiServer, collected: Collected
) -> None:
    turn_id = await post(api, "calc 6*7", "api:traced", traceparent=TRACEPARENT,
                         tracestate="vendor=1")  # fmt: skip
    events = await wait_end(api.node, turn_id)
    spans = await turn_spans(collected, turn_id)
    assert {s.context.trace_id for s in spans if s.context} == {int(TRACE, 16)}

    request = one(spans, ROUTE)
    assert request.kind is SpanKind.SERVER and parent_id(request) == int(CALLER, 16)
    attributes = dict(request.attributes or {})
    assert attributes["http.route"] == "/v1/agents/{agent}/messages"
    assert attributes["http.response.status_code"] == 202

    turn = one(spans, "dispach.turn")
    assert parent_id(turn) == span_id(request)
    end = end_of(events)
    assert dict(turn.attributes or {}).items() >= {
        "dispach.agent.id": "assistant", "dispach.session.key": "api:traced",
        "dispach.turn.id": turn_id, "dispach.turn.outcome": end.reason,
        "dispach.turn.steps": end.steps, "dispach.turn.attempt": 1,
    }.items()  # fmt: skip
    steps = children(spans, turn)
    assert [s.name for s in steps] == ["dispach.step"] * end.steps == ["dispach.step"] * 2
    chats = [c for step in steps for c in children(spans, step)]
    model = api.node.agents["assistant"].model_id
    assert [c.name for c in chats if c.name.startswith("chat")] == [f"chat {model}"] * 2
    tools = [c for c in children(spans, steps[0]) if c.name.startswith("execute_tool")]
    assert [t.name for t in tools] == ["execute_tool calculator"]
    assert dict(tools[0].attributes or {}).items() >= {
        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "calculator",
    }.items()  # fmt: skip
    chat = dict(chats[0].attributes or {})
    assert chat["gen_ai.operation.name"] == "chat"
    assert chat["gen_ai.provider.name"] == "scripted"
    assert chat["gen_ai.request.model"] == model
    assert isinstance(chat["gen_ai.usage.output_tokens"], int)
    assert chat["gen_ai.usage.output_tokens"] > 0
    assert "gen_ai.usage.cache_read_input_tokens" in chat
    # A tool call's arguments are never in a span (the expression was 6*7).
    assert not [(s.name, k) for s in spans for k, v in (s.attributes or {}).items()
                if "6*7" in str(v)]  # fmt: skip

    # The log holds the context: turn.start the request's, the turn's events the turn's own.
    assert events[0].metadata.correlation_id == traceparent_of(request)
    assert {e.metadata.correlation_id for e in events[1:]} == {traceparent_of(turn)}


@pytest.mark.asyncio
async def test_a_turn_posted_on_node_a_and_run_on_node_b_is_in_node_as_request_trace(
    api_factory: ApiFactory, collected: Collected
) -> None:
    a = await api_factory.start()
    b = await api_factory.start()
    own_a, own_b = a.node.ownership, b.node.ownership
    assert own_a is not None and own_b is not None

    async def split() -> bool:
        # Served, not only fenced: a partition's epoch is known while its turns resume, and
        # commands for it wait until it is open (Ownership.owns).
        serving = [any(o.owns(p) for p in range(o.count)) for o in (own_a, own_b)]
        return all(serving) and own_a.ready and own_b.ready

    for _ in range(400):
        if await split():
            break
        await asyncio.sleep(0.05)
    assert await split(), "the two nodes did not share the partitions"
    session = next(f"api:b-{i}" for i in range(1000)
                   if own_b.owns(own_b.partition("assistant", f"api:b-{i}")))  # fmt: skip

    turn_id = await post(a, "hello", session, traceparent=TRACEPARENT)
    events = await wait_end(b.node, turn_id)
    spans = await turn_spans(collected, turn_id)

    request = one(spans, ROUTE)
    forward = one(spans, "dispach.forward submit")
    command = one(spans, "dispach.command submit")
    turn = one(spans, "dispach.turn")
    assert parent_id(request) == int(CALLER, 16)
    assert forward.kind is SpanKind.CLIENT and parent_id(forward) == span_id(request)
    assert (forward.attributes or {})["dispach.node.target"] == b.node.node_id
    assert command.kind is SpanKind.SERVER and parent_id(command) == span_id(forward)
    assert (command.attributes or {})["dispach.node.id"] == b.node.node_id
    assert parent_id(turn) == span_id(command)
    assert (turn.attributes or {})["dispach.node.id"] == b.node.node_id
    assert events[0].metadata.correlation_id == traceparent_of(command)
    assert {s.context.trace_id for s in spans if s.context} == {int(TRACE, 16)}


HOOKED = """
id: hooked
model: {provider: scripted}
channels:
  - {id: hooks, type: webhook, url: "%s", backoff_s: [0.05]}
"""


@pytest.mark.asyncio
async def test_a_delivery_starts_a_trace_of_its_own_linked_to_the_turn_that_promised_it(
    api_factory: ApiFactory, collected: Collected, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISPACH_WEBHOOK_SECRET", "test-webhook-secret")
    with WebhookReceiver("test-webhook-secret") as receiver:
        api_factory.write_agent("hooked", HOOKED % receiver.url)
        api = await api_factory.start()
        async with httpx.AsyncClient(base_url=api.url) as http:
            body = {"text": "hello", "deliver": {"channel": "hooks", "to": "ops"}}
            r = await http.post("/v1/agents/hooked/messages", json=body,
                                headers={"traceparent": TRACEPARENT})  # fmt: skip
        assert r.status_code == 202, r.text
        await asyncio.to_thread(receiver.wait_for, 1, 10.0)
    for _ in range(200):
        spans = collected.spans()
        deliveries = [s for s in spans if s.name == "dispach.delivery webhook"]
        if deliveries:
            break
        await asyncio.sleep(0.05)
    (delivery,) = deliveries
    turn = one(spans, "dispach.turn")
    assert delivery.kind is SpanKind.PRODUCER and delivery.parent is None
    assert delivery.context is not None and delivery.context.trace_id != int(TRACE, 16)
    assert [link.context.span_id for link in delivery.links] == [span_id(turn)]
    assert (delivery.attributes or {})["dispach.delivery.attempt"] == 1


_NAPS: list[str] = []

RESUMABLE = """
id: resumable
model:
  provider: scripted
  script:
    - {match: "^nap$", tool: nap_once, input: {}}
tools:
  - name: nap_once
    module: tests.test_tracing:nap_once
    description: Sleeps through its first call (the node stops under it), not the next.
    input_schema: {type: object}
"""


async def nap_once(args: dict[str, Any], ctx: object) -> str:
    """The first call sleeps until its node stops; a call again (the resumed turn) returns."""
    _NAPS.append("nap")
    if len(_NAPS) == 1:
        await asyncio.sleep(60)
    return "rested"


@pytest.mark.asyncio
async def test_a_turn_resumed_by_the_next_node_is_still_a_child_of_the_request(
    api_factory: ApiFactory, collected: Collected
) -> None:
    _NAPS.clear()
    api_factory.write_agent("resumable", RESUMABLE)
    first = await api_factory.start()
    turn_id = await post(first, "nap", "api:resumed", agent="resumable", traceparent=TRACEPARENT)
    for _ in range(200):
        if _NAPS:
            break
        await asyncio.sleep(0.05)
    assert _NAPS, "the tool never ran"
    await first.stop()
    await first.node.stop()  # the turn is cut short, unfinished: the next start resumes it
    second = await api_factory.start()
    events = await wait_end(second.node, turn_id)
    assert end_of(events).reason == "final"
    for _ in range(200):
        runs = [s for s in collected.spans() if s.name == "dispach.turn"]
        if len(runs) == 2:
            break
        await asyncio.sleep(0.05)
    request = one(collected.spans(), ROUTE)
    facts = sorted(((s.attributes or {})["dispach.turn.attempt"],
                    (s.attributes or {})["dispach.turn.outcome"]) for s in runs)  # fmt: skip
    assert facts == [(1, "unfinished"), (2, "final")]
    assert [parent_id(s) for s in runs] == [span_id(request)] * 2


@pytest.mark.asyncio
async def test_a_model_failure_sets_the_error_status_of_its_chat_span_and_of_the_turn(
    api_factory: ApiFactory,
    collected: Collected,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DISPACH_TEST_ANTHROPIC_KEY", "test-key")
    api_factory.write_agent("failing", f"""
id: failing
model: {{provider: anthropic, base_url: "{fake_anthropic.url}",
         api_key_env: DISPACH_TEST_ANTHROPIC_KEY}}
""")  # fmt: skip
    fake_anthropic.script(StreamFault(Reply(text="halfway there"), after_events=5, kind="error"))
    api = await api_factory.start()
    turn_id = await post(api, "hello", "api:failing", agent="failing")
    events = await wait_end(api.node, turn_id)
    end = end_of(events)
    assert end.reason == "error" and end.error is not None
    spans = await turn_spans(collected, turn_id)
    turn = one(spans, "dispach.turn")
    chat = next(s for s in spans if s.name.startswith("chat "))
    for span in (turn, chat):
        assert span.status.status_code is StatusCode.ERROR
        assert (span.attributes or {})["error.type"] == end.error.code
    request = one(spans, ROUTE)
    assert request.status.status_code is StatusCode.UNSET  # a 202 is no error of the request's


def tracing_on() -> bool:
    return tracing.ENABLED


class _Receiver(BaseHTTPRequestHandler):
    """An OTLP/HTTP traces endpoint: decodes each export and keeps its spans' names."""

    received: list[tuple[str, dict[str, Any], list[str]]]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        export = ExportTraceServiceRequest.FromString(body)
        for resource_spans in export.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            names = [s.name for scope in resource_spans.scope_spans for s in scope.spans]
            self.received.append((self.path, resource, names))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.asyncio
async def test_the_otlp_endpoint_receives_the_spans_with_the_service_and_node_named(
    api_factory: ApiFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    received: list[tuple[str, dict[str, Any], list[str]]] = []
    handler = type("Handler", (_Receiver,), {"received": received})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
        api = await api_factory.start()  # the node turns tracing on from the environment
        assert tracing_on()
        turn_id = await post(api, "hello", "api:otlp")
        await wait_end(api.node, turn_id)
        await api.stop()
        await api.node.stop()  # exports what is buffered and turns tracing off
        assert not tracing_on()
    finally:
        await asyncio.to_thread(server.shutdown)  # it waits up to serve_forever's 0.5 s poll
        server.server_close()
    names = [name for _, _, spans in received for name in spans]
    model = api.node.agents["assistant"].model_id
    assert {ROUTE, "dispach.turn", "dispach.step", f"chat {model}"} <= set(names)
    assert {path for path, _, _ in received} == {"/v1/traces"}
    resource = received[0][1]
    assert resource["service.name"] == "dispach"
    assert resource["dispach.node.id"] == api.node.node_id
    assert resource["deployment.environment"] == "test"


def test_tracing_is_off_and_free_without_an_endpoint() -> None:
    assert tracing.configure("n", environ={}) is None
    assert not tracing.ENABLED
    assert tracing.turn(TRACEPARENT, "a", "s", "t", "n", 1) is tracing.UNTRACED
    assert tracing.traceparent() is None and tracing.headers() is None
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x"})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": ""})

"""Request telemetry of the HTTP gateway (gateways/http/telemetry.py) on a real node behind uvicorn:
request metrics by route template, the access line, ``X-Request-Id``, a malformed
``traceparent``, and the token counters of real model calls. The registry is process-wide, so
metric checks are differences between two readings."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import structlog
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY
from websockets.asyncio.client import connect

from actors import tracing
from eventstore.catalogue import ModelResult
from tests import fakes
from tests.conftest import ApiFactory, ApiServer
from tests.fakes import FakeAnthropic, Reply
from tests.turns import wait_end

fake_anthropic = fakes.fake_anthropic

REQUESTS = "dispach_http_requests_total"
LATENCY = "dispach_http_request_duration_seconds"
TOKENS = "dispach_model_tokens_total"


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def routes_seen() -> set[str]:
    return {
        s.labels["route"]
        for metric in REGISTRY.collect()
        if metric.name == "dispach_http_requests"
        for s in metric.samples
    }


@pytest.fixture
def lines() -> Iterator[list[structlog.typing.EventDict]]:
    """The access lines logged while the test runs."""
    with structlog.testing.capture_logs() as captured:
        yield captured


def access(captured: list[structlog.typing.EventDict]) -> list[structlog.typing.EventDict]:
    return [e for e in captured if e.get("event") == "request" and "route" in e]


@pytest.mark.asyncio
async def test_requests_are_counted_and_timed_by_route_template_never_by_path(
    api: ApiServer,
) -> None:
    agent, unmatched = ("GET", "/v1/agents/{agent}"), ("GET", "unmatched")
    before = {
        "ok": sample(REQUESTS, method="GET", route=agent[1], status="200"),
        "missing": sample(REQUESTS, method="GET", route=agent[1], status="404"),
        "nowhere": sample(REQUESTS, method="GET", route=unmatched[1], status="404"),
        "timed": sample(LATENCY + "_count", method="GET", route=agent[1]),
        "post": sample(REQUESTS, method="POST", route="/v1/agents/{agent}/messages", status="202"),
    }
    async with httpx.AsyncClient(base_url=api.url) as http:
        assert (await http.get("/v1/agents/assistant")).status_code == 200
        assert (await http.get("/v1/agents/nobody-like-this")).status_code == 404
        assert (await http.get("/v1/no/such/path/4711")).status_code == 404
        r = await http.post("/v1/agents/assistant/messages", json={"text": "hi"})
        assert r.status_code == 202
    after = {
        "ok": sample(REQUESTS, method="GET", route=agent[1], status="200"),
        "missing": sample(REQUESTS, method="GET", route=agent[1], status="404"),
        "nowhere": sample(REQUESTS, method="GET", route=unmatched[1], status="404"),
        "timed": sample(LATENCY + "_count", method="GET", route=agent[1]),
        "post": sample(REQUESTS, method="POST", route="/v1/agents/{agent}/messages", status="202"),
    }
    assert {k: after[k] - before[k] for k in before} == {
        "ok": 1, "missing": 1, "nowhere": 1, "timed": 2, "post": 1,
    }  # fmt: skip
    seen = routes_seen()
    assert not {r for r in seen if "nobody" in r or "4711" in r or "assistant" in r}
    assert seen >= {"/v1/agents/{agent}", "unmatched", "/v1/agents/{agent}/messages"}


@pytest.mark.asyncio
async def test_a_request_refused_before_routing_is_counted_under_its_route(
    api_factory: ApiFactory,
) -> None:
    api = await api_factory.start(tokens=["s3cret"])
    route = "/v1/agents/{agent}/turns"
    before = sample(REQUESTS, method="GET", route=route, status="401")
    async with httpx.AsyncClient(base_url=api.url) as http:
        assert (await http.get("/v1/agents/assistant/turns")).status_code == 401
    assert sample(REQUESTS, method="GET", route=route, status="401") - before == 1


@pytest.mark.asyncio
async def test_an_event_stream_is_timed_to_its_start_and_logged_for_its_whole_life(
    api: ApiServer, lines: list[structlog.typing.EventDict]
) -> None:
    labels = {"method": "GET", "route": "/v1/events"}
    count, total = sample(LATENCY + "_count", **labels), sample(LATENCY + "_sum", **labels)
    began = time.monotonic()
    async with (
        httpx.AsyncClient(base_url=api.url, timeout=10) as http,
        http.stream("GET", "/v1/events") as stream,
    ):
        assert stream.status_code == 200
        await asyncio.sleep(1.2)  # the stream stays open, sending nothing (or a keep-alive)
    lived = time.monotonic() - began
    for _ in range(100):  # the server notices the disconnect on its next send or receive
        logged = [e for e in access(lines) if e["route"] == "/v1/events"]
        if logged:
            break
        await asyncio.sleep(0.05)
    assert sample(LATENCY + "_count", **labels) - count == 1
    assert sample(LATENCY + "_sum", **labels) - total < 0.5 < lived
    assert logged[0]["duration_ms"] >= 1000


@pytest.mark.asyncio
async def test_a_websocket_is_counted_and_logged_once_it_closes_and_never_timed(
    api: ApiServer, lines: list[structlog.typing.EventDict]
) -> None:
    route = {"method": "GET", "route": "/v1/ws"}
    opened = sample(REQUESTS, **route, status="101")
    timed = sample(LATENCY + "_count", **route)
    async with connect(api.ws_url, additional_headers={"X-Request-Id": "ws-1"}) as ws:
        assert ws.response is not None and ws.response.headers["X-Request-Id"] == "ws-1"
        assert msgspec.json.decode(await ws.recv())["type"] == "ws.open"
    for _ in range(100):
        logged = [e for e in access(lines) if e["request_id"] == "ws-1"]
        if logged:
            break
        await asyncio.sleep(0.05)
    assert logged[0].items() >= {"method": "WS", "route": "/v1/ws", "status": 101}.items()
    assert sample(REQUESTS, **route, status="101") - opened == 1
    assert sample(LATENCY + "_count", **route) == timed


@pytest.mark.asyncio
async def test_the_access_line_says_what_was_asked_and_nothing_secret(
    api_factory: ApiFactory, lines: list[structlog.typing.EventDict]
) -> None:
    api = await api_factory.start(tokens=["t0ken-value"])
    async with httpx.AsyncClient(base_url=api.url) as http:
        r = await http.post(
            "/v1/agents/assistant/messages?token=query-secret&x=1",
            json={"text": "body-secret text"},
            headers={"Authorization": "Bearer t0ken-value", "X-Request-Id": "req-42.a_b"},
        )
        assert r.status_code == 202
    line = next(e for e in access(lines) if e["request_id"] == "req-42.a_b")
    assert line.items() >= {
        "method": "POST", "route": "/v1/agents/{agent}/messages",
        "path": "/v1/agents/assistant/messages", "status": 202, "bytes": len(r.content),
        "remote": "127.0.0.1", "log_level": "info",
    }.items()  # fmt: skip
    assert isinstance(line["duration_ms"], float) and line["duration_ms"] > 0
    text = repr(line)
    for secret in ("query-secret", "x=1", "t0ken-value", "body-secret", "Bearer"):
        assert secret not in text


@pytest.mark.asyncio
async def test_a_sane_request_id_is_echoed_and_any_other_replaced(api: ApiServer) -> None:
    async with httpx.AsyncClient(base_url=api.url) as http:

        async def rid(path: str, sent: str | None = None) -> str:
            r = await http.get(path, headers={"X-Request-Id": sent} if sent is not None else {})
            return r.headers["X-Request-Id"]

        assert await rid("/v1/health", "abc-DEF_1.2") == "abc-DEF_1.2"
        assert await rid("/v1/health", "a" * 128) == "a" * 128
        assert await rid("/v1/nowhere", "on-an-error-too") == "on-an-error-too"
        made = {await rid("/v1/health", bad) for bad in ("a" * 129, "has space", "x/y", "")}
        made |= {await rid("/v1/health"), await rid("/v1/health")}
        assert len(made) == 6
        assert all(re.fullmatch(r"[0-9a-f]{16}", m) for m in made)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "traceparent",
    [
        "garbage",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # an all-zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # an all-zero span id
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # the forbidden version
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper case
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" + "-x" * 300,
    ],
)
async def test_a_malformed_traceparent_is_ignored_and_the_request_starts_a_trace(
    api: ApiServer, traceparent: str
) -> None:
    exporter = InMemorySpanExporter()
    handle = tracing.configure("test-node", environ={}, exporter=exporter)
    assert handle is not None
    try:
        async with httpx.AsyncClient(base_url=api.url) as http:
            r = await http.post("/v1/agents/assistant/messages", json={"text": "hi"},
                                headers={"traceparent": traceparent})  # fmt: skip
        assert r.status_code == 202, r.text
        handle.flush()
        request = next(s for s in exporter.get_finished_spans() if s.name.startswith("POST "))
        assert request.parent is None
        assert request.context is not None
        assert f"{request.context.trace_id:032x}" not in traceparent.lower()
        await wait_end(api.node, r.json()["turnId"])
    finally:
        handle.shutdown()


@pytest.mark.asyncio
async def test_model_tokens_are_counted_once_per_call_by_kind_as_model_result_records_them(
    api_factory: ApiFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISPACH_TEST_ANTHROPIC_KEY", "test-key")
    fake_anthropic.cache_min_tokens = 1  # the second turn reads what the first one wrote
    api_factory.write_agent("counted", f"""
id: counted
model: {{provider: anthropic, base_url: "{fake_anthropic.url}",
         api_key_env: DISPACH_TEST_ANTHROPIC_KEY}}
""")  # fmt: skip
    fake_anthropic.script(Reply(text="first answer"), Reply(text="second answer"))
    api = await api_factory.start()
    model = api.node.agents["counted"].model_id
    kinds = ("prompt", "output", "cache_read", "cache_write")
    before = {k: sample(TOKENS, agent="counted", model=model, kind=k) for k in kinds}
    results: list[ModelResult] = []
    async with httpx.AsyncClient(base_url=api.url) as http:
        for text in ("hello", "again"):
            r = await http.post("/v1/agents/counted/messages",
                                json={"text": text, "sessionKey": "api:tokens"})  # fmt: skip
            assert r.status_code == 202
            events = await wait_end(api.node, r.json()["turnId"])
            results += [e.data for e in events if isinstance(e.data, ModelResult)]
    moved = {k: sample(TOKENS, agent="counted", model=model, kind=k) - before[k] for k in kinds}
    assert len(results) == 2
    assert moved == {
        "prompt": sum(m.prompt_tokens for m in results),
        "output": sum(m.output_tokens for m in results),
        "cache_read": sum(m.cache_read_tokens for m in results),
        "cache_write": sum(m.cache_write_tokens for m in results),
    }
    assert moved["cache_read"] > 0 and moved["cache_write"] > 0 and moved["output"] > 0

"""Usage and cost folded from the log (eventstore/projections/usage.py), priced by the price
table (actors/prices.py), served by ``GET /v1/usage`` and per agent, and the per-agent daily
budgets that refuse new turns."""

from __future__ import annotations

import asyncio
import json
import os
import random
from datetime import UTC, datetime, time, timedelta
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from websockets.asyncio.client import connect

from actors import prices
from actors.prices import Counts, PriceTable
from eventstore import Metadata, NewEvent
from eventstore.catalogue import ModelCall, ModelResult, Tokens, TurnEnd, TurnStart
from eventstore.event import Event
from tests.conftest import ApiFactory, ApiServer, NodeFactory
from tests.turns import refused, send, store_of, wait_end


@pytest.mark.asyncio
async def test_the_scripted_model_is_named_scripted_on_the_record(
    node_factory: NodeFactory,
) -> None:
    node = await node_factory.start()
    accepted = await send(node, "assistant", "hello")
    events = await wait_end(node, accepted.turn_id)
    calls = [e.data for e in events if isinstance(e.data, ModelCall)]
    results = [e.data for e in events if isinstance(e.data, ModelResult)]
    assert [c.model for c in calls] == ["scripted"]
    assert [r.model for r in results] == ["scripted"]


# --- the meter over a 1,000-turn log --------------------------------------------------------

MODELS = ("claude-sonnet-4-5", "gpt-4o-mini", "claude-sonnet-4-5-20250929", "house-model")


def a_turn(rng: random.Random, n: int) -> tuple[str, list[NewEvent]]:
    """A turn of one or more model calls (a discarded one now and then), with counts and a
    model drawn at random, ended with the totals its calls add up to."""
    turn_id = f"t_usage_{n}"
    meta = Metadata(agent_id=rng.choice(["alpha", "beta"]), session_key=f"s{rng.randint(0, 9)}",
                    turn_id=turn_id)  # fmt: skip
    model = rng.choice(MODELS)
    events: list[Event] = [TurnStart(source="api", input=f"question {n}", attempt=1, node="n")]
    totals = Tokens()
    for _ in range(rng.randint(1, 3)):
        read, write = rng.randint(0, 500), rng.randint(0, 300)
        result = ModelResult(
            prompt_tokens=rng.randint(0, 4000) + read + write, output_tokens=rng.randint(0, 900),
            cache_read_tokens=read, cache_write_tokens=write, finish_reason="end_turn",
            latency_ms=5, model=model, discarded=rng.random() < 0.1,
            server_tool_requests={"web_search_requests": 2} if rng.random() < 0.2 else None,
        )  # fmt: skip
        events += [ModelCall(role="main", model=model, prompt_tokens=result.prompt_tokens),
                   result]  # fmt: skip
        totals = Tokens(prompt=totals.prompt + result.prompt_tokens,
                        output=totals.output + result.output_tokens,
                        cache_read=totals.cache_read + result.cache_read_tokens,
                        cache_write=totals.cache_write + result.cache_write_tokens)  # fmt: skip
    steps = sum(isinstance(e, ModelResult) for e in events)
    events.append(TurnEnd(reason="final", steps=steps, tokens=totals, duration_ms=9, text="ok"))
    return f"turn-{turn_id}", [NewEvent(event=e, metadata=meta) for e in events]


async def usage(api: ApiServer, path: str = "/v1/usage", **params: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=api.url, headers=api.headers) as client:
        response = await client.get(path, params=params)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


@pytest.mark.asyncio
async def test_usage_over_a_thousand_turns_is_the_sum_of_their_own_counts(
    api_factory: ApiFactory,
) -> None:
    for agent in ("alpha", "beta"):
        api_factory.write_agent(agent, f"id: {agent}\nmodel:\n  provider: scripted\n")
    api = await api_factory.start()
    seed = int(os.environ.get("DISPACH_SEED") or random.randrange(2**32))
    print(f"DISPACH_SEED={seed}")
    rng = random.Random(seed)
    store = store_of(api.node)
    # Built and checked off the loop (a thousand turns' structs take a while on a busy machine).
    written = await asyncio.to_thread(lambda: [a_turn(rng, n) for n in range(1000)])
    for start in range(0, 1000, 50):
        await asyncio.gather(*(store.aappend(s, e) for s, e in written[start : start + 50]))
    # What the turns say of themselves: their own rows (the turns projection, from turn.end).
    rows = await store.afetch(
        b"""SELECT agent_id, session_key, count(*), sum(prompt_tokens), sum(output_tokens),
                   sum(cache_read_tokens), sum(cache_write_tokens), sum(steps)
              FROM turns WHERE turn_id LIKE 't_usage_%' GROUP BY agent_id, session_key"""
    )
    own = {(a, s): [int(v) for v in rest] for a, s, *rest in rows}
    assert sum(v[0] for v in own.values()) == 1000
    by_session = await usage(api, by="agent,session")
    got = {(b["agentId"], b["sessionKey"]): [b["promptTokens"], b["outputTokens"],
                                            b["cacheReadTokens"], b["cacheWriteTokens"],
                                            b["calls"]]
           for b in by_session["buckets"]}  # fmt: skip
    assert got == {key: v[1:] for key, v in own.items()}
    # Priced by model: what the price table says of each model's sums, a snapshot as its
    # model, an unknown model never guessed at.
    by_model = {b["model"]: b for b in (await usage(api, by="model"))["buckets"]}
    assert set(by_model) == set(MODELS)
    await asyncio.to_thread(check_costs, written, by_model)
    # An agent's buckets are the agents' buckets of that agent; today is every call.
    alpha = await usage(api, "/v1/agents/alpha/usage", by="model")
    assert alpha["by"] == ["model"]
    everyone = (await usage(api, by="agent,model"))["buckets"]
    assert [{k: v for k, v in b.items() if k != "agentId"} for b in everyone
            if b["agentId"] == "alpha"] == alpha["buckets"]  # fmt: skip
    today = datetime.now(UTC).date().isoformat()
    days = (await usage(api, by="day", **{"from": today}))["buckets"]
    assert [d["day"] for d in days] == [today]
    assert days[0]["calls"] == sum(b["calls"] for b in by_model.values())
    # A range that ends before the calls holds none.
    assert (await usage(api, by="agent", to="2001-01-01"))["buckets"] == []


def check_costs(written: list[tuple[str, list[NewEvent]]], by_model: dict[str, Any]) -> None:
    """Each model's bucket against the price table's price of its calls, summed here: a
    snapshot priced as its model, a model or a server tool without a price never guessed at."""
    table = PriceTable()
    for model, bucket in by_model.items():
        calls = [e.event for _, events in written for e in events
                 if isinstance(e.event, ModelResult) and e.event.model == model]  # fmt: skip
        searches = sum((c.server_tool_requests or {}).get("web_search_requests", 0) for c in calls)
        assert bucket["calls"] == len(calls)
        assert bucket["serverToolRequests"] == ({"web_search_requests": searches} if searches
                                                else {})  # fmt: skip
        price = table.price(model)
        if price is None or (searches and "web_search_requests" not in price.server_tools):
            assert bucket["costUsd"] is None  # no price for the model, or for its searches
            assert ("house-model" if price is None else "web_search_requests") in (
                bucket["costReason"])  # fmt: skip
            continue
        uncached = sum(c.prompt_tokens - c.cache_read_tokens - c.cache_write_tokens for c in calls)
        read, write = price.cache_read or price.input, price.cache_write or price.input
        tokens = (uncached * price.input + sum(c.output_tokens for c in calls) * price.output
                  + sum(c.cache_read_tokens for c in calls) * read
                  + sum(c.cache_write_tokens for c in calls) * write)  # fmt: skip
        expected = tokens / 1e6 + searches * price.server_tools.get("web_search_requests", 0.0)
        assert bucket["costUsd"] == pytest.approx(expected, abs=1e-5)


@pytest.mark.asyncio
async def test_usage_refuses_a_grouping_or_range_it_cannot_read(api: ApiServer) -> None:
    async with httpx.AsyncClient(base_url=api.url) as client:
        for params, code, field in [
            ({"by": "agent,colour"}, "usage_group_invalid", "by"),
            ({"by": "agent,agent"}, "usage_group_invalid", "by"),
            ({"from": "yesterday"}, "usage_range_invalid", "from"),
            ({"from": "2026-12-02", "to": "2026-12-01"}, "usage_range_invalid", "to"),
        ]:
            response = await client.get("/v1/usage", params=params)
            assert response.status_code == 400, params
            error = response.json()["error"]
            assert (error["code"], error["field"]) == (code, field) and error["hint"]
        response = await client.get("/v1/agents/assistant/usage", params={"by": "agent"})
        assert response.json()["error"]["code"] == "usage_group_invalid"


# --- the turn resource's cost -----------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_turn_shows_its_cost_call_by_call(api_factory: ApiFactory) -> None:
    # The operator prices the scripted model (free by default): $1 and $2 per million.
    priced = prices.load({"DISPACH_PRICES": '{"scripted": {"input": 1, "output": 2}}'})
    api = await api_factory.start(prices=priced)
    async with httpx.AsyncClient(base_url=api.url) as client:
        accepted = await client.post("/v1/agents/assistant/messages", json={"text": "hello"})
        turn_id = accepted.json()["turnId"]
        await wait_end(api.node, turn_id)
        turn = (await client.get(f"/v1/agents/assistant/turns/{turn_id}")).json()
        listed = (await client.get("/v1/agents/assistant/turns")).json()["turns"]
    [call] = turn["calls"]
    assert call["model"] == "scripted"
    expected = (call["promptTokens"] * 1 + call["outputTokens"] * 2) / 1e6
    assert call["costUsd"] == pytest.approx(expected)
    assert turn["costUsd"] == pytest.approx(expected)
    assert "costReason" not in turn
    assert [t["costUsd"] for t in listed if t["turnId"] == turn_id] == [turn["costUsd"]]


@pytest.mark.asyncio
async def test_a_turn_of_an_unpriced_model_has_a_null_cost_and_says_why(api: ApiServer) -> None:
    store = store_of(api.node)
    stream, events = a_turn(random.Random(1), 0)
    unpriced = [NewEvent(event=msgspec.structs.replace(e.event, model="house-model"),
                         metadata=e.metadata) if isinstance(e.event, ModelResult) else e
                for e in events]  # fmt: skip
    await store.aappend(stream, unpriced)
    async with httpx.AsyncClient(base_url=api.url) as client:
        agent = events[0].metadata.agent_id
        turn = (await client.get(f"/v1/turns/{stream.removeprefix('turn-')}")).json()
    assert agent and turn["costUsd"] is None
    assert "house-model" in turn["costReason"] and "DISPACH_PRICES" in turn["costReason"]


# --- budgets ----------------------------------------------------------------------------------

THRIFTY = """
id: thrifty
model:
  provider: scripted
limits:
  daily_tokens: 1
"""


@pytest.mark.asyncio
async def test_an_agent_over_its_daily_budget_refuses_new_turns_at_every_door(
    api_factory: ApiFactory,
) -> None:
    api_factory.write_agent("thrifty", THRIFTY)
    api = await api_factory.start()
    first = await send(api.node, "thrifty", "hello")  # nothing used yet today: accepted
    await wait_end(api.node, first.turn_id)
    async with httpx.AsyncClient(base_url=api.url) as client:
        response = await client.post("/v1/agents/thrifty/messages", json={"text": "again"})
        other = await client.post("/v1/agents/assistant/messages", json={"text": "hi"})
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["code"] == "budget_exhausted" and "daily_tokens" in error["message"]
    midnight = datetime.combine(datetime.now(UTC).date() + timedelta(days=1), time(), UTC)
    assert midnight.strftime("%Y-%m-%dT%H:%M:%SZ") in error["hint"]
    wait = int(response.headers["retry-after"])
    assert 0 < wait <= (midnight - datetime.now(UTC)).total_seconds() + 2
    assert other.status_code == 202  # an agent without a budget is not held back
    # The NATS door and the WebSocket door say the same.
    refusal = await refused(api.node, "thrifty", "once more")
    assert refusal.code == "budget_exhausted"
    async with connect(api.ws_url) as ws:
        assert json.loads(await ws.recv())["type"] == "ws.open"
        await ws.send(json.dumps({"type": "message", "agentId": "thrifty", "text": "and again"}))
        frame = json.loads(await ws.recv())
    assert frame["type"] == "ws.error" and frame["code"] == "budget_exhausted"
    turns = await store_of(api.node).afetch(
        b"SELECT count(*) FROM turns WHERE agent_id = 'thrifty'"
    )
    assert turns == [(1,)]


def test_prices_match_snapshots_never_guess_and_take_the_operators_entries(
    tmp_path: Path,
) -> None:
    table = PriceTable()
    counts = Counts(prompt=1_000_000, output=1_000_000)
    assert table.cost("claude-sonnet-4-5-20250929", counts) == table.cost("claude-sonnet-4-5",
                                                                          counts)  # fmt: skip
    assert table.cost("claude-sonnet-4-5", counts).usd == pytest.approx(18.0)
    assert table.cost("claude-sonnet-4-5x", counts).usd is None
    assert table.cost("house", Counts()).usd == 0.0  # nothing used costs nothing
    prices_file = tmp_path / "prices.yaml"
    prices_file.write_text("house: {input: 1, output: 3}\ngpt-4o: {input: 9, output: 9}\n")
    loaded = prices.load({"DISPACH_PRICES_FILE": str(prices_file),
                          "DISPACH_PRICES": '{"gpt-4o": {"input": 5, "output": 5}}'})  # fmt: skip
    assert loaded.cost("house", counts).usd == pytest.approx(4.0)
    assert loaded.cost("gpt-4o", counts).usd == pytest.approx(10.0)  # the variable wins
    assert loaded.cost("gpt-4o-mini", counts) == PriceTable().cost("gpt-4o-mini", counts)
    with pytest.raises(prices.PriceError) as bad:
        prices.load({"DISPACH_PRICES": '{"x": {"input": -1, "output": 0}}'})
    assert bad.value.code == "prices_invalid" and bad.value.hint


def test_the_default_model_is_priced() -> None:
    """An agent that names no model gets one whose cost is known (2 and 10 dollars per million
    input and output tokens for claude-sonnet-5; a cache read a tenth, a write 1.25 times)."""
    from gateways.model.config import ModelConfig

    model = ModelConfig().id
    cost = PriceTable().cost(model, Counts(prompt=1_000_000, output=1_000_000))
    assert cost.usd == pytest.approx(12.0), cost

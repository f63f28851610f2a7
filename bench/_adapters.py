"""CPU of one model call on the event loop, split into the SDK's share and our adapter's own.

Used by bench/turns.py (``--adapters``, or on its own: ``.venv/bin/python bench/turns.py
--adapters-only``). Each provider's fake (tests/fakes: a real HTTP server on loopback, in
threads of its own, so its CPU is not the loop thread's) answers the same reply: a paragraph of
text, thinking or reasoning, and one tool call, streamed in small deltas like a real model's.

For each provider, per call, in loop-thread CPU (``time.thread_time``):
  - baseline: the same request and body through a bare ``httpx2.AsyncClient`` stream (the
    transfer alone: connection reuse, chunked decoding), measured in the same run;
  - adapter: ``<Provider>Model.stream()`` to its ``Completed`` (SDK request building and
    response handling, the HTTP transfer, and our parsing);
  - ours: our parsing alone, replaying the recorded body's chunks through the adapter's reader
    (no socket, no SDK);
  - SDK share = adapter - baseline - ours;
  - typed: the SDK used as documented, parameters through its types and a typed chunk
    stream over the same reply (the Anthropic adapter's reading before it took the body raw;
    for OpenAI, what the body-raw adapter with the conversation in ``extra_body`` avoids).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx2

from actors.model import Completed, ModelRequest, Reasoning

CALLS = 200
ROUNDS = 3
TEXT = "The answer, written out at some length so that it streams in many small deltas. " * 6
THINKING = "First I consider the question, then what the tool will tell me. " * 4
TOOL_INPUT = {"expression": "6*7", "note": "a tool call whose input arrives in pieces"}
REQUEST = ModelRequest(
    model="bench-model",
    system=[{"type": "text", "text": "You are a benchmark."}],
    messages=[{"role": "user", "content": [{"type": "text", "text": "calculate 6*7"}]}],
    tools=[{"name": "calculator", "description": "arithmetic",
            "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}}}],
    max_tokens=4096,
)  # fmt: skip


def _history(exchanges: int) -> list[dict[str, Any]]:
    """A conversation of ``exchanges`` tool rounds before the question (3 messages each)."""
    messages: list[dict[str, Any]] = []
    for n in range(exchanges):
        call = {"type": "tool_use", "id": f"toolu_{n:04d}", "name": "calculator",
                "input": {"expression": f"{n}*7"}}  # fmt: skip
        messages += [
            {"role": "user", "content": [{"type": "text", "text": f"question {n}, in words"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "answer " * 40}, call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                                          "content": str(n * 7)}]},
        ]  # fmt: skip
    return messages + REQUEST.messages


SIZES = (0, 20)
"""Tool rounds of history before the question: a fresh session, and 61 messages."""


@dataclass(frozen=True)
class Figures:
    provider: str
    messages: int
    deltas: int
    body_bytes: int
    baseline_ms: float
    adapter_ms: float
    ours_ms: float
    typed_ms: float | None = None
    """The SDK's own typed stream (``messages.create(stream=True)``, one pydantic object per
    event): how the adapter read replies before it read the body itself."""

    @property
    def sdk_ms(self) -> float:
        return max(0.0, self.adapter_ms - self.baseline_ms - self.ours_ms)


class _Replayed:
    """A response whose body is recorded chunks (what the adapter's reader iterates)."""

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk


async def _cpu_per_call(call: Callable[[], Awaitable[Any]], calls: int) -> float:
    """Median over rounds of loop-thread CPU per call, in ms (a warm-up call first)."""
    await call()
    rounds = []
    for _ in range(ROUNDS):
        start = time.thread_time()
        for _ in range(calls):
            await call()
        rounds.append((time.thread_time() - start) * 1000 / calls)
    return statistics.median(rounds)


async def _recorded(url: str, headers: dict[str, str], body: dict[str, Any]) -> list[bytes]:
    async with (
        httpx2.AsyncClient() as client,
        client.stream("POST", url, json=body, headers=headers) as response,
    ):
        return [chunk async for chunk in response.aiter_bytes()]


async def _baseline(url: str, headers: dict[str, str], body: dict[str, Any], calls: int) -> float:
    async with httpx2.AsyncClient() as client:

        async def call() -> None:
            async with client.stream("POST", url, json=body, headers=headers) as response:
                async for _ in response.aiter_bytes():
                    pass

        return await _cpu_per_call(call, calls)


async def _drain(stream: AsyncIterator[Any]) -> Completed:
    last = None
    async for event in stream:
        last = event
    assert isinstance(last, Completed), last
    return last


async def anthropic_figures(calls: int = CALLS, exchanges: int = 0) -> Figures:
    from gateways.model.anthropic import AnthropicModel, _read
    from tests.fakes.anthropic_server import FakeAnthropic, Reply, ToolUse

    reply = Reply(text=TEXT, thinking=THINKING, tool_uses=[ToolUse("calculator", TOOL_INPUT)],
                  chunk_size=12)  # fmt: skip
    with FakeAnthropic() as fake:
        fake.default = reply
        model = AnthropicModel("bench-model", api_key="bench", base_url=fake.url)
        request = msgspec_replace(REQUEST, reasoning=Reasoning(budget_tokens=2048),
                                  messages=_history(exchanges))  # fmt: skip
        body = {"model": "bench-model", "max_tokens": 4096, "stream": True,
                "messages": request.messages, "system": REQUEST.system, "tools": REQUEST.tools,
                "thinking": {"type": "enabled", "budget_tokens": 2048}}  # fmt: skip
        headers = {"x-api-key": "bench", "anthropic-version": "2023-06-01"}
        url = fake.url + "/v1/messages"
        chunks = await _recorded(url, headers, body)
        baseline = await _baseline(url, headers, body, calls)
        adapter = await _cpu_per_call(lambda: _drain(model.stream(request)), calls)
        ours = await _cpu_per_call(lambda: _drain(_read(_Replayed(chunks), 0.0)), calls)
        client = model._client

        async def typed() -> None:
            stream = await client.messages.create(
                model="bench-model",
                max_tokens=4096,
                stream=True,
                messages=REQUEST.messages,
                system=REQUEST.system,
                tools=REQUEST.tools,
                thinking={"type": "enabled", "budget_tokens": 2048},
            )  # type: ignore[call-overload]
            async for _ in stream:
                pass

        typed_ms = await _cpu_per_call(typed, calls)
        completed = await _drain(model.stream(request))
        await model.aclose()
    deltas = sum(chunk.count(b"content_block_delta") for chunk in chunks) // 2
    assert any(b.get("type") == "tool_use" for b in completed.content)
    size = sum(map(len, chunks))
    return Figures("anthropic", len(request.messages), deltas, size, baseline, adapter, ours,
                   typed_ms)  # fmt: skip


def msgspec_replace(request: ModelRequest, **changes: Any) -> ModelRequest:
    import msgspec

    return msgspec.structs.replace(request, **changes)


async def openai_figures(calls: int = CALLS, exchanges: int = 0) -> Figures:
    from gateways.model.openai import OpenAIModel, _read, chat_messages, function_tools
    from tests.fakes.openai_server import FakeOpenAI, Reply, ToolCall

    reply = Reply(text=TEXT, reasoning=THINKING, tool_calls=[ToolCall("calculator", TOOL_INPUT)],
                  chunk_size=12)  # fmt: skip
    with FakeOpenAI() as fake:
        fake.default = reply
        model = OpenAIModel("bench-model", api_key="bench", base_url=fake.url + "/v1")
        request = msgspec_replace(REQUEST, reasoning=Reasoning(effort="medium"),
                                  messages=_history(exchanges))  # fmt: skip
        body = {"model": "bench-model", "max_completion_tokens": 4096, "stream": True,
                "stream_options": {"include_usage": True}, "reasoning_effort": "medium",
                "messages": chat_messages(REQUEST.system, request.messages),
                "tools": function_tools(REQUEST.tools)}  # fmt: skip
        headers = {"authorization": "Bearer bench"}
        url = fake.url + "/v1/chat/completions"
        chunks = await _recorded(url, headers, body)
        baseline = await _baseline(url, headers, body, calls)
        adapter = await _cpu_per_call(lambda: _drain(model.stream(request)), calls)
        ours = await _cpu_per_call(lambda: _drain(_read(_Replayed(chunks), 0.0, "auto")), calls)
        client = model._client

        async def typed() -> None:
            stream = await client.chat.completions.create(
                model="bench-model", max_completion_tokens=4096, stream=True,
                stream_options={"include_usage": True}, reasoning_effort="medium",
                messages=body["messages"], tools=body["tools"],
            )  # fmt: skip
            async for _ in stream:
                pass

        typed_ms = await _cpu_per_call(typed, calls)
        completed = await _drain(model.stream(request))
        await model.aclose()
    deltas = sum(chunk.count(b"data: ") for chunk in chunks)
    assert any(b.get("type") == "tool_use" for b in completed.content)
    size = sum(map(len, chunks))
    return Figures("openai", len(request.messages), deltas, size, baseline, adapter, ours,
                   typed_ms)  # fmt: skip


async def all_figures(calls: int = CALLS) -> list[Figures]:
    figures = []
    for exchanges in SIZES:
        figures.append(await anthropic_figures(calls, exchanges))
        figures.append(await openai_figures(calls, exchanges))
    return figures


def print_figures(figures: list[Figures]) -> None:
    print("\n## CPU per model call on the event loop (loop thread, ms; median of rounds)")
    print("| provider | messages | deltas | body | baseline (bare httpx2) | adapter (SDK + ours) | "
          "ours alone | SDK share | SDK as documented (typed) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for f in figures:
        print(f"| {f.provider} | {f.messages} | {f.deltas} | {f.body_bytes / 1024:.1f} KiB | "
              f"{f.baseline_ms:.3f} | {f.adapter_ms:.3f} | {f.ours_ms:.3f} | {f.sdk_ms:.3f} | "
              f"{'—' if f.typed_ms is None else f'{f.typed_ms:.3f}'} |")  # fmt: skip
    print("Goal (issue 15): ours alone <= 0.3 ms per call.")


if __name__ == "__main__":
    print_figures(asyncio.run(all_figures()))

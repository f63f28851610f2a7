"""The fake Anthropic server, proven against the real SDK (``anthropic`` 2.x over ``httpx2``).

Every test talks to the fake over a real socket, with the SDK unchanged: what passes here is what
the runtime's model adapter will see from the real API (streams, retries, mid-stream faults).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from typing import Any

import anthropic
import httpx2
import pytest
from anthropic.types import (
    MessageParam,
    ParsedMessage,
    TextBlock,
    ThinkingBlock,
    ToolParam,
    ToolUseBlock,
)

from tests import fakes
from tests.fakes import (
    FakeAnthropic,
    HttpError,
    Reply,
    StreamFault,
    ToolUse,
    anthropic_client_kwargs,
    estimate_input_tokens,
)

fake_anthropic = fakes.fake_anthropic  # the fixture, until a conftest provides it suite-wide

MODEL = "claude-sonnet-5"  # not in the SDK's deprecated list: no DeprecationWarning
HELLO: list[MessageParam] = [{"role": "user", "content": "Hello"}]
WEATHER: ToolParam = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TIME: ToolParam = {
    "name": "get_time",
    "description": "The local time in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def sync_client(fake: FakeAnthropic, **options: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(**anthropic_client_kwargs(fake), **options)


def async_client(fake: FakeAnthropic, **options: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(**anthropic_client_kwargs(fake), **options)


async def stream_final(
    fake: FakeAnthropic,
    texts: list[str] | None = None,
    tools: list[ToolParam] | None = None,
    **options: Any,
) -> ParsedMessage[None]:
    """One ``messages.stream()`` through a fresh ``AsyncAnthropic``: text deltas go to ``texts``
    as they arrive; returns ``get_final_message()``."""
    async with (
        async_client(fake, **options) as client,
        client.messages.stream(
            model=MODEL,
            max_tokens=64,
            messages=HELLO,
            tools=anthropic.omit if tools is None else tools,
        ) as stream,
    ):
        async for event in stream:
            if event.type == "text" and texts is not None:
                texts.append(event.text)
        return await stream.get_final_message()


def tool_uses(message: anthropic.types.Message) -> list[ToolUseBlock]:
    return [block for block in message.content if isinstance(block, ToolUseBlock)]


# --- replies --------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_streamed_text_reply_arrives_in_chunks_with_usage(
    fake_anthropic: FakeAnthropic,
) -> None:
    text = "Hello from the fake server."
    fake_anthropic.script(Reply(text=text, chunk_size=5))
    async with (
        async_client(fake_anthropic) as client,
        client.messages.stream(model=MODEL, max_tokens=64, messages=HELLO) as stream,
    ):
        deltas = [delta async for delta in stream.text_stream]
        message = await stream.get_final_message()
        request_id = stream.request_id

    assert deltas == ["Hello", " from", " the ", "fake ", "serve", "r."]
    assert isinstance(message.content[0], TextBlock) and message.content[0].text == text
    assert message.stop_reason == "end_turn" and message.model == MODEL
    (recorded,) = fake_anthropic.message_requests()
    assert message.usage.input_tokens == estimate_input_tokens(recorded.body)
    assert message.usage.output_tokens == len(text) // 4
    assert message.usage.cache_read_input_tokens == message.usage.cache_creation_input_tokens == 0
    assert request_id is not None and request_id.startswith("req_")
    assert recorded.body["stream"] is True and recorded.body["messages"] == HELLO
    assert recorded.headers["authorization"] == "Bearer test"
    assert recorded.headers["x-stainless-helper-method"] == "stream"
    assert recorded.retry_count == 0


def test_a_non_streaming_create_gets_a_json_message(fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(Reply(text="Plain JSON.", output_tokens=7, input_tokens=3))
    with sync_client(fake_anthropic) as client:
        message = client.messages.create(model=MODEL, max_tokens=64, messages=HELLO)
        default = client.messages.create(model=MODEL, max_tokens=64, messages=HELLO)

    assert isinstance(message.content[0], TextBlock) and message.content[0].text == "Plain JSON."
    assert (message.usage.input_tokens, message.usage.output_tokens) == (3, 7)
    assert message.stop_reason == "end_turn"
    assert message._request_id is not None and message._request_id.startswith("req_")
    assert isinstance(default.content[0], TextBlock) and default.content[0].text == "ok"
    first, _ = fake_anthropic.message_requests()
    assert "stream" not in first.body
    assert first.headers["user-agent"].startswith("Anthropic/Python")


@pytest.mark.asyncio
async def test_two_parallel_tool_uses_stream_their_inputs_in_pieces(
    fake_anthropic: FakeAnthropic,
) -> None:
    fake_anthropic.script(
        Reply(
            text="Checking both.",
            tool_uses=[
                ToolUse("get_weather", {"city": "San Francisco"}),
                ToolUse("get_time", {"city": "Paris"}, id="toolu_fixed"),
            ],
            chunk_size=3,
        )
    )
    partial: dict[int, list[str]] = {}
    snapshots: list[object] = []
    async with (
        async_client(fake_anthropic) as client,
        client.messages.stream(
            model=MODEL, max_tokens=256, messages=HELLO, tools=[WEATHER, TIME]
        ) as stream,
    ):
        async for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial.setdefault(event.index, []).append(event.delta.partial_json)
            elif event.type == "input_json":
                snapshots.append(event.snapshot)
        message = await stream.get_final_message()

    weather, clock = tool_uses(message)
    assert (weather.name, weather.input) == ("get_weather", {"city": "San Francisco"})
    assert (clock.name, clock.input, clock.id) == ("get_time", {"city": "Paris"}, "toolu_fixed")
    assert weather.id.startswith("toolu_") and weather.id != clock.id
    assert message.stop_reason == "tool_use"
    assert sorted(partial) == [1, 2]  # block 0 is the text
    assert partial[1][0] == "" and json.loads("".join(partial[1])) == {"city": "San Francisco"}
    assert all(len(piece) <= 3 for piece in partial[1] + partial[2])
    assert {} in snapshots and {"city": "Paris"} in snapshots  # incomplete pieces parse to {}


def test_tool_uses_in_a_non_streaming_reply(fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("get_weather", {"city": "Oslo"}), ToolUse("get_time", {})])
    )
    with sync_client(fake_anthropic) as client:
        message = client.messages.create(
            model=MODEL, max_tokens=64, messages=HELLO, tools=[WEATHER, TIME]
        )

    assert [(b.name, b.input) for b in tool_uses(message)] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert message.stop_reason == "tool_use" and len(message.content) == 2


def test_a_thinking_block_comes_first_with_a_signature(fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(Reply(text="Done.", thinking="Let me think this through."))
    with sync_client(fake_anthropic) as client:
        with client.messages.stream(model=MODEL, max_tokens=64, messages=HELLO) as stream:
            message = stream.get_final_message()
        follow_up: list[MessageParam] = [
            *HELLO,
            message.to_param(),
            {"role": "user", "content": "Go on."},
        ]
        client.messages.create(model=MODEL, max_tokens=64, messages=follow_up)

    thinking, text = message.content
    assert isinstance(thinking, ThinkingBlock) and thinking.thinking == "Let me think this through."
    assert thinking.signature and isinstance(text, TextBlock) and text.text == "Done."
    replayed = fake_anthropic.message_requests()[1].body["messages"][1]["content"][0]
    assert replayed["type"] == "thinking" and replayed["signature"] == thinking.signature


# --- validation -----------------------------------------------------------------------------


def test_every_tool_use_needs_a_tool_result_right_after(fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("get_weather", {"city": "Rome"}, id="toolu_rome")]),
        Reply(text="It is sunny in Rome."),
    )
    with sync_client(fake_anthropic) as client:
        first = client.messages.create(model=MODEL, max_tokens=64, messages=HELLO, tools=[WEATHER])
        asked: list[MessageParam] = [*HELLO, first.to_param()]

        without: list[MessageParam] = [*asked, {"role": "user", "content": "Well?"}]
        with pytest.raises(anthropic.BadRequestError) as missing:
            client.messages.create(model=MODEL, max_tokens=64, messages=without, tools=[WEATHER])

        late: list[MessageParam] = [
            *asked,
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Here:"},
                    {"type": "tool_result", "tool_use_id": "toolu_rome", "content": "sunny"},
                ],
            },
        ]
        with pytest.raises(anthropic.BadRequestError) as misplaced:
            client.messages.create(model=MODEL, max_tokens=64, messages=late, tools=[WEATHER])

        assert fake_anthropic.pending == 1  # rejected requests consume nothing
        answered: list[MessageParam] = [
            *asked,
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_rome", "content": "sunny"}
                ],
            },
        ]
        final = client.messages.create(
            model=MODEL, max_tokens=64, messages=answered, tools=[WEATHER]
        )

    assert missing.value.status_code == 400 and missing.value.type == "invalid_request_error"
    assert missing.value.api_message == (
        "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: "
        "toolu_rome. Each `tool_use` block must have a corresponding `tool_result` block in the "
        "next message."
    )
    assert misplaced.value.api_message is not None
    assert misplaced.value.api_message.startswith(
        "messages.2: Did not find 1 `tool_result` block(s) at the beginning of this message."
    )
    assert missing.value.request_id is not None and missing.value.request_id.startswith("req_")
    assert isinstance(final.content[0], TextBlock) and final.content[0].text.endswith("Rome.")
    assert [r.retry_count for r in fake_anthropic.message_requests()] == [0, 0, 0, 0]


def test_a_tool_result_without_its_tool_use_is_refused(fake_anthropic: FakeAnthropic) -> None:
    orphan: list[MessageParam] = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_nowhere", "content": "x"}],
        },
    ]
    with sync_client(fake_anthropic) as client, pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=64, messages=orphan)
    assert caught.value.api_message is not None
    assert "unexpected `tool_use_id` found in `tool_result` blocks: toolu_nowhere" in (
        caught.value.api_message
    )


def test_removed_sampling_parameters_are_refused(fake_anthropic: FakeAnthropic) -> None:
    with sync_client(fake_anthropic) as client:
        for name in ("temperature", "top_p", "top_k"):
            with pytest.raises(anthropic.BadRequestError) as caught:
                client.messages.create(
                    model=MODEL, max_tokens=64, messages=HELLO, extra_body={name: 0.5}
                )
            assert caught.value.api_message == f"{name}: Extra inputs are not permitted"
    assert len(fake_anthropic.message_requests()) == 3  # 400s are not retried


def test_more_than_four_cache_markers_are_refused(fake_anthropic: FakeAnthropic) -> None:
    marked: list[MessageParam] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}}
                for i in range(5)
            ],
        }
    ]
    with sync_client(fake_anthropic) as client, pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=64, messages=marked)
    assert caught.value.api_message == (
        "A maximum of 4 blocks with cache_control may be provided. Found 5."
    )


# --- HTTP errors and the SDK's retries ------------------------------------------------------


@pytest.mark.asyncio
async def test_a_429_with_retry_after_ms_is_retried_at_once(
    fake_anthropic: FakeAnthropic,
) -> None:
    fake_anthropic.script(
        HttpError(429, "rate_limit_error", retry_after_ms=1), Reply(text="second time lucky")
    )
    message = await stream_final(fake_anthropic)

    assert isinstance(message.content[0], TextBlock)
    assert message.content[0].text == "second time lucky"
    first, second = fake_anthropic.message_requests()
    assert (first.retry_count, second.retry_count) == (0, 1)
    assert first.body == second.body
    assert second.at - first.at < 0.3  # 1 ms asked for; the SDK's own backoff is >= 0.375 s


def test_three_529s_exhaust_the_retries(fake_anthropic: FakeAnthropic) -> None:
    overloaded = HttpError(529, "overloaded_error", retry_after_ms=1)
    fake_anthropic.script(overloaded, overloaded, overloaded)
    with sync_client(fake_anthropic) as client, pytest.raises(anthropic.OverloadedError) as caught:
        client.messages.create(model=MODEL, max_tokens=64, messages=HELLO)

    assert caught.value.status_code == 529 and caught.value.type == "overloaded_error"
    assert caught.value.api_message == "Overloaded"
    assert [r.retry_count for r in fake_anthropic.message_requests()] == [0, 1, 2]
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["request_id"] == caught.value.request_id


def test_x_should_retry_overrides_the_status(fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(
        HttpError(529, "overloaded_error", retry_after_ms=1, should_retry=False),
        HttpError(400, "invalid_request_error", retry_after_ms=1, should_retry=True),
        Reply(text="retried a 400"),
    )
    with sync_client(fake_anthropic) as client:
        with pytest.raises(anthropic.OverloadedError):
            client.messages.create(model=MODEL, max_tokens=64, messages=HELLO)
        assert len(fake_anthropic.message_requests()) == 1
        message = client.messages.create(model=MODEL, max_tokens=64, messages=HELLO)

    assert isinstance(message.content[0], TextBlock) and message.content[0].text == "retried a 400"
    assert [r.retry_count for r in fake_anthropic.message_requests()] == [0, 0, 1]


def test_an_error_code_selects_the_sdk_subclass(fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(
        HttpError(
            429,
            "rate_limit_error",
            "Spend limit reached",
            should_retry=False,
            error_code="enforced_spend_limit_reached",
        )
    )
    with (
        sync_client(fake_anthropic) as client,
        pytest.raises(anthropic.EnforcedSpendLimitReachedError) as caught,
    ):
        client.messages.create(model=MODEL, max_tokens=64, messages=HELLO)
    assert caught.value.error_code == "enforced_spend_limit_reached"
    assert caught.value.api_message == "Spend limit reached"


# --- faults in the middle of a stream -------------------------------------------------------


@pytest.mark.asyncio
async def test_an_error_event_mid_stream_raises_a_bare_api_status_error(
    fake_anthropic: FakeAnthropic,
) -> None:
    fake_anthropic.script(StreamFault(Reply(text="partial answer"), after_events=4, kind="error"))
    texts: list[str] = []
    with pytest.raises(anthropic.APIStatusError) as caught:
        await stream_final(fake_anthropic, texts)

    assert texts == ["partial "]  # message_start, block start, ping, one delta, then the error
    assert caught.value.type == "overloaded_error"
    assert caught.value.status_code == 200  # the stream's own HTTP status
    assert not isinstance(caught.value, anthropic.InternalServerError)
    assert len(fake_anthropic.message_requests()) == 1  # never retried by the SDK


@pytest.mark.asyncio
async def test_a_dropped_connection_raises_an_httpx2_error(
    fake_anthropic: FakeAnthropic,
) -> None:
    fake_anthropic.script(
        StreamFault(Reply(text="cut off in the middle"), after_events=5, kind="drop")
    )
    with pytest.raises((httpx2.HTTPError, anthropic.APIConnectionError)) as caught:
        await stream_final(fake_anthropic)

    assert isinstance(caught.value, httpx2.RemoteProtocolError)  # raw, not wrapped by the SDK
    assert len(fake_anthropic.message_requests()) == 1


@pytest.mark.asyncio
async def test_a_truncated_stream_ends_quietly_without_a_stop_reason(
    fake_anthropic: FakeAnthropic,
) -> None:
    fake_anthropic.script(
        StreamFault(Reply(text="abcdefghijklmnopqrstuvwx"), after_events=5, kind="truncate")
    )
    message = await stream_final(fake_anthropic)

    assert message.stop_reason is None
    assert (
        isinstance(message.content[0], TextBlock) and message.content[0].text == "abcdefghijklmnop"
    )
    assert message.usage.output_tokens == 1  # message_start's figure: no message_delta came


@pytest.mark.asyncio
async def test_a_stall_trips_the_client_read_timeout(fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(StreamFault(Reply(text="never finished"), after_events=3, kind="stall"))
    started = time.monotonic()
    with pytest.raises(httpx2.TimeoutException) as caught:
        await stream_final(fake_anthropic, timeout=anthropic.Timeout(2, read=0.3))

    assert isinstance(caught.value, httpx2.ReadTimeout)
    assert time.monotonic() - started < 5  # the stall itself lasts 30 s
    assert len(fake_anthropic.message_requests()) == 1


def test_stop_cuts_a_stall_short(fake_anthropic: FakeAnthropic) -> None:
    # fake_anthropic is here for its clean environment; this test stops a fake of its own
    fake = FakeAnthropic().start()
    fake.script(StreamFault(Reply(text="waiting"), after_events=2, kind="stall", stall_seconds=60))
    failures: list[BaseException] = []

    def consume() -> None:
        with sync_client(fake, max_retries=0) as client:
            try:
                with client.messages.stream(model=MODEL, max_tokens=64, messages=HELLO) as stream:
                    stream.get_final_message()
            except Exception as error:
                failures.append(error)

    consumer = threading.Thread(target=consume)
    consumer.start()
    fake.wait_for_requests(1, timeout=5)
    time.sleep(0.2)  # let the stall begin
    started = time.monotonic()
    fake.stop()
    stopped_in = time.monotonic() - started
    consumer.join(5)

    assert stopped_in < 2 and not consumer.is_alive()
    assert len(failures) == 1 and isinstance(failures[0], httpx2.RemoteProtocolError)
    assert fake.errors == []


@pytest.mark.asyncio
async def test_malformed_tool_json_raises_value_error(fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(Reply(tool_uses=[ToolUse("get_weather", raw_json='{"city": }')]))
    with pytest.raises(ValueError, match="Unable to parse tool parameter JSON"):
        await stream_final(fake_anthropic, tools=[WEATHER])


def test_raw_tool_json_is_sent_verbatim_without_streaming(fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(Reply(tool_uses=[ToolUse("get_weather", raw_json='{"city":"Lima"}')]))
    with sync_client(fake_anthropic) as client:
        message = client.messages.create(
            model=MODEL, max_tokens=64, messages=HELLO, tools=[WEATHER]
        )
    assert tool_uses(message)[0].input == {"city": "Lima"}


def test_faults_on_non_streaming_requests(fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(
        StreamFault(Reply(text="x"), after_events=0, kind="error"),
        StreamFault(Reply(text="x"), after_events=0, kind="drop"),
    )
    with sync_client(fake_anthropic, max_retries=0) as client:
        with pytest.raises(anthropic.OverloadedError):
            client.messages.create(model=MODEL, max_tokens=64, messages=HELLO)
        with pytest.raises(anthropic.APIConnectionError):
            client.messages.create(model=MODEL, max_tokens=64, messages=HELLO)


# --- timing ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_events_arrive_as_they_are_sent(fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(Reply(text="x" * 40, chunk_size=4, event_delay=0.05))  # 16 events
    started = time.monotonic()
    first_text: float | None = None
    async with (
        async_client(fake_anthropic) as client,
        client.messages.stream(model=MODEL, max_tokens=64, messages=HELLO) as stream,
    ):
        async for event in stream:
            if event.type == "text" and first_text is None:
                first_text = time.monotonic() - started
    ended = time.monotonic() - started

    assert first_text is not None
    assert ended >= 15 * 0.05  # the delays really happened ...
    assert ended - first_text > 0.5  # ... and the first text came well before the end


# --- count_tokens and the prompt cache ------------------------------------------------------


def test_count_tokens_uses_the_same_estimate_as_usage(fake_anthropic: FakeAnthropic) -> None:
    system = "You are terse."
    with sync_client(fake_anthropic) as client:
        counted = client.messages.count_tokens(
            model=MODEL, messages=HELLO, system=system, tools=[WEATHER]
        )
        message = client.messages.create(
            model=MODEL, max_tokens=64, messages=HELLO, system=system, tools=[WEATHER]
        )

    count_request, create_request = fake_anthropic.requests
    assert count_request.path == "/v1/messages/count_tokens"
    assert counted.input_tokens == estimate_input_tokens(count_request.body)
    assert counted.input_tokens == message.usage.input_tokens > 0
    assert fake_anthropic.message_requests() == [create_request]


def test_a_repeated_cached_prefix_is_read_from_the_cache(fake_anthropic: FakeAnthropic) -> None:
    pinned = "Pinned instructions that never change. " * 120  # about 1,200 estimated tokens

    def ask(volatile: str, pinned_text: str = pinned) -> anthropic.types.Usage:
        with sync_client(fake_anthropic) as client:
            return client.messages.create(
                model=MODEL,
                max_tokens=64,
                messages=HELLO,
                system=[
                    {"type": "text", "text": pinned_text, "cache_control": {"type": "ephemeral"}},
                    {"type": "text", "text": volatile},
                ],
            ).usage

    first = ask("Session notes, turn 1.")
    second = ask("Session notes, turn 1.")
    third = ask("Session notes, turn 2: different, but after the marker.")
    changed = ask("Session notes, turn 3.", pinned_text=pinned + "!")

    total = estimate_input_tokens(fake_anthropic.message_requests()[0].body)
    assert (
        first.cache_creation_input_tokens is not None and first.cache_creation_input_tokens > 1024
    )
    assert first.cache_read_input_tokens == 0
    assert first.input_tokens + first.cache_creation_input_tokens == total
    assert first.cache_creation is not None
    assert first.cache_creation.ephemeral_5m_input_tokens == first.cache_creation_input_tokens
    assert second.cache_read_input_tokens == first.cache_creation_input_tokens
    assert second.cache_creation_input_tokens == 0
    assert second.input_tokens == first.input_tokens < total
    assert third.cache_read_input_tokens == first.cache_creation_input_tokens
    assert changed.cache_read_input_tokens == 0 and changed.cache_creation_input_tokens


def test_a_rolling_marker_reads_the_previous_turns_prefix(fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.cache_min_tokens = 10
    marker: dict[str, Any] = {"cache_control": {"type": "ephemeral", "ttl": "1h"}}
    turn_one: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "a " * 40}]}]
    turn_two: list[Any] = [
        {"role": "user", "content": [{"type": "text", "text": "a " * 40}]},
        {"role": "assistant", "content": "b " * 40},
        {"role": "user", "content": [{"type": "text", "text": "c " * 40}]},
    ]
    with sync_client(fake_anthropic) as client:
        turn_one[0]["content"][0].update(marker)
        first = client.messages.create(model=MODEL, max_tokens=64, messages=turn_one).usage
        turn_two[2]["content"][0].update(marker)  # the marker moved to the newest block
        second = client.messages.create(model=MODEL, max_tokens=64, messages=turn_two).usage

    assert first.cache_creation is not None
    assert first.cache_creation.ephemeral_1h_input_tokens == first.cache_creation_input_tokens
    assert second.cache_read_input_tokens == first.cache_creation_input_tokens
    assert second.cache_creation_input_tokens is not None
    assert second.cache_creation_input_tokens > 0  # the rest of the new prefix is written


def test_a_short_prefix_is_never_cached(fake_anthropic: FakeAnthropic) -> None:
    system: Any = [{"type": "text", "text": "short", "cache_control": {"type": "ephemeral"}}]
    with sync_client(fake_anthropic) as client:
        for _ in range(2):
            usage = client.messages.create(
                model=MODEL, max_tokens=64, messages=HELLO, system=system
            ).usage
            assert usage.cache_read_input_tokens == usage.cache_creation_input_tokens == 0


def test_a_request_over_the_context_window_is_refused(fake_anthropic: FakeAnthropic) -> None:
    long: list[MessageParam] = [{"role": "user", "content": "word " * 400}]
    prompt = estimate_input_tokens({"messages": long})
    assert prompt > 400
    fake_anthropic.context_window = prompt + 100
    fake_anthropic.script(Reply(text="fits"))
    with sync_client(fake_anthropic) as client:
        with pytest.raises(anthropic.BadRequestError) as too_long:
            client.messages.create(model=MODEL, max_tokens=64, messages=long + long)
        with pytest.raises(anthropic.BadRequestError) as no_room:
            client.messages.create(model=MODEL, max_tokens=101, messages=long)
        assert fake_anthropic.pending == 1  # refused before the script was touched
        message = client.messages.create(model=MODEL, max_tokens=100, messages=long)

    doubled = estimate_input_tokens({"messages": long + long})
    window = prompt + 100
    assert too_long.value.status_code == 400 and too_long.value.type == "invalid_request_error"
    assert too_long.value.api_message == f"prompt is too long: {doubled} tokens > {window} maximum"
    assert no_room.value.api_message == (
        f"input length and `max_tokens` exceed context limit: {prompt} + 101 > {window}, "
        "decrease input length or `max_tokens` and try again"
    )
    assert isinstance(message.content[0], TextBlock) and message.content[0].text == "fits"
    assert message.usage.input_tokens == prompt
    assert fake_anthropic.largest_prompt == doubled  # refused requests count too
    assert len(fake_anthropic.message_requests()) == 3  # a 400 is not retried
    fake_anthropic.reset()
    assert fake_anthropic.largest_prompt == 0


# --- scripting ------------------------------------------------------------------------------


def test_a_responder_answers_once_the_script_is_used_up(fake_anthropic: FakeAnthropic) -> None:
    def echo(body: dict[str, Any]) -> Reply:
        return Reply(text=f"echo: {body['messages'][-1]['content']}")

    fake_anthropic.script(Reply(text="scripted"))
    fake_anthropic.responder = echo
    with sync_client(fake_anthropic) as client:
        texts = []
        for prompt in ("one", "two"):
            message = client.messages.create(
                model=MODEL, max_tokens=64, messages=[{"role": "user", "content": prompt}]
            )
            assert isinstance(message.content[0], TextBlock)
            texts.append(message.content[0].text)
        fake_anthropic.responder = None
        fake_anthropic.default = Reply(text="fallback")
        message = client.messages.create(model=MODEL, max_tokens=64, messages=HELLO)
        assert isinstance(message.content[0], TextBlock)
        texts.append(message.content[0].text)

    assert texts == ["scripted", "echo: two", "fallback"]


def test_reset_forgets_script_log_and_cache(fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.cache_min_tokens = 1
    system: Any = [{"type": "text", "text": "cached", "cache_control": {"type": "ephemeral"}}]
    fake_anthropic.script(Reply(text="unused"), Reply(text="unused"))
    with sync_client(fake_anthropic) as client:
        client.messages.create(model=MODEL, max_tokens=64, messages=HELLO, system=system)
        fake_anthropic.reset()
        message = client.messages.create(model=MODEL, max_tokens=64, messages=HELLO, system=system)

    assert isinstance(message.content[0], TextBlock) and message.content[0].text == "ok"
    assert message.usage.cache_read_input_tokens == 0 and message.usage.cache_creation_input_tokens
    assert len(fake_anthropic.requests) == 1 and fake_anthropic.pending == 0


def test_take_requests_empties_the_log_but_keeps_the_cache(fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.cache_min_tokens = 1
    system: Any = [{"type": "text", "text": "cached", "cache_control": {"type": "ephemeral"}}]
    with sync_client(fake_anthropic) as client:
        client.messages.count_tokens(model=MODEL, messages=HELLO)
        client.messages.create(model=MODEL, max_tokens=64, messages=HELLO, system=system)
        taken = fake_anthropic.take_requests()
        assert fake_anthropic.requests == []
        message = client.messages.create(model=MODEL, max_tokens=64, messages=HELLO, system=system)

    assert [r.path for r in taken] == ["/v1/messages/count_tokens", "/v1/messages"]
    assert message.usage.cache_read_input_tokens
    assert fake_anthropic.largest_prompt == estimate_input_tokens(taken[1].body)
    assert len(fake_anthropic.requests) == 1


def test_wait_for_requests_blocks_until_they_arrive(fake_anthropic: FakeAnthropic) -> None:
    def later() -> None:
        time.sleep(0.1)
        with sync_client(fake_anthropic) as client:
            client.messages.count_tokens(model=MODEL, messages=HELLO)
            client.messages.create(model=MODEL, max_tokens=8, messages=HELLO)

    sender = threading.Thread(target=later)
    sender.start()
    (recorded,) = fake_anthropic.wait_for_requests(1, 5, path="/v1/messages")
    sender.join(5)
    assert recorded.body["max_tokens"] == 8
    with pytest.raises(TimeoutError):
        fake_anthropic.wait_for_requests(3, 0.05)


# --- the wire itself ------------------------------------------------------------------------


def raw_post(
    connection: http.client.HTTPConnection, path: str, body: object, headers: dict[str, str]
) -> tuple[http.client.HTTPResponse, bytes]:
    connection.request("POST", path, json.dumps(body), headers)
    response = connection.getresponse()
    return response, response.read()


def test_the_sse_wire_format_and_keep_alive(fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(Reply(text="wire", tool_uses=[ToolUse("get_weather", {"city": "X"})]))
    port = int(fake_anthropic.url.rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    auth = {"x-api-key": "legacy-key", "content-type": "application/json"}
    body = {"model": MODEL, "max_tokens": 8, "messages": HELLO, "stream": True}
    try:
        response, raw = raw_post(connection, "/v1/messages", body, auth)
        assert response.status == 200
        assert response.getheader("transfer-encoding") == "chunked"
        assert response.getheader("content-type") == "text/event-stream; charset=utf-8"
        assert (response.getheader("request-id") or "").startswith("req_")
        names = []
        for frame in raw.decode().split("\n\n"):
            if not frame:
                continue
            event_line, data_line = frame.split("\n")
            name = event_line.removeprefix("event: ")
            assert event_line == f"event: {name}" and data_line.startswith("data: ")
            assert json.loads(data_line.removeprefix("data: "))["type"] == name
            names.append(name)
        assert names[:3] == ["message_start", "content_block_start", "ping"]
        assert names[-2:] == ["message_delta", "message_stop"] and names.count("ping") == 1

        # the same connection serves the next request (HTTP/1.1 keep-alive)
        response, raw = raw_post(connection, "/v1/messages", {**body, "stream": False}, auth)
        assert response.status == 200 and json.loads(raw)["content"][0]["text"] == "ok"
    finally:
        connection.close()


@pytest.mark.parametrize(
    ("path", "headers", "body", "status", "error_type", "message"),
    [
        ("/v1/messages", {}, {}, 401, "authentication_error", "invalid x-api-key"),
        ("/v1/complete", {"x-api-key": "k"}, {}, 404, "not_found_error", None),
        (
            "/v1/messages",
            {"authorization": "Bearer k"},
            {"model": MODEL, "messages": HELLO},
            400,
            "invalid_request_error",
            "max_tokens: Field required",
        ),
        (
            "/v1/messages",
            {"authorization": "Bearer k"},
            {"model": MODEL, "max_tokens": "8", "messages": HELLO},
            400,
            "invalid_request_error",
            "max_tokens: Input should be a valid integer",
        ),
        (
            "/v1/messages/count_tokens",
            {"authorization": "Bearer k"},
            {"model": MODEL},
            400,
            "invalid_request_error",
            "messages: Field required",
        ),
    ],
)
def test_refusals_have_the_real_error_shape(
    fake_anthropic: FakeAnthropic,
    path: str,
    headers: dict[str, str],
    body: dict[str, Any],
    status: int,
    error_type: str,
    message: str | None,
) -> None:
    port = int(fake_anthropic.url.rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        response, raw = raw_post(connection, path, body, headers)
    finally:
        connection.close()
    error = json.loads(raw)
    assert response.status == status and error["type"] == "error"
    assert error["error"]["type"] == error_type
    assert message is None or error["error"]["message"] == message
    assert error["request_id"] == response.getheader("request-id")
    assert fake_anthropic.requests[0].path == path and fake_anthropic.pending == 0

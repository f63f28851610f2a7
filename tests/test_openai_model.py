"""``OpenAIModel`` against the fake OpenAI server (the real SDK, a real local socket): what goes
on the wire for a conversation in Anthropic's blocks, how a streamed reply comes back as our
events, and every failure before and after the first byte."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from actors.model import Completed, ModelError, ModelEvent, ModelRequest, Reasoning, Retrying
from actors.model import TextDelta as Delta
from gateways.model.openai import _DECODE_CHUNK, OpenAIModel, _Reply
from tests.fakes import openai_server
from tests.fakes.openai_server import FakeOpenAI, HttpError, Reply, StreamFault, ToolCall

fake_openai = openai_server.fake_openai

MODEL = "gpt-test"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": CITY}
CLOCK = {"name": "get_time", "description": "The time", "input_schema": {"type": "object"}}
HELLO = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]

Factory = Callable[..., OpenAIModel]


@pytest_asyncio.fixture
async def make_model(fake_openai: FakeOpenAI) -> AsyncIterator[Factory]:
    """Models pointed at the fake (options as ``OpenAIModel`` takes them), closed afterwards."""
    made: list[OpenAIModel] = []

    def make(**options: Any) -> OpenAIModel:
        options = {"api_key": "test", "base_url": fake_openai.url + "/v1", **options}
        made.append(OpenAIModel(MODEL, **options))
        return made[-1]

    yield make
    for model in made:
        await model.aclose()


def request(messages: list[dict[str, Any]] | None = None, **fields: Any) -> ModelRequest:
    return ModelRequest(model=MODEL, system=fields.pop("system", []),
                        messages=HELLO if messages is None else messages,
                        tools=fields.pop("tools", []), max_tokens=fields.pop("max_tokens", 256),
                        **fields)  # fmt: skip


async def events(model: OpenAIModel, sent: ModelRequest | None = None) -> list[ModelEvent]:
    return [event async for event in model.stream(sent or request())]


async def collect(model: OpenAIModel, sent: ModelRequest, seen: list[ModelEvent]) -> None:
    """Stream into ``seen``, so the events before a failure are kept."""
    async for event in model.stream(sent):
        seen.append(event)


async def failure(
    model: OpenAIModel, sent: ModelRequest | None = None, seen: list[ModelEvent] | None = None
) -> ModelError:
    with pytest.raises(ModelError) as caught:
        await collect(model, sent or request(), [] if seen is None else seen)
    return caught.value


def completed(got: list[ModelEvent]) -> Completed:
    last = got[-1]
    assert isinstance(last, Completed)
    return last


# --------------------------------------------------------------------------------------------
# The request

SYSTEM = [
    {"type": "text", "text": "You are terse."},
    {"type": "text", "text": "About you: agent helper.", "cache_control": {"type": "ephemeral"}},
]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Oslo?"}]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "two cities", "signature": "sig"},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_b", "name": "get_weather", "input": {"city": "Oslo"}},
    ]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "call_a", "content": "sunny"},
        {"type": "tool_result", "tool_use_id": "call_b", "is_error": True,
         "content": [{"type": "text", "text": "station offline"}]},
    ]},
    {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "tool_use", "id": "call_c", "name": "get_time", "input": {}},
    ]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "call_c", "content": "12:00",
         "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Also, thanks!"},
    ]},
    {"role": "assistant", "content": [{"type": "text", "text": "Paris is sunny; Oslo unknown."}]},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"}]},
    {"role": "user", "content": [{"type": "text", "text": "Hello?"}]},
]  # fmt: skip
SENT = [
    {"role": "system", "content": "You are terse.\n\nAbout you: agent helper."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
        {"id": "call_b", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_b", "content": "Error: station offline"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_c", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]},
    {"role": "tool", "tool_call_id": "call_c", "content": "12:00"},
    {"role": "user", "content": "Also, thanks!"},
    {"role": "assistant", "content": "Paris is sunny; Oslo unknown."},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "user", "content": "Hello?"},
]  # fmt: skip


@pytest.mark.asyncio
async def test_a_conversation_goes_out_as_chat_completions_messages(
    fake_openai: FakeOpenAI, make_model: Factory
) -> None:
    model = make_model()
    sent = request(CONVERSATION, system=SYSTEM, tools=[WEATHER, CLOCK], max_tokens=300,
                   reasoning=Reasoning(effort="low"))  # fmt: skip
    await events(model, sent)
    (recorded,) = fake_openai.completion_requests()
    body = recorded.body
    assert body["messages"] == SENT
    assert body["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "description": "The weather in "
         "a city", "parameters": WEATHER["input_schema"]}},
        {"type": "function", "function": {"name": "get_time", "description": "The time",
         "parameters": {"type": "object"}}},
    ]  # fmt: skip
    assert (body["model"], body["stream"], body["max_completion_tokens"]) == (MODEL, True, 300)
    assert body["stream_options"] == {"include_usage": True}
    assert body["reasoning_effort"] == "low"
    assert "max_tokens" not in body
    assert recorded.headers["authorization"] == "Bearer test"


@pytest.mark.asyncio
async def test_older_servers_get_max_tokens_and_no_stream_options(
    fake_openai: FakeOpenAI, make_model: Factory
) -> None:
    model = make_model(max_tokens_param="max_tokens", stream_usage=False)
    got = await events(model, request(max_tokens=77))
    body = fake_openai.completion_requests()[0].body
    assert body["max_tokens"] == 77
    assert "max_completion_tokens" not in body and "stream_options" not in body
    assert "tools" not in body and "reasoning_effort" not in body
    assert completed(got).usage.prompt_tokens == 0  # the server was not asked for usage


@pytest.mark.asyncio
async def test_a_server_tool_cannot_be_sent(fake_openai: FakeOpenAI, make_model: Factory) -> None:
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    error = await failure(make_model(), request(tools=[WEATHER, search]))
    assert error.code == "model_bad_request" and "web_search" in error.message
    assert "model.server_tools" in error.hint
    assert fake_openai.requests == []


# --------------------------------------------------------------------------------------------
# The reply


@pytest.mark.asyncio
async def test_text_and_reasoning_stream_as_deltas_and_end_as_blocks(
    fake_openai: FakeOpenAI, make_model: Factory
) -> None:
    fake_openai.script(Reply(text="Four.", reasoning="two and two", chunk_size=4))
    got = await events(make_model())
    assert got[:-1] == [
        Delta("two ", "reasoning"), Delta("and ", "reasoning"), Delta("two", "reasoning"),
        Delta("Four"), Delta("."),
    ]  # fmt: skip
    done = completed(got)
    assert done.content == [
        {"type": "thinking", "thinking": "two and two", "signature": ""},
        {"type": "text", "text": "Four."},
    ]
    assert done.stop_reason == "end_turn"
    assert done.first_token_ms is not None and done.first_token_ms >= 0


@pytest.mark.asyncio
async def test_reasoning_in_openrouters_field_and_a_field_switched_off(
    fake_openai: FakeOpenAI, make_model: Factory
) -> None:
    reply = Reply(text="ok", reasoning="thinking", reasoning_field="reasoning", chunk_size=100)
    fake_openai.script(reply, reply)
    assert (await events(make_model()))[0] == Delta("thinking", "reasoning")
    got = await events(make_model(reasoning_field="none"))
    assert got[0] == Delta("ok") and completed(got).content == [{"type": "text", "text": "ok"}]


@pytest.mark.asyncio
async def test_tool_calls_split_across_chunks_become_tool_use_blocks(
    fake_openai: FakeOpenAI, make_model: Factory
) -> None:
    fake_openai.script(Reply(text="Let me look.", chunk_size=3, tool_calls=[
        ToolCall("get_weather", {"city": "Paris", "units": "metric"}, id="call_1"),
        ToolCall("get_time", {}, id="call_2"),
    ]))  # fmt: skip
    got = await events(make_model(), request(tools=[WEATHER, CLOCK]))
    assert all(isinstance(e, Delta) and e.kind == "text" for e in got[:-1])
    done = completed(got)
    assert done.content == [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather",
         "input": {"city": "Paris", "units": "metric"}},
        {"type": "tool_use", "id": "call_2", "name": "get_time", "input": {}},
    ]  # fmt: skip
    assert done.stop_reason == "tool_use"


@pytest.mark.parametrize(
    ("raw", "note"),
    [('{"city": "Par', "DecodeError"), ('["Paris"]', "expected a JSON object, got list")],
)
@pytest.mark.asyncio
async def test_arguments_that_are_no_json_object_leave_a_note(
    fake_openai: FakeOpenAI, make_model: Factory, raw: str, note: str
) -> None:
    fake_openai.script(Reply(tool_calls=[ToolCall("get_weather", raw_arguments=raw, id="c")]))
    (block,) = completed(await events(make_model(), request(tools=[WEATHER]))).content
    assert (block["id"], block["name"], block["input"]) == ("c", "get_weather", {})
    assert note in block["invalid_json"]


@pytest.mark.parametrize(
    ("reply", "stop", "content"),
    [
        (Reply(text="It was a dark and", finish_reason="length"), "max_tokens",
         [{"type": "text", "text": "It was a dark and"}]),
        (Reply(text="", finish_reason="content_filter"), "refusal", []),
        (Reply(refusal="I can't help with that."), "refusal",
         [{"type": "text", "text": "I can't help with that."}]),
        (Reply(text="calling", tool_calls=[ToolCall("get_time", {}, id="t")],
               finish_reason="stop"), "tool_use",
         [{"type": "text", "text": "calling"},
          {"type": "tool_use", "id": "t", "name": "get_time", "input": {}}]),
    ],
)  # fmt: skip
@pytest.mark.asyncio
async def test_finish_reasons_in_anthropics_words(
    fake_openai: FakeOpenAI, make_model: Factory, reply: Reply, stop: str,
    content: list[dict[str, Any]],
) -> None:  # fmt: skip
    fake_openai.script(reply)
    got = await events(make_model())
    done = completed(got)
    assert (done.stop_reason, done.content) == (stop, content)
    if reply.refusal:
        assert "".join(e.text for e in got[:-1] if isinstance(e, Delta)) == reply.refusal


@pytest.mark.asyncio
async def test_usage_counts_cached_tokens_apart(
    fake_openai: FakeOpenAI, make_model: Factory
) -> None:
    fake_openai.script(Reply(text="hi", prompt_tokens=5000, cached_tokens=4096,
                             completion_tokens=120, reasoning_tokens=100))  # fmt: skip
    usage = completed(await events(make_model())).usage
    assert (usage.input_tokens, usage.cache_read_tokens, usage.output_tokens) == (904, 4096, 120)
    assert usage.prompt_tokens == 5000 and usage.cache_write_tokens == 0


def test_chunks_of_compatible_servers_fold_the_same() -> None:
    """What some compatible servers stream differently (no call index, the id and name repeated
    on every piece, DeepSeek's cache field, reasoning under both names) folds like OpenAI's."""
    reply = _Reply(time.monotonic(), "auto")
    texts: list[str] = []
    for chunk in [
        {"choices": [{"delta": {"role": "assistant", "reasoning_content": "hm",
                                "reasoning": "hm"}}]},
        {"choices": [{"delta": {"tool_calls": [{"id": "a", "function": {"name": "f",
                                                "arguments": '{"x":'}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"id": "a", "function": {"name": "f",
                                                "arguments": "1}"}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"id": "b", "function": {"name": "g",
                                                "arguments": "{}"}}]}}]},
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}],
         "usage": {"prompt_tokens": 100, "completion_tokens": 9, "prompt_cache_hit_tokens": 64}},
    ]:  # fmt: skip
        texts.extend(d.text for d in reply.take(_DECODE_CHUNK(msgspec.json.encode(chunk))))
    done = reply.completed()
    assert texts == ["hm"]
    assert done.content == [
        {"type": "thinking", "thinking": "hm", "signature": ""},
        {"type": "tool_use", "id": "a", "name": "f", "input": {"x": 1}},
        {"type": "tool_use", "id": "b", "name": "g", "input": {}},
    ]
    assert (done.usage.input_tokens, done.usage.cache_read_tokens) == (36, 64)


# --------------------------------------------------------------------------------------------
# Failures


@pytest.mark.asyncio
async def test_a_429_is_retried_after_the_delay_the_server_asked_for(
    fake_openai: FakeOpenAI, make_model: Factory
) -> None:
    fake_openai.script(
        HttpError(429, "tokens", code="rate_limit_exceeded", retry_after_ms=150),
        HttpError(503, "server_error", retry_after=0.1),
        Reply(text="at last"),
    )
    started = time.monotonic()
    got = await events(make_model())
    assert got[:2] == [
        Retrying(status=429, attempt=1, delay_ms=150, error="rate_limit_exceeded"),
        Retrying(status=503, attempt=2, delay_ms=100, error="server_error"),
    ]
    assert completed(got).content == [{"type": "text", "text": "at last"}]
    assert time.monotonic() - started >= 0.25
    assert [r.retry_count for r in fake_openai.completion_requests()] == [0, 0, 0]  # ours


@pytest.mark.asyncio
async def test_retries_run_out(fake_openai: FakeOpenAI, make_model: Factory) -> None:
    refusal = HttpError(429, "requests", code="rate_limit_exceeded", retry_after_ms=10)
    fake_openai.script(refusal, refusal)
    error = await failure(make_model(max_retries=1))
    assert (error.code, error.status) == ("model_rate_limited", 429)
    assert "Rate limit reached" in error.message
    assert len(fake_openai.completion_requests()) == 2


@pytest.mark.asyncio
async def test_an_exhausted_quota_is_not_retried(
    fake_openai: FakeOpenAI, make_model: Factory
) -> None:
    fake_openai.script(HttpError(429, "insufficient_quota", code="insufficient_quota"))
    error = await failure(make_model())
    assert error.code == "model_billing" and "quota" in error.hint
    assert len(fake_openai.completion_requests()) == 1


@pytest.mark.parametrize(
    ("item", "code", "hint"),
    [
        (HttpError(401, "invalid_request_error", code="invalid_api_key"), "model_auth_failed",
         "check OPENAI_API_KEY (or model.api_key_env)"),
        (HttpError(404, "invalid_request_error", code="model_not_found"), "model_not_found",
         "model.id"),
        (HttpError(400, "invalid_request_error", "Invalid 'messages[1].content'"),
         "model_bad_request", "bug"),
        (HttpError(400, "invalid_request_error", "Unrecognized request argument supplied: "
                   "max_completion_tokens"), "model_bad_request", "max_tokens_param: max_tokens"),
        (HttpError(400, "invalid_request_error", "unknown field `stream_options`"),
         "model_bad_request", "stream_usage: false"),
        (HttpError(400, "invalid_request_error", "the request exceeds the available context "
                   "size, try increasing it"), "context_window_exceeded", "context_window"),
        (HttpError(400, "BadRequestError", "'max_tokens' is too large: 4000. This model's "
                   "maximum context length is 4096 tokens"), "context_window_exceeded",
         "reserve_output"),
    ],
)  # fmt: skip
@pytest.mark.asyncio
async def test_refusals_before_the_first_byte_are_typed(
    fake_openai: FakeOpenAI, make_model: Factory, item: HttpError, code: str, hint: str
) -> None:
    fake_openai.script(item)
    error = await failure(make_model())
    assert (error.code, error.status) == (code, item.status)
    assert hint in error.hint


@pytest.mark.asyncio
async def test_a_context_the_server_refuses_is_context_window_exceeded(
    fake_openai: FakeOpenAI, make_model: Factory
) -> None:
    fake_openai.context_window = 50
    error = await failure(make_model(), request(CONVERSATION, system=SYSTEM))
    assert (error.code, error.status) == ("context_window_exceeded", 400)
    assert "maximum context length is 50 tokens" in error.message


@pytest.mark.asyncio
async def test_an_unreachable_server_is_retried_then_reported(make_model: Factory) -> None:
    with FakeOpenAI() as gone:
        url = gone.url
    model = make_model(base_url=url + "/v1", max_retries=1, connect_timeout_s=1.0)
    seen: list[ModelEvent] = []
    error = await failure(model, seen=seen)
    assert error.code == "model_unreachable" and "model.base_url" in error.hint
    assert [type(e) for e in seen] == [Retrying]
    assert isinstance(seen[0], Retrying) and seen[0].status == 0


@pytest.mark.parametrize(
    ("fault", "code"),
    [
        (StreamFault(Reply(text="a long answer"), after_chunks=3, kind="drop"),
         "model_connection_dropped"),
        (StreamFault(Reply(text="a long answer"), after_chunks=3, kind="truncate"),
         "model_stream_truncated"),
        (StreamFault(Reply(text="a long answer"), after_chunks=3, kind="error"),
         "model_stream_error"),
        (StreamFault(Reply(text="a long answer"), after_chunks=3, kind="error",
                     error_type="overloaded_error"), "model_overloaded"),
        (StreamFault(Reply(text="a long answer"), after_chunks=3, kind="error",
                     error_type="rate_limit_exceeded"), "model_rate_limited"),
    ],
)  # fmt: skip
@pytest.mark.asyncio
async def test_a_failure_after_the_first_byte_is_never_retried(
    fake_openai: FakeOpenAI, make_model: Factory, fault: StreamFault, code: str
) -> None:
    fake_openai.script(fault, Reply(text="never asked for"))
    seen: list[ModelEvent] = []
    assert (await failure(make_model(), seen=seen)).code == code
    assert seen == [Delta("a long a"), Delta("nswer")]
    assert fake_openai.pending == 1


@pytest.mark.asyncio
async def test_a_stream_that_goes_quiet_has_stalled(
    fake_openai: FakeOpenAI, make_model: Factory
) -> None:
    fake_openai.script(StreamFault(Reply(text="hello there"), after_chunks=2, kind="stall"))
    started = time.monotonic()
    error = await failure(make_model(stall_timeout_s=0.3))
    assert error.code == "model_stalled"
    assert 0.25 <= time.monotonic() - started < 5


@pytest.mark.asyncio
async def test_calls_share_one_kept_alive_connection(
    fake_openai: FakeOpenAI, make_model: Factory
) -> None:
    """Each stream is read to the end of its body, past ``[DONE]``: the connection goes back to
    the pool (no new handshake per call, which costs most against a TLS endpoint)."""
    model = make_model()
    for _ in range(3):
        await events(model)
    ports = {r.client_port for r in await fake_openai.await_requests(3)}
    assert len(ports) == 1


@pytest.mark.asyncio
async def test_a_body_left_open_after_done_still_completes(
    fake_openai: FakeOpenAI, make_model: Factory
) -> None:
    fake_openai.script(StreamFault(Reply(text="all here"), after_chunks=99, kind="linger",
                                   stall_seconds=5))  # fmt: skip
    started = time.monotonic()
    got = await events(make_model(stall_timeout_s=2))
    assert completed(got).content == [{"type": "text", "text": "all here"}]
    assert time.monotonic() - started < 1

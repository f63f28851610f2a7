"""The fake OpenAI server, proven against the real SDK (``openai`` 3.x over ``httpx2``).

Every test talks to the fake over a real socket with the SDK unchanged: what passes here is what
the OpenAI adapter will see from the real API (streams, tool call deltas, usage, retries, faults
and the API's refusals).
"""

from __future__ import annotations

import http.client
import json
import time
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from tests.fakes import openai_server
from tests.fakes.openai_server import (
    COMPLETIONS_PATH,
    FakeOpenAI,
    HttpError,
    Reply,
    StreamFault,
    ToolCall,
    estimate_prompt_tokens,
)

fake_openai = openai_server.fake_openai

MODEL = "gpt-test"
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def client(fake: FakeOpenAI, **options: Any) -> openai.OpenAI:
    return openai.OpenAI(api_key="test", base_url=fake.url + "/v1", **options)


def chunks(fake: FakeOpenAI, **params: Any) -> list[ChatCompletionChunk]:
    """Every chunk of one streamed completion, as the SDK parses them."""
    params = {"model": MODEL, "messages": HELLO, **params}
    with client(fake, max_retries=0) as sdk:
        return list(sdk.chat.completions.create(stream=True, **params))


def test_text_streams_in_chunks_opened_by_the_role_and_closed_by_the_finish_reason(
    fake_openai: FakeOpenAI,
) -> None:
    fake_openai.script(Reply(text="Hello there, friend", chunk_size=5))
    got = chunks(fake_openai)
    assert got[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].delta.content for c in got[1:-1]] == ["Hello", " ther", "e, fr", "iend"]
    assert got[-1].choices[0].finish_reason == "stop"
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in got)
    assert len({c.id for c in got}) == 1
    assert all(c.usage is None for c in got)  # not asked for


def test_the_body_is_server_sent_events_ending_with_done(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(Reply(text="hi"))
    connection = http.client.HTTPConnection(fake_openai.url.removeprefix("http://"))
    body = {"model": MODEL, "messages": HELLO, "stream": True}
    headers = {"Authorization": "Bearer test", "Content-Type": "application/json"}
    connection.request("POST", COMPLETIONS_PATH, json.dumps(body), headers)
    response = connection.getresponse()
    assert response.getheader("content-type", "").startswith("text/event-stream")
    assert response.getheader("transfer-encoding") == "chunked"
    events = response.read().decode().split("\n\n")
    connection.close()
    assert events[-1] == ""
    assert events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_the_sdk_reassembles_tool_call_deltas(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(Reply(tool_calls=[ToolCall("get_weather", {"city": "Paris"}, id="call_1"),
                                         ToolCall("get_weather", {"city": "Oslo"})],
                             chunk_size=4))  # fmt: skip
    got = chunks(fake_openai, tools=[WEATHER])
    opener = got[0].choices[0].delta
    assert opener.role == "assistant" and opener.content is None  # calls only: opened together
    assert opener.tool_calls is not None and opener.tool_calls[0].id == "call_1"
    assert opener.tool_calls[0].function is not None
    assert opener.tool_calls[0].function.arguments == ""
    pieces = [d.tool_calls[0] for c in got[1:-1] if (d := c.choices[0].delta).tool_calls]
    assert all(len(p.function.arguments or "") <= 4 for p in pieces if p.function and not p.id)
    assert got[-1].choices[0].finish_reason == "tool_calls"

    fake_openai.script(
        Reply(text="Checking.", tool_calls=[ToolCall("get_weather", {"city": "Rome"})])
    )
    with (
        client(fake_openai) as sdk,
        sdk.chat.completions.stream(model=MODEL, messages=HELLO, tools=[WEATHER]) as stream,
    ):
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.content == "Checking."
    assert message.tool_calls is not None
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Rome"}


def test_raw_arguments_go_out_verbatim(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(Reply(tool_calls=[ToolCall("get_weather", raw_arguments='{"city": "Par')]))
    got = chunks(fake_openai, tools=[WEATHER])
    text = "".join(
        tc.function.arguments or ""
        for c in got if c.choices for tc in c.choices[0].delta.tool_calls or () if tc.function
    )  # fmt: skip
    assert text == '{"city": "Par'


def test_reasoning_streams_under_the_field_the_server_uses(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(Reply(text="4", reasoning="two and two", chunk_size=100),
                       Reply(text="4", reasoning="two and two", reasoning_field="reasoning",
                             chunk_size=100))  # fmt: skip
    vllm = chunks(fake_openai)
    assert vllm[1].choices[0].delta.model_extra == {"reasoning_content": "two and two"}
    openrouter = chunks(fake_openai)
    assert (openrouter[1].choices[0].delta.model_extra or {}).get("reasoning") == "two and two"


def test_a_refusal_streams_in_its_own_field(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(Reply(refusal="I can't help with that."))
    got = chunks(fake_openai)
    assert got[0].choices[0].delta.refusal == ""
    assert "".join(c.choices[0].delta.refusal or "" for c in got) == "I can't help with that."
    assert all(not c.choices[0].delta.content for c in got)


def test_usage_comes_in_a_last_chunk_without_choices_when_asked(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(Reply(text="hi", reasoning="hmm, let me see", prompt_tokens=2000,
                             cached_tokens=1536, completion_tokens=40))  # fmt: skip
    got = chunks(fake_openai, stream_options={"include_usage": True})
    last = got[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (2000, 40)
    assert last.usage.total_tokens == 2040
    assert last.usage.prompt_tokens_details is not None
    assert last.usage.prompt_tokens_details.cached_tokens == 1536
    assert last.usage.completion_tokens_details is not None
    assert last.usage.completion_tokens_details.reasoning_tokens == 3
    assert all(c.usage is None for c in got[:-1])
    assert got[-2].choices[0].finish_reason == "stop"

    fake_openai.script(Reply(text="hi"))
    estimated = chunks(fake_openai, stream_options={"include_usage": True})[-1].usage
    assert estimated is not None
    assert estimated.prompt_tokens == estimate_prompt_tokens(fake_openai.requests[-1].body)


def test_finish_reason_can_be_scripted(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(Reply(text="cut", finish_reason="length"))
    assert chunks(fake_openai)[-1].choices[0].finish_reason == "length"


def test_a_non_streaming_request_gets_a_chat_completion(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(Reply(text="Sure.", reasoning="easy",
                             tool_calls=[ToolCall("get_weather", {"city": "Lima"})]))  # fmt: skip
    with client(fake_openai) as sdk:
        completion = sdk.chat.completions.create(model=MODEL, messages=HELLO, tools=[WEATHER])
    assert completion.object == "chat.completion"
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure."
    assert (choice.message.model_extra or {}).get("reasoning_content") == "easy"
    assert choice.message.tool_calls is not None
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Lima"}  # type: ignore[union-attr]
    assert completion.usage is not None and completion.usage.prompt_tokens > 0


def test_models_are_listed(fake_openai: FakeOpenAI) -> None:
    fake_openai.models = ["gpt-test", "gpt-other"]
    with client(fake_openai) as sdk:
        assert [m.id for m in sdk.models.list()] == ["gpt-test", "gpt-other"]


def test_a_429_with_retry_after_is_honoured_by_the_sdk(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(HttpError(429, "tokens", code="rate_limit_exceeded", retry_after_ms=300),
                       Reply(text="ok"))  # fmt: skip
    with client(fake_openai, max_retries=1) as sdk:
        completion = sdk.chat.completions.create(model=MODEL, messages=HELLO)
    assert completion.choices[0].message.content == "ok"
    first, second = fake_openai.completion_requests()
    assert (first.retry_count, second.retry_count) == (0, 1)
    assert second.at - first.at >= 0.29

    fake_openai.script(HttpError(429, "insufficient_quota", code="insufficient_quota",
                                 retry_after=1))  # fmt: skip
    with client(fake_openai, max_retries=0) as sdk, pytest.raises(openai.RateLimitError) as caught:
        sdk.chat.completions.create(model=MODEL, messages=HELLO)
    assert caught.value.code == "insufficient_quota"
    assert caught.value.type == "insufficient_quota"
    assert caught.value.response.headers["retry-after"] == "1"


def test_a_dropped_stream_is_a_connection_error(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(StreamFault(Reply(text="a long answer"), after_chunks=2, kind="drop"))
    seen: list[str] = []

    def read() -> None:
        for chunk in chunks_lazily(fake_openai):
            seen.append(chunk.choices[0].delta.content or "")

    with pytest.raises(openai.APIConnectionError):
        read()
    assert seen == ["", "a long a"]


def chunks_lazily(fake: FakeOpenAI, **options: Any) -> Any:
    with client(fake, max_retries=0, **options) as sdk:
        yield from sdk.chat.completions.create(model=MODEL, messages=HELLO, stream=True)


def test_an_error_object_mid_stream_is_raised_by_the_sdk(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(StreamFault(Reply(text="partial"), after_chunks=2, kind="error",
                                   error_message="The server had an error"))  # fmt: skip
    with pytest.raises(openai.APIError) as caught:
        list(chunks_lazily(fake_openai))
    assert caught.value.message == "The server had an error"
    assert caught.value.type == "server_error"


def test_a_truncated_stream_ends_without_a_finish_reason(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(StreamFault(Reply(text="partial answer"), after_chunks=2, kind="truncate"))
    got = list(chunks_lazily(fake_openai))
    assert len(got) == 2 and all(c.choices[0].finish_reason is None for c in got)


def test_a_stall_times_the_sdk_out_and_stop_ends_it(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(StreamFault(Reply(text="hi"), after_chunks=1, kind="stall"))
    started = time.monotonic()
    with pytest.raises(openai.APITimeoutError):
        list(chunks_lazily(fake_openai, timeout=openai.Timeout(0.3, connect=2.0)))
    assert time.monotonic() - started < 5


def test_event_delay_spaces_the_chunks(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(Reply(text="abcdefgh", chunk_size=4, event_delay=0.1))
    started = time.monotonic()
    assert len(chunks(fake_openai)) == 4
    assert time.monotonic() - started >= 0.3


def test_requests_are_recorded_and_a_responder_answers_when_the_script_is_empty(
    fake_openai: FakeOpenAI,
) -> None:
    fake_openai.responder = lambda body: Reply(text=f"{len(body['messages'])} messages")
    got = chunks(fake_openai, max_completion_tokens=50)
    assert "".join(c.choices[0].delta.content or "" for c in got) == "1 messages"
    (recorded,) = fake_openai.completion_requests()
    assert recorded.method == "POST" and recorded.headers["authorization"] == "Bearer test"
    assert recorded.body["max_completion_tokens"] == 50 and recorded.body["stream"] is True


TOOL_STEP: list[Any] = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
    ]},
]  # fmt: skip
ANSWER_A = {"role": "tool", "tool_call_id": "call_a", "content": "sunny"}
ANSWER_B = {"role": "tool", "tool_call_id": "call_b", "content": "rain"}


@pytest.mark.parametrize(
    ("params", "param", "code", "fragment"),
    [
        ({"messages": []}, "messages", "empty_array", "empty array"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role",
         "invalid_value", "'robot'"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter",
         "Missing required parameter"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
         "messages[0].content[0].type", "invalid_value", "'tool_result'"),
        ({"messages": [HELLO[0], ANSWER_A]}, "messages.[1].role", None,
         "must be a response to a preceeding message with 'tool_calls'"),
        ({"messages": [*TOOL_STEP, ANSWER_A]}, "messages.[1].role", None,
         "did not have response messages: call_b"),
        ({"messages": [*TOOL_STEP, ANSWER_A, {"role": "user", "content": "and?"}, ANSWER_B]},
         "messages.[1].role", None, "call_b"),
        ({"messages": [*TOOL_STEP, ANSWER_A, {**ANSWER_B, "tool_call_id": "call_z"}]},
         "messages.[3].tool_call_id", None, "'call_z' not found in 'tool_calls'"),
        ({"messages": [TOOL_STEP[0], {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}]},
         "messages[1].tool_calls[0].function.arguments", "invalid_type", "expected a string"),
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]},
         "tools[0].function.name", "invalid_value", "does not match pattern"),
        ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]},
         "tools[0].function.name", "string_above_max_length", "maximum length 64"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type",
         "invalid_value", "'web_search_20250305'"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value",
         "only allowed when 'stream' is enabled"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "integer_below_min_value",
         "below minimum"),
    ],
)  # fmt: skip
def test_invalid_requests_are_refused_as_the_api_does(
    fake_openai: FakeOpenAI, params: dict[str, Any], param: str, code: str | None, fragment: str
) -> None:
    fake_openai.script(Reply(text="never sent"))
    request = {"model": MODEL, "messages": HELLO, **params}
    with client(fake_openai, max_retries=0) as sdk, pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(**request)
    error = caught.value
    assert (error.type, error.param, error.code) == ("invalid_request_error", param, code)
    assert fragment in error.message
    assert fake_openai.pending == 1  # refused before anything was generated


def test_a_complete_tool_exchange_is_accepted(fake_openai: FakeOpenAI) -> None:
    fake_openai.script(Reply(text="Sunny in Paris, rain in Oslo."))
    messages = [*TOOL_STEP, ANSWER_B, ANSWER_A, {"role": "user", "content": "thanks"}]
    with client(fake_openai) as sdk:
        completion = sdk.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert completion.choices[0].message.content == "Sunny in Paris, rain in Oslo."


def test_the_context_window_refuses_what_does_not_fit(fake_openai: FakeOpenAI) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": HELLO}
    prompt = estimate_prompt_tokens(body)
    fake_openai.context_window = prompt + 10
    with client(fake_openai, max_retries=0) as sdk:
        sdk.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=10)
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=11)
        assert caught.value.code == "context_length_exceeded"
        assert f"maximum context length is {prompt + 10} tokens" in caught.value.message
        assert f"({prompt} in the messages, 11 in the completion)" in caught.value.message
        fake_openai.context_window = prompt - 1
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.chat.completions.create(model=MODEL, messages=HELLO)
        assert f"your messages resulted in {prompt} tokens" in caught.value.message


def test_a_missing_or_wrong_key_is_a_401(fake_openai: FakeOpenAI) -> None:
    connection = http.client.HTTPConnection(fake_openai.url.removeprefix("http://"))
    body = json.dumps({"model": MODEL, "messages": HELLO})
    for headers in ({}, {"Authorization": "Bearer "}):
        connection.request("POST", COMPLETIONS_PATH, body, headers)
        response = connection.getresponse()
        error = json.loads(response.read())["error"]
        assert response.status == 401 and "didn't provide an API key" in error["message"]
        assert error["type"] == "invalid_request_error"
    connection.close()
    fake_openai.api_key = "sk-right-key"
    with (
        client(fake_openai, max_retries=0) as sdk,
        pytest.raises(openai.AuthenticationError) as caught,
    ):
        sdk.chat.completions.create(model=MODEL, messages=HELLO)
    assert caught.value.code == "invalid_api_key"


def test_unknown_paths_and_strict_models_are_404(fake_openai: FakeOpenAI) -> None:
    fake_openai.strict_models = True
    with client(fake_openai, max_retries=0) as sdk:
        with pytest.raises(openai.NotFoundError) as caught:
            sdk.chat.completions.create(model="gpt-nope", messages=HELLO)
        assert caught.value.code == "model_not_found"
        with pytest.raises(openai.NotFoundError) as caught:
            sdk.completions.create(model=MODEL, prompt="hi")
        assert "Invalid URL (POST /v1/completions)" in caught.value.message

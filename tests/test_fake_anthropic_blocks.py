"""Every content block the Messages API streams, and what the API refuses to take back, proven
against the real SDK (``anthropic`` 2.x) on the fake Anthropic server's real socket.

Each block type arrives with the real event shapes and accumulates (``messages.stream()``, or
``beta.messages.stream()`` for compaction) to what was scripted; each validation refuses what the
real API refuses and accepts the same history sent back whole. The last part replays recorded
streams: the fake's own, and the SDK repository's when ``DISPACH_SDK_STREAMS`` names a checkout.
"""

from __future__ import annotations

import base64
import json
from typing import Any, cast

import anthropic
import pytest
from anthropic.types import (
    CodeExecutionToolResultBlock,
    Message,
    ParsedMessage,
    RawMessageStreamEvent,
    RedactedThinkingBlock,
    ServerToolUseBlock,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    WebFetchToolResultBlock,
    WebSearchToolResultBlock,
)
from anthropic.types.beta import BetaCompactionBlock

from tests import fakes
from tests.fakes import FakeAnthropic, Reply, ToolUse, anthropic_client_kwargs
from tests.fakes.anthropic_server import (
    CodeRun,
    Compaction,
    Cut,
    Fetched,
    Issuer,
    Redacted,
    SearchResult,
    ServerToolUse,
    Text,
    Thinking,
    ToolError,
    Unknown,
    cite_chars,
    cite_search,
)

fake_anthropic = fakes.fake_anthropic

MODEL = "claude-sonnet-5"
HELLO: list[dict[str, Any]] = [{"role": "user", "content": "Hello"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
THINK = {"type": "enabled", "budget_tokens": 2048}
PAGE = SearchResult("https://example.org/eclipse", "Eclipses explained", page_age="3 days ago")


def client(fake: FakeAnthropic) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(**anthropic_client_kwargs(fake), max_retries=0)


async def streamed(fake: FakeAnthropic, **params: Any) -> ParsedMessage[None]:
    """One ``messages.stream()``: the SDK's accumulated final message."""
    request = {"model": MODEL, "max_tokens": 4096, "messages": HELLO, **params}
    async with client(fake) as sdk, sdk.messages.stream(**request) as stream:
        return await stream.get_final_message()


async def events_of(fake: FakeAnthropic, **params: Any) -> list[RawMessageStreamEvent]:
    """One ``messages.create(stream=True)``: the SDK's typed events, unaccumulated."""
    request = {"model": MODEL, "max_tokens": 4096, "messages": HELLO, **params}
    async with client(fake) as sdk:
        stream = await sdk.messages.create(stream=True, **request)
        return [event async for event in stream]


async def sent(fake: FakeAnthropic, messages: list[Any], **params: Any) -> Message:
    """A non-streaming request with ``messages`` as given (shapes the SDK's types may not
    allow, to see what the server says)."""
    request = {"model": MODEL, "max_tokens": 4096, **params}
    async with client(fake) as sdk:
        message: Message = await sdk.messages.create(messages=cast(Any, messages), **request)
        return message


async def refusal(fake: FakeAnthropic, messages: list[Any], **params: Any) -> str:
    """The message of the 400 the server answers ``messages`` with; no item is consumed."""
    pending = fake.pending
    with pytest.raises(anthropic.BadRequestError) as raised:
        await sent(fake, messages, **params)
    assert fake.pending == pending
    body = raised.value.body
    assert isinstance(body, dict)
    return str(body["error"]["message"])


def deltas(events: list[RawMessageStreamEvent], index: int) -> list[dict[str, Any]]:
    return [
        e.delta.to_dict() for e in events if e.type == "content_block_delta" and e.index == index
    ]


def starts(events: list[RawMessageStreamEvent]) -> list[str]:
    return [e.content_block.type for e in events if e.type == "content_block_start"]


def plain(message: Message) -> list[dict[str, Any]]:
    """The message's blocks as the JSON a client sends back."""
    return [block.to_dict() for block in message.content]


def history(message: Message, *after: dict[str, Any]) -> list[dict[str, Any]]:
    return [*HELLO, {"role": "assistant", "content": plain(message)}, *after]


def tool_result(use_id: str, content: str = "15 C") -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": use_id, "content": content}],
    }


# --- the blocks arrive, and accumulate to what was scripted ---------------------------------


@pytest.mark.asyncio
async def test_every_block_type_streams_with_the_real_event_shapes(
    fake_anthropic: FakeAnthropic,
) -> None:
    citation = cite_search(PAGE, "the Moon passes between")
    reply = Reply(
        content=[
            Thinking("Search first."),
            Redacted(),
            ServerToolUse("web_search", {"query": "solar eclipse"}, result=[PAGE]),
            Text("An eclipse is when the Moon passes between.", citations=[citation]),
            ToolUse("get_weather", {"city": "Paris"}),
        ],
        chunk_size=6,
    )
    fake_anthropic.script(reply)
    events = await events_of(fake_anthropic, tools=[WEATHER, SEARCH])

    assert starts(events) == [
        "thinking",
        "redacted_thinking",
        "server_tool_use",
        "web_search_tool_result",
        "text",
        "tool_use",
    ]
    thinking = deltas(events, 0)
    assert [d["type"] for d in thinking] == ["thinking_delta"] * 3 + ["signature_delta"]
    assert "".join(d.get("thinking", "") for d in thinking) == "Search first."
    assert deltas(events, 1) == deltas(events, 3) == []  # whole in their start
    search = deltas(events, 2)
    assert {d["type"] for d in search} == {"input_json_delta"} and search[0]["partial_json"] == ""
    assert json.loads("".join(d["partial_json"] for d in search)) == {"query": "solar eclipse"}
    text = deltas(events, 4)
    assert text[0] == {"type": "citations_delta", "citation": citation}
    assert {d["type"] for d in text[1:]} == {"text_delta"}
    assert [e.type for e in events][-2:] == ["message_delta", "message_stop"]
    final = events[-2]
    assert final.type == "message_delta" and final.delta.stop_reason == "tool_use"
    assert final.usage.server_tool_use is not None
    assert final.usage.server_tool_use.web_search_requests == 1
    assert final.usage.server_tool_use.web_fetch_requests == 0


@pytest.mark.asyncio
async def test_the_stream_helper_accumulates_each_block_to_what_was_scripted(
    fake_anthropic: FakeAnthropic,
) -> None:
    citation = cite_chars("blue", 0, 10, 14, title="Sky")
    fake_anthropic.script(
        Reply(
            content=[
                Thinking("Check the page."),
                Redacted("ZmFrZS1yZWRhY3RlZA=="),
                ServerToolUse("web_search", {"query": "q"}, result=[PAGE], id="srvtoolu_01a"),
                Text("The sky is blue.", citations=[citation]),
                ToolUse("get_weather", {"city": "Oslo"}, id="toolu_01b"),
            ],
            chunk_size=4,
        )
    )
    message = await streamed(fake_anthropic, tools=[WEATHER, SEARCH])

    thinking, redacted, use, result, text, tool = message.content
    assert isinstance(thinking, ThinkingBlock) and thinking.thinking == "Check the page."
    assert fake_anthropic.issuer.issued("thinking", thinking.signature, "Check the page.")
    assert isinstance(redacted, RedactedThinkingBlock) and redacted.data == "ZmFrZS1yZWRhY3RlZA=="
    assert isinstance(use, ServerToolUseBlock)
    assert (use.id, use.name, use.input) == ("srvtoolu_01a", "web_search", {"query": "q"})
    assert isinstance(result, WebSearchToolResultBlock) and result.tool_use_id == "srvtoolu_01a"
    assert isinstance(result.content, list)
    (page,) = result.content
    assert (page.url, page.title, page.page_age) == (PAGE.url, PAGE.title, "3 days ago")
    assert base64.b64decode(page.encrypted_content)  # opaque, like the real one
    assert isinstance(text, TextBlock) and text.text == "The sky is blue."
    assert [c.to_dict() for c in text.citations or []] == [citation]
    assert isinstance(tool, ToolUseBlock) and (tool.id, tool.input) == (
        "toolu_01b",
        {"city": "Oslo"},
    )
    assert message.usage.server_tool_use is not None
    assert message.usage.server_tool_use.web_search_requests == 1


@pytest.mark.asyncio
async def test_fetch_and_code_results_and_tool_errors_parse_as_the_sdk_types(
    fake_anthropic: FakeAnthropic,
) -> None:
    fetched = Fetched("https://example.org/a", "Page text.", title="A", retrieved_at="2026-01-01")
    fake_anthropic.script(
        Reply(
            content=[
                ServerToolUse("web_fetch", {"url": fetched.url}, result=fetched),
                ServerToolUse("code_execution", {"code": "print(2)"}, result=CodeRun("2\n")),
                ServerToolUse("web_search", {"query": "x"}, result=ToolError("max_uses_exceeded")),
                ServerToolUse("web_fetch", {"url": "u"}, result=ToolError("url_not_accessible")),
            ],
            stop_reason="pause_turn",
        )
    )
    message = await streamed(fake_anthropic)

    fetch, code, failed_search, failed_fetch = message.content[1::2]
    assert isinstance(fetch, WebFetchToolResultBlock) and fetch.content.type == "web_fetch_result"
    assert fetch.content.url == fetched.url and fetch.content.content.source.data == "Page text."
    assert isinstance(code, CodeExecutionToolResultBlock)
    assert code.content.type == "code_execution_result" and code.content.stdout == "2\n"
    assert code.content.return_code == 0
    assert isinstance(failed_search, WebSearchToolResultBlock)
    assert not isinstance(failed_search.content, list)
    assert failed_search.content.type == "web_search_tool_result_error"
    assert failed_search.content.error_code == "max_uses_exceeded"
    assert isinstance(failed_fetch, WebFetchToolResultBlock)
    assert failed_fetch.content.type == "web_fetch_tool_result_error"
    assert message.stop_reason == "pause_turn"
    assert message.usage.server_tool_use is not None
    assert message.usage.server_tool_use.web_fetch_requests == 2
    assert message.usage.server_tool_use.web_search_requests == 1


@pytest.mark.asyncio
async def test_a_compaction_block_streams_one_compaction_delta_and_accumulates_in_beta(
    fake_anthropic: FakeAnthropic,
) -> None:
    fake_anthropic.script(
        Reply(
            content=[
                Compaction("Earlier: the user asked about eclipses.", signed=True),
                Text("Go on."),
            ]
        ),
        Reply(content=[Compaction("Summary.")]),
    )
    async with (
        client(fake_anthropic) as sdk,
        sdk.beta.messages.stream(model=MODEL, max_tokens=64, messages=cast(Any, HELLO)) as stream,
    ):
        message = await stream.get_final_message()
    events = await events_of(fake_anthropic)

    compaction, text = message.content
    assert isinstance(compaction, BetaCompactionBlock)
    assert compaction.content == "Earlier: the user asked about eclipses."
    issuer = fake_anthropic.issuer
    assert issuer.issued("compaction", compaction.encrypted_content, compaction.content)
    assert issuer.issued("compaction-signature", compaction.signature, compaction.content)
    assert text.type == "text"
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.to_dict() == {
        "type": "compaction",
        "content": None,
        "encrypted_content": None,
    }
    (delta,) = deltas(events, 0)
    assert delta["type"] == "compaction_delta" and delta["content"] == "Summary."


@pytest.mark.asyncio
async def test_an_unknown_block_type_arrives_whole_and_the_sdk_keeps_it(
    fake_anthropic: FakeAnthropic,
) -> None:
    future = Unknown("hologram", {"frames": [1, 2], "caption": "later"})
    fake_anthropic.script(Reply(content=[future, Text("After it.")]))
    message = await streamed(fake_anthropic)

    fake_anthropic.script(Reply(content=[future]))
    events = await events_of(fake_anthropic)

    odd, text = message.content
    whole = {"type": "hologram", "frames": [1, 2], "caption": "later"}
    assert odd.to_dict() == whole  # kept by the SDK as it came, extra fields and all
    assert isinstance(text, TextBlock) and text.text == "After it."
    assert starts(events) == ["hologram"] and deltas(events, 0) == []
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.to_dict() == whole


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("reply", "stop_reason", "stop_sequence"),
    [
        (Reply(text="Done."), "end_turn", None),
        (Reply(tool_uses=[ToolUse("get_weather", {})]), "tool_use", None),
        (Reply(text="Counting: 1, 2,", stop_sequence="3"), "stop_sequence", "3"),
        (Reply(text="I can't", stop_reason="refusal"), "refusal", None),
        (
            Reply(content=[ServerToolUse("web_search", {"query": "q"})], stop_reason="pause_turn"),
            "pause_turn",
            None,
        ),
        (
            Reply(text="Long", stop_reason="model_context_window_exceeded"),
            "model_context_window_exceeded",
            None,
        ),
        (Reply(text="Cut sho", cut=Cut(0, 7)), "max_tokens", None),
    ],
)
async def test_each_stop_reason_reaches_the_final_message(
    fake_anthropic: FakeAnthropic, reply: Reply, stop_reason: str, stop_sequence: str | None
) -> None:
    fake_anthropic.script(reply)
    message = await streamed(fake_anthropic, tools=[WEATHER, SEARCH])
    assert (message.stop_reason, message.stop_sequence) == (stop_reason, stop_sequence)


@pytest.mark.asyncio
@pytest.mark.parametrize("content", [[], [Text("")]])
async def test_a_refusal_streams_what_text_it_had_with_its_details(
    fake_anthropic: FakeAnthropic, content: list[Text]
) -> None:
    fake_anthropic.script(Reply(content=content, stop_reason="refusal"))
    events = await events_of(fake_anthropic)
    assert starts(events) == ["text"] * len(content) and deltas(events, 0) == []
    final = events[-2]
    assert final.type == "message_delta" and final.delta.stop_reason == "refusal"
    assert final.delta.stop_details is not None and final.delta.stop_details.type == "refusal"


@pytest.mark.asyncio
async def test_a_reply_cut_off_mid_tool_use_sends_half_the_json_then_max_tokens(
    fake_anthropic: FakeAnthropic,
) -> None:
    tool = ToolUse("get_weather", {"city": "San Francisco"})
    half = len(tool.json_text()) // 2
    reply = Reply(content=[Text("Checking."), tool, Text("never sent")], cut=Cut(1, half))
    fake_anthropic.script(reply, reply)
    events = await events_of(fake_anthropic, tools=[WEATHER])
    message = await streamed(fake_anthropic, tools=[WEATHER])

    assert starts(events) == ["text", "tool_use"]
    assert "".join(d["partial_json"] for d in deltas(events, 1)) == tool.json_text()[:half]
    names = [e.type for e in events]
    assert names[-4:] == [
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert message.stop_reason == "max_tokens"
    cut = message.content[1]
    assert isinstance(cut, ToolUseBlock) and cut.input == {}  # '{"city": "San' parses to {}


@pytest.mark.asyncio
async def test_a_cut_can_leave_the_block_unclosed_as_an_sdk_recording_does(
    fake_anthropic: FakeAnthropic,
) -> None:
    fake_anthropic.script(
        Reply(content=[ToolUse("get_weather", {"city": "Rome"})], cut=Cut(0, 9, stop=False))
    )
    events = await events_of(fake_anthropic, tools=[WEATHER])
    assert "content_block_stop" not in [e.type for e in events]
    assert "".join(d["partial_json"] for d in deltas(events, 0)) == '{"city": '


@pytest.mark.asyncio
async def test_thinking_cut_off_is_still_signed_over_what_was_sent_and_goes_back(
    fake_anthropic: FakeAnthropic,
) -> None:
    fake_anthropic.script(
        Reply(content=[Thinking("a long chain of thought"), Text("x")], cut=Cut(0, 6))
    )
    message = await streamed(fake_anthropic, thinking=THINK)
    (thinking,) = message.content
    assert isinstance(thinking, ThinkingBlock) and thinking.thinking == "a long"
    fake_anthropic.script(Reply(text="ok"))
    await sent(
        fake_anthropic, history(message, {"role": "user", "content": "go on"}), thinking=THINK
    )


def test_a_non_streaming_answer_carries_the_same_blocks_whole(
    fake_anthropic: FakeAnthropic,
) -> None:
    fake_anthropic.script(
        Reply(
            content=[
                Thinking("t"),
                ServerToolUse("web_search", {"query": "q"}, result=[PAGE]),
                Text("cited", citations=[cite_search(PAGE, "c")]),
                ToolUse("get_weather", raw_json='{"city": "Oslo"}'),
            ],
        ),
        Reply(
            content=[Text("Half an ans"), ToolUse("get_weather", {"city": "Rome"})], cut=Cut(1, 5)
        ),
    )
    with anthropic.Anthropic(**anthropic_client_kwargs(fake_anthropic)) as sdk:
        whole = sdk.messages.create(model=MODEL, max_tokens=64, messages=cast(Any, HELLO))
        cut = sdk.messages.create(model=MODEL, max_tokens=64, messages=cast(Any, HELLO))

    assert [b.type for b in whole.content] == [
        "thinking",
        "server_tool_use",
        "web_search_tool_result",
        "text",
        "tool_use",
    ]
    tool = whole.content[-1]
    assert isinstance(tool, ToolUseBlock) and tool.input == {"city": "Oslo"}
    assert whole.usage.server_tool_use is not None
    assert cut.stop_reason == "max_tokens" and [b.type for b in cut.content] == ["text", "tool_use"]
    partial = cut.content[1]
    assert isinstance(partial, ToolUseBlock) and partial.input == {}


# --- what comes back is checked: thinking -----------------------------------------------------


def test_the_issuer_tells_what_it_issued_from_edits_and_forgeries() -> None:
    issuer, other = Issuer(), Issuer()
    signature = issuer.thinking_signature("plan")
    assert issuer.issued("thinking", signature, "plan")
    assert signature != issuer.thinking_signature("plan")  # a fresh nonce each time
    assert not issuer.issued("thinking", signature, "plan!")
    assert not issuer.issued("redacted_thinking", signature, "plan")
    assert not other.issued("thinking", signature, "plan")
    assert not issuer.issued("thinking", "not base64!", "plan")
    assert not issuer.issued("thinking", None, "plan")


@pytest.mark.asyncio
async def test_thinking_signed_by_the_fake_goes_back_and_an_edited_one_is_refused(
    fake_anthropic: FakeAnthropic,
) -> None:
    fake_anthropic.script(
        Reply(
            content=[
                Thinking("I need the weather."),
                ToolUse("get_weather", {"city": "Oslo"}, id="toolu_w"),
            ]
        ),
        Reply(text="It is 15 C."),
    )
    message = await streamed(fake_anthropic, tools=[WEATHER], thinking=THINK)
    good = history(message, tool_result("toolu_w"))
    edited = json.loads(json.dumps(good))
    edited[1]["content"][0]["thinking"] = "I need the weather, and more."
    unsigned = json.loads(json.dumps(good))
    del unsigned[1]["content"][0]["signature"]
    forged = json.loads(json.dumps(good))
    forged[1]["content"][0]["signature"] = Issuer().thinking_signature("I need the weather.")

    ask = {"tools": [WEATHER], "thinking": THINK}
    assert (
        await refusal(fake_anthropic, edited, **ask)
        == "messages.1.content.0: Invalid `signature` in `thinking` block"
    )
    assert (
        await refusal(fake_anthropic, forged, **ask)
        == "messages.1.content.0: Invalid `signature` in `thinking` block"
    )
    assert (
        await refusal(fake_anthropic, unsigned, **ask)
        == "messages.1.content.0.thinking.signature: Field required"
    )
    answer = await sent(fake_anthropic, good, **ask)
    assert answer.content[0].type == "text" and fake_anthropic.pending == 0
    taken = fake_anthropic.message_requests()[-1].body
    assert fake_anthropic.problem_with(taken) is None
    assert fake_anthropic.problem_with({**taken, "messages": edited}) is not None
    # the SDK's own to_param() round trip is what the API takes, too
    fake_anthropic.script(Reply(text="again"))
    params = [*HELLO, message.to_param(), tool_result("toolu_w")]
    await sent(fake_anthropic, cast(list[Any], params), **ask)


@pytest.mark.asyncio
async def test_with_thinking_on_the_tool_loop_must_start_with_thinking(
    fake_anthropic: FakeAnthropic,
) -> None:
    bare = [
        *HELLO,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_x", "name": "get_weather", "input": {}}],
        },
        tool_result("toolu_x"),
    ]
    expected = (
        "messages.1.content.0.type: Expected `thinking` or `redacted_thinking`, but found "
        "`tool_use`. When `thinking` is enabled, a final `assistant` message must start with a "
        "thinking block"
    )
    for thinking in (THINK, {"type": "adaptive"}):
        message = await refusal(fake_anthropic, bare, tools=[WEATHER], thinking=thinking)
        assert message.startswith(expected)
    fake_anthropic.script(Reply(text="a"), Reply(text="b"), Reply(text="c"))
    await sent(fake_anthropic, bare, tools=[WEATHER])  # thinking off: no requirement
    await sent(fake_anthropic, bare, tools=[WEATHER], thinking={"type": "disabled"})
    ended = [*bare, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Next"}]
    await sent(fake_anthropic, ended, tools=[WEATHER], thinking=THINK)  # an older loop: none


@pytest.mark.asyncio
async def test_redacted_thinking_goes_back_as_issued_and_invented_data_is_refused(
    fake_anthropic: FakeAnthropic,
) -> None:
    fake_anthropic.script(
        Reply(content=[Redacted(), ToolUse("get_weather", {}, id="toolu_r")]), Reply(text="ok")
    )
    message = await streamed(fake_anthropic, tools=[WEATHER], thinking=THINK)
    good = history(message, tool_result("toolu_r"))
    invented = json.loads(json.dumps(good))
    invented[1]["content"][0]["data"] = base64.b64encode(b"x" * 48).decode()

    refused = await refusal(fake_anthropic, invented, tools=[WEATHER], thinking=THINK)
    assert refused == "messages.1.content.0: Invalid `data` in `redacted_thinking` block"
    await sent(fake_anthropic, good, tools=[WEATHER], thinking=THINK)


@pytest.mark.asyncio
async def test_a_final_assistant_message_cannot_hold_thinking_with_thinking_off(
    fake_anthropic: FakeAnthropic,
) -> None:
    issuer = fake_anthropic.issuer
    block = {"type": "thinking", "thinking": "hm", "signature": issuer.thinking_signature("hm")}
    prefill = [*HELLO, {"role": "assistant", "content": [block]}]
    refused = await refusal(fake_anthropic, prefill)
    assert refused.startswith("messages.1.content.0: When thinking is disabled, an `assistant`")
    fake_anthropic.script(Reply(text="ok"))
    await sent(fake_anthropic, prefill, thinking=THINK)


# --- what comes back is checked: compaction, server tools, text -----------------------------------


@pytest.mark.asyncio
async def test_a_compaction_goes_back_as_issued_and_an_altered_one_is_refused(
    fake_anthropic: FakeAnthropic,
) -> None:
    fake_anthropic.script(
        Reply(content=[Compaction("The story so far.", signed=True), Text("Hi.")])
    )
    async with (
        client(fake_anthropic) as sdk,
        sdk.beta.messages.stream(model=MODEL, max_tokens=64, messages=cast(Any, HELLO)) as stream,
    ):
        message = await stream.get_final_message()
    block = message.content[0].to_dict()
    after = {"role": "user", "content": "Continue."}

    def with_block(compaction: dict[str, Any]) -> list[Any]:
        return [
            *HELLO,
            {"role": "assistant", "content": [compaction, {"type": "text", "text": "Hi."}]},
            after,
        ]

    async with client(fake_anthropic) as sdk:
        for altered, error in [
            (
                {**block, "content": "A different story."},
                anthropic.types.CompactionContentMismatchError,
            ),
            (
                {**block, "signature": Issuer().issue("compaction-signature", "x")},
                anthropic.types.CompactionSignatureInvalidError,
            ),
        ]:
            with pytest.raises(error):
                await sdk.beta.messages.create(
                    model=MODEL, max_tokens=64, messages=cast(Any, with_block(altered))
                )
    bare = await refusal(fake_anthropic, with_block({"type": "compaction"}))
    assert bare == "messages.1.content.0.content: Field required"
    fake_anthropic.script(Reply(text="a"), Reply(text="b"))
    await sent(fake_anthropic, with_block(block))
    failed = {"type": "compaction", "content": None}  # a compaction that failed: a no-op
    await sent(fake_anthropic, with_block(failed))


@pytest.mark.asyncio
async def test_a_server_tool_use_goes_back_with_its_result_or_not_at_all(
    fake_anthropic: FakeAnthropic,
) -> None:
    fake_anthropic.script(
        Reply(
            content=[
                ServerToolUse("web_search", {"query": "q"}, result=[PAGE], id="srvtoolu_s"),
                Text("Found."),
            ],
        )
    )
    message = await streamed(fake_anthropic, tools=[SEARCH])
    use, result, text = plain(message)
    after = {"role": "user", "content": "Thanks."}

    def back(*blocks: dict[str, Any]) -> list[Any]:
        return [*HELLO, {"role": "assistant", "content": list(blocks)}, after]

    assert await refusal(fake_anthropic, back(use, text), tools=[SEARCH]) == (
        "messages.1: `web_search` tool use with id `srvtoolu_s` was found without a "
        "corresponding `web_search_tool_result` block"
    )
    assert (await refusal(fake_anthropic, back(result, text), tools=[SEARCH])).startswith(
        "messages.1.content.0: unexpected `tool_use_id` found in `web_search_tool_result` blocks"
    )
    fake_anthropic.script(Reply(text="ok"))
    await sent(fake_anthropic, back(use, result, text), tools=[SEARCH])


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        (
            [{"role": "user", "content": [{"type": "text", "text": ""}]}],
            "messages: text content blocks must be non-empty",
        ),
        (
            [
                *HELLO,
                {
                    "role": "assistant",
                    "content": [{"type": "text", "text": ""}, {"type": "text", "text": "x"}],
                },
                *HELLO,
            ],
            "messages: text content blocks must be non-empty",
        ),
        (
            [{"role": "user", "content": " \n"}],
            "messages: text content blocks must contain non-whitespace text",
        ),
        (
            [{"role": "user", "content": ""}],
            "messages.0: all messages must have non-empty content except for the optional final "
            "assistant message",
        ),
        (
            [*HELLO, {"role": "assistant", "content": "Sure, "}],
            "messages: final assistant content cannot end with trailing whitespace",
        ),
    ],
)
async def test_text_must_say_something(
    fake_anthropic: FakeAnthropic, messages: list[Any], expected: str
) -> None:
    assert await refusal(fake_anthropic, messages) == expected


@pytest.mark.asyncio
async def test_whitespace_beside_other_text_and_a_prefill_are_accepted(
    fake_anthropic: FakeAnthropic,
) -> None:
    fake_anthropic.script(Reply(text="a"), Reply(text="b"))
    await sent(
        fake_anthropic,
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": " "}, {"type": "text", "text": "hi"}],
            }
        ],
    )
    await sent(fake_anthropic, [*HELLO, {"role": "assistant", "content": "Sure,"}])


# --- request parameters ------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (
            {"thinking": {"type": "enabled", "budget_tokens": 1000}},
            "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024",
        ),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 4096}},
            "`max_tokens` must be greater than `thinking.budget_tokens`.",
        ),
        ({"thinking": {"type": "enabled"}}, "thinking.enabled.budget_tokens: Field required"),
        ({"thinking": {"type": "sometimes"}}, "thinking: Input tag 'sometimes' found using 'type'"),
        (
            {"tools": [{"type": "web_search_1999", "name": "web_search"}]},
            "tools.0: Input tag 'web_search_1999' found using 'type' does not match any of the "
            "expected tags: 'bash_20250124', ",
        ),
        ({"tools": [{"name": "get_weather"}]}, "tools.0.custom.input_schema: Field required"),
        ({"tools": [WEATHER, WEATHER]}, "tools: Tool names must be unique."),
    ],
)
async def test_thinking_and_tools_parameters_are_checked(
    fake_anthropic: FakeAnthropic, params: dict[str, Any], expected: str
) -> None:
    assert (await refusal(fake_anthropic, HELLO, **params)).startswith(expected)


@pytest.mark.asyncio
async def test_server_tools_adaptive_thinking_and_a_budget_below_max_tokens_are_accepted(
    fake_anthropic: FakeAnthropic,
) -> None:
    fake_anthropic.script(Reply(text="a"), Reply(text="b"))
    tools = [WEATHER, SEARCH, {"type": "code_execution_20250825", "name": "code_execution"}]
    await sent(fake_anthropic, HELLO, tools=tools, thinking={"type": "adaptive"})
    await sent(fake_anthropic, HELLO, thinking={"type": "enabled", "budget_tokens": 1024})

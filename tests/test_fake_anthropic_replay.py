"""Replaying recorded Messages streams through the fake Anthropic server to the real SDK.

``RawStream`` sends an SSE body verbatim, one event per chunk. The fake's own streams, laid out
as the SDK's repository keeps its recordings, are found by ``sdk_recorded_streams`` and replay
to the message ``fold`` says they describe; so do the SDK repository's own recordings when
``DISPACH_SDK_STREAMS`` names a checkout of anthropics/anthropic-sdk-python (the last test).
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any, cast

import anthropic
import pytest

from tests import fakes
from tests.fakes import FakeAnthropic, Reply, ToolUse, anthropic_client_kwargs
from tests.fakes.anthropic_server import (
    Compaction,
    RawStream,
    Redacted,
    SearchResult,
    ServerToolUse,
    Text,
    Thinking,
    Unknown,
    cite_chars,
    cite_search,
)
from tests.fakes.sdk_streams import ENV, SdkStream, fold, parse_sse, sdk_recorded_streams

fake_anthropic = fakes.fake_anthropic

MODEL = "claude-sonnet-5"
HELLO: list[dict[str, Any]] = [{"role": "user", "content": "Hello"}]
PAGE = SearchResult("https://example.org/eclipse", "Eclipses explained", page_age="3 days ago")


def client(fake: FakeAnthropic) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(**anthropic_client_kwargs(fake), max_retries=0)


def test_a_raw_stream_is_cut_into_one_chunk_per_event_verbatim() -> None:
    text = 'event: ping\ndata: {"type": "ping"}   \n\nevent: message_stop\r\ndata: {}\r\n\r\ntail'
    frames = RawStream(text).frames()
    assert b"".join(frames) == text.encode() and len(frames) == 3
    assert frames[0].endswith(b"   \n\n") and frames[2] == b"tail"


def fake_body(fake: FakeAnthropic, reply: Reply) -> str:
    """The raw SSE body the fake streams for ``reply``."""
    fake.script(reply)
    port = int(fake.url.rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    body = {"model": MODEL, "max_tokens": 64, "messages": HELLO, "stream": True}
    try:
        connection.request("POST", "/v1/messages", json.dumps(body), {"x-api-key": "k"})
        return connection.getresponse().read().decode()
    finally:
        connection.close()


EVERYTHING = Reply(
    content=[
        Thinking("Plan."),
        ServerToolUse("web_search", {"query": "q"}, result=[PAGE]),
        Text("Said.", citations=[cite_search(PAGE, "s")]),
        ToolUse("get_weather", {"city": "Oslo"}),
    ],
    chunk_size=3,
)


def test_the_streamed_answer_folds_to_the_non_streaming_one(fake_anthropic: FakeAnthropic) -> None:
    pinned = Reply(
        content=[
            Thinking("Plan.", signature="c2ln"),
            Redacted("ZGF0YQ=="),
            ServerToolUse(
                "web_search",
                {"query": "q"},
                result=[SearchResult("u", "t", None, "ZW5j")],
                id="srvtoolu_1",
            ),
            Text("Said.", citations=[cite_chars("S", 0, 0, 1)]),
            Compaction("C.", encrypted_content="ZQ==", signature="cw=="),
            Unknown("hologram", {"n": 1}),
            ToolUse("get_weather", {"city": "Oslo"}, id="toolu_1"),
        ],
        chunk_size=2,
    )
    message = fold(parse_sse(fake_body(fake_anthropic, pinned)))
    fake_anthropic.script(pinned)
    with anthropic.Anthropic(**anthropic_client_kwargs(fake_anthropic)) as sdk:
        whole = sdk.messages.with_raw_response.create(
            model=MODEL, max_tokens=64, messages=cast(Any, HELLO)
        )
    expected = json.loads(whole.http_response.text)
    compaction = message["content"][5]
    assert compaction == {
        "type": "compaction",
        "content": "C.",
        "encrypted_content": "ZQ==",
        "signature": "cw==",
    }
    assert message["content"] == expected["content"]
    assert message["stop_reason"] == expected["stop_reason"] == "tool_use"


def write_recordings(root: Path, fake: FakeAnthropic) -> None:
    """The fake's own streams, laid out as the SDK's repository keeps its recordings."""
    body = fake_body(fake, EVERYTHING)
    (root / "tests/lib/streaming/fixtures").mkdir(parents=True)
    (root / "tests/lib/streaming/fixtures/everything_response.txt").write_text(body)
    (root / "tests/sample_file.txt").write_text("Hello, world!\n")
    (root / "tests/fixtures/scenario").mkdir(parents=True)
    (root / "tests/fixtures/scenario/compaction.sse").write_text(
        fake_body(fake, Reply(content=[Compaction("Sum."), Text("ok")]))
    )
    snapshot = root / "tests/lib/__inline_snapshot__/test_x/TestAsync"
    snapshot.mkdir(parents=True)
    exchanges = [
        {
            "request": {
                "method": "POST",
                "url": "https://api.anthropic.com/v1/messages",
                "body": {"stream": True},
            },
            "response": {
                "status_code": 429,
                "headers": {"content-type": "application/json"},
                "body": {"type": "error"},
            },
        },
        {
            "request": {
                "method": "POST",
                "url": "https://api.anthropic.com/v1/messages?beta=true",
                "body": {"stream": True},
            },
            "response": {
                "status_code": 200,
                "headers": {"Content-Type": "text/event-stream; charset=utf-8"},
                "body": body,
            },
        },
    ]
    (snapshot / "0000.json").write_text(json.dumps(exchanges))


async def replayed(fake: FakeAnthropic, stream: SdkStream) -> dict[str, Any]:
    """The SDK's accumulation of ``stream`` replayed by the fake (the beta helper for beta
    streams), as JSON."""
    fake.script(RawStream(stream.text))
    async with client(fake) as sdk:
        if stream.beta:
            manager = sdk.beta.messages.stream(
                model=MODEL, max_tokens=64, messages=cast(Any, HELLO)
            )
            async with manager as beta:
                return (await beta.get_final_message()).model_dump(mode="json", warnings=False)
        async with sdk.messages.stream(
            model=MODEL, max_tokens=64, messages=cast(Any, HELLO)
        ) as plain_stream:
            return (await plain_stream.get_final_message()).model_dump(mode="json", warnings=False)


def same_blocks(accumulated: dict[str, Any], folded: dict[str, Any]) -> None:
    """The SDK's blocks hold every field the stream gave (it adds its own, None, ones)."""
    assert len(accumulated["content"]) == len(folded["content"])
    for ours, theirs in zip(accumulated["content"], folded["content"], strict=True):
        assert {k: v for k, v in ours.items() if k in theirs or v is not None} == theirs
    assert accumulated["stop_reason"] == folded["stop_reason"]
    assert accumulated["usage"]["output_tokens"] == folded["usage"]["output_tokens"]


@pytest.mark.asyncio
async def test_recordings_in_the_sdk_layout_are_found_and_replay_through_the_sdk(
    fake_anthropic: FakeAnthropic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert sdk_recorded_streams() == []
    write_recordings(tmp_path, fake_anthropic)
    monkeypatch.setenv(ENV, str(tmp_path))
    found = sdk_recorded_streams()

    assert [(s.name, s.beta) for s in found] == [
        ("tests/fixtures/scenario/compaction.sse", True),
        ("tests/lib/__inline_snapshot__/test_x/TestAsync/0000.json#1", True),
        ("tests/lib/streaming/fixtures/everything_response.txt", False),
    ]
    assert found[1].request == {"stream": True}
    for stream in found:
        same_blocks(await replayed(fake_anthropic, stream), fold(stream.events))
    assert fake_anthropic.pending == 0


SDK_STREAMS = sdk_recorded_streams()


@pytest.mark.asyncio
@pytest.mark.skipif(not SDK_STREAMS, reason=f"{ENV} names no checkout of the SDK's repository")
@pytest.mark.parametrize("stream", SDK_STREAMS, ids=[s.name for s in SDK_STREAMS])
async def test_the_sdk_repositorys_recorded_streams_replay_to_what_they_describe(
    fake_anthropic: FakeAnthropic, stream: SdkStream
) -> None:
    """Runs when ``DISPACH_SDK_STREAMS`` names a checkout of anthropics/anthropic-sdk-python."""
    same_blocks(await replayed(fake_anthropic, stream), fold(stream.events))

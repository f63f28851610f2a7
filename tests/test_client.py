"""The Python client (gateways.client) and the CLI commands built on it."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import httpx2
import pytest
from click.testing import CliRunner

from actors.ids import keyed_turn_id
from gateways.client import Accepted, Client, ClientError, SseFrame, StreamFrame, parse
from runtime.cli import main
from tests import fakes
from tests.conftest import ApiFactory, ApiServer
from tests.fakes import FakeAnthropic, Reply

fake_anthropic = fakes.fake_anthropic

# ---- the SSE parser ----------------------------------------------------------------------

PARSED: list[tuple[str, list[str], list[SseFrame]]] = [
    (
        "an event frame",
        ["event: turn.start", "id: c1", 'data: {"a": 1}', ""],
        [SseFrame("turn.start", "c1", '{"a": 1}')],
    ),
    (
        "several data lines are joined by a newline",
        ["event: x", "data: one", "data: two", ""],
        [SseFrame("x", None, "one\ntwo")],
    ),
    (
        "comments are heartbeats, between and inside frames",
        [": ping", "", "event: x", ": ping", "data: 1", "", ": ping", ""],
        [SseFrame("x", None, "1")],
    ),
    (
        "one space after the colon is dropped, no more",
        ["event:x", "data:  two spaces", ""],
        [SseFrame("x", None, " two spaces")],
    ),
    (
        "a control frame does not inherit the previous frame's id",
        ["event: turn.end", "id: c9", "data: {}", "", "event: stream.ended", "data: {}", ""],
        [SseFrame("turn.end", "c9", "{}"), SseFrame("stream.ended", None, "{}")],
    ),
    (
        "a frame without an event line is a message",
        ["data: hi", ""],
        [SseFrame("message", None, "hi")],
    ),
    (
        "a field without a colon has an empty value",
        ["event: x", "data", "data", ""],
        [SseFrame("x", None, "\n")],
    ),
    (
        "an id with a NUL is ignored; retry and unknown fields too",
        ["id: a\0b", "retry: 10", "colour: red", "event: x", "data: 1", ""],
        [SseFrame("x", None, "1")],
    ),
    (
        "blank lines alone make no frames; an unfinished frame is not yielded",
        ["", "", "event: x", "data: cut off"],
        [],
    ),
]


@pytest.mark.parametrize(
    ("lines", "frames"), [case[1:] for case in PARSED], ids=[case[0] for case in PARSED]
)
def test_sse_parser(lines: list[str], frames: list[SseFrame]) -> None:
    assert list(parse(lines)) == frames


# ---- without a node ------------------------------------------------------------------------


def a_closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_node_that_is_not_there_is_server_unreachable_with_a_hint() -> None:
    with Client(a_closed_port()) as client, pytest.raises(ClientError) as caught:
        client.agents()
    assert caught.value.code == "server_unreachable" and caught.value.status is None
    assert "dispach serve" in caught.value.hint and "DISPACH_URL" in caught.value.hint


def test_a_stream_that_cannot_reconnect_gives_up_after_its_delays() -> None:
    with (
        Client(a_closed_port(), reconnect_delays=(0.01, 0.01, 0.01)) as client,
        pytest.raises(ClientError) as caught,
    ):
        list(client.stream_turn("assistant", "t_1", after="c7"))
    assert caught.value.code == "stream_lost"
    assert "3 reconnections failed" in caught.value.message and "'c7'" in caught.value.hint


def test_cli_send_to_no_node_fails_with_the_hint() -> None:
    result = CliRunner().invoke(main, ["send", "--url", a_closed_port(), "hello"])
    assert result.exit_code == 1
    assert "server_unreachable" in result.output and "dispach serve" in result.output


# ---- against a node ------------------------------------------------------------------------

SLOW = """
id: slow
model:
  provider: scripted
  script:
    - {{match: "^wait$", tool: record, input: {{path: "{path}", seconds: {seconds}}}}}
tools:
  - name: record
    module: tests.fixtures_tools:record_and_wait
    description: Records that it ran, then waits.
    mutating: true
    input_schema: {{type: object}}
"""


def event_ids(frames: list[StreamFrame]) -> list[str]:
    return [f.id for f in frames if f.id is not None]


@pytest.mark.asyncio
async def test_send_then_stream_the_turn_to_its_end(api: ApiServer) -> None:
    def run() -> tuple[Accepted, list[StreamFrame], dict[str, Any], list[dict[str, Any]]]:
        with Client(api.url, api.token) as client:
            assert "assistant" in [a["id"] for a in client.agents()]
            accepted = client.send("assistant", "calculate 6*7", session_key="s1")
            frames = list(client.stream_turn("assistant", accepted.turn_id))
            return (
                accepted,
                frames,
                client.turn(accepted.turn_id),
                client.events("assistant", accepted.turn_id),
            )

    accepted, frames, turn, stored = await asyncio.to_thread(run)
    assert accepted.session_key == "s1" and not accepted.replayed
    assert frames[0].event == "stream.replay" and frames[0].id is None
    assert [f.event for f in frames[-2:]] == ["turn.end", "stream.ended"]
    assert frames[-1].data["status"] == "final"
    assert event_ids(frames) == [e["cursor"] for e in stored]  # every event, once, in order
    calls = [f.data["data"] for f in frames if f.event == "tool.call"]
    assert calls[0]["slug"] == "calculator" and "args" not in calls[0]
    reply = "".join(f.data["data"]["delta"] for f in frames if f.event == "model.chunk")
    assert "42" in reply
    assert turn["status"] == "final" and turn["agentId"] == "assistant" and "42" in turn["text"]


@pytest.mark.asyncio
async def test_refusals_are_client_errors_with_the_node_envelope(api: ApiServer) -> None:
    def run() -> tuple[ClientError, ClientError, Accepted, Accepted]:
        with Client(api.url, api.token) as client:
            with pytest.raises(ClientError) as unknown:
                client.send("nobody", "hi")
            first = client.send("assistant", "hello", idempotency_key="k-1")
            again = client.send("assistant", "hello", idempotency_key="k-1")
            list(client.stream_turn("assistant", first.turn_id))
            with pytest.raises(ClientError) as ended:
                client.stop("assistant", first.turn_id)
            return unknown.value, ended.value, first, again

    unknown, ended, first, again = await asyncio.to_thread(run)
    assert (unknown.status, unknown.code) == (404, "agent_not_found") and unknown.hint
    assert (ended.status, ended.code) == (409, "turn_not_running")
    assert again.replayed and again.turn_id == first.turn_id and not first.replayed


@pytest.mark.asyncio
async def test_the_token_is_sent_as_a_bearer(api_factory: ApiFactory) -> None:
    api = await api_factory.start(tokens=["0123456789abcdef-secret@assistant"])

    def run() -> tuple[ClientError, list[dict[str, Any]]]:
        with Client(api.url) as anonymous, pytest.raises(ClientError) as refused:
            anonymous.agents()
        with Client(api.url, api.token) as client:
            return refused.value, client.agents()

    refused, agents = await asyncio.to_thread(run)
    assert (refused.status, refused.code) == (401, "unauthorized") and refused.hint
    assert [a["id"] for a in agents] == ["assistant"]

    # The CLI takes the first token of DISPACH_API_TOKEN, without its scope.
    listed = "0123456789abcdef-secret@assistant,another-token-0123456789"
    code, out, err = await dispach(api, "send", "--no-stream", "hi", token=listed)
    assert code == 0 and out.startswith("t"), err
    code, _, err = await dispach(api, "send", "--no-stream", "hi", token="")
    assert code == 1 and "unauthorized" in err


class CuttingProxy:
    """A TCP proxy in front of the node that cuts its first connection halfway through the
    frame carrying ``marker``, as a network would: the client sees a broken stream and half a
    frame, then reconnects through the proxy (later connections pass untouched)."""

    def __init__(self, upstream_port: int, marker: bytes) -> None:
        self.upstream_port = upstream_port
        self.marker = marker
        self.connections = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        cut = self.connections == 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer, None)),
            asyncio.create_task(self._pump(up_reader, writer, self.marker if cut else None)),
        ]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._tasks.difference_update(pumps)
            writer.close()
            up_writer.close()

    @staticmethod
    async def _pump(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, cut_at: bytes | None
    ) -> None:
        seen = b""
        while data := await reader.read(65536):
            if cut_at is not None:
                seen += data
                at = seen.find(cut_at)
                if at >= 0:
                    writer.write(data[: len(data) - (len(seen) - at - len(cut_at))])
                    await writer.drain()
                    return
            writer.write(data)
            await writer.drain()


@pytest.mark.asyncio
async def test_stream_turn_resumes_exactly_after_a_dropped_connection(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    api_factory.write_agent("slow", SLOW.format(path=tmp_path / "ran.txt", seconds=1))
    api = await api_factory.start()
    proxy = CuttingProxy(api.port, b"event: tool.call")
    proxied = await proxy.start()

    def run() -> tuple[list[StreamFrame], list[dict[str, Any]]]:
        with Client(api.url, api.token) as direct, Client(proxied, api.token) as cut:
            accepted = direct.send("slow", "wait")
            frames = list(cut.stream_turn("slow", accepted.turn_id))
            return frames, direct.events("slow", accepted.turn_id)

    try:
        frames, stored = await asyncio.to_thread(run)
    finally:
        await proxy.stop()
    assert proxy.connections == 2
    replays = [i for i, f in enumerate(frames) if f.event == "stream.replay"]
    assert len(replays) == 2  # one per connection
    before_cut = frames[replays[1] - 1]
    assert replays[1] > 0 and before_cut.id is not None
    assert frames[replays[1]].data["from"] == before_cut.id  # resumed after the last event seen
    assert frames[replays[1] + 1].event == "tool.call"  # the half frame, now whole
    ids = event_ids(frames)
    assert len(ids) == len(set(ids))
    assert ids == [e["cursor"] for e in stored]  # no gap, no duplicate
    assert [f.event for f in frames[-2:]] == ["turn.end", "stream.ended"]


@pytest.mark.asyncio
async def test_a_stream_cut_after_turn_end_is_not_reopened(api: ApiServer) -> None:
    proxy = CuttingProxy(api.port, b"event: stream.ended")
    proxied = await proxy.start()

    def run() -> list[StreamFrame]:
        with Client(api.url, api.token) as direct, Client(proxied, api.token) as cut:
            accepted = direct.send("assistant", "hello")
            return list(cut.stream_turn("assistant", accepted.turn_id))

    try:
        frames = await asyncio.to_thread(run)
    finally:
        await proxy.stop()
    assert frames[-1].event == "turn.end" and proxy.connections == 1


@pytest.mark.asyncio
async def test_a_stream_resumed_at_its_end_returns_at_once(api: ApiServer) -> None:
    """The node answers 204 to a resume at or past turn.end (a browser's EventSource stops
    there); the client takes it as the end, not as a broken stream to reconnect."""

    def run() -> tuple[list[StreamFrame], list[StreamFrame]]:
        with Client(api.url, api.token) as client:
            accepted = client.send("assistant", "hello")
            whole = list(client.stream_turn("assistant", accepted.turn_id))
            end = next(f for f in whole if f.event == "turn.end")
            return whole, list(client.stream_turn("assistant", accepted.turn_id, after=end.id))

    whole, resumed = await asyncio.wait_for(asyncio.to_thread(run), 30)
    assert whole[-1].event == "stream.ended"
    assert resumed == []


# ---- the CLI against a node ----------------------------------------------------------------

DISPACH = str(Path(sys.executable).parent / "dispach")


async def dispach(
    api: ApiServer, *args: str, stdin: bytes = b"", token: str | None = None
) -> tuple[int, str, str]:
    """Run the CLI against ``api`` (with its token, or DISPACH_API_TOKEN=``token``)."""
    env = os.environ | {
        "DISPACH_URL": api.url,
        "DISPACH_API_TOKEN": (api.token or "") if token is None else token,
    }
    process = await asyncio.create_subprocess_exec(
        DISPACH, *args, env=env, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(stdin), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@pytest.mark.asyncio
async def test_cli_send_prints_the_reply_the_tool_calls_and_the_status(api: ApiServer) -> None:
    code, out, err = await dispach(api, "send", "--session", "cli-1", "calculate 6*7")
    assert code == 0, err
    assert "42" in out and "[scripted model, offline]" in out
    assert "tool.call  calculator" in err and "tool.result  calculator ok" in err
    assert "final: 2 steps" in err and "session cli-1" in err

    code, out, err = await dispach(api, "send", "--agent", "nobody", "hi")
    assert code == 1 and "agent_not_found" in err and "hint:" in err


@pytest.mark.asyncio
async def test_cli_send_exits_3_when_the_turn_is_stopped(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    ran = tmp_path / "ran.txt"
    # The tool's 6 s are the window for `dispach turns stop` (a process start: >2 s under load).
    api_factory.write_agent("slow", SLOW.format(path=ran, seconds=6))
    api = await api_factory.start()
    sending = asyncio.create_task(dispach(api, "send", "--agent", "slow", "wait"))
    async with asyncio.timeout(30):
        while not ran.exists():  # the tool runs: the turn is mid-step
            await asyncio.sleep(0.05)
    turn_id = await asyncio.to_thread(latest_turn, api, "slow")
    stopped = await dispach(api, "turns", "stop", turn_id)
    assert stopped[0] == 0 and f"stopping {turn_id}" in stopped[1]
    code, _, err = await sending
    assert code == 3, err
    assert "stopped:" in err


def latest_turn(api: ApiServer, agent: str) -> str:
    with httpx2.Client(base_url=api.url, headers=api.headers) as http:
        turns = http.get(f"/v1/agents/{agent}/turns", params={"limit": 1}).json()["turns"]
        return str(turns[0]["turnId"])


@pytest.mark.asyncio
async def test_cli_turns_show_prints_the_resource_and_its_timeline(api: ApiServer) -> None:
    code, out, err = await dispach(api, "send", "--no-stream", "calculate 6*7")
    assert code == 0, err
    turn_id = out.strip()
    assert turn_id.startswith("t")
    await asyncio.to_thread(wait_ended, api, turn_id)
    code, out, err = await dispach(api, "turns", "show", turn_id)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"turn {turn_id}  agent assistant")
    assert "status final (ended)" in lines[1]
    timeline = lines[lines.index("timeline:") + 1 :]
    assert timeline[0].split()[:2] == ["+0.000s", "turn.start"]
    assert "api: 'calculate 6*7'" in timeline[0]
    assert any("tool.call" in line and "calculator" in line for line in timeline)
    assert "turn.end" in timeline[-1] and "final: 2 steps" in timeline[-1]

    code, out, _ = await dispach(api, "turns", "show", turn_id, "--json")
    shown = json.loads(out)
    assert shown["turn"]["turnId"] == turn_id and shown["events"][-1]["type"] == "turn.end"


def wait_ended(api: ApiServer, turn_id: str) -> None:
    with Client(api.url, api.token) as client:
        list(client.stream_turn("assistant", turn_id, chunks=False))


@pytest.mark.asyncio
async def test_cli_chat_keeps_one_session_until_quit(api: ApiServer) -> None:
    code, out, err = await dispach(
        api,
        "chat",
        "--session",
        "chat-1",
        stdin=b"note: buy milk\n\nwhat are my notes?\n/quit\nnever sent\n",
    )
    assert code == 0, err
    assert out.count("you> ") == 4  # three lines read (one blank), then /quit
    assert out.count("assistant> ") == 2 and "[scripted model, offline]" in out
    turns = await asyncio.to_thread(session_turns, api, "chat-1")
    assert [t["input"] for t in turns] == ["what are my notes?", "note: buy milk"]
    assert "buy milk" in turns[0]["text"]


def session_turns(api: ApiServer, session: str) -> list[dict[str, Any]]:
    with httpx2.Client(base_url=api.url, headers=api.headers) as http:
        listed = http.get("/v1/agents/assistant/turns", params={"sessionKey": session}).json()
        return list(listed["turns"])


# ---- a lost answer: the message is sent again with its Idempotency-Key ----------------------

LOSE_THE_ANSWER = b"HTTP/1.1 "  # the proxy cuts the first connection as the answer starts


@pytest.mark.asyncio
async def test_send_retries_a_lost_answer_with_its_key_and_makes_one_turn(api: ApiServer) -> None:
    proxy = CuttingProxy(api.port, LOSE_THE_ANSWER)
    proxied = await proxy.start()

    def run() -> Accepted:
        with Client(proxied, api.token) as client:
            return client.send("assistant", "hello once", session_key="lost-1")

    try:
        accepted = await asyncio.to_thread(run)
    finally:
        await proxy.stop()
    assert proxy.connections == 2  # the first answer was lost, the message sent again
    assert accepted.turn_id.startswith("t_k")  # a keyed turn: the client sent a key
    assert accepted.replayed  # the node had accepted the first send; the retry replayed it
    turns = await asyncio.to_thread(session_turns, api, "lost-1")
    assert [t["turnId"] for t in turns] == [accepted.turn_id]


@pytest.mark.asyncio
async def test_cli_resends_a_lost_answer_under_one_key_and_honours_an_explicit_key(
    api: ApiServer,
) -> None:
    for command in ("send", "chat"):
        proxy = CuttingProxy(api.port, LOSE_THE_ANSWER)
        proxied = await proxy.start()
        session = f"lost-{command}"
        try:
            if command == "send":
                sent = ("send", "--url", proxied, "--session", session, "--no-stream", "hello")
                code, out, err = await dispach(api, *sent)
                assert code == 0 and out.strip().startswith("t_k"), err
            else:
                chat = ("chat", "--url", proxied, "--session", session)
                code, out, err = await dispach(api, *chat, stdin=b"hello\n/quit\n")
                assert code == 0 and "assistant> " in out and "error" not in err, err
        finally:
            await proxy.stop()
        assert proxy.connections >= 2
        turns = await asyncio.to_thread(session_turns, api, session)
        assert len(turns) == 1 and turns[0]["turnId"].startswith("t_k"), command

    # An explicit key still wins over the default one.
    args = ("send", "--no-stream", "--session", "mine", "--idempotency-key", "mine-1", "hi")
    first = await dispach(api, *args)
    again = await dispach(api, *args)
    assert first[0] == 0 and again[0] == 0, first[2] + again[2]
    assert first[1].strip() == again[1].strip() == keyed_turn_id("assistant", "mine-1")
    assert len(await asyncio.to_thread(session_turns, api, "mine")) == 1


@pytest.mark.asyncio
async def test_cli_cluster_status_prints_the_nodes_partitions_and_singletons(
    api: ApiServer,
) -> None:
    async def settled() -> dict[str, Any]:
        for _ in range(200):  # a node reads its own acquisitions at the next renewal round
            code, out, err = await dispach(api, "cluster", "status", "--json")
            assert code == 0, err
            status: dict[str, Any] = json.loads(out)
            if status["leases"] and all(n["partitions"] for n in status["nodes"]):
                return status
            await asyncio.sleep(0.05)
        raise AssertionError(out)

    status = await settled()
    node = api.node.node_id
    assert status["node"] == node and status["owned"] == list(range(status["partitions"]))
    partitions = [lease for lease in status["leases"] if lease["partition"] is not None]
    assert {lease["node"] for lease in partitions} == {node}
    assert len({lease["epoch"] for lease in partitions}) == status["partitions"]
    assert any(lease["lease"] == "s.scheduler" for lease in status["leases"])
    code, out, err = await dispach(api, "cluster", "status")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(
        f"cluster {status['cluster']}: 1 node(s), {status['partitions']} partitions"
    )
    assert f"  {node}: {status['partitions']} partition(s)" in out
    assert f"  scheduler: held by {node}" in out


@pytest.mark.asyncio
async def test_cli_send_shows_thinking_only_with_reasoning_and_never_as_the_reply(
    api_factory: ApiFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISPACH_TEST_ANTHROPIC_KEY", "test-key")
    api_factory.write_agent("thinker", f"""
id: thinker
model:
  provider: anthropic
  base_url: {fake_anthropic.url}
  api_key_env: DISPACH_TEST_ANTHROPIC_KEY
  max_output_tokens: 4096
  thinking: {{budget_tokens: 2048}}
""")  # fmt: skip
    fake_anthropic.default = Reply(thinking="Weighing the options.", text="Take the train.")
    api = await api_factory.start()
    code, out, err = await dispach(api, "send", "--agent", "thinker", "--reasoning", "how?")
    assert code == 0, err
    assert out.strip() == "Take the train."
    assert "Weighing the options." in err
    code, out, err = await dispach(api, "send", "--agent", "thinker", "how again?")
    assert code == 0, err
    assert out.strip() == "Take the train." and "Weighing" not in err

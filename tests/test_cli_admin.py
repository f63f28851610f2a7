"""``dispach --version``, ``agents``, ``sessions`` and ``approvals`` against a real node: the CLI
runs as a subprocess (as a person runs it), the node on the test's Postgres and NATS."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import pytest

from gateways.http.app import VERSION
from tests.conftest import ApiFactory, ApiServer
from tests.test_client import DISPACH, a_closed_port, dispach

CAREFUL = """
id: careful
model:
  provider: scripted
  script:
    - {{match: "^record (.+)$", tool: record, input: {{path: "{path}", seconds: 0}}}}
tools:
  - name: record
    module: tests.fixtures_tools:record_and_wait
    description: Records that it ran.
    mutating: true
    policy: ask
    input_schema: {{type: object, properties: {{path: {{type: string}}}}, required: [path]}}
  - {{name: calculator, policy: deny}}
limits: {{approval_timeout_s: 60}}
schedules:
  - {{id: nightly, kind: cron, expr: "0 3 * * *", task: sum, deliver: none}}
"""


async def careful(api_factory: ApiFactory, tmp_path: Path) -> ApiServer:
    api_factory.write_agent("careful", CAREFUL.format(path=tmp_path / "ran.txt"))
    return await api_factory.start()


async def ok(api: ApiServer, *args: str) -> str:
    """The CLI's stdout; it must exit 0."""
    code, out, err = await dispach(api, *args)
    assert code == 0, f"{args}: exit {code}\n{err}"
    return out


async def as_json(api: ApiServer, *args: str) -> Any:
    return json.loads(await ok(api, *args, "--json"))


def refused_with(result: tuple[int, str, str], code: str) -> None:
    """A failed command: exit 1, the error's code, message and hint on stderr, nothing on stdout."""
    status, out, err = result
    assert status == 1 and out == "", err
    assert f"Error: {code}: " in err and "\n  hint: " in err, err


def columns(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def test_version_is_the_node_version() -> None:
    shown = subprocess.run(
        [DISPACH, "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    assert shown.returncode == 0 and shown.stdout == f"dispach {VERSION}\n"


@pytest.mark.asyncio
async def test_agents_lists_and_shows_models_tools_policies_schedules_and_limits(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    api = await careful(api_factory, tmp_path)
    listed = await as_json(api, "agents")
    assert [a["id"] for a in listed] == ["assistant", "careful"]
    table = (await ok(api, "agents")).splitlines()
    assert table[0].split() == ["ID", "MODEL", "TOOLS", "CHANNELS"]
    assert [columns(line) for line in table[1:]] == [
        [a["id"], a["model"], str(a["tools"]), "-"] for a in listed
    ]

    shown = await as_json(api, "agents", "show", "careful")
    assert shown["agent"]["id"] == "careful" and shown["agent"]["limits"]
    policies = {t["slug"]: t["policy"] for t in shown["tools"]}
    assert (policies["record"], policies["calculator"]) == ("ask", "deny")
    assert [s["id"] for s in shown["schedules"]] == ["nightly"]
    text = await ok(api, "agents", "show", "careful")
    lines = text.splitlines()
    assert lines[0] == "agent careful (careful), " + shown["agent"]["status"]
    assert lines[1].startswith(f"model {shown['agent']['model']}, max ")
    assert (
        "channels: none" in lines
        and f"tools ({len(policies)}):" in lines
        and "schedules (1):" in lines
    )
    rows = {columns(line)[0]: columns(line)[1:] for line in lines if line.startswith("  ")}
    record = next(t for t in shown["tools"] if t["slug"] == "record")
    assert rows["record"] == ["ask", "yes", f"{record['timeoutS']:g} s", "Records that it ran."]
    assert rows["calculator"][:2] == ["deny", "no"]
    assert rows["nightly"][:3] == ["cron 0 3 * * *", "isolated", "yes"]
    assert "approval_timeout_s=60" in next(line for line in lines if line.startswith("limits: "))


@pytest.mark.asyncio
async def test_failures_print_code_message_and_hint_and_exit_1(api: ApiServer) -> None:
    refused_with(await dispach(api, "agents", "show", "nobody"), "agent_not_found")
    refused_with(await dispach(api, "sessions", "list", "--agent", "nobody"), "agent_not_found")
    refused_with(await dispach(api, "approvals", "list", "--agent", "nobody"), "agent_not_found")
    refused_with(
        await dispach(api, "approvals", "grant", "a_nope", "--agent", "nobody"), "agent_not_found"
    )
    refused_with(
        await dispach(api, "sessions", "show", "--agent", "assistant", "nope"), "session_not_found"
    )
    unreachable = await dispach(api, "agents", "--url", a_closed_port())
    refused_with(unreachable, "server_unreachable")
    assert "dispach serve" in unreachable[2]


async def send(api: ApiServer, session: str, text: str, agent: str = "assistant") -> None:
    await ok(api, "send", "--agent", agent, "--session", session, text)


def turn_ids(messages: list[dict[str, Any]]) -> list[str]:
    """The session's turns, oldest first, from a history page (newest first)."""
    return list(dict.fromkeys(m["turnId"] for m in reversed(messages)))


@pytest.mark.asyncio
async def test_sessions_list_and_show_the_history_turn_by_turn(api: ApiServer) -> None:
    await send(api, "s1", "calculate 6*7")
    await send(api, "s1", "hello")
    await send(api, "s2", "hello")
    listed = await as_json(api, "sessions", "list", "--agent", "assistant")
    assert {s["sessionKey"]: s["turns"] for s in listed} == {"s1": 2, "s2": 1}
    assert [s["sessionKey"] for s in listed] == ["s2", "s1"]  # most recently active first
    assert len(await as_json(api, "sessions", "list", "--agent", "assistant", "--limit", "1")) == 1
    table = (await ok(api, "sessions", "list", "--agent", "assistant")).splitlines()
    assert table[0].split()[:3] == ["KEY", "TURNS", "MESSAGES"]
    s1 = next(s for s in listed if s["sessionKey"] == "s1")
    assert table[2].split()[:3] == ["s1", "2", str(s1["messages"])]
    assert columns(table[2]) == ["s1", "2", str(s1["messages"]), "final", ANY, s1["lastTurnId"]]
    found = await as_json(api, "sessions", "list", "--agent", "assistant", "--search", "S1")
    assert [s["sessionKey"] for s in found] == ["s1"]  # a part of the key, case aside
    ended = ("sessions", "list", "--agent", "assistant", "--status")
    assert len(await as_json(api, *ended, "final")) == 2
    assert await as_json(api, *ended, "error") == []
    refused_with(await dispach(api, *ended, "finished"), "invalid_value")

    shown = await as_json(api, "sessions", "show", "--agent", "assistant", "s1")
    assert shown["session"] == s1
    first, second = turn_ids(shown["messages"])
    assert second == s1["lastTurnId"]
    users = [m["content"] for m in reversed(shown["messages"]) if m["role"] == "user"]
    assert users == ["calculate 6*7", "hello"]
    lines = (await ok(api, "sessions", "show", "--agent", "assistant", "s1")).splitlines()
    assert lines[0] == "session s1  agent assistant"
    assert lines[1].startswith(f"2 turn(s), {s1['messages']} message(s)")
    assert lines.index(f"  turn {first}") < lines.index("    user      calculate 6*7")
    assert lines.index("    user      calculate 6*7") < lines.index(f"  turn {second}")
    assert lines.index(f"  turn {second}") < lines.index("    user      hello")
    assert any("asks for calculator" in line for line in lines)  # the model's call, by name
    assert any(line.strip().startswith("tool") and "42" in line for line in lines)


async def waiting(api: ApiServer, n: int) -> list[dict[str, Any]]:
    """The approvals of every agent once ``n`` wait (listed by the CLI itself)."""
    for _ in range(200):
        found: list[dict[str, Any]] = (await as_json(api, "approvals", "list"))["approvals"]
        if len(found) >= n:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"fewer than {n} approvals waiting")


@pytest.mark.asyncio
async def test_approvals_are_listed_with_their_commands_then_granted_or_denied(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    api = await careful(api_factory, tmp_path)
    ran = tmp_path / "ran.txt"
    sending = asyncio.create_task(dispach(api, "send", "--agent", "careful", "record this"))
    (approval,) = await waiting(api, 1)
    aid, turn_id = approval["approvalId"], approval["turnId"]
    assert (approval["agentId"], approval["slug"]) == ("careful", "record")
    assert (await as_json(api, "approvals", "list", "--agent", "assistant")) == {"approvals": []}
    assert (await as_json(api, "approvals", "list", "--agent", "careful"))["approvals"] == [
        approval
    ]
    grant = f"dispach approvals grant {aid} --agent careful"
    deny = f"dispach approvals deny {aid} --agent careful"
    lines = (await ok(api, "approvals", "list")).splitlines()
    assert lines[0] == f"{aid}  agent careful  session api:default  turn {turn_id}"
    assert lines[1].startswith(f"  tool record ({approval['callId']}, mutating), requested 20")
    assert f"  grant: {grant}" in lines and f"  deny:  {deny}" in lines
    assert approval["args"] == {"path": str(ran), "seconds": 0}  # what the person approves
    assert f'  arguments: {{"path": "{ran}", "seconds": 0}}' in lines
    assert not ran.exists()  # nothing runs before the answer

    assert await ok(api, *grant.split()[1:]) == (f"granted {aid} (agent careful): the call runs\n")
    code, out, err = await sending
    assert code == 0, err
    assert ran.read_text() == "ran\n"  # the call ran, once
    assert (
        f"approval.requested  record ({approval['callId']}, mutating) waits for approval {aid}"
        in err
    )
    assert f"grant: {grant}" in err and f"deny:  {deny}" in err  # the follower says how
    assert f"approval.resolved  record granted by api ({aid})" in err
    refused_with(await dispach(api, *grant.split()[1:]), "approval_not_found")  # answered once
    assert (await as_json(api, "approvals", "list")) == {"approvals": []}

    sending = asyncio.create_task(
        dispach(api, "send", "--agent", "careful", "--session", "s2", "record that")
    )
    (second,) = await waiting(api, 1)
    answer = await as_json(api, "approvals", "deny", second["approvalId"], "--agent", "careful")
    assert answer == {"approvalId": second["approvalId"], "granted": False}
    code, out, err = await sending
    assert code == 0, err
    assert ran.read_text() == "ran\n"  # denied: it did not run again
    turn = (await as_json(api, "turns", "show", second["turnId"]))["turn"]
    assert turn["status"] == "final" and "refused" in turn["text"]
    assert "refused" in out and "record denied by api" in err


@pytest.mark.asyncio
async def test_sessions_fork_copies_the_history_up_to_a_turn(api: ApiServer) -> None:
    await send(api, "s1", "calculate 6*7")
    await send(api, "s1", "hello")
    source = await as_json(api, "sessions", "show", "--agent", "assistant", "s1")
    first, _ = turn_ids(source["messages"])

    forked = await as_json(
        api, "sessions", "fork", "--agent", "assistant", "s1", "--at", "1", "--new-key", "f1"
    )
    assert (forked["agentId"], forked["sessionKey"]) == ("assistant", "f1")
    assert forked["forkedFrom"]["sessionKey"] == "s1" and forked["forkedFrom"]["turnId"] == first
    assert forked["forkedFrom"]["turns"] == 1
    copy = await as_json(api, "sessions", "show", "--agent", "assistant", "f1")
    users = [m["content"] for m in copy["messages"] if m["role"] == "user"]
    assert users == ["calculate 6*7"]
    shown = await ok(api, "sessions", "show", "--agent", "assistant", "f1")
    assert f"forked from assistant/s1 at turn {first}" in shown.splitlines()
    again = await as_json(api, "sessions", "list", "--agent", "assistant")
    assert {s["sessionKey"]: s["turns"] for s in again}["s1"] == 2  # the source is untouched

    text = await ok(
        api, "sessions", "fork", "--agent", "assistant", "s1", "--at", first, "--new-key", "f2"
    )
    assert text.startswith(f"forked assistant/s1 up to turn {first} (1 turn(s), ")
    assert text.rstrip().endswith("into assistant/f2")
    missing = await dispach(api, "sessions", "fork", "--agent", "assistant", "s1", "--at", "9")
    assert missing[0] == 1 and "\n  hint: " in missing[2], missing[2]

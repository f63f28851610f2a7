"""The console shows a handoff as a folded child timeline: in a real headless Chromium against a
real ``dispach serve``, the supervisor's turn shows handoff.start with the member's turn folded
under it; opened, it reads that turn's own events (the member's tool call among them) and its
turn resource."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from playwright.sync_api import Page

from tests import fakes
from tests.fakes import FakeAnthropic, Reply, ToolUse
from tests.test_browser import (  # noqa: F401 - fixtures
    ServeFactory,
    browser,
    serve,
    write_agent,
)
from tests.test_console import (  # noqa: F401 - fixtures
    events_of,
    open_console,
    send,
    shoot,
    wait_ended,
    wait_shown,
)
from tests.test_handoff import member, supervisor

fake_anthropic = fakes.fake_anthropic
pytestmark = pytest.mark.slow


@pytest.mark.timeout(180)
def test_a_handoff_is_a_folded_child_timeline(
    serve: ServeFactory,  # noqa: F811
    fake_anthropic: FakeAnthropic,
    open_console: Callable[..., Page],  # noqa: F811
    tmp_path: Path,
) -> None:
    write_agent(tmp_path, "boss", supervisor(fake_anthropic))
    write_agent(tmp_path, "adder", member(fake_anthropic))
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("handoff", {"member": "adder", "task": "add 2 and 3"})]),
        Reply(tool_uses=[ToolUse("calculator", {"expression": "2 + 3"})]),
        Reply(text='{"total": 5}'),
        Reply(text="The total is 5."),
    )
    node = serve(DISPACH_TEST_ANTHROPIC_KEY="test")
    parent = send(node, "boss", "team", "what is 2 + 3?")
    assert wait_ended(node, "boss", parent)["status"] == "final"
    [start] = [e for e in events_of(node, "boss", parent) if e["type"] == "handoff.start"]
    child = start["data"]["turnId"]

    page = open_console(node, "#/agents/boss/sessions/team")
    wait_shown(page, parent, "handoff.result")
    row = page.locator(f".turn[data-turn-id='{parent}'] [data-type='handoff.start']")
    assert "to adder" in row.inner_text()
    nested = f".turn[data-turn-id='{parent}'] .handoff-child .turn[data-turn-id='{child}']"
    assert page.locator(f"{nested} .turn-body").is_hidden()  # folded until asked for
    result = page.locator(f".turn[data-turn-id='{parent}'] [data-type='handoff.result']")
    assert "adder · ok" in result.inner_text() and "2 steps" in result.inner_text()

    page.click(f"{nested} .toggle")
    page.wait_for_selector(f"{nested} [data-type='tool.call']")
    page.wait_for_selector(f"{nested} [data-type='turn.end']")
    assert "calculator" in page.inner_text(f"{nested} [data-type='tool.call']")
    page.wait_for_function(
        "sel => document.querySelector(sel)?.textContent.includes('final')",
        arg=f"{nested} .turn-head .status",
    )
    child_ids = [e["id"] for e in events_of(node, "adder", child)]
    shown = page.evaluate(
        "sel => [...document.querySelectorAll(`${sel} [data-id]`)].map(e => e.dataset.id)", nested
    )
    assert shown == child_ids  # the member's whole turn, once, in log order
    shoot(page, "handoff")

"""Console defects found trying it as a new user would (issue 37, part 5), each in a real
headless Chromium against a real ``dispach serve`` with the offline scripted model: a slower
earlier view never lands over a newer one; a session's view stops saying it has no turns once
one arrives; a count of one is singular."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, Page, Route

from tests.test_browser import (  # noqa: F401 - fixtures
    ServeFactory,
    ServeNode,
    browser,
    serve,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:  # noqa: F811
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    opened = context.new_page()
    opened.set_default_timeout(30_000)
    opened.on("pageerror", lambda e: errors.append(str(e)))
    yield opened
    context.close()
    assert not errors, errors


def test_a_slow_first_view_never_lands_over_the_view_the_route_moved_to(
    serve: ServeFactory,  # noqa: F811
    page: Page,
) -> None:
    node = serve()
    held: list[Route] = []

    def hold_first(route: Route) -> None:  # the agents list answers only when let go
        if held:
            route.continue_()
        else:
            held.append(route)

    page.route(re.compile(r".*/v1/agents(\?.*)?$"), hold_first)
    page.goto(f"{node.url}/console/#/")
    while not held:
        page.wait_for_timeout(20)
    page.evaluate("location.hash = '#/agents/assistant/sessions/web'")
    page.wait_for_selector("h1:has-text('Session')")
    with page.expect_response(re.compile(r".*/v1/agents$")):
        held[0].continue_()
    page.wait_for_timeout(1000)  # what the agents view does with its answer, it has done
    assert page.inner_text("#view h1") == "Session web"
    assert page.query_selector("#view .live-state") is not None
    assert page.title().startswith("Session web")


def test_a_session_view_stops_saying_it_has_no_turns_once_one_arrives_and_counts_singly(
    serve: ServeFactory,  # noqa: F811
    page: Page,
) -> None:
    node = serve()
    page.goto(f"{node.url}/console/#/agents/assistant/sessions/fresh")
    page.wait_for_selector(".live-state:text('live')")
    page.wait_for_selector("text=No turns yet")
    with node.http() as http:  # from outside the page, as another client would
        accepted = http.post("/v1/agents/assistant/messages",
                             json={"text": "hello", "sessionKey": "fresh"})  # fmt: skip
    assert accepted.status_code == 202, accepted.text
    turn_id = accepted.json()["turnId"]
    page.wait_for_selector(f".turn[data-turn-id='{turn_id}'] [data-type='turn.end']")
    page.wait_for_selector("text=1 turn ·")
    text = page.inner_text("#view")
    assert "No turns" not in text
    # One step, one turn, one message: singular, in the header and in the timeline.
    assert re.search(r"\b1 steps\b|\b1 turns\b|\b1 messages\b", text) is None, text
    assert "1 step ·" in text and "final after 1 step ·" in text
    # The turn's cost (the scripted model is free by the default price table).
    cost = page.wait_for_selector(f".turn[data-turn-id='{turn_id}'] .cost")
    assert cost is not None and cost.inner_text().strip() == "$0.0000 ·"

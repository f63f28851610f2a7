"""What a web page may do to a node (gateways/http/origins.py, gateways/http/auth.py): the Origin
policy on HTTP and WebSocket, CORS for the allowed origins, JSON-only bodies, and the node secret
that signs stream tokens. Requests here are made as a browser would make them (its headers); the
same in a real Chromium is tests/test_browser.py."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from runtime.config import from_env
from runtime.datadir import DataDir
from runtime.errors import ConfigError
from tests.conftest import ApiFactory, ApiServer
from tests.test_api_http import all_turns, client_of, error_of

EVIL = "http://127.0.0.1:9"
"""Another origin on loopback: a page the user happens to have open."""
ALLOWED = "http://localhost:5173"
MESSAGES = "/v1/agents/assistant/messages"


@pytest.mark.asyncio
async def test_a_cross_site_post_is_refused_whatever_its_content_type(api: ApiServer) -> None:
    body = '{"text": "write a file", "sessionKey": "csrf"}'
    async with client_of(api) as http:
        as_text = await http.post(
            MESSAGES, content=body, headers={"Origin": EVIL, "Content-Type": "text/plain"}
        )
        as_json = await http.post(
            MESSAGES, content=body, headers={"Origin": EVIL, "Content-Type": "application/json"}
        )
        null_origin = await http.post(MESSAGES, content=body, headers={"Origin": "null"})
        assert await all_turns(http) == []
    for response in (as_text, as_json, null_origin):
        error_of(response, 403, "origin_not_allowed")


@pytest.mark.asyncio
async def test_a_body_that_is_not_json_is_refused_before_any_route(api: ApiServer) -> None:
    body = '{"text": "hello"}'
    async with client_of(api) as http:
        plain = await http.post(MESSAGES, content=body, headers={"Content-Type": "text/plain"})
        form = await http.post(MESSAGES, data={"text": "hello"})
        undeclared = await http.post(MESSAGES, content=body)
        multipart = await http.post(MESSAGES, files={"text": ("t.txt", b"hello")})
        approval = await http.post(
            "/v1/agents/assistant/approvals/ap_x",
            content='{"granted": true}',
            headers={"Content-Type": "text/plain;charset=utf-8"},
        )
        assert await all_turns(http) == []
        with_charset = await http.post(
            MESSAGES, content=body, headers={"Content-Type": "Application/JSON; charset=utf-8"}
        )
        # A POST without a body needs no content type (stop, run a schedule).
        bodiless = await http.post("/v1/agents/assistant/turns/t_nope/stop")
    for response in (plain, form, undeclared, multipart, approval):
        error_of(response, 415, "content_type_unsupported")
    assert with_charset.status_code == 202, with_charset.text
    error_of(bodiless, 404, "turn_not_found")


@pytest.mark.asyncio
async def test_clients_without_an_origin_and_the_node_s_own_pages_are_unaffected(
    api: ApiServer,
) -> None:
    async with client_of(api) as http:
        curl_like = await http.post(MESSAGES, json={"text": "hello"})
        own = await http.post(MESSAGES, json={"text": "hello"}, headers={"Origin": api.url})
        listed = await http.get("/v1/agents", headers={"Origin": api.url})
        health = await http.get("/v1/health", headers={"Origin": EVIL})
    assert curl_like.status_code == 202 and own.status_code == 202, (curl_like.text, own.text)
    assert listed.status_code == 200
    # Even the open routes refuse a foreign page: it learns nothing, not even that a node runs.
    error_of(health, 403, "origin_not_allowed")


@pytest.mark.asyncio
async def test_a_cross_site_websocket_is_refused_before_the_upgrade(api: ApiServer) -> None:
    with pytest.raises(InvalidStatus) as refused:
        async with connect(api.ws_url, origin=EVIL):  # type: ignore[arg-type]
            pass
    response = refused.value.response
    assert response.status_code == 403
    assert b'"origin_not_allowed"' in response.body
    async with connect(api.ws_url, origin=api.url) as ws:  # type: ignore[arg-type]
        assert b"ws.open" in str(await ws.recv()).encode()


@pytest.mark.asyncio
async def test_cors_lets_an_allowed_origin_read_and_no_other(api_factory: ApiFactory) -> None:
    api = await api_factory.start(allowed_origins=(ALLOWED,))
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, idempotency-key",
    }
    async with client_of(api) as http:
        allowed = await http.options(MESSAGES, headers={"Origin": ALLOWED, **preflight})
        other = await http.options(MESSAGES, headers={"Origin": EVIL, **preflight})
        odd_header = await http.options(
            MESSAGES,
            headers={
                "Origin": ALLOWED,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "x-something",
            },
        )
        posted = await http.post(MESSAGES, json={"text": "hi"}, headers={"Origin": ALLOWED})
        refused = await http.get("/v1/agents/nope", headers={"Origin": ALLOWED})
    assert allowed.status_code == 200, allowed.text
    assert allowed.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert "idempotency-key" in allowed.headers["access-control-allow-headers"].lower()
    error_of(other, 403, "origin_not_allowed")
    assert "access-control-allow-origin" not in other.headers
    error_of(odd_header, 400, "cors_preflight_refused")
    assert posted.status_code == 202
    assert posted.headers["access-control-allow-origin"] == ALLOWED
    # An error is readable by the allowed page too (its envelope says what went wrong).
    error_of(refused, 404, "agent_not_found")
    assert refused.headers["access-control-allow-origin"] == ALLOWED


@pytest.mark.asyncio
async def test_a_405_names_every_method_of_its_path(api: ApiServer) -> None:
    async with client_of(api) as http:
        schedule = await http.post("/v1/agents/assistant/schedules/s1")
        schedules = await http.delete("/v1/agents/assistant/schedules")
        session = await http.post("/v1/agents/assistant/sessions/k")
    error_of(schedule, 405, "method_not_allowed")
    assert set(schedule.headers["allow"].split(", ")) == {"GET", "HEAD", "PUT", "PATCH", "DELETE"}
    assert set(schedules.headers["allow"].split(", ")) == {"GET", "HEAD", "POST"}
    assert set(session.headers["allow"].split(", ")) == {"GET", "HEAD", "DELETE"}


def test_the_node_secret_is_made_once_and_kept_owner_only(tmp_path: Path) -> None:
    first = DataDir(tmp_path / "home").secret()
    again = DataDir(tmp_path / "home").secret()
    assert first == again and len(first) == 32
    mode = stat.S_IMODE(os.stat(tmp_path / "home" / "secret").st_mode)
    assert mode == 0o600
    (tmp_path / "home" / "secret").write_text("not hex\n")
    with pytest.raises(ConfigError) as broken:
        DataDir(tmp_path / "home").secret()
    assert broken.value.field == "DISPACH_SECRET"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("DISPACH_ALLOWED_ORIGINS", "https://console.example.com/app"),
        ("DISPACH_ALLOWED_ORIGINS", "console.example.com"),
        ("DISPACH_ALLOWED_ORIGINS", "*"),
        ("DISPACH_SECRET", "short"),
    ],
)
def test_browser_settings_are_checked_at_start(tmp_path: Path, name: str, value: str) -> None:
    with pytest.raises(ConfigError) as refused:
        from_env({"DISPACH_HOME": str(tmp_path), name: value})
    assert refused.value.field == name


def test_allowed_origins_are_read_as_browsers_write_them(tmp_path: Path) -> None:
    settings = from_env(
        {
            "DISPACH_HOME": str(tmp_path),
            "DISPACH_ALLOWED_ORIGINS": "https://console.example.com, http://[::1]:8080",
        }
    )
    assert settings.allowed_origins == ("https://console.example.com", "http://[::1]:8080")


@pytest.mark.asyncio
async def test_a_node_s_own_origin_follows_its_host_header(api: ApiServer) -> None:
    # localhost:<port> is another origin than 127.0.0.1:<port> to a browser, but a page served
    # by the node under either name carries that same name in its Host header.
    local = api.url.replace("127.0.0.1", "localhost")
    async with httpx.AsyncClient(base_url=local, timeout=30) as http:
        same = await http.get("/v1/agents", headers={"Origin": local})
        cross = await http.get("/v1/agents", headers={"Origin": api.url})
    assert same.status_code == 200
    error_of(cross, 403, "origin_not_allowed")

"""API keys (issue 37, part 1) on one node: minted over the API with a scope and an agent list,
the secret shown once and stored as a salted digest only, each route refusing a scope below the
one it needs (``403 scope_insufficient`` naming it), a revocation refused at once here and, with
no broadcast heard, within the cache's age bound; the boot claim of a fresh token-less node
(a real ``dispach serve``), and the secret nowhere in the log or the events.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from typing import Any

import httpx
import nats.aio.client
import pytest
from websockets.asyncio.client import connect

from eventstore import EventStore
from eventstore import keys as table
from gateways.http import scopes
from gateways.http.keys import MAX_AGE_S, KeyRing, digest, mint, parse
from tests.conftest import ApiFactory, ApiServer, Servers
from tests.test_browser import DISPACH, ServeFactory, serve, write_agent

__all__ = ["serve"]  # a fixture, used by name

TOKEN = "keys-test-token-0123456789"
Json = dict[str, Any]


# --- pure: which scope each route needs; the secret's shape ----------------------------------


@pytest.mark.parametrize(
    ("method", "path", "needed"),
    [
        ("GET", "/v1/agents", "read"),
        ("GET", "/v1/agents/a/turns/t1", "read"),
        ("GET", "/v1/events", "read"),
        ("GET", "/v1/ws", "read"),
        ("POST", "/v1/stream-tokens", "read"),
        ("POST", "/v1/agents/a/messages", "chat"),
        ("POST", "/v1/agents/a/turns/t1/stop", "chat"),
        ("POST", "/v1/agents/a/approvals/ap1", "chat"),
        ("GET", "/v1/mcp", "chat"),
        ("POST", "/v1/mcp", "chat"),
        ("POST", "/v1/agents/a/schedules", "write"),
        ("PUT", "/v1/agents/a/schedules/s1", "write"),
        ("DELETE", "/v1/agents/a/schedules/s1", "write"),
        ("POST", "/v1/agents/a/schedules/s1/run", "write"),
        ("DELETE", "/v1/agents/a/sessions/k", "write"),
        ("DELETE", "/v1/agents/a/sessions/k/messages", "write"),
        ("POST", "/v1/agents/a/sessions/k/phase", "write"),
        ("POST", "/v1/agents/a/sessions/k/fork", "write"),
        ("POST", "/v1/agents/a/reload", "admin"),
        ("GET", "/v1/keys", "admin"),
        ("POST", "/v1/keys", "admin"),
        ("DELETE", "/v1/keys/abc", "admin"),
        ("GET", "/v1/activity", "admin"),
        ("POST", "/v1/some/new/route", "admin"),
    ],
)
def test_each_route_needs_its_scope(method: str, path: str, needed: str) -> None:
    assert scopes.required(method, path) == needed
    rank = scopes.SCOPES.index(needed)
    for i, held in enumerate(scopes.SCOPES):
        assert scopes.allows(held, needed) is (i >= rank)


def test_a_minted_secret_verifies_against_its_row_only() -> None:
    secret, row = mint("ci", "read", None)
    assert secret.startswith("dsp_") and len(secret) == 4 + 16 + 1 + 43
    parsed = parse(secret)
    assert parsed is not None and parsed[0] == row.key_id
    assert digest(row.salt, parsed[1]) == row.digest
    assert secret.encode() not in row.digest + row.salt
    _, row2 = mint("ci", "read", None)
    assert row2.salt != row.salt and digest(row2.salt, parsed[1]) != row2.digest
    assert parse(secret[:-1]) is None and parse("dsp_" + "x" * 60) is None


# --- one node, with an environment token (admin) -----------------------------------------------


async def _mint(api: ApiServer, token: str = TOKEN, **body: Any) -> Json:
    async with httpx.AsyncClient(base_url=api.url, timeout=30) as http:
        r = await http.post("/v1/keys", json={"label": "t", **body},
                            headers={"Authorization": f"Bearer {token}"})  # fmt: skip
    assert r.status_code == 201, r.text
    made: Json = r.json()
    return made


def _as(api: ApiServer, secret: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=api.url, timeout=30, headers={"Authorization": f"Bearer {secret}"}
    )


async def _wait_end(http: httpx.AsyncClient, turn_id: str) -> Json:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = await http.get(f"/v1/turns/{turn_id}")
        if r.status_code == 200 and r.json()["status"] != "running":
            found: Json = r.json()
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"turn {turn_id} did not end")


@pytest.mark.asyncio
async def test_a_read_key_reads_turns_but_cannot_send(api_factory: ApiFactory) -> None:
    api = await api_factory.start(tokens=[TOKEN])
    reader = await _mint(api, scope="read")
    chatter = await _mint(api, scope="chat")
    assert reader["scope"] == "read" and reader["lastUsedAt"] is None
    async with _as(api, chatter["secret"]) as http:
        sent = await http.post("/v1/agents/assistant/messages", json={"text": "hello"})
        assert sent.status_code == 202, sent.text
        turn_id = sent.json()["turnId"]
        await _wait_end(http, turn_id)
        # chat is below write: clearing a session is refused, naming the scope it needs
        cleared = await http.delete(f"/v1/agents/assistant/sessions/{sent.json()['sessionKey']}")
        assert cleared.status_code == 403
        assert cleared.json()["error"]["code"] == "scope_insufficient"
        assert "'write'" in cleared.json()["error"]["message"]
    async with _as(api, reader["secret"]) as http:
        refused = await http.post("/v1/agents/assistant/messages", json={"text": "hello"})
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["code"] == "scope_insufficient" and "'chat'" in error["message"]
        assert error["hint"]
        read = await http.get(f"/v1/agents/assistant/turns/{turn_id}")
        assert read.status_code == 200 and read.json()["turnId"] == turn_id
        listed = await http.get("/v1/agents/assistant/turns")
        assert [t["turnId"] for t in listed.json()["turns"]] == [turn_id]
        assert (await http.get("/v1/keys")).json()["error"]["code"] == "scope_insufficient"
        # the WebSocket: subscribing reads, a message frame acts
        protocols = ["dispach.bearer", reader["secret"]]
        async with connect(api.ws_url, subprotocols=protocols) as ws:
            assert json.loads(await ws.recv())["type"] == "ws.open"
            await ws.send(json.dumps({"type": "message", "agentId": "assistant", "text": "hi"}))
            frame = json.loads(await ws.recv())
            assert frame["type"] == "ws.error" and frame["code"] == "scope_insufficient"
    async with httpx.AsyncClient(base_url=api.url, headers=api.headers) as http:
        keys = (await http.get("/v1/keys")).json()["keys"]
    assert {k["keyId"] for k in keys} == {reader["keyId"], chatter["keyId"]}
    assert all("secret" not in k for k in keys)
    assert all(k["lastUsedAt"] is not None for k in keys), keys  # each was used once
    store = api.node.store
    assert store is not None  # the secrets are in no event of the log
    text = "".join(repr(e) for e in await store.aread_all(limit=10_000))
    assert turn_id in text and reader["secret"] not in text and chatter["secret"] not in text


@pytest.mark.asyncio
async def test_agent_list_and_label_and_unscoped_rules(api_factory: ApiFactory) -> None:
    api_factory.write_agent("other", "id: other\n")
    api = await api_factory.start(tokens=[TOKEN])
    only = await _mint(api, scope="admin", agents=["other"])
    async with _as(api, only["secret"]) as http:
        agents = (await http.get("/v1/agents")).json()
        assert [a["id"] for a in agents] == ["other"]
        hidden = await http.get("/v1/agents/assistant")
        assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "agent_not_found"
        minted = await http.post("/v1/keys", json={"label": "x"})
        assert minted.status_code == 403
        assert minted.json()["error"]["code"] == "keys_need_unscoped_key"
        activity = await http.get("/v1/activity")
        assert activity.json()["error"]["code"] == "activity_needs_unscoped_key"
    async with httpx.AsyncClient(base_url=api.url, headers=api.headers) as http:
        for body, code in [
            ({}, "key_label_required"),
            ({"label": "a\nb"}, "key_label_invalid"),
            ({"label": "x" * 65}, "key_label_invalid"),
            ({"label": "x", "scope": "root"}, "key_scope_invalid"),
            ({"label": "x", "agents": []}, "key_scope_agents_invalid"),
            ({"label": "   "}, "key_label_invalid"),
        ]:
            r = await http.post("/v1/keys", json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == code, (body, r.text)
            assert r.json()["error"]["hint"]
        gone = await http.delete("/v1/keys/0000000000000000")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "key_not_found"


@pytest.mark.asyncio
async def test_a_revoked_key_is_refused_at_once(api_factory: ApiFactory) -> None:
    api = await api_factory.start(tokens=[TOKEN])
    key = await _mint(api, scope="read")
    async with _as(api, key["secret"]) as http:
        assert (await http.get("/v1/agents")).status_code == 200
        async with httpx.AsyncClient(base_url=api.url, headers=api.headers) as admin:
            revoked = await admin.delete(f"/v1/keys/{key['keyId']}")
            again = await admin.delete(f"/v1/keys/{key['keyId']}")
        assert revoked.status_code == 200 and revoked.json()["revokedAt"]
        assert again.json()["revokedAt"] == revoked.json()["revokedAt"]
        refused = await http.get("/v1/agents")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
        forged = key["secret"][:-2] + ("AA" if not key["secret"].endswith("AA") else "BB")
    async with _as(api, forged) as http:
        assert (await http.get("/v1/agents")).status_code == 401


class _NoBroadcast:
    """A key source with the store and no NATS: nothing tells the ring of a revocation."""

    def __init__(self, store: EventStore) -> None:
        self.store: EventStore | None = store
        self.nc: nats.aio.client.Client | None = None


@pytest.mark.asyncio
async def test_a_lost_broadcast_still_expires_within_the_age_bound(
    api_factory: ApiFactory,
) -> None:
    api = await api_factory.start(tokens=[TOKEN])
    store = api.node.store
    assert store is not None
    secret, row = mint("lost", "read", None)
    await table.insert(store, row)
    ring = KeyRing(_NoBroadcast(store), may_open=False)
    assert await ring.verify(secret) is not None
    await table.revoke(store, row.key_id)  # as another node would, its broadcast lost
    revoked_at = time.monotonic()
    while await ring.verify(secret) is not None:
        await asyncio.sleep(0.02)
    assert time.monotonic() - revoked_at <= MAX_AGE_S + 0.1
    await ring.aclose()


# --- a fresh install: no token, no key; the boot claim -----------------------------------------


def _cli(url: str, token: str) -> Any:
    env = {**os.environ, "DISPACH_URL": url, "DISPACH_API_TOKEN": token, "NO_PROXY": "127.0.0.1"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([DISPACH, *args], env=env, capture_output=True, text=True,
                              timeout=60, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done

    return run


def _claim(log: str) -> str:
    for line in log.splitlines():
        if '"first_key_claim"' in line:
            found: str = json.loads(line)["claim"]
            return found
    raise AssertionError(f"no first_key_claim in the log:\n{log[-3000:]}")


def test_the_boot_claim_mints_the_first_admin_key_once(
    serve: ServeFactory, servers: Servers, schema: str, tmp_path: Any
) -> None:
    write_agent(tmp_path, "assistant", "id: assistant\n")
    node = serve()
    claim = _claim(node.output())
    assert claim.startswith("dspc_")
    with httpx.Client(base_url=node.url, timeout=30) as anyone:
        assert anyone.get("/v1/agents").status_code == 200  # open until a key exists
        unclaimed = anyone.post("/v1/keys", json={"label": "first"})
        assert unclaimed.status_code == 401
        assert unclaimed.json()["error"]["code"] == "claim_required"
        claimed = {"Authorization": f"Bearer {claim}"}
        elsewhere = anyone.get("/v1/agents", headers=claimed)
        assert elsewhere.status_code == 403
        assert elsewhere.json()["error"]["code"] == "claim_only_mints_keys"
        narrow = anyone.post("/v1/keys", json={"label": "f", "scope": "read"}, headers=claimed)
        assert narrow.status_code == 400
        first = anyone.post("/v1/keys", json={"label": "first"}, headers=claimed)
        assert first.status_code == 201, first.text
        key = first.json()
        assert key["scope"] == "admin" and key["agents"] is None
        spent = anyone.post("/v1/keys", json={"label": "second"}, headers=claimed)
        assert spent.status_code == 401 and spent.json()["error"]["code"] == "claim_spent"
        closed = anyone.get("/v1/agents")  # the node asks for a credential from now on
        assert closed.status_code == 401 and closed.json()["error"]["code"] == "unauthorized"
        mine = {"Authorization": f"Bearer {key['secret']}"}
        assert anyone.get("/v1/agents", headers=mine).status_code == 200
        sent = anyone.post("/v1/agents/assistant/messages", json={"text": "hi"}, headers=mine)
        assert sent.status_code == 202, sent.text
        cli = _cli(node.url, key["secret"])
        made = cli("keys", "create", "--label", "from-cli", "--scope", "read", "--json")
        minted = json.loads(made.stdout)
        assert minted["scope"] == "read" and minted["secret"].startswith("dsp_")
        listed = cli("keys", "list").stdout
        assert "from-cli" in listed and minted["secret"] not in listed
        assert "revoked" in cli("keys", "revoke", minted["keyId"]).stdout
        read_only = {"Authorization": f"Bearer {minted['secret']}"}
        assert anyone.get("/v1/agents", headers=read_only).status_code == 401
        anyone.delete(f"/v1/keys/{key['keyId']}", headers=mine)
        assert anyone.get("/v1/agents").status_code == 401  # revoking the last key: still closed
    node.stop()
    node.start()  # restarted with a key in the table: no claim is printed again
    assert node.output().count('"first_key_claim"') == 1
    output = node.output()
    assert key["secret"] not in output
    store = EventStore(servers.database_url, schema=schema)
    store.open()
    try:
        everything = "".join(repr(e) for e in store.read_all(limit=100_000))
    finally:
        store.close()
    assert "turn.start" in everything and key["secret"] not in everything

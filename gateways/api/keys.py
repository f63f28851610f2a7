"""API keys (``POST/GET /v1/keys``, ``DELETE /v1/keys/{keyId}``): minted with a label, a scope
(read < chat < write < admin) and an optional agent list; the secret is in the answer to the POST
and nowhere else, ever (the table keeps a salted digest: gateways/http/keys.py). A revocation is
soft (the record stays, ``revokedAt`` set) and reaches every node within a second.

Only an admin whose credential names no agent list manages keys (the Guard checks the scope;
:func:`~gateways.api.common.unrestricted` the list). The boot claim mints the first key, which is
an unrestricted admin: the node closes behind it.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from actors.messages import Refused
from eventstore import StoreError
from eventstore import keys as table
from eventstore.keys import KeyRow
from gateways.api.common import (
    ApiError,
    decode_body,
    read_body,
    store_error,
    store_of,
    unrestricted,
)
from gateways.http.errors import json_response
from gateways.http.keys import KeyRing, mint
from gateways.http.operation import Operation, answer, param
from gateways.http.scopes import SCOPES, Scope

MAX_LABEL = 64
LABEL = r"^[^\x00-\x1f\x7f]*[^\s\x00-\x1f\x7f][^\x00-\x1f\x7f]*$"
"""Printable, not blank."""
NEEDS_UNSCOPED = "keys_need_unscoped_key"


class KeyBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/keys``."""

    label: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_LABEL, pattern=LABEL)]
    scope: Scope = "admin"
    """``read`` (every GET), ``chat`` (+ send, stop, approve), ``write`` (+ schedules, phase,
    clear, fork), ``admin`` (everything). Absent: ``admin``, as the original's absent scope."""
    agents: (
        Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]], msgspec.Meta(min_length=1)]
        | None
    ) = None
    """Only these agents (others answer 404); absent: every agent."""


class KeyInfo(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    key_id: str
    label: str
    scope: str
    agents: list[str] | None
    created_at: str
    last_used_at: str | None
    """Coalesced: written at most once a minute per key and node."""
    revoked_at: str | None


class KeyCreated(KeyInfo, frozen=True, kw_only=True, rename="camel"):
    secret: str
    """``dsp_…``: shown here once, stored nowhere."""


class KeyList(msgspec.Struct, frozen=True, kw_only=True):
    keys: list[KeyInfo]


def info(row: KeyRow) -> KeyInfo:
    return KeyInfo(
        key_id=row.key_id, label=row.label, scope=row.scope,
        agents=None if row.agents is None else list(row.agents),
        created_at=row.created_at.isoformat(),
        last_used_at=None if row.last_used_at is None else row.last_used_at.isoformat(),
        revoked_at=None if row.revoked_at is None else row.revoked_at.isoformat(),
    )  # fmt: skip


def _ring(request: Request) -> KeyRing:
    ring: KeyRing = request.app.state.keys
    return ring


def _refine(field: str | None, text: str) -> Refused | None:
    if field == "label":
        missing = "missing" in text
        return Refused(code="key_label_required" if missing else "key_label_invalid",
                       field="label", message=f"the label does not fit: {text}",
                       hint=f"send a label of 1 to {MAX_LABEL} printable characters, e.g. "
                       '{"label": "ci"}')  # fmt: skip
    if field == "scope":
        return Refused(code="key_scope_invalid", field="scope",
                       message=f"the scope is not one of {', '.join(SCOPES)}: {text}",
                       hint="send scope as read, chat, write or admin")  # fmt: skip
    if field is not None and field.startswith("agents"):
        return Refused(code="key_scope_agents_invalid", field="agents",
                       message=f"agents is not a list of agent ids: {text}",
                       hint='send agents as ids, e.g. ["support"], or leave it out')  # fmt: skip
    return None


def _checked(body: KeyBody, claim: bool) -> tuple[str, tuple[str, ...] | None]:
    """The label and agent list, else the refusal. An agent list may name agents this node
    does not run (yet): it confines the key to them, whatever is loaded later."""
    label = body.label.strip()
    agents = None if body.agents is None else tuple(sorted(set(body.agents)))
    if claim and (body.scope != "admin" or agents is not None):
        raise ApiError(400, "key_scope_invalid",
                       "the boot claim mints an admin key for every agent",
                       "send no scope and no agents; mint narrower keys with the admin key",
                       "scope")  # fmt: skip
    return label, agents


async def create_key(request: Request) -> Response:
    who = unrestricted(request, NEEDS_UNSCOPED, "minting a key")
    if who.anonymous:  # the first key closes an open node: only its operator may mint it
        raise ApiError(401, "claim_required",
                       "minting the first key needs the boot claim this node printed at start",
                       "call with `Authorization: Bearer <claim>` (the node's first_key_claim "
                       "log line), or `dispach keys create --claim <claim>`")  # fmt: skip
    body: KeyBody = decode_body(await read_body(request, 10_000), KeyBody, _refine)
    label, agents = _checked(body, who.claim)
    secret, row = mint(label, body.scope, agents)
    store = store_of(request)
    ring = _ring(request)
    try:
        stored = await (table.insert_first(store, row) if who.claim else table.insert(store, row))
    except StoreError as e:
        raise store_error(e) from e
    if stored is None:  # a key exists already (minted elsewhere since this node started)
        ring.claim_spent = True
        raise ApiError(401, "claim_spent", "a key exists already: the boot claim is void",
                       "sign in with a key, or DISPACH_API_TOKEN")  # fmt: skip
    await ring.changed(stored.key_id, created=True)
    made = info(stored)
    return json_response(KeyCreated(**msgspec.structs.asdict(made), secret=secret), 201)


async def list_keys(request: Request) -> Response:
    unrestricted(request, NEEDS_UNSCOPED, "listing the keys")
    try:
        rows = await table.listed(store_of(request))
    except StoreError as e:
        raise store_error(e) from e
    return json_response(KeyList(keys=[info(r) for r in rows]))


async def revoke_key(request: Request) -> Response:
    unrestricted(request, NEEDS_UNSCOPED, "revoking a key")
    key_id = request.path_params["key_id"]
    try:
        row = await table.revoke(store_of(request), key_id)
    except StoreError as e:
        raise store_error(e) from e
    if row is None:
        raise ApiError(404, "key_not_found", f"no key {key_id!r}",
                       "GET /v1/keys lists the keys and their ids", "keyId")  # fmt: skip
    await _ring(request).changed(key_id)
    return json_response(info(row))


CREATE_KEY = Operation(
    "POST",
    "/v1/keys",
    create_key,
    "Mint a key: label, scope (read < chat < write < admin), agents; the secret is in this "
    "answer only. The boot claim mints the first (admin) key",
    {"201": answer(KeyCreated, "Minted")},
    body=KeyBody,
    errors=("400", "401", "403", "413", "415", "503"),
)
LIST_KEYS = Operation(
    "GET",
    "/v1/keys",
    list_keys,
    "API keys (never their secrets); admin, no agent list",
    {"200": answer(KeyList, "Keys")},
    errors=("401", "403", "503"),
)
REVOKE_KEY = Operation(
    "DELETE",
    "/v1/keys/{key_id}",
    revoke_key,
    "Revoke a key (soft: the record stays); every node refuses it within a second",
    {"200": answer(KeyInfo, "The revoked key")},
    params=[param("key_id", "path", "Key id (`keyId`)")],
    errors=("401", "403", "404", "503"),
)

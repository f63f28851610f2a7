"""API keys as the gateway knows them: minting a secret, verifying a presented one, and what each
node caches of the ``api_keys`` table (eventstore/keys.py).

A secret is ``dsp_<keyId>_<secret>``: 16 hex digits of key id, then 256 random bits
(``secrets.token_urlsafe(32)``). The table keeps HMAC-SHA256 of the secret under a random salt of
its own, never the secret, and the id makes verification one row: read it, recompute, compare in
constant time. The secret is high-entropy, so a fast keyed hash is enough (a slow KDF protects
guessable passwords, which these are not).

Each node caches the rows it read, at most :data:`MAX_AGE_S` old: a revocation (or a minting) is
broadcast over NATS (``<cluster>.keys.changed``) and drops the row at once on every node, and
should a broadcast be lost, the age bound still refuses the revoked key within a second. A key's
``last_used_at`` is written at most once per :data:`TOUCH_EVERY_S` per key and node.

A node with neither a token nor any key prints a boot **claim** (``dspc_…``) at start: held in
this process's memory only, good for one ``POST /v1/keys`` (the first key), void once any key
exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import re
import secrets
import time
from datetime import UTC, datetime
from typing import Protocol

import nats.aio.client
import nats.aio.msg
import nats.errors
import structlog

from eventstore import EventStore, StoreError, subjects
from eventstore import keys as table
from eventstore.keys import KeyRow
from gateways.http.scopes import Scope

log = structlog.get_logger("dispach.keys")

PREFIX = "dsp_"
CLAIM_PREFIX = "dspc_"
MAX_AGE_S = 1.0
"""The oldest cached row a node trusts (the bound on a revocation whose broadcast was lost)."""
TOUCH_EVERY_S = 60.0
MAX_CACHED = 10_000
_SHAPE = re.compile(r"dsp_([0-9a-f]{16})_([A-Za-z0-9_-]{43})")
_CREATED = b"+"
"""The broadcast's payload for "a key was minted" (a node running open must now close)."""


def digest(salt: bytes, secret: str) -> bytes:
    return hmac.new(salt, secret.encode(), hashlib.sha256).digest()


def parse(presented: str) -> tuple[str, str] | None:
    """``(key_id, secret)`` of a well-formed key, else None."""
    found = _SHAPE.fullmatch(presented)
    return (found[1], found[2]) if found else None


def mint(label: str, scope: Scope, agents: tuple[str, ...] | None) -> tuple[str, KeyRow]:
    """A new key: the secret to show once, and the row to store (its salted digest only)."""
    key_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_bytes(16)
    now = datetime.now(UTC)
    row = KeyRow(key_id=key_id, label=label, scope=scope, agents=agents, salt=salt,
                 digest=digest(salt, secret), created_at=now, last_used_at=None,
                 revoked_at=None)  # fmt: skip
    return f"{PREFIX}{key_id}_{secret}", row


class KeySource(Protocol):
    """Where the ring reads its rows and hears changes (the node; None until it is ready)."""

    store: EventStore | None
    nc: nats.aio.client.Client | None


class _Cached:
    __slots__ = ("at", "row")

    def __init__(self, row: KeyRow | None, at: float) -> None:
        self.row, self.at = row, at


class KeyRing:
    """One node's view of the keys (loop-confined: no locks)."""

    def __init__(self, source: KeySource, *, may_open: bool) -> None:
        self._source = source
        self.may_open = may_open
        """Loopback with no token: open to anyone until the first key is minted."""
        self._cache: dict[str, _Cached] = {}
        self._ever: bool | None = None
        self._ever_at = 0.0
        self._touched: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._listening = False
        self.claim: str | None = None
        self.claim_spent = False

    def __repr__(self) -> str:  # the claim stays out of tracebacks
        return f"KeyRing(cached={len(self._cache)})"

    # --- at start ----------------------------------------------------------------------------

    async def start(self, tokens: bool) -> str | None:
        """Listen for changes; with no token and no key ever minted, make the boot claim and
        return it (the caller prints it)."""
        store = self._source.store
        assert store is not None, "the store opens before the keys are read"
        await self._listen()
        state = await table.state(store)
        self._ever, self._ever_at = state.ever, time.monotonic()
        if tokens or state.ever:
            return None
        self.claim = CLAIM_PREFIX + secrets.token_urlsafe(32)
        return self.claim

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)

    # --- the Guard asks ---------------------------------------------------------------------

    async def is_open(self) -> bool:
        """No credential needed: loopback, no token, and no key ever minted (re-read at most
        once a second while it holds; a minting's broadcast closes it at once)."""
        if not self.may_open:
            return False
        store = self._source.store
        if store is None:
            return self._ever is not True  # not ready: the Readiness gate answers 503
        if self._ever is None or (not self._ever and time.monotonic() - self._ever_at > MAX_AGE_S):
            await self._listen()
            at = time.monotonic()
            self._ever, self._ever_at = (await table.state(store)).ever, at
        return not self._ever

    def claim_matches(self, presented: str) -> bool:
        return self.claim is not None and hmac.compare_digest(
            presented.encode(), self.claim.encode()
        )

    async def verify(self, presented: str) -> KeyRow | None:
        """The live key ``presented`` is the secret of, else None. Raises ``StoreError`` when the
        row must be read and cannot be."""
        parsed = parse(presented)
        if parsed is None:
            return None
        key_id, secret = parsed
        now = time.monotonic()
        cached = self._cache.get(key_id)
        if cached is None or now - cached.at > MAX_AGE_S:
            store = self._source.store
            if store is None:
                return None
            await self._listen()
            cached = _Cached(await table.get(store, key_id), now)
            self._remember(key_id, cached)
        row = cached.row
        if row is None or row.revoked_at is not None:
            return None
        if not hmac.compare_digest(digest(row.salt, secret), row.digest):
            return None
        self._touch(row.key_id, now)
        return row

    # --- changes ------------------------------------------------------------------------------

    async def changed(self, key_id: str, *, created: bool = False) -> None:
        """A key was minted or revoked here: forget it, and tell every node to."""
        self._cache.pop(key_id, None)
        if created:
            self._ever = True
            self.claim_spent = True
        nc = self._source.nc
        if nc is None:
            return
        try:
            await nc.publish(subjects.keys_changed(), _CREATED if created else key_id.encode())
        except nats.errors.Error as e:  # the age bound still expires other nodes' copies
            log.warning("keys_broadcast_failed", key_id=key_id, error=str(e))

    async def _listen(self) -> None:
        nc = self._source.nc
        if self._listening or nc is None:
            return
        self._listening = True
        try:
            await nc.subscribe(subjects.keys_changed(), cb=self._on_changed)
        except nats.errors.Error as e:
            self._listening = False
            log.warning("keys_listen_failed", error=str(e))

    async def _on_changed(self, msg: nats.aio.msg.Msg) -> None:
        if msg.data == _CREATED:
            self._ever = True
            self.claim_spent = True
            return
        self._cache.pop(msg.data.decode(errors="replace"), None)

    def _remember(self, key_id: str, cached: _Cached) -> None:
        if len(self._cache) >= MAX_CACHED:  # bounded: drop what is stale, else everything
            stale = [k for k, c in self._cache.items() if cached.at - c.at > MAX_AGE_S]
            for k in stale:
                del self._cache[k]
            if len(self._cache) >= MAX_CACHED:
                self._cache.clear()
        self._cache[key_id] = cached

    def _touch(self, key_id: str, now: float) -> None:
        """Record the key's use, at most once a minute per key on this node, off the request."""
        if now - self._touched.get(key_id, -TOUCH_EVERY_S) < TOUCH_EVERY_S:
            return
        store = self._source.store
        if store is None or len(self._tasks) >= 64:
            return
        if len(self._touched) >= MAX_CACHED:
            self._touched.clear()
        self._touched[key_id] = now
        task = asyncio.get_running_loop().create_task(_touch(store, key_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def _touch(store: EventStore, key_id: str) -> None:
    with contextlib.suppress(StoreError):  # a lost last-use write is the next minute's to make
        await table.touch(store, key_id, datetime.now(UTC))

"""What a node checks of its credentials at start, once the database is open: a public bind on
keys alone needs a live admin key, and a node with neither a token nor a key prints the boot
claim that mints the first one (gateways/http/keys.py)."""

from __future__ import annotations

import structlog

from eventstore import EventStore
from eventstore.keys import state
from gateways.http.keys import KeyRing
from runtime.config import Settings
from runtime.errors import ConfigError

log = structlog.get_logger("dispach.node")


async def check_bind(settings: Settings, store: EventStore) -> None:
    """A public bind without a token (``DISPACH_AUTH=keys``) runs only while a live admin key
    can call it: it is never open, and never without a way in."""
    if settings.loopback or settings.tokens:
        return
    if not (await state(store)).live_admin:
        raise ConfigError(
            f"refusing to listen on {settings.host} on keys alone: the database holds no live "
            "admin key (with no agent list)",
            "mint one first (on a loopback node of this database: dispach keys create --label "
            "ops --claim <the claim it prints>), or set DISPACH_API_TOKEN",
            "DISPACH_AUTH",
        )


async def announce_claim(ring: KeyRing, settings: Settings) -> None:
    """Read the keys; with no token and no key ever minted, print the boot claim (a log line:
    the operator reads it where the node's output goes)."""
    claim = await ring.start(tokens=bool(settings.tokens))
    if claim is not None:
        log.warning(
            "first_key_claim",
            claim=claim,
            hint="no API token and no key yet: `dispach keys create --label <name> --claim "
            "<claim>` (or POST /v1/keys with `Authorization: Bearer <claim>`) mints the first "
            "admin key; the claim is good once, in this process only",
        )

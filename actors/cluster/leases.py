"""The lease bucket: a JetStream key-value bucket whose entries expire after the lease TTL.

A lease is taken with ``create`` (which only succeeds when the key is absent), kept with an
``update`` that names the revision it last wrote (compare-and-set), and given back with a
``delete`` that names it too. The revision of the ``create`` is the lease's **epoch**: JetStream
numbers every write of the bucket in one increasing sequence, so a later owner always holds a
greater epoch than any earlier one (the store's fence relies on it, eventstore/fencing.py).

What a call could not find out (NATS unreachable, a timeout) raises :class:`LeaseUnavailable`;
a lease that is definitely not ours any more answers None.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import msgspec
import nats.aio.client
import nats.errors
import nats.js.api
import nats.js.errors
import structlog

log = structlog.get_logger("dispach.cluster")


class LeaseUnavailable(Exception):
    """The bucket could not be asked (NATS down or slow): nothing is known either way."""


class LeaseValue(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a lease key holds: its holder and epoch; a member key adds whether it drains."""

    node: str
    epoch: int = 0
    draining: bool = False
    started: float = 0.0


@dataclass(frozen=True)
class Entry:
    name: str
    value: LeaseValue
    revision: int
    created: float
    """When the entry was written (the server's clock, seconds since the epoch; 0 unknown)."""


_ENCODE = msgspec.json.Encoder()
_DECODE = msgspec.json.Decoder(LeaseValue)
_UNAVAILABLE = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
    asyncio.TimeoutError,
)


class LeaseBucket:
    def __init__(
        self, nc: nats.aio.client.Client, bucket: str, ttl: float, replicas: int = 1
    ) -> None:
        self._nc = nc
        self._js = nc.jetstream(timeout=max(1.0, ttl / 3))
        self.bucket = bucket
        self.ttl = ttl
        self.replicas = replicas
        self._kv: nats.js.kv.KeyValue | None = None

    async def open(self) -> None:
        """Create the bucket, or bind to it when another node did. Expired entries leave a
        marker, so a watcher would see the expiry (servers before 2.11 lack markers: the bucket
        is then made without them and expiry is only seen by reading)."""
        config = nats.js.api.KeyValueConfig(
            bucket=self.bucket, history=1, ttl=self.ttl, replicas=self.replicas,
            description="Dispach leases: partitions, members and singletons",
        )  # fmt: skip
        try:
            self._kv = await self._js.create_key_value(config)
        except nats.js.errors.BadRequestError as e:
            # It exists with another configuration (another node's TTL, say): use it as it is.
            log.warning("lease_bucket_exists", bucket=self.bucket, error=str(e))
            self._kv = await self._js.key_value(self.bucket)
        except _UNAVAILABLE as e:
            raise LeaseUnavailable(str(e) or type(e).__name__) from e

    @property
    def kv(self) -> nats.js.kv.KeyValue:
        assert self._kv is not None, "open() the bucket first"
        return self._kv

    async def create(self, name: str, value: LeaseValue) -> int | None:
        """Take a free lease: its revision (the epoch), or None when someone holds it."""
        try:
            return await self.kv.create(name, _ENCODE.encode(value))
        except nats.js.errors.KeyWrongLastSequenceError:
            return None
        except _UNAVAILABLE as e:
            raise LeaseUnavailable(str(e) or type(e).__name__) from e
        except nats.js.errors.APIError as e:
            if e.err_code == 10071:  # wrong last sequence, as some servers word it
                return None
            raise LeaseUnavailable(str(e)) from e

    async def renew(self, name: str, value: LeaseValue, revision: int) -> int | None:
        """Keep a lease: its new revision, or None when it is no longer ours (it expired, or
        another node took it since ``revision``)."""
        try:
            return await self.kv.update(name, _ENCODE.encode(value), last=revision)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyNotFoundError):
            return None
        except _UNAVAILABLE as e:
            raise LeaseUnavailable(str(e) or type(e).__name__) from e
        except nats.js.errors.APIError as e:
            if e.err_code == 10071:
                return None
            raise LeaseUnavailable(str(e)) from e

    async def adopt(self, name: str, value: LeaseValue, revision: int) -> int | None:
        """Take over a lease an earlier life of this node held (same node id, so nobody else
        serves it): a compare-and-set on the revision seen, which becomes the new epoch."""
        return await self.renew(name, value, revision)

    async def put(self, name: str, value: LeaseValue) -> int:
        """Write a key only this node writes (its membership heartbeat)."""
        try:
            return await self.kv.put(name, _ENCODE.encode(value))
        except (*_UNAVAILABLE, nats.js.errors.APIError) as e:
            raise LeaseUnavailable(str(e) or type(e).__name__) from e

    async def release(self, name: str, revision: int) -> None:
        """Give a lease back (only if it is still the one we wrote)."""
        with contextlib.suppress(nats.js.errors.APIError, *_UNAVAILABLE):
            await self.kv.delete(name, last=revision)

    async def snapshot(self) -> dict[str, Entry]:
        """Every live entry of the bucket, read now."""
        try:
            watcher = await self.kv.watchall(ignore_deletes=True)
        except _UNAVAILABLE as e:
            raise LeaseUnavailable(str(e) or type(e).__name__) from e
        entries: dict[str, Entry] = {}
        try:
            while True:
                update = await watcher.updates(timeout=max(1.0, self.ttl / 3))  # type: ignore[no-untyped-call]
                if update is None:
                    break
                if update.value is None or update.revision is None:
                    continue
                try:
                    value = _DECODE.decode(update.value)
                except msgspec.DecodeError:
                    log.warning("lease_value_invalid", key=update.key)
                    continue
                created = update.created
                stamp = created.timestamp() if hasattr(created, "timestamp") else 0.0
                entries[update.key] = Entry(update.key, value, update.revision, stamp)
        except _UNAVAILABLE as e:
            raise LeaseUnavailable(str(e) or type(e).__name__) from e
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()  # type: ignore[no-untyped-call]
        return entries

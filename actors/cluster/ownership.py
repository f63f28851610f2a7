"""Ownership: which partitions (and singletons) this node holds, kept by one loop on the event
loop, and the answers the command path and the store ask of it.

The loop renews what it holds every third of the lease TTL, reads the bucket, and carries out
what :func:`actors.cluster.plan.plan` decides. A partition it acquires is *opened* before any
command reaches it: its fence is raised to the lease's epoch in Postgres (from then on no older
owner can append for it) and its unfinished turns are resumed from the log. A partition it hands
over is *closed* between turns: commands for it wait, its sessions finish their running turn
and start no other, then the lease is given back and the next owner opens it. A partition it
*loses* (another node holds the key, or the store refused an append with a stale epoch) is
dropped at once: its session actors stop without appending anything.

Losing contact with NATS does not drop anything by itself: safety comes from the fence (a
paused or cut-off node's appends are refused once a new owner raised it), so a node that merely
cannot renew keeps serving until it learns that another node took over.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec
import nats.aio.client
import nats.errors
import structlog
from prometheus_client import Counter, Gauge

from actors.cluster.leases import Entry, LeaseBucket, LeaseUnavailable, LeaseValue
from actors.cluster.partitions import partition_name, partition_number, partition_of
from actors.cluster.plan import View, plan
from actors.messages import ClusterLease, ClusterNode, ClusterStatus
from eventstore import Metadata, StoreError, subjects
from eventstore.fencing import Fence

log = structlog.get_logger("dispach.cluster")

LEASES_HELD = Gauge("dispach_leases_held", "Partition leases this node holds")
OPENED = Counter(
    "dispach_lease_takeovers_total",
    "Partitions this node took over (fenced at a new epoch, unfinished turns resumed)",
)
LEASES_LOST = Counter(
    "dispach_leases_lost_total", "Partitions this node lost without handing them over"
)
HANDOVERS = Counter("dispach_lease_handovers_total", "Partitions this node handed over")

_FENCED_CATEGORIES = ("turn", "session")


class Sessions(Protocol):
    """What ownership asks of the engine (actors/session/directory.py)."""

    async def resume_partitions(self, partitions: set[int]) -> int: ...

    async def hand_over(self, partition: int, timeout: float) -> None: ...

    def drop_partition(self, partition: int) -> None: ...


class Fences(Protocol):
    async def araise_fences(self, fences: list[Fence]) -> dict[int, int]: ...


@dataclass(frozen=True)
class Held:
    revision: int
    epoch: int


@dataclass(frozen=True)
class Remote:
    node: str


LOCAL = "local"
Route = Remote | str


@dataclass
class Singleton:
    name: str
    start: Callable[[], Awaitable[None]]
    stop: Callable[[], Awaitable[None]]
    running: bool = False


class Ownership:
    def __init__(
        self,
        nc: nats.aio.client.Client,
        node_id: str,
        *,
        partitions: int,
        ttl: float,
        replicas: int = 1,
        handover_seconds: float = 10.0,
    ) -> None:
        self.node_id = node_id
        self.count = partitions
        self.ttl = ttl
        self.interval = ttl / 3
        self.handover_seconds = handover_seconds
        self._nc = nc
        self.bucket = LeaseBucket(nc, subjects.bucket("leases"), ttl, replicas)
        self._sessions: Sessions | None = None
        self._fences: Fences | None = None
        self._held: dict[str, Held] = {}
        self.epochs: dict[int, int] = {}
        """Partitions open here (commands are served) -> their epoch. Read from any thread."""
        self._opening: set[int] = set()
        self._closing: set[str] = set()
        self._inflight: dict[int, int] = {}
        self._entries: dict[str, Entry] = {}
        self._free_since: dict[str, float] = {}
        self._singletons: dict[str, Singleton] = {}
        self._changed = asyncio.Event()
        self._wake = asyncio.Event()
        self._draining = False
        self._stopping = False
        self._started = time.time()
        self._task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._sub: object | None = None
        self.ready = False
        """The bucket was read once: routes are known."""

    # --- set-up ----------------------------------------------------------------------------------

    def singleton(
        self, name: str, start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]
    ) -> None:
        """Run ``start`` while this node holds the singleton lease ``name``, ``stop`` when it
        gives it up. Register before :meth:`start`."""
        self._singletons[f"s.{name}"] = Singleton(f"s.{name}", start, stop)

    def holds(self, name: str) -> bool:
        """This node runs the singleton ``name`` now."""
        found = self._singletons.get(f"s.{name}")
        return found is not None and found.running

    async def start(self, sessions: Sessions, fences: Fences) -> None:
        self._sessions, self._fences = sessions, fences
        deadline = time.monotonic() + max(30.0, 3 * self.ttl)
        while True:  # the bucket may be being created by another node, or NATS be electing
            try:
                await self.bucket.open()
                break
            except LeaseUnavailable as e:
                if time.monotonic() > deadline:
                    raise
                log.warning("lease_bucket_unavailable", error=str(e))
                await asyncio.sleep(0.5)
        self._sub = await self._nc.subscribe(subjects.cluster_changed(), cb=self._on_changed)
        await self._tick()
        self.ready = True
        self._task = asyncio.create_task(self._run(), name="ownership")

    async def drain(self, timeout: float) -> None:
        """Hand every lease over (between turns) and leave the cluster."""
        self._draining = True
        deadline = time.monotonic() + timeout
        self._wake.set()
        while (self._held or self._tasks) and time.monotonic() < deadline:
            await self._wait_changed(deadline)
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            try:
                async with asyncio.timeout(max(1.0, min(self.interval + 5, timeout))):
                    await asyncio.shield(self._task)  # the tick in hand (its renewals) ends
            except TimeoutError:
                self._task.cancel()
        late = list(self._tasks)  # openings and handovers that did not finish in time
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        # Not handed over in time: given up as they are. Without NATS the deletes cannot be
        # made: the leases then expire by themselves (the fence keeps this node out anyway).
        member = self._entries.get(_member(self.node_id))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(1.0, self.interval)):
                await asyncio.gather(*(self._give_up(name) for name in list(self._held)))
                if member is not None:
                    await self.bucket.release(member.name, member.revision)
                await self._announce()
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()  # type: ignore[attr-defined]
        log.info("cluster_left", node=self.node_id, handed_over_in_time=not late)

    # --- questions -------------------------------------------------------------------------------

    def partition(self, agent_id: str, session_key: str) -> int:
        return partition_of(agent_id, session_key, self.count)

    def fence_for(self, stream: str, metadata: Metadata) -> Fence | None:
        """The store's fencing hook: an append to a session's or turn's stream carries the epoch
        under which this node owns the session's partition (0 when it does not own it: the
        store then refuses it once any node has fenced the partition)."""
        if stream.split("-", 1)[0] not in _FENCED_CATEGORIES:
            return None
        if metadata.agent_id is None or metadata.session_key is None:
            return None
        partition = partition_of(metadata.agent_id, metadata.session_key, self.count)
        return Fence(partition, self.epochs.get(partition, 0))

    def epoch_of(self, metadata: Metadata) -> int | None:
        """The epoch under which this node writes the session's turns now (it owns the
        session's partition), or None: the feed's test of whether memory holds a turn whole
        (eventstore/feed.py ``Feed.whole``)."""
        if metadata.agent_id is None or metadata.session_key is None:
            return None
        return self.epochs.get(partition_of(metadata.agent_id, metadata.session_key, self.count))

    def owns(self, partition: int) -> bool:
        """Commands for ``partition`` are served here now (open, not opening or closing)."""
        return (
            partition in self.epochs
            and partition not in self._opening
            and partition_name(partition) not in self._closing
        )

    def owner(self, partition: int) -> str | None:
        entry = self._entries.get(partition_name(partition))
        return entry.value.node if entry is not None else None

    def alive(self, node_id: str) -> bool:
        """Whether ``node_id`` is a live member (its heartbeat has not expired)."""
        return node_id == self.node_id or _member(node_id) in self._entries

    async def route(self, partition: int, deadline: float) -> Route | None:
        """Where a command for ``partition`` goes: :data:`LOCAL`, a :class:`Remote` owner, or
        None when no node serves it before ``deadline`` (monotonic)."""
        while True:
            if self.owns(partition):
                return LOCAL
            owner = self.owner(partition)
            name = partition_name(partition)
            if owner is not None and owner != self.node_id and name not in self._held:
                return Remote(owner)
            if not await self._wait_changed(deadline):
                return None

    @contextlib.asynccontextmanager
    async def serving(self, partition: int):  # type: ignore[no-untyped-def]
        """Hold the partition open while a command is handled here (a handover waits)."""
        self._inflight[partition] = self._inflight.get(partition, 0) + 1
        try:
            yield
        finally:
            left = self._inflight[partition] - 1
            if left:
                self._inflight[partition] = left
            else:
                del self._inflight[partition]
                self._changed.set()

    async def opened(self, deadline: float) -> bool:
        """Wait until every partition this node has taken is open (fenced and resumed), or
        ``deadline`` (monotonic): True when none is still opening."""
        while self._opening:
            if not await self._wait_changed(deadline):
                return False
        return True

    async def changed(self, deadline: float) -> bool:
        """Wait until ownership changes (or ``deadline``): True when it did."""
        return await self._wait_changed(deadline)

    def status(self) -> ClusterStatus:
        """What ``GET /v1/cluster`` shows."""
        now = time.time()
        members: dict[str, ClusterNode] = {}
        partitions: dict[str, list[int]] = {}
        leases = []
        for name, entry in sorted(self._entries.items(), key=lambda kv: _order(kv[0])):
            age_ms = int(max(0.0, now - entry.created) * 1000) if entry.created else None
            holder = entry.value.node
            if name.startswith("n."):
                members[holder] = ClusterNode(id=holder, draining=entry.value.draining,
                                              age_ms=age_ms)  # fmt: skip
                continue
            partition = partition_number(name)
            held = self._held.get(name)
            epoch = held.epoch if held is not None else entry.value.epoch or entry.revision
            leases.append(ClusterLease(lease=name, partition=partition, node=holder,
                                       epoch=epoch, age_ms=age_ms))  # fmt: skip
            if partition is not None:
                partitions.setdefault(holder, []).append(partition)
        for holder in partitions.keys() - members.keys():  # its heartbeat expired first
            members[holder] = ClusterNode(id=holder)
        nodes = [
            msgspec.structs.replace(node, partitions=partitions.get(node.id, []))
            for node in sorted(members.values(), key=lambda n: n.id)
        ]
        return ClusterStatus(
            cluster=subjects.PREFIX, node=self.node_id, partitions=self.count, ttl_s=self.ttl,
            owned=sorted(p for p in self.epochs if self.owns(p)), draining=self._draining,
            nodes=nodes, leases=leases,
        )  # fmt: skip

    # --- the loop --------------------------------------------------------------------------------

    async def _run(self) -> None:
        # Ends when ``_stopping`` is set, not by cancellation: Python 3.11's wait_for can
        # swallow a cancel that lands as its wait completes, and this loop would then run on.
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._wake.wait()
            self._wake.clear()
            if self._stopping:
                return
            try:
                await self._tick()
            except Exception:  # a bug must not stop the renewals
                log.exception("ownership_tick_failed")

    async def _tick(self) -> None:
        await self._renew()
        try:
            self._entries = await self.bucket.snapshot()
        except LeaseUnavailable as e:
            log.warning("lease_read_failed", error=str(e))
            return
        for name, held in list(self._held.items()):
            entry = self._entries.get(name)
            if entry is not None and entry.value.node != self.node_id:
                await self._lose(name, f"held by {entry.value.node}")
            elif entry is not None and entry.revision > held.revision:
                self._held[name] = Held(entry.revision, held.epoch)
        self._changed.set()
        now = time.monotonic()
        for name in [n for n in self._wanted() if n not in self._entries]:
            self._free_since.setdefault(name, now)
        for name in [n for n in self._free_since if n in self._entries]:
            del self._free_since[name]
        orphans = frozenset(
            n for n, since in self._free_since.items() if now - since > 2 * self.interval
        )
        members = {
            e.value.node for n, e in self._entries.items() if n.startswith("n.")
            and not e.value.draining
        }  # fmt: skip
        if not self._draining:
            members.add(self.node_id)
        view = View(
            me=self.node_id,
            members=frozenset(members),
            holders={n: e.value.node for n, e in self._entries.items() if not n.startswith("n.")},
            wanted=frozenset(self._wanted()),
            held=frozenset(self._held),
            # A partition still opening is not handed over until it is open.
            releasing=frozenset(self._closing) | {partition_name(p) for p in self._opening},
            orphans=orphans,
            draining=self._draining,
        )
        decided = plan(view)
        if decided.acquire:
            await self._acquire(decided.acquire)
        for name in decided.release:
            self._closing.add(name)
            self._spawn(self._release(name))
        LEASES_HELD.set(sum(1 for n in self._held if n.startswith("p.")))

    def _wanted(self) -> list[str]:
        return [partition_name(p) for p in range(self.count)] + list(self._singletons)

    async def _renew(self) -> None:
        member = _member(self.node_id)
        value = LeaseValue(node=self.node_id, draining=self._draining, started=self._started)
        try:
            revision = await self.bucket.put(member, value)
            self._entries[member] = Entry(member, value, revision, time.time())
        except LeaseUnavailable as e:
            log.warning("heartbeat_failed", error=str(e))
        names = list(self._held)
        results = await asyncio.gather(*(self._renew_one(n) for n in names))
        for name, result in zip(names, results, strict=True):
            if result is False:
                await self._lose(name, "lease expired or taken")

    async def _renew_one(self, name: str) -> bool | None:
        """True renewed, False lost, None unknown (NATS unavailable)."""
        held = self._held.get(name)
        if held is None:
            return True
        value = LeaseValue(node=self.node_id, epoch=held.epoch)
        try:
            revision = await self.bucket.renew(name, value, held.revision)
        except LeaseUnavailable:
            return None
        if revision is None:
            return False
        current = self._held.get(name)
        if current is held:
            self._held[name] = Held(revision, held.epoch)
        elif current is None:
            # Given back (or lost) while this renewal was on its way: the renewal came first,
            # so the delete of the revision it replaced was refused. Give back the new one, or
            # the lease stays taken, by no one, until it expires.
            await self.bucket.release(name, revision)
        return True

    async def _acquire(self, names: frozenset[str]) -> None:
        if self._draining:  # began draining while this tick read the bucket
            return
        value = LeaseValue(node=self.node_id)
        ordered = sorted(names)

        async def take(name: str) -> int | None:
            earlier = self._entries.get(name)
            if earlier is not None and earlier.value.node == self.node_id:
                return await self.bucket.adopt(name, value, earlier.revision)
            return await self.bucket.create(name, value)

        results = await asyncio.gather(*(take(n) for n in ordered), return_exceptions=True)
        opened: dict[int, int] = {}
        for name, result in zip(ordered, results, strict=True):
            if isinstance(result, BaseException) or result is None:
                continue
            self._held[name] = Held(result, result)
            self._entries[name] = Entry(name, LeaseValue(node=self.node_id, epoch=result), result,
                                        time.time())  # fmt: skip
            partition = partition_number(name)
            if partition is not None:
                opened[partition] = result
            elif name in self._singletons:
                self._spawn(self._start_singleton(self._singletons[name]))
        if opened:
            self._opening.update(opened)
            self._spawn(self._open(opened))

    async def _open(self, opened: dict[int, int]) -> None:
        """Fence, then resume: a command reaches these partitions only after both."""
        assert self._fences is not None and self._sessions is not None
        delay = 0.1
        while True:
            live = {p: e for p, e in opened.items() if self._held.get(partition_name(p))}
            if not live:
                return
            try:
                current = await self._fences.araise_fences([Fence(p, e) for p, e in live.items()])
                break
            except StoreError as e:
                log.warning("fence_raise_failed", error=e.message, partitions=len(live))
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.interval)
        stale = {p for p, e in live.items() if current.get(p, e) > e}
        for partition in stale:  # a later epoch is already fenced: this lease is not ours
            await self._lose(partition_name(partition), "a later epoch holds the fence")
        fresh = {p: e for p, e in live.items() if p not in stale}
        # Appends of the resumed turns carry the new epoch; commands still wait (opening).
        self.epochs.update(fresh)
        delay = 0.1
        while True:
            try:
                resumed = await self._sessions.resume_partitions(set(fresh))
                break
            except StoreError as e:  # the turns stay unfinished in the log: try again
                log.warning("resume_failed", error=e.message, partitions=len(fresh))
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.interval)
        self._opening.difference_update(live)
        OPENED.inc(len(fresh))
        await self._announce()  # nodes holding commands for these partitions route them now
        if fresh:
            log.info("partitions_opened", count=len(fresh), turns_resumed=resumed,
                     epochs=f"{min(fresh.values())}..{max(fresh.values())}")  # fmt: skip
        self._changed.set()

    async def _release(self, name: str) -> None:
        """Hand a lease over: wait for the commands in hand and the running turns, then give
        it back and tell the other nodes at once."""
        assert self._sessions is not None
        deadline = time.monotonic() + self.handover_seconds
        partition = partition_number(name)
        try:
            if partition is not None:
                self._changed.set()
                while self._inflight.get(partition) and time.monotonic() < deadline:
                    await self._wait_changed(deadline)
                await self._sessions.hand_over(partition, max(0.0, deadline - time.monotonic()))
                self.epochs.pop(partition, None)
                HANDOVERS.inc()
            elif name in self._singletons:
                await self._stop_singleton(self._singletons[name])
            held = self._held.pop(name, None)
            if held is not None:
                await self.bucket.release(name, held.revision)
                self._entries.pop(name, None)
        finally:
            self._closing.discard(name)
            self._changed.set()
        await self._announce()

    async def _give_up(self, name: str) -> None:
        partition = partition_number(name)
        if partition is not None and self._sessions is not None:
            self.epochs.pop(partition, None)
            self._sessions.drop_partition(partition)
        elif name in self._singletons:
            await self._stop_singleton(self._singletons[name])
        held = self._held.pop(name, None)
        if held is not None:
            await self.bucket.release(name, held.revision)

    async def _lose(self, name: str, why: str) -> None:
        """The lease is not ours any more: stop serving it now (nothing is appended)."""
        if self._held.pop(name, None) is None:
            return
        partition = partition_number(name)
        log.warning("lease_lost", lease=name, reason=why)
        if partition is not None:
            LEASES_LOST.inc()
            self.epochs.pop(partition, None)
            self._opening.discard(partition)
            if self._sessions is not None:
                self._sessions.drop_partition(partition)
        elif name in self._singletons:
            await self._stop_singleton(self._singletons[name])
        self._changed.set()
        self._wake.set()

    def fenced(self, partition: int) -> None:
        """The store refused an append for ``partition`` with a stale epoch (on the loop)."""
        name = partition_name(partition)
        if name in self._held:
            self._spawn(self._lose(name, "the store refused a stale epoch"))

    async def _start_singleton(self, singleton: Singleton) -> None:
        if not singleton.running:
            singleton.running = True
            log.info("singleton_acquired", lease=singleton.name)
            try:
                await singleton.start()
            except Exception:
                log.exception("singleton_start_failed", lease=singleton.name)

    async def _stop_singleton(self, singleton: Singleton) -> None:
        if singleton.running:
            singleton.running = False
            log.info("singleton_released", lease=singleton.name)
            try:
                await singleton.stop()
            except Exception:
                log.exception("singleton_stop_failed", lease=singleton.name)

    # --- plumbing --------------------------------------------------------------------------------

    def _spawn(self, work: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _wait_changed(self, deadline: float) -> bool:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        self._changed.clear()
        try:
            async with asyncio.timeout(min(left, self.interval)):
                await self._changed.wait()
        except TimeoutError:
            return time.monotonic() < deadline
        return True

    async def _announce(self) -> None:
        """A lease was given back: the other nodes read the bucket now, not at their tick."""
        with contextlib.suppress(nats.errors.Error):
            await self._nc.publish(subjects.cluster_changed(), self.node_id.encode())

    async def _on_changed(self, msg: object) -> None:
        self._wake.set()


def _order(name: str) -> tuple[int, int, str]:
    """Partitions in number order, then singletons, then members."""
    partition = partition_number(name)
    if partition is not None:
        return (0, partition, name)
    return (1 if name.startswith("s.") else 2, 0, name)


def _member(node_id: str) -> str:
    return f"n.{subjects.token(node_id)}"

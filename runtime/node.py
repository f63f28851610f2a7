"""A Dispach node: embedded or external Postgres and NATS, the event store, projection runners,
the actor host, and the HTTP gateway, started in order and drained in reverse."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import msgspec
import nats
import nats.aio.client
import nats.errors
import pykka
import structlog

from actors import tracing
from actors.actor import ask
from actors.agent import Agent
from actors.budget import Budget, Budgets
from actors.channels import ChannelHost
from actors.cluster.activity import Activity, node_activity
from actors.cluster.commands import Commands
from actors.cluster.ownership import Ownership
from actors.handoff import Handoffs
from actors.host import ActorHost
from actors.messages import ClusterStatus, NodeActivity, Refused
from actors.outbox import Channel
from actors.outbox.actor import DRAIN, KICK, OutboxActor
from actors.schedule.actor import CLOCK_ON, SchedulerActor
from actors.session.directory import SessionDirectory
from actors.tools import LiveSources, ToolSource
from eventstore import (
    ASYNC,
    INLINE,
    EventStore,
    NatsHints,
    ProjectionRunner,
    RecordedEvent,
    subjects,
)
from eventstore.archive import Retention
from eventstore.bridge import Portal, blocking
from eventstore.catalogue import DeliveryEnqueued, WebhookCreated
from eventstore.feed import Feed
from eventstore.retention import RetentionTask
from gateways.api.common import AgentChange
from gateways.api.schemas import AgentDetail, AgentState, SkillList
from gateways.http.app import VERSION
from gateways.http.keys import KeyRing
from gateways.http.readiness import CLUSTER, NATS, POSTGRES, PROJECTIONS
from gateways.ingress import Ingress
from gateways.toolsources import KINDS
from runtime import credentials, manifest, skills, teams, webhooks
from runtime.config import Settings, nats_servers
from runtime.details import agent_detail
from runtime.embedded import EmbeddedServices
from runtime.lifecycle import Lifecycle
from runtime.logs import redact_url

log = structlog.get_logger("dispach.node")


SOURCES_START_SECONDS = 10.0
"""How long a node's start waits for each live tool source (an MCP server) to list its tools;
a slower one's tools join its agents when it is up."""


class Node:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.node_id = settings.node_id
        self.services = EmbeddedServices(settings.home, settings.database_url, settings.nats_url)
        self.actors = ActorHost()
        self.store: EventStore | None = None
        self.nc: nats.aio.client.Client | None = None
        self._hints: NatsHints | None = None
        self._hints_nc: nats.aio.client.Client | None = None
        self._portal: Portal | None = None
        self.agents: dict[str, Agent] = {}
        self._manifests: dict[str, manifest.Manifest] = {}
        self._texts: dict[str, str] = {}
        """Each agent's manifest text as the node loaded it (a reload records the one it
        replaces)."""
        self.lifecycle: Lifecycle | None = None
        """Reload, stop and start of the agents, on every node (runtime/lifecycle.py)."""
        self._env: dict[str, str] = {}
        self.sources: dict[str, LiveSources] = {}
        """The live tool sources the manifests declare, by kind (``mcp_servers``); a kind no
        manifest declares is not opened (nor its SDK imported)."""
        self.handoffs = Handoffs()
        """What the supervisors' handoff tools reach (the log, the command path), bound at
        start."""
        self.engine: SessionDirectory | None = None
        self.feed: Feed | None = None
        self._details: dict[str, AgentDetail] = {}
        self.ownership: Ownership | None = None
        self.commands: Commands | None = None
        self._tracing: tracing.Tracing | None = None
        self._ingress: Ingress | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._announcing: set[asyncio.Task[None]] = set()
        """Commit hints and outbox kicks being published (see _on_commit)."""
        self._outbox: pykka.ActorRef[Any] | None = None
        self.scheduler: pykka.ActorRef[Any] | None = None
        self.activity: Activity | None = None
        self.keyring: KeyRing | None = None
        """The gateway's keys (set by :func:`serve`): read at start, for the boot claim."""
        self._phase = "starting"
        self._started = time.monotonic()
        self.accept_timeout = settings.accept_timeout_seconds
        self.prices = settings.prices
        """The price table usage is costed with (actors/prices.py)."""
        self.webhook_policy = settings.webhook_policy  # the API checks targets against it
        self._webhooks: webhooks.Webhooks | None = None  # event webhooks: channel and fan-out

    # --- gateways.Runtime (read by the gateway) ------------------------------------------------

    def agent_details(self) -> dict[str, AgentDetail]:
        supervisors = teams.supervisors({a: d.members for a, d in self._details.items()})
        return {a: self._shown(d, supervisors.get(a)) for a, d in self._details.items()}

    def agent_detail(self, agent_id: str) -> AgentDetail | None:
        # Asked for every request that names an agent: this agent's view alone.
        detail = self._details.get(agent_id)
        if detail is None:
            return None
        supervisors = teams.supervisors({a: d.members for a, d in self._details.items()})
        return self._shown(detail, supervisors.get(agent_id))

    def _shown(self, detail: AgentDetail, supervisors: list[str] | None) -> AgentDetail:
        """An agent as the API shows it: its teams, whether it is stopped and the version new
        turns run, and what its tool sources warn of."""
        agent_id = detail.id
        changes: dict[str, Any] = {}
        if supervisors:
            changes["member_of"] = supervisors
        if self.lifecycle is not None:
            changes.update(self.lifecycle.shown(agent_id))
        if self.sources and agent_id in self._manifests:
            down = [w for live in self.sources.values() for w in live.warnings(agent_id)]
            if down:
                changes["warnings"] = [*detail.warnings, *down]
        return msgspec.structs.replace(detail, **changes) if changes else detail

    def skills(self, agent_id: str) -> SkillList | None:
        agent = self.agents.get(agent_id)
        return skills.listed(agent) if agent is not None else None

    def channel(self, agent_id: str, channel_id: str) -> Channel | None:
        if not agent_id and channel_id == webhooks.CHANNEL:  # no agent's: the subscriptions'
            return None if self._webhooks is None else self._webhooks.channel
        agent = self.agents.get(agent_id)
        return agent.channels.get(channel_id) if agent is not None else None

    async def change_agent(
        self, kind: AgentChange, agent_id: str, by: str, reason: str | None
    ) -> AgentState | Refused:
        if self.lifecycle is None:
            return Refused(code="not_ready", message="the node is not ready yet",
                           hint="retry shortly; GET /v1/ready says when")  # fmt: skip
        return await self.lifecycle.change(kind, agent_id, by, reason)

    def cluster_status(self) -> ClusterStatus | None:
        if self.ownership is None or not self.ownership.ready:
            return None
        return self.ownership.status()

    def uptime_ms(self) -> int:
        return int((time.monotonic() - self._started) * 1000)

    def readiness(self) -> tuple[bool, str, dict[str, bool]]:
        # Asked by the gateway for every request (gateways/http/readiness.py): attribute reads only.
        checks = {
            POSTGRES: self.store is not None and self.store.health.up,
            NATS: self.nc is not None
            and self.nc.is_connected
            and self._hints_nc is not None
            and self._hints_nc.is_connected,
            PROJECTIONS: bool(self._tasks) and not any(t.done() for t in self._tasks),
            CLUSTER: self.ownership is not None and self.ownership.ready,
        }
        return self._phase == "ready" and all(checks.values()), self._phase, checks

    def warnings(self) -> list[str]:
        held = self.store.health.held if self.store is not None else []
        return [f"a {h.describe()} holds the log back: {h.effect}" for h in held]

    # --- lifecycle -----------------------------------------------------------------------------

    def _fence_by(self, ownership: Ownership, store: EventStore, feed: Feed) -> None:
        """Appends to sessions and turns go under the partition's epoch, a refusal tells the
        ownership, and the feed knows under which epoch it remembered each turn."""
        portal = self._portal
        assert portal is not None, "the node is starting"
        store.fencing = ownership.fence_for
        store.on_fenced = lambda partition: portal.call_soon(ownership.fenced, partition)
        feed.owner_of = ownership.epoch_of  # a running turn's resource from memory, while whole

    async def _connect(self, nats_url: str, *, hints: bool = False) -> nats.aio.client.Client:
        """The node's NATS connection, or (``hints``) its second one, ``no_echo``, for commit
        hints: other nodes' arrive, this node's own commits wake its readers directly."""
        if hints:
            return await nats.connect(
                servers=nats_servers(nats_url), name=f"dispach-{self.node_id}-hints",
                no_echo=True, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                error_cb=_nats_error,
            )  # fmt: skip
        return await nats.connect(
            servers=nats_servers(nats_url), name=f"dispach-{self.node_id}",
            max_reconnect_attempts=-1, reconnect_time_wait=0.5, error_cb=_nats_error,
            disconnected_cb=self._nats_disconnected, reconnected_cb=_nats_reconnected,
        )  # fmt: skip

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._portal = Portal(loop)
        self._tracing = tracing.configure(self.node_id)  # on when an OTLP endpoint is set
        subjects.use(self.settings.cluster)
        if self.services.needed:
            await blocking(self.services.start)
        database_url, nats_url = self.services.database_url, self.services.nats_url
        assert database_url is not None and nats_url is not None
        self.nc = await self._connect(nats_url)
        store = EventStore(
            database_url,
            schema=self.settings.schema,
            inline=INLINE,
            on_commit=self._on_commit,
            pool_size=self.settings.pool_size,
            writer_queue=self.settings.writer_queue,
        )
        # Commit hints travel on a connection of their own with no_echo: other nodes' hints
        # arrive, this node's own commits wake its readers directly (see _on_commit).
        self._hints_nc = await self._connect(nats_url, hints=True)
        self._hints = NatsHints(self._hints_nc, store.hints)
        await self._hints.start()
        applied = await store.aopen()
        self.store = store
        await credentials.check_bind(self.settings, store)
        feed = await self._start_readers(store)
        await self._load_agents()
        self.engine = SessionDirectory(
            store, self.agents, self._portal, self.actors, self.node_id,
            idle_seconds=self.settings.session_idle_seconds,
            max_sessions=self.settings.max_sessions,
            partitions=self.settings.partitions,
        )  # fmt: skip
        ownership = Ownership(
            self.nc, self.node_id,
            partitions=self.settings.partitions,
            ttl=self.settings.lease_ttl_seconds,
            replicas=self.settings.replicas,
            handover_seconds=self.settings.drain_seconds,
        )  # fmt: skip
        self.ownership = ownership
        self._fence_by(ownership, store, feed)
        await self._start_lifecycle(store, self.engine)
        self.commands = Commands(
            self.engine, ownership, self.nc,
            wait_seconds=min(self.accept_timeout, self.settings.lease_ttl_seconds + 2),
            admit=Budgets(store, self.prices, self._budget_of).admit,
        )  # fmt: skip
        await self.commands.listen()
        self.handoffs.bind(store, self.commands)  # before any turn runs or resumes
        self._ingress = Ingress(self.nc, set(self.agents), self.commands)
        self.scheduler = self.actors.start(SchedulerActor, self.engine, self.commands)
        scheduler = self.scheduler
        ownership.singleton(
            "scheduler",
            lambda: _tell(scheduler, CLOCK_ON),
            lambda: _settle(scheduler, DRAIN, self.settings.drain_seconds),
        )
        if self.settings.retention_turns_days is not None:  # one node archives (retention.py)
            keeper = RetentionTask(
                store.conninfo, store.schema, Retention(
                    self.settings.retention_turns_days,
                    self.settings.retention_keep_sessions_active,
                ), self.settings.archives_path,
            )  # fmt: skip
            ownership.singleton("retention", keeper.start, keeper.stop)
        for agent in self.agents.values():
            host = ChannelHost(self.engine, self.commands, agent.id)
            for channel in agent.channels.values():
                if channel.singleton is None:
                    await channel.start(host)
                else:  # its inbound runs on one node at a time (a bot's long poll)
                    ownership.singleton(
                        channel.singleton,
                        functools.partial(channel.start, host),
                        channel.stop,
                    )
        self._webhooks = webhooks.start(self.settings, store, feed, ownership)
        # Partitions are opened (fenced, their unfinished turns resumed) as their leases come.
        await ownership.start(self.engine, store)
        # The outbox recovers in-doubt items before it sends anything, once the members are
        # known (an attempt of a live member is not in doubt).
        self._outbox = self.actors.start(
            OutboxActor, self._portal, store, self.channel, self.node_id, ownership.alive,
            poll_s=self.settings.outbox_poll_seconds,
            recover_every_s=max(5.0, self.settings.lease_ttl_seconds),
        )  # fmt: skip
        await self._hints_nc.subscribe(subjects.outbox_all(), cb=self._on_kick)
        await self._ingress.start()
        self._tasks.append(asyncio.create_task(self.engine.passivate_idle(), name="passivate"))
        await self._answer_for_access()
        self._phase = "ready"
        log.info(
            "node_ready",
            node=self.node_id,
            postgres=redact_url(database_url),
            postgres_embedded=self.settings.embedded_postgres,
            nats=redact_url(nats_url),
            nats_embedded=self.settings.embedded_nats,
            schema=self.settings.schema,
            migrations_applied=applied,
            agents=sorted(self.agents),
            cluster=self.settings.cluster,
            partitions_owned=len(ownership.epochs),
            startup_ms=self.uptime_ms(),
        )

    async def _start_readers(self, store: EventStore) -> Feed:
        """The store's probe, the asynchronous projections' runners and the feed, as tasks of
        the node; the feed once it is ready."""
        self._tasks.append(asyncio.create_task(store.probe(), name="postgres-probe"))
        for projection in ASYNC:
            runner = ProjectionRunner(store, projection)
            self._tasks.append(asyncio.create_task(runner.run(), name=f"projection-{runner.name}"))
        feed = Feed(store)
        self._tasks.append(asyncio.create_task(feed.run(), name="feed"))
        await feed.ready()
        self.feed = feed
        return feed

    async def _answer_for_access(self) -> None:
        """Answer ``GET /v1/activity``'s gathering; read the keys (and print the boot claim)."""
        assert self.nc is not None
        self.activity = Activity(self.nc, self._activity)
        await self.activity.listen()
        if self.keyring is not None:
            await credentials.announce_claim(self.keyring, self.settings)

    async def _close_access(self) -> None:
        if self.activity is not None:
            await self.activity.close()
        if self.keyring is not None:
            await self.keyring.aclose()

    async def _activity(self) -> NodeActivity:
        engine, store, ownership = self.engine, self.store, self.ownership
        assert engine is not None and store is not None and ownership is not None
        return await node_activity(self.node_id, set(engine.running), store,
                                   ownership.holds("scheduler"))  # fmt: skip

    async def _start_lifecycle(self, store: EventStore, engine: SessionDirectory) -> None:
        """Each agent's lifecycle folded from the log before any door opens or any turn
        resumes: a stopped agent stays stopped across restarts."""
        assert self.nc is not None
        self.lifecycle = Lifecycle(store, self.nc, engine, self.node_id,
                                   self.settings.agents_path, self._build, self._swap,
                                   self._build_old)  # fmt: skip
        for agent in self.agents.values():
            self.lifecycle.keep(agent, self._texts.get(agent.id))
        await self.lifecycle.start()

    async def _load_agents(self) -> None:
        """Read the manifests, check the tool sources they declare and start them (waiting a
        bounded time for each to list its tools), then build the agents: before any turn is
        resumed, so a resumed turn finds the tools it was using."""
        self._env = dict(os.environ)
        reads = await blocking(manifest.load_sources, self.settings.agents_path)
        self._manifests = {agent_id: read.manifest for agent_id, read in reads.items()}
        self._texts = {agent_id: read.text for agent_id, read in reads.items()}
        # Every declaration is checked before any source starts.
        declared = {
            kind: {a: kind.declare(a, getattr(m, kind.key), self._env)
                   for a, m in self._manifests.items()}
            for kind in KINDS
        }  # fmt: skip
        for kind, by_agent in declared.items():
            if any(by_agent.values()):
                self.sources[kind.key] = kind.open(by_agent, VERSION, self._sources_changed)
        await asyncio.gather(*(live.start(SOURCES_START_SECONDS) for live in self.sources.values()))
        self.agents = await blocking(lambda: {
            agent_id: self._build(read) for agent_id, read in reads.items()
        })  # fmt: skip
        self._details = {a.id: agent_detail(a) for a in self.agents.values()}
        assert self.store is not None, "the store opens before the agents load"
        for agent in self.agents.values():  # the versions of the skills this node ranks
            await skills.index(self.store, agent)

    def _budget_of(self, agent_id: str) -> Budget | None:
        agent = self.agents.get(agent_id)
        return agent.budget if agent is not None else None

    def _build(self, read: manifest.Read) -> Agent:
        """An agent from its manifest, with this node's environment and live sources (blocking:
        at start, or on a thread for a reload)."""
        m = read.manifest
        members = teams.members_of({**self._manifests, m.id: m})
        return manifest.build(m, self._env, self._sources_of(m.id),
                              recall=skills.load(m, self.settings.agents_path),
                              addressable=teams.addressable(m, members),
                              version=read.version)  # fmt: skip

    def _swap(self, agent: Agent, read: manifest.Read) -> tuple[Agent, list[str]]:
        """A reloaded agent in place for new turns (sessions read ``self.agents`` as a turn
        starts). What the node started and runs beside its agents stays as it is until the
        next start: the channels (their long polls and webhooks are running), the tool sources
        (MCP servers), the schedules (reconciled at start); each one that the new manifest
        changes is named in the answer."""
        old, was = self.agents[agent.id], self._manifests[agent.id]
        warnings = [
            f"{field} changed in the manifest: they take effect at the node's next start"
            for field in ("channels", "schedules", *(kind.key for kind in KINDS))
            if msgspec.to_builtins(getattr(was, field)) != msgspec.to_builtins(
                getattr(read.manifest, field))
        ]  # fmt: skip
        unused = [c for c in agent.channels.values() if c not in old.channels.values()]
        agent = dataclasses.replace(agent, channels=old.channels, schedules=old.schedules)
        for channel in unused:  # built, never started
            self._background(channel.aclose())
        self.agents[agent.id] = agent
        self._manifests[agent.id] = read.manifest
        self._details[agent.id] = agent_detail(agent)
        if self.store is not None:  # the versions of its skills this node ranks
            self._background(skills.index(self.store, agent))
        return agent, warnings

    def _build_old(self, read: manifest.Read) -> Agent:
        """An earlier version of a running agent, for a turn that resumes on it (blocking, on
        a thread): built as a reload's, with the channels and schedules the node runs (those it
        built are never started)."""
        agent = self._build(read)
        old = self.agents[agent.id]
        unused = [c for c in agent.channels.values() if c not in old.channels.values()]
        assert self._portal is not None, "versions are built once the node runs"
        for channel in unused:  # built on this thread, closed on the loop
            self._portal.call_soon(self._background, channel.aclose())
        return dataclasses.replace(agent, channels=old.channels, schedules=old.schedules)

    def _sources_of(self, agent_id: str) -> list[ToolSource]:
        """The agent's team tool (a supervisor's handoff), then its live sources, kind after
        kind."""
        team = teams.sources(self._manifests[agent_id], self.handoffs)
        return [*team, *(s for live in self.sources.values() for s in live.of(agent_id))]

    def _sources_changed(self, agent_id: str) -> None:
        """A source of the agent lists other tools (a server came up, came back, or said they
        changed): the agent gets a new tool list, for its next turn."""
        agent = self.agents.get(agent_id)
        if agent is None:
            return  # not built yet: its first build reads the listing
        rebuilt = manifest.with_tools(agent, self._manifests[agent_id], self._env,
                                      self._sources_of(agent_id))  # fmt: skip
        self.agents[agent_id] = rebuilt
        self._details[agent_id] = agent_detail(rebuilt)

    async def _nats_disconnected(self) -> None:
        if self._phase != "draining":  # our own drain disconnects on purpose
            log.warning("nats_disconnected")

    def _on_commit(self, committed: Sequence[RecordedEvent]) -> None:
        # Runs on the loop, right after the batch's callers were answered (the writer hands
        # both over at once): wake this node's readers, then tell the other nodes.
        if self.feed is not None:
            self.feed.remember(committed)  # a reader of a turn run here starts from memory
        if self.store is not None and self._wakes_store():
            self.store.hints.notify(committed[-1].checkpoint)
        if self._hints is not None:
            self._background(self._hints.publish(committed))
        made = any(isinstance(e.data, WebhookCreated) for e in committed)
        if made and self._webhooks is not None:
            self._webhooks.fanout.nudge()  # it reads the log only while a subscription lives
        promised = {e.data.channel_id for e in committed if isinstance(e.data, DeliveryEnqueued)}
        if promised and self._outbox is not None:
            self._outbox.tell(KICK)  # a reply was promised: send it now, not at the next poll
            self._background(self._kick_others(promised))

    def _wakes_store(self) -> bool:
        """Whether this node's own commits wake the store's subscribers: always without a feed;
        with one, when its tail must read them (a reader memory does not serve) or when the
        store has a subscriber besides that tail (an in-process reader of the whole log)."""
        feed, store = self.feed, self.store
        if feed is None or store is None:
            return True
        return feed.tails_own_commits or store.subscribers > (1 if feed.tailing else 0)

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._announcing.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._announcing.discard)

    async def _kick_others(self, channels: set[str]) -> None:
        """Tell the other nodes' outboxes (on the no-echo connection: not this node's own)."""
        if self._hints_nc is not None and self._hints_nc.is_connected:
            for channel in channels:
                with contextlib.suppress(nats.errors.Error):
                    await self._hints_nc.publish(subjects.outbox(channel), b"")

    async def _on_kick(self, _msg: Any) -> None:
        if self._outbox is not None:
            self._outbox.tell(KICK)

    async def stop(self) -> None:
        """Drain: refuse new work, stop actors, flush the writer, then close connections and
        stop embedded services. Safe to call whatever ``start`` reached."""
        self._phase = "draining"
        timeout = self.settings.drain_seconds
        await self._close_access()
        await self._leave(timeout)
        await self._stop_delivery(timeout)
        if self.engine is not None:
            await self.engine.drain(timeout)  # stops the actors and waits for the turns
        else:
            await blocking(self.actors.stop, timeout)
        for agent in self.agents.values():
            await agent.model.aclose()
            for channel in agent.channels.values():
                await channel.aclose()
        for live in self.sources.values():
            await live.aclose(timeout)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self.store is not None:
            await self.store.aclose()
            self.store = None
        if self._hints is not None:
            await self._hints.stop()
        if self._hints_nc is not None:
            with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                await asyncio.wait_for(self._hints_nc.close(), timeout)
            self._hints_nc = None
        if self.nc is not None:
            with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                await asyncio.wait_for(self.nc.drain(), timeout)
            self.nc = None
        await blocking(self.services.stop)
        if self._tracing is not None:  # exports what is buffered (a bounded wait)
            await blocking(self._tracing.shutdown)
            self._tracing = None
        self._phase = "stopped"
        log.info("node_stopped", node=self.node_id)

    async def _leave(self, timeout: float) -> None:
        """Take no more commands, and hand every partition over between turns (and the
        singletons): the other nodes take them; alone, what is still queued resumes at the
        next start."""
        if self._ingress is not None:
            await self._ingress.stop()
        if self.lifecycle is not None:  # no more reloads, stops or starts heard
            await self.lifecycle.stop()
        if self.ownership is not None and self.ownership.ready:
            await self.ownership.drain(timeout)
        if self.commands is not None:
            await self.commands.close()

    async def _stop_delivery(self, timeout: float) -> None:
        """Channels stop taking messages in; the scheduler's clock stops; the outbox starts no
        more sends and lets those in flight finish (and be recorded), so a clean stop leaves no
        item in doubt. What does not finish in time is flagged uncertain at the next start."""
        for agent in self.agents.values():
            for channel in agent.channels.values():
                await channel.stop()
        for actor in (self.scheduler, self._outbox):  # both answer DRAIN with a future
            if actor is not None:
                await _settle(actor, DRAIN, timeout)
        if self._webhooks is not None:  # the outbox sends through it no more
            await self._webhooks.channel.aclose()


async def _tell(actor: pykka.ActorRef[Any], message: object) -> None:
    with contextlib.suppress(pykka.ActorDeadError):
        actor.tell(message)


async def _settle(actor: pykka.ActorRef[Any], message: object, timeout: float) -> None:
    """Ask an actor something it answers with a future, and wait for that future."""
    with contextlib.suppress(pykka.ActorDeadError, TimeoutError):
        done = await ask(actor, message, timeout)
        await asyncio.wait_for(asyncio.shield(done), timeout)


async def _nats_error(e: Exception) -> None:
    log.warning("nats_error", error=str(e))


async def _nats_reconnected() -> None:
    log.info("nats_reconnected")

"""Live agents: reload, stop and start, on every node of the cluster.

The log is the truth: each change is one event in the agent's stream ``agent-<id>``
(``agent.reloaded``, ``agent.stopped``, ``agent.started``), appended by the node asked, expecting
the version it folded (two nodes asked at once: one appends, the other folds it and tries again).
The node asked applies its change at once and publishes ``<cluster>.agents.changed`` with the
agent's id; every node then reads that stream after what it has folded, and also every
:data:`POLL_SECONDS` (a lost notice delays a node, it never leaves it behind). A node folds
every agent's stream at start, so a stopped agent stays stopped across restarts.

- **Stop / start** change :attr:`SessionDirectory.lives`, which the command path reads: a new
  message for a stopped agent is refused ``agent_stopped`` by the node asked and by the
  session's owner, whatever door it came through (a schedule records the tick as skipped, a
  channel its message as rejected). Turns running or accepted finish.
- **Reload** reads the manifest from the asked node's disk, validates and builds it (a broken
  manifest changes nothing and the caller gets its error), and records its text, so that every
  other node builds exactly that version whatever its own disk holds. The new agent replaces the
  old in the node's agent map, which a session reads when a turn starts: a running turn keeps
  the agent it started with, and a resumed one finds it among :attr:`SessionDirectory.versions`.
  At a node's start its disk is what it runs (as before this existed): the log's last reload is
  not preferred over a manifest edited since.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Literal

import nats.aio.client
import nats.aio.msg
import nats.aio.subscription
import nats.errors
import structlog

from actors import lifecycle
from actors.agent import Agent
from actors.lifecycle import Life
from actors.messages import Refused
from actors.session.directory import SessionDirectory
from eventstore import (
    NO_STREAM,
    EventStore,
    Metadata,
    NewEvent,
    StoreError,
    WrongExpectedVersion,
    streams,
    subjects,
)
from eventstore.bridge import blocking
from eventstore.catalogue import AgentReloaded
from eventstore.event import Event
from gateways.api.schemas import AgentState
from gateways.manifests import ManifestError
from runtime import manifest

log = structlog.get_logger("dispach.lifecycle")

POLL_SECONDS = 2.0
"""How often a node reads the agents' streams without a notice (the fallback)."""
VERSIONS_KEPT = 4
"""Versions of one agent a node keeps built for turns that resume on the one they began with."""
_TRIES = 3

Build = Callable[[manifest.Read], Agent]
"""Build an agent from a manifest (blocking: run on a thread), with the node's env and sources."""
Swap = Callable[[Agent, manifest.Read], tuple[Agent, list[str]]]
"""Put a built agent in place for new turns; returns the agent as placed and what it could not
change while the node runs (its channels, its tool sources)."""


class Lifecycle:
    def __init__(
        self,
        store: EventStore,
        nc: nats.aio.client.Client,
        engine: SessionDirectory,
        node_id: str,
        agents_path: Path | None,
        build: Build,
        swap: Swap,
        build_old: Build,
    ) -> None:
        self._store = store
        self._nc = nc
        self._engine = engine
        self._node = node_id
        self._path = agents_path
        self._build = build
        self._swap = swap
        self._build_old = build_old
        self._locks: dict[str, asyncio.Lock] = {}
        self._sub: nats.aio.subscription.Subscription | None = None
        self._poll: asyncio.Task[None] | None = None
        self._warnings: dict[str, list[str]] = {}
        self._texts: dict[tuple[str, str], str] = {}
        """The text of each version this node built, by (agent, version): a reload records the
        one it replaces."""
        engine.rebuild = self.rebuild

    @property
    def lives(self) -> dict[str, Life]:
        return self._engine.lives

    def life(self, agent_id: str) -> Life:
        return self.lives.get(agent_id) or Life(agent_id=agent_id)

    def keep(self, agent: Agent, text: str | None = None) -> None:
        """Remember a built version (the newest :data:`VERSIONS_KEPT` of each agent), and its
        manifest's text."""
        if text is not None:
            self._texts[(agent.id, agent.version)] = text
        versions = self._engine.versions
        versions[(agent.id, agent.version)] = agent
        mine = [key for key in versions if key[0] == agent.id]
        for key in mine[:-VERSIONS_KEPT]:
            del versions[key]

    # --- lifecycle of the listener -----------------------------------------------------------

    async def start(self) -> None:
        """Fold every agent's stream (before the node takes messages), then listen."""
        for agent_id in list(self._engine.agents):
            await self.catch_up(agent_id, build=False)
        self._sub = await self._nc.subscribe(subjects.agents_changed(), cb=self._on_notice)
        self._poll = asyncio.create_task(self._polling(), name="agents-poll")

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
            self._sub = None
        if self._poll is not None:
            self._poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll
            self._poll = None

    async def _on_notice(self, msg: nats.aio.msg.Msg) -> None:
        agent_id = msg.data.decode(errors="replace")
        if agent_id in self._engine.agents:
            await self._catch_up_quietly(agent_id)

    async def _polling(self) -> None:
        while True:
            await asyncio.sleep(POLL_SECONDS)
            for agent_id in list(self._engine.agents):
                await self._catch_up_quietly(agent_id)

    async def _catch_up_quietly(self, agent_id: str) -> None:
        try:
            await self.catch_up(agent_id)
        except StoreError as e:  # the next notice or poll reads it again
            log.warning("agent_catch_up_failed", agent=agent_id, error=e.message)

    # --- folding the log ---------------------------------------------------------------------

    def _lock(self, agent_id: str) -> asyncio.Lock:
        return self._locks.setdefault(agent_id, asyncio.Lock())

    async def catch_up(self, agent_id: str, *, build: bool = True) -> Life:
        async with self._lock(agent_id):
            return await self._catch_up(agent_id, build=build)

    async def _catch_up(self, agent_id: str, *, build: bool = True) -> Life:
        """Fold what the agent's stream holds after what this node folded; a reload recorded
        by another node is built and swapped in (``build``: not at start, where the disk is
        what the node runs)."""
        before = self.life(agent_id)
        events = await self._store.aread_stream(streams.agent(agent_id), before.stream_version + 1)
        if not events:
            return before
        after = lifecycle.fold(before, events)
        self.lives[agent_id] = after
        if after.disabled != before.disabled:
            log.info("agent_state", agent=agent_id, status=after.status, by=after.disabled_by)
            await self._hold_channels(agent_id, after.disabled)
        reloaded = after.reloaded
        if build and reloaded is not None and after.reloaded_position != before.reloaded_position:
            current = self._engine.agents.get(agent_id)
            if current is None or current.version != reloaded.version:
                await self._adopt(agent_id, reloaded)
        return after

    async def _hold_channels(self, agent_id: str, paused: bool) -> None:
        """A stopped agent's channels fetch nothing (a bot's long poll pauses; its updates
        wait at the provider) until it is started again."""
        agent = self._engine.agents.get(agent_id)
        for channel in agent.channels.values() if agent is not None else ():
            await channel.pause(paused)

    async def rebuild(self, agent_id: str, version: str) -> Agent | None:
        """The agent at ``version``, built from the text the log holds of it (a reload's, or
        the version a reload replaced), for a turn that began on it and resumes here: it is
        kept among the versions, never put in place for new turns. None when the log holds no
        such text or it cannot be built here (the turn then runs on the current version)."""
        async with self._lock(agent_id):
            found = self._engine.versions.get((agent_id, version))
            if found is not None:
                return found
            events = await self._store.aread_stream(streams.agent(agent_id))
            text = lifecycle.text_of([e.data for e in events], version)
            if text is None:
                return None
            source = f"the log's record of {agent_id} at {version}"
            try:
                read = manifest.from_text(text, source, version)
                agent = await blocking(self._build_old, read)
            except ManifestError as e:
                failed = e
            else:
                self.keep(agent, text)
                log.info("agent_version_rebuilt", agent=agent_id, version=version)
                return agent
        log.error("agent_version_not_built", agent=agent_id, version=version,
                  code=failed.code, error=failed.message, hint=failed.hint)  # fmt: skip
        return None

    async def _adopt(self, agent_id: str, reloaded: AgentReloaded) -> None:
        """Build the version another node recorded, from the text it recorded."""
        source = f"agent.reloaded of {agent_id} ({reloaded.version}, from node {reloaded.node})"
        try:
            read = manifest.from_text(reloaded.manifest, source, reloaded.version)
            agent = await blocking(self._build, read)
        except ManifestError as e:
            failed = e
        else:
            self._put(agent, read)
            return
        # Another node validated it; this one cannot build it (a variable it lacks): it keeps
        # the version it runs, which GET /v1/agents/{id} shows.
        log.error("agent_reload_not_built", agent=agent_id, version=reloaded.version,
                  code=failed.code, error=failed.message, hint=failed.hint)  # fmt: skip

    def _put(self, agent: Agent, read: manifest.Read) -> None:
        agent, self._warnings[agent.id] = self._swap(agent, read)
        self.keep(agent, read.text)
        log.info("agent_reloaded", agent=agent.id, version=agent.version)

    # --- commands ------------------------------------------------------------------------------

    async def change(
        self, kind: Literal["reload", "stop", "start"], agent_id: str, by: str, reason: str | None
    ) -> AgentState | Refused:
        if agent_id not in self._engine.agents:
            return Refused(code="agent_not_found", message=f"no agent {agent_id!r} on this node",
                           hint="a node's agents are those it started with")  # fmt: skip
        try:
            async with self._lock(agent_id):
                if kind == "reload":
                    return await self._reload(agent_id, by)
                return await self._switch(agent_id, kind, by, reason)
        except StoreError as e:
            return Refused(code=e.code, message=e.message, hint=e.hint)

    async def _switch(
        self, agent_id: str, kind: Literal["stop", "start"], by: str, reason: str | None
    ) -> AgentState | Refused:
        for _ in range(_TRIES):
            life = await self._catch_up(agent_id)
            events: list[Event] = []
            if kind == "stop":
                events.extend(lifecycle.stop(life, by, reason, self._node))
            else:
                events.extend(lifecycle.start(life, by, self._node))
            if not events:
                return self._state(agent_id, changed=False)
            if await self._append(agent_id, life, events):
                await self._catch_up(agent_id)
                await self._tell(agent_id)
                return self._state(agent_id, changed=True)
        return _contended(agent_id)

    async def _reload(self, agent_id: str, by: str) -> AgentState | Refused:
        try:
            read = await blocking(manifest.read_one, self._path, agent_id)
            if read.manifest.id != agent_id:
                raise ManifestError(f"the manifest of {agent_id!r} names id {read.manifest.id!r}",
                                    f"set id: {agent_id}", field="id")  # fmt: skip
            agent = await blocking(self._build, read)
        except ManifestError as e:
            return Refused(code=e.code, message=e.message, hint=e.hint, field=e.field)
        previous = self._engine.agents[agent_id].version or None
        for _ in range(_TRIES):
            life = await self._catch_up(agent_id)
            event = AgentReloaded(version=read.version, previous=previous, by=by,
                                  node=self._node, manifest=read.text,
                                  previous_manifest=self._texts.get((agent_id, previous or ""),
                                                                    ""))  # fmt: skip
            if await self._append(agent_id, life, [event]):
                self._put(agent, read)
                await self._catch_up(agent_id, build=False)  # this node built it already
                await self._tell(agent_id)
                return self._state(agent_id, changed=read.version != previous, previous=previous)
        return _contended(agent_id)

    async def _append(self, agent_id: str, life: Life, events: list[Event]) -> bool:
        """Append after what ``life`` folded; False if another node appended first."""
        expected = NO_STREAM if life.stream_version < 0 else life.stream_version
        meta = Metadata(agent_id=agent_id)
        try:
            await self._store.aappend(streams.agent(agent_id),
                                      [NewEvent(event=e, metadata=meta) for e in events],
                                      expected)  # fmt: skip
        except WrongExpectedVersion:
            return False
        return True

    async def _tell(self, agent_id: str) -> None:
        """Tell the other nodes (a hint: they poll anyway)."""
        with contextlib.suppress(nats.errors.Error):
            await self._nc.publish(subjects.agents_changed(), agent_id.encode())

    # --- what the API shows --------------------------------------------------------------------

    def _state(self, agent_id: str, *, changed: bool, previous: str | None = None) -> AgentState:
        life = self.life(agent_id)
        agent = self._engine.agents[agent_id]
        return AgentState(
            id=agent_id, status=life.status, version=agent.version, changed=changed,
            previous_version=previous, disabled_at=_iso(life.disabled_at),
            disabled_by=life.disabled_by, reason=life.reason,
            reloaded_at=_iso(life.reloaded_at), warnings=self._warnings.get(agent_id, []),
        )  # fmt: skip

    def shown(self, agent_id: str) -> dict[str, object]:
        """The lifecycle fields of the agent's resource (``GET /v1/agents[/{id}]``)."""
        life = self.life(agent_id)
        agent = self._engine.agents.get(agent_id)
        return {
            "status": life.status,
            "version": agent.version if agent is not None else "",
            "disabled_at": _iso(life.disabled_at),
            "disabled_by": life.disabled_by,
            "reason": life.reason,
            "reloaded_at": _iso(life.reloaded_at),
        }


def _iso(when: datetime | None) -> str | None:
    return None if when is None else when.isoformat()


def _contended(agent_id: str) -> Refused:
    return Refused(
        code="agent_change_conflict",
        message=f"agent {agent_id!r} was changed by other requests {_TRIES} times while this "
        "one was decided",
        hint=f"read GET /v1/agents/{agent_id} and retry",
    )

"""The directory of a node's sessions: where a command for a session finds its SessionActor
(activated on demand, passivated when idle), and where unfinished turns are found and resumed at
start."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pykka
import structlog

from actors import idempotency, ids, lifecycle, recall
from actors.actor import MailboxFull, ask
from actors.agent import Agent
from actors.cluster.partitions import partition_of
from actors.context import fork as forks
from actors.context.history import History
from actors.context.load import load
from actors.context.load import phase as load_phase
from actors.context.replay import replay
from actors.context.view import session_context
from actors.host import ActorHost
from actors.messages import (
    Accepted,
    Cleared,
    ClearSession,
    ContextStep,
    Forked,
    ForkSession,
    PhaseMoved,
    Refused,
    ResolveApproval,
    Resolved,
    Resume,
    SessionContext,
    SetPhase,
    StopResult,
    StopTurn,
    Submit,
    TurnContext,
    not_addressable,
)
from actors.recall import Recalled
from actors.session.actor import HAND_OVER, HISTORY, IDLE_FOR, Accepting, Pending, SessionActor
from actors.session.core import (
    Fork,
)
from eventstore import EventStore, StoreError, WrongExpectedVersion
from eventstore.bridge import Lock, Portal, blocking, settled
from eventstore.catalogue import Deliver

log = structlog.get_logger("dispach.engine")

_ASK_TIMEOUT = 30.0
_PEEK_TIMEOUT = 5.0
_UNFINISHED = b"""SELECT turn_id, agent_id, session_key FROM turns
                  WHERE status = 'running' ORDER BY started_at, turn_id"""
_TURN = b"SELECT agent_id, session_key, status FROM turns WHERE turn_id = %s"
_APPROVAL = b"""SELECT session_key, status, turn_id FROM approvals
                 WHERE approval_id = %s AND agent_id = %s"""


class SessionDirectory:
    def __init__(
        self,
        store: EventStore,
        agents: dict[str, Agent],
        portal: Portal,
        host: ActorHost,
        node_id: str,
        idle_seconds: float = 60.0,
        max_sessions: int = 1024,
        partitions: int = 64,
    ) -> None:
        self.store = store
        self.agents = agents
        self.portal = portal
        self.host = host
        self.node_id = node_id
        self.idle_seconds = idle_seconds
        self.max_sessions = max_sessions
        self.partitions = partitions
        """Past this many live session actors (each holds its session's history in memory), idle
        ones are passivated at once."""
        self._crowded = asyncio.Event()
        self.running: set[asyncio.Task[Any]] = set()
        """Tasks of the turns running on this node (touched on the event loop only)."""
        self._sessions: dict[tuple[str, str], pykka.ActorRef[Any]] = {}
        self._lock = Lock()
        self.lives: dict[str, lifecycle.Life] = {}
        """Each agent's lifecycle as this node last folded it from the log (runtime/lifecycle.py
        keeps it): a stopped agent's new messages are refused here, on the session's owner."""
        self.versions: dict[tuple[str, str], Agent] = {}
        """Every version of each agent this node built since it started, by (agent, version),
        the newest few of each kept: a turn resumed here runs on the version it started with
        when it is one of them (:meth:`agent_at`)."""
        self.rebuild: Callable[[str, str], Awaitable[Agent | None]] | None = None
        """Builds a version of an agent from the text the log holds of it (runtime/lifecycle.py
        sets it): a turn resumed after the whole cluster restarted finds its version there."""

    def refusal(self, agent_id: str, source: str | None = None) -> Refused | None:
        """Why a new message for the agent from ``source`` is refused now, if it is: the agent
        is stopped, or it is a team's member (not addressable) and the message is no handoff."""
        if (stopped := lifecycle.refusal(self.lives.get(agent_id))) is not None:
            return stopped
        agent = self.agents.get(agent_id)
        return None if agent is None else not_addressable(agent_id, agent.addressable, source)

    async def agent_at(self, agent_id: str, version: str | None) -> Agent | None:
        """The agent at ``version``: one this node built, or else one :attr:`rebuild` builds
        from the log (None: not known here nor on the record)."""
        if version is None:
            return None
        found = self.versions.get((agent_id, version))
        if found is None and self.rebuild is not None:
            found = await self.rebuild(agent_id, version)
        return found

    def live_sessions(self) -> set[tuple[str, str]]:
        """``(agent, session)`` of the session actors alive now (thread-safe)."""
        with self._lock:
            return set(self._sessions)

    def session(self, agent_id: str, session_key: str) -> pykka.ActorRef[Any]:
        """The session's actor, activated if it is not running (thread-safe)."""
        key = (agent_id, session_key)
        with self._lock:
            ref = self._sessions.get(key)
            if ref is None or not ref.is_alive():
                ref = self.host.start(SessionActor, self, agent_id, session_key)
                self._sessions[key] = ref
                if len(self._sessions) > self.max_sessions:
                    self.portal.call_soon(self._crowded.set)
            return ref

    def _not_taken(self, submit: Submit) -> Refused | None:
        """Why a message is refused before its session sees it: no such agent, the agent is
        stopped, or its delivery target does not fit."""
        if submit.agent_id not in self.agents:
            return Refused(
                code="agent_not_found",
                message=f"no agent {submit.agent_id!r} on this node",
                hint=f"known agents: {', '.join(sorted(self.agents))}",
                field="agentId",
            )
        if (refused := self.refusal(submit.agent_id, submit.source)) is not None:
            return refused
        if submit.deliver is not None:
            return _deliver_problem(self.agents[submit.agent_id], submit.deliver)
        return None

    async def submit(self, submit: Submit) -> Accepted | Refused:
        if (refused := self._not_taken(submit)) is not None:
            return refused
        if submit.idempotency_key is not None:
            keyed = await self._keyed(submit, submit.idempotency_key)
            if not isinstance(keyed, Submit):
                return keyed
            submit = keyed
        for _ in range(2):  # once more if the session was passivated under our feet
            ref = self.session(submit.agent_id, submit.session_key)
            result = await _offer(ref, submit)
            if result is None:
                continue
            if isinstance(result, Refused):
                return result
            try:
                await settled(result.committed)
            except WrongExpectedVersion as e:
                if submit.turn_id is None or submit.request_hash is None:
                    return Refused(code=e.code, message=e.message, hint=e.hint)
                result = Accepting(result.accepted, result.committed, duplicate=True)
            except StoreError as e:
                return _not_accepted(e)
            if result.duplicate:
                # Another acceptance with the same key won the race: answer from its turn.start.
                return await self._answer_duplicate(result.accepted.turn_id, submit)
            return result.accepted
        return Refused(code="session_unavailable", message="the session could not be activated",
                       hint="retry the message")  # fmt: skip

    async def _keyed(self, submit: Submit, key: str) -> Submit | Accepted | Refused:
        """A keyed message with its derived turn id, or the answer if that turn exists."""
        invalid = idempotency.key_refused(key)
        if invalid is not None:
            return invalid
        turn_id = ids.keyed_turn_id(submit.agent_id, key)
        digest = idempotency.request_hash(submit.session_key, submit.text, submit.deliver)
        try:
            earlier = await self._replay(turn_id, digest)
        except StoreError as e:
            return _not_accepted(e)
        if earlier is not None:
            return earlier
        return msgspec.structs.replace(submit, turn_id=turn_id, request_hash=digest)

    async def _answer_duplicate(self, turn_id: str, submit: Submit) -> Accepted | Refused:
        assert submit.request_hash is not None
        try:
            earlier = await self._replay(turn_id, submit.request_hash)
        except StoreError as e:
            return _not_accepted(e)
        if earlier is not None:
            return earlier
        return Refused(code="accept_conflict",
                       message="a turn with this Idempotency-Key is being accepted",
                       hint="retry with the same key shortly")  # fmt: skip

    async def _replay(self, turn_id: str, digest: str) -> Accepted | Refused | None:
        """The answer for a keyed request whose turn is already stored, or None if it is not."""
        return await idempotency.stored(self.store, turn_id, digest)

    async def set_phase(self, command: SetPhase) -> PhaseMoved | Refused:
        if command.agent_id not in self.agents:
            return Refused(code="agent_not_found", message=f"no agent {command.agent_id!r}",
                           hint="a node's agents are those it started with")  # fmt: skip
        moved: PhaseMoved | Refused = await _once_stored(
            self.session(command.agent_id, command.session_key), command
        )
        return moved

    async def clear(self, clear: ClearSession) -> Cleared | Refused:
        if clear.agent_id not in self.agents:
            return Refused(code="agent_not_found", message=f"no agent {clear.agent_id!r}",
                           hint=f"known agents: {', '.join(sorted(self.agents))}")  # fmt: skip
        cleared: Cleared | Refused = await _once_stored(
            self.session(clear.agent_id, clear.session_key), clear
        )
        return cleared

    async def fork(self, fork: ForkSession) -> Forked | Refused:
        """Start the new session of ``fork`` from its source's history (the new session's owner
        runs this: it reads the source's read models, then its actor appends session.forked)."""
        for agent_id, field in ((fork.source_agent_id, None), (fork.agent_id, "agent")):
            if agent_id not in self.agents:
                return Refused(code="agent_not_found", message=f"no agent {agent_id!r}",
                               hint=f"known agents: {', '.join(sorted(self.agents))}",
                               field=field)  # fmt: skip
        try:
            planned = await forks.plan(self.store, fork)
            if isinstance(planned, Refused):
                return planned
            taken = await forks.taken(self.store, fork.agent_id, fork.session_key)
        except StoreError as e:
            return Refused(code=e.code, message=e.message, hint=e.hint)
        if taken is not None:
            return taken
        forked: Forked | Refused = await _once_stored(
            self.session(fork.agent_id, fork.session_key), Fork(planned.event, planned.answer)
        )
        if isinstance(forked, Refused) and forked.code == WrongExpectedVersion.code:
            return forks.exists(fork.agent_id, fork.session_key)  # its stream was not empty
        return forked

    async def turn_session(self, turn_id: str) -> tuple[str, str, str] | None:
        """``(agent, session, status)`` of a stored turn, or None."""
        rows = await self.store.afetch(_TURN, [turn_id])
        return (rows[0][0], rows[0][1], rows[0][2]) if rows else None

    async def approval_session(self, agent_id: str, approval_id: str) -> str | None:
        """The session of an open approval, or None (unknown, or answered already)."""
        rows = await self.store.afetch(_APPROVAL, [approval_id, agent_id])
        return rows[0][0] if rows and rows[0][1] == "pending" else None

    async def stop(self, stop: StopTurn) -> StopResult:
        rows = await self.store.afetch(_TURN, [stop.turn_id])
        if not rows:
            return StopResult(stopping=False, state="unknown")
        agent_id, session_key, status = rows[0]
        if status != "running":
            return StopResult(stopping=False, state="ended")
        ref = self.session(agent_id, session_key)
        result: StopResult | Pending = await ask(ref, stop, _ASK_TIMEOUT)
        if isinstance(result, Pending):
            try:
                await settled(result.committed)
            except StoreError as e:  # the queued turn stays accepted; a restart runs it
                log.warning("stop_not_stored", turn=stop.turn_id, error=e.message)
                return StopResult(stopping=False, state="unknown")
            answer: StopResult = result.answer
            return answer
        return result

    async def resolve_approval(self, resolve: ResolveApproval) -> Resolved | Refused:
        """Answer a tool call's approval request, through the session that holds its turn."""
        try:
            rows = await self.store.afetch(_APPROVAL, [resolve.approval_id, resolve.agent_id])
        except StoreError as e:
            return Refused(code=e.code, message=e.message, hint=e.hint)
        if not rows or rows[0][1] != "pending":
            return Refused(
                code="approval_not_found",
                message=f"no open approval {resolve.approval_id!r} on agent {resolve.agent_id!r}",
                hint="it was answered already, timed out, or never existed; GET "
                f"/v1/agents/{resolve.agent_id}/approvals lists the open ones",
            )
        resolve = msgspec.structs.replace(resolve, turn_id=rows[0][2])
        resolved: Resolved | Refused = await _once_stored(
            self.session(resolve.agent_id, rows[0][0]), resolve
        )
        return resolved

    async def context(
        self, agent_id: str, session_key: str | None, text: str = "", messages: bool = False
    ) -> SessionContext | Refused:
        """The context the session's next turn would assemble for ``text`` (none: no input
        yet), block by block, in the phase it is in; without a session, what a new session's
        first turn would. Reading it activates no session actor."""
        agent = self.agents.get(agent_id)
        if agent is None:
            return _no_agent(agent_id, self.agents)
        if session_key is None:  # what a new session would see: no history, the entry phase
            return session_context(agent, None, History(), None, text, messages)
        history = await self._history(agent_id, session_key)
        phase = None
        if agent.phases is not None:
            phase = await load_phase(self.store, agent_id, session_key)
        recalled = await self._recalled(agent, history, text)
        return session_context(agent, session_key, history, phase, text, messages, recalled)

    async def _recalled(self, agent: Agent, history: History, text: str) -> Recalled:
        """What a turn with the input ``text`` would recall (chosen as the turn would, recorded
        nowhere); without an input, nothing is chosen."""
        policy = agent.recall
        if not text or not policy.active:
            return Recalled(replaces_notes=policy.notes)
        chosen = await recall.select(self.store, agent.id, policy, history, text)
        return await recall.resolve(self.store, agent.id, policy, history.notes, chosen)

    async def _history(self, agent_id: str, session_key: str) -> History:
        """The live actor's copy of the session's history when it holds one, else the history
        rebuilt from the log's read models (the same entries, view and notes; only the
        correction ratio, learnt from the provider's reports, is the actor's alone)."""
        with self._lock:
            ref = self._sessions.get((agent_id, session_key))
        if ref is not None:
            try:
                held: History | None = await ask(ref, HISTORY, _PEEK_TIMEOUT)
            except (pykka.ActorDeadError, TimeoutError):
                held = None
            if held is not None:
                return held
        return await load(self.store, agent_id, session_key)

    async def turn_context(self, agent_id: str, turn_id: str) -> TurnContext | Refused:
        """What each model call of a past (or running) turn was sent, rebuilt from the log."""
        agent = self.agents.get(agent_id)
        if agent is None:
            return _no_agent(agent_id, self.agents)
        steps = await replay(self.store, agent, turn_id)
        if steps is None:
            return Refused(code="turn_not_found", message=f"no turn {turn_id!r}",
                           hint="check the turnId returned by POST .../messages",
                           field="turnId")  # fmt: skip
        return TurnContext(turn_id=turn_id, steps=[
            ContextStep(step=i, system=s["system"], tools=s["tools"], messages=s["messages"])
            for i, s in enumerate(steps, 1)
        ])  # fmt: skip

    async def drain(self, timeout: float) -> None:
        """Stop every actor (running turns are cancelled without a stop request, so they stay
        unfinished and resume at the next start) and wait for the turns' tasks to unwind."""
        await blocking(self.host.stop, timeout)
        if self.running:
            await asyncio.wait(set(self.running), timeout=timeout)

    async def resume_partitions(self, partitions: set[int]) -> int:
        """Queue every turn of these partitions without a ``turn.end`` on its session, in
        acceptance order (this node has just opened them: fenced, so no older owner appends)."""
        rows = await self.store.afetch(_UNFINISHED)
        by_session: dict[tuple[str, str], list[str]] = defaultdict(list)
        for turn_id, agent_id, session_key in rows:
            if partition_of(agent_id, session_key, self.partitions) not in partitions:
                continue
            if agent_id in self.agents:
                by_session[(agent_id, session_key)].append(turn_id)
            else:
                log.warning("resume_unknown_agent", turn=turn_id, agent=agent_id)
        for (agent_id, session_key), turn_ids in by_session.items():
            self.session(agent_id, session_key).tell(Resume(turn_ids))
        resumed = sum(len(t) for t in by_session.values())
        if resumed:
            log.info("turns_resumed", turns=resumed, sessions=len(by_session))
        return resumed

    def _of_partition(self, partition: int) -> list[tuple[tuple[str, str], pykka.ActorRef[Any]]]:
        with self._lock:
            return [
                (key, ref) for key, ref in self._sessions.items()
                if partition_of(key[0], key[1], self.partitions) == partition
            ]  # fmt: skip

    def _forget(self, key: tuple[str, str], ref: pykka.ActorRef[Any]) -> None:
        with self._lock:
            if self._sessions.get(key) is ref:
                del self._sessions[key]
        ref.stop(block=False)

    async def hand_over(self, partition: int, timeout: float) -> None:
        """The partition moves to another node: its sessions finish the turn they run (within
        ``timeout``) and start no other, then stop. What is still queued, or did not finish in
        time, stays unfinished in the log for the next owner to resume."""
        sessions = self._of_partition(partition)
        waits = []
        for _, ref in sessions:
            with contextlib.suppress(pykka.ActorDeadError, TimeoutError):
                idle = await ask(ref, HAND_OVER, _PEEK_TIMEOUT)
                waits.append(idle)
        if waits:
            _, late = await asyncio.wait(waits, timeout=max(timeout, 0.001))
            if late:
                log.warning("handover_timeout", partition=partition, sessions=len(late))
        for key, ref in sessions:
            self._forget(key, ref)

    def drop_partition(self, partition: int) -> None:
        """The partition is someone else's now: stop its sessions at once (their running turns
        are cancelled without appending; the new owner has resumed them from the log)."""
        for key, ref in self._of_partition(partition):
            self._forget(key, ref)

    async def passivate_idle(self) -> None:
        """Stop session actors idle for longer than ``idle_seconds``, or idle at all while there
        are more than ``max_sessions`` of them (each holds its history; they reactivate on demand
        and hold nothing that needs a replay)."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(5.0, self.idle_seconds / 2)):
                    await self._crowded.wait()
            self._crowded.clear()
            with self._lock:
                candidates = list(self._sessions.items())
            crowded = len(candidates) > self.max_sessions
            threshold = 0.5 if crowded else self.idle_seconds
            for key, ref in candidates:
                try:
                    idle_for = await ask(ref, IDLE_FOR, _ASK_TIMEOUT)
                except pykka.ActorDeadError:
                    idle_for = float("inf")
                if idle_for > threshold:
                    with self._lock:
                        if self._sessions.get(key) is ref:
                            del self._sessions[key]
                    ref.stop(block=False)


def _no_agent(agent_id: str, agents: dict[str, Agent]) -> Refused:
    return Refused(code="agent_not_found", message=f"no agent {agent_id!r}",
                   hint=f"known agents: {', '.join(sorted(agents))}", field="agent")  # fmt: skip


def _deliver_problem(agent: Agent, deliver: Deliver) -> Refused | None:
    channel = agent.channels.get(deliver.channel)
    if channel is None:
        return Refused(
            code="deliver_invalid",
            message=f"agent {agent.id!r} has no channel {deliver.channel!r}",
            hint=f"channels of this agent: {', '.join(sorted(agent.channels)) or 'none'}; "
            "declare one under channels: in its manifest, or leave deliver out",
            field="deliver.channel",
        )
    problem = channel.target_problem(deliver.to, deliver.thread)
    if problem is not None:
        hint = f"name a recipient the {channel.type} channel {channel.id!r} can reach"
        return Refused(code="deliver_invalid", message=problem, hint=hint, field="deliver.to")
    return None


async def _offer(ref: pykka.ActorRef[Any], submit: Submit) -> Accepting | Refused | None:
    """Ask a session actor to accept a message; None if it stopped meanwhile (passivated)."""
    try:
        result: Accepting | Refused = await ask(ref, submit, _ASK_TIMEOUT)
    except pykka.ActorDeadError:
        return None
    except MailboxFull as e:
        return Refused(code="session_unavailable", message=f"session {submit.session_key!r} "
                       f"cannot take more messages now: {e}",
                       hint="retry shortly; nothing was accepted")  # fmt: skip
    return result


async def _once_stored(ref: pykka.ActorRef[Any], command: object) -> Any:
    """Ask a session actor, and answer once the append it made for the command is stored (its
    ``Pending``); a refusal, or the store's error, is the answer otherwise."""
    try:
        result: Pending | Refused = await ask(ref, command, _ASK_TIMEOUT)
        if isinstance(result, Refused):
            return result
        await settled(result.committed)
    except StoreError as e:
        return Refused(code=e.code, message=e.message, hint=e.hint)
    return result.answer


def _not_accepted(e: StoreError) -> Refused:
    return Refused(code=e.code, message=f"the message was not accepted: {e.message}", hint=e.hint)

"""The one command path: every command for a session (a message from any door, a stop, an
approval's answer, a clear, a fork) goes to the node that owns the session's partition.

When this node owns it the engine is called in process, with no NATS hop; otherwise the command
travels to ``<cluster>.node.<owner>.<kind>`` and the owner answers. A command that finds no
owner (a takeover is in progress) waits for one, boundedly, then is refused ``session_moving``,
which clients retry; so is one that reached a node just as it lost the partition. Nothing is
retried that might have been carried out: a forwarded command that times out is answered as a
timeout, never sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec
import nats.aio.client
import nats.aio.msg
import nats.aio.subscription
import nats.errors
import structlog
from prometheus_client import Counter

from actors import tracing
from actors.cluster.ownership import LOCAL, Ownership
from actors.inflight import InFlight
from actors.messages import (
    TOO_DEEP,
    Accepted,
    Cleared,
    ClearSession,
    Forked,
    ForkSession,
    PhaseMoved,
    Refused,
    Reply,
    ResolveApproval,
    Resolved,
    SetPhase,
    StopResult,
    StopTurn,
    Submit,
    too_deep,
)
from actors.session.directory import SessionDirectory
from eventstore import StoreError, subjects

log = structlog.get_logger("dispach.commands")

FORWARDED = Counter(
    "dispach_commands_forwarded_total", "Commands sent to the node owning their session", ["kind"]
)
MOVING = "session_moving"

Kind = Literal["submit", "stop", "clear", "resolve", "fork", "phase"]
_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    "submit": msgspec.json.Decoder(Submit),
    "stop": msgspec.json.Decoder(StopTurn),
    "clear": msgspec.json.Decoder(ClearSession),
    "phase": msgspec.json.Decoder(SetPhase),
    "resolve": msgspec.json.Decoder(ResolveApproval),
    "fork": msgspec.json.Decoder(ForkSession),
}
_FORWARDED_TIMEOUT = 300.0
_ENCODE = msgspec.json.Encoder()
_REPLY = msgspec.json.Decoder(Reply)


def moving(retry_after: float) -> Refused:
    return Refused(
        code=MOVING,
        message="the session's partition is moving to another node",
        hint=f"retry in {math.ceil(retry_after)} s: its new owner answers then",
    )


class Commands:
    def __init__(
        self,
        engine: SessionDirectory,
        ownership: Ownership,
        nc: nats.aio.client.Client,
        *,
        wait_seconds: float,
        admit: Callable[[Submit], Awaitable[Refused | None]] | None = None,
    ) -> None:
        self._engine = engine
        self._own = ownership
        self._nc = nc
        self.wait_seconds = wait_seconds
        """How long a command waits for its partition to get an owner before ``session_moving``."""
        self.retry_after = max(1.0, ownership.interval)
        self._sub: nats.aio.subscription.Subscription | None = None
        self._inflight = InFlight()
        self._pending: set[asyncio.Future[Reply]] = set()
        self._admit = admit
        """Asked before a message is routed (actors/budget.py): a refusal is the answer."""

    # --- the doors call these ---------------------------------------------------------------------

    async def submit(self, submit: Submit, timeout: float = 30.0) -> Accepted | Refused:
        if self._admit is not None:
            try:
                refused = await self._admit(submit)
            except StoreError as e:
                return Refused(code=e.code, message=e.message, hint=e.hint)
            if refused is not None:
                return refused
        # A stopped agent, or a team's member asked by anything but a handoff, is refused by the
        # node asked, as its session's owner refuses it.
        if (refused := self._engine.refusal(submit.agent_id, submit.source)) is not None:
            return refused
        partition = self._own.partition(submit.agent_id, submit.session_key)
        reply = await self._route(partition, "submit", submit, timeout)
        if reply.accepted is not None:
            return reply.accepted
        return reply.error or _empty()

    async def stop(self, stop: StopTurn, timeout: float = 10.0) -> StopResult | Refused:
        try:
            found = await self._engine.turn_session(stop.turn_id)
        except StoreError as e:
            return Refused(code=e.code, message=e.message, hint=e.hint)
        if found is None:
            return StopResult(stopping=False, state="unknown")
        agent_id, session_key, status = found
        if status != "running":
            return StopResult(stopping=False, state="ended")
        reply = await self._route(self._own.partition(agent_id, session_key), "stop", stop, timeout)
        return reply.stop or reply.error or _empty()

    async def clear(self, clear: ClearSession, timeout: float = 10.0) -> Cleared | Refused:
        partition = self._own.partition(clear.agent_id, clear.session_key)
        reply = await self._route(partition, "clear", clear, timeout)
        return reply.cleared or reply.error or _empty()

    async def set_phase(self, command: SetPhase, timeout: float = 10.0) -> PhaseMoved | Refused:
        partition = self._own.partition(command.agent_id, command.session_key)
        reply = await self._route(partition, "phase", command, timeout)
        return reply.phase or reply.error or _empty()

    async def resolve(self, resolve: ResolveApproval, timeout: float = 10.0) -> Resolved | Refused:
        try:
            session_key = await self._engine.approval_session(resolve.agent_id, resolve.approval_id)
        except StoreError as e:
            return Refused(code=e.code, message=e.message, hint=e.hint)
        if session_key is None:  # unknown or answered: the engine says which, in its words
            return await self._engine.resolve_approval(resolve)
        partition = self._own.partition(resolve.agent_id, session_key)
        reply = await self._route(partition, "resolve", resolve, timeout)
        return reply.resolved or reply.error or _empty()

    async def fork(self, fork: ForkSession, timeout: float = 10.0) -> Forked | Refused:
        """To the owner of the new session (which reads the source from the read models)."""
        partition = self._own.partition(fork.agent_id, fork.session_key)
        reply = await self._route(partition, "fork", fork, timeout)
        return reply.forked or reply.error or _empty()

    # --- routing ----------------------------------------------------------------------------------

    async def _route(self, partition: int, kind: Kind, command: Any, timeout: float) -> Reply:
        start = time.monotonic()
        deadline = start + min(self.wait_seconds, timeout)
        while True:
            where = await self._own.route(partition, deadline)
            if where is None:
                return Reply(error=moving(self.retry_after))
            left = max(0.5, start + timeout - time.monotonic())
            if where == LOCAL:
                reply = await self._local(partition, kind, command, left)
            else:
                assert not isinstance(where, str)
                FORWARDED.labels(kind).inc()
                reply = await self._forward(where.node, kind, partition, command, left)
            if reply.error is None or reply.error.code != MOVING:
                return reply
            waited = await self._own.changed(min(deadline, time.monotonic() + self.retry_after))
            if not waited and time.monotonic() >= deadline:
                return reply

    async def _local(self, partition: int, kind: str, command: Any, timeout: float) -> Reply:
        """Handle it here, answering within ``timeout``. What takes longer goes on (it is
        never cancelled half-way: an acceptance whose append is queued still commits, and its
        turn runs); the caller is told it timed out, and a retry with the same key finds it."""
        work = asyncio.ensure_future(self._here(partition, kind, command))
        self._pending.add(work)
        work.add_done_callback(self._pending.discard)
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(work)
        except TimeoutError:
            return Reply(error=_timeout(kind, timeout))

    async def _here(self, partition: int, kind: str, command: Any) -> Reply:
        async with self._own.serving(partition):
            if not self._own.owns(partition):
                return Reply(error=moving(self.retry_after))
            if kind == "submit" and (parent := tracing.traceparent()) is not None:
                command = msgspec.structs.replace(command, traceparent=parent)
            return await _handle(self._engine, kind, command)

    async def _forward(
        self, node: str, kind: str, partition: int, command: Any, timeout: float
    ) -> Reply:
        subject = subjects.node_command(node, kind, partition)
        try:
            with tracing.forward(kind, node) as headers:  # the trace goes on at the owner
                answer = await self._nc.request(subject, _ENCODE.encode(command), timeout,
                                                headers=headers)  # fmt: skip
        except nats.errors.NoRespondersError:  # it is gone, or not listening yet
            return Reply(error=moving(self.retry_after))
        except nats.errors.TimeoutError:
            return Reply(error=_timeout(kind, timeout))
        except nats.errors.Error as e:
            return Reply(error=Refused(code="nats_unavailable",
                                       message=f"the command could not reach node {node}: {e}",
                                       hint="retry once NATS is reachable"))  # fmt: skip
        return _REPLY.decode(answer.data)

    # --- commands other nodes send here ---------------------------------------------------------

    async def listen(self) -> None:
        self._sub = await self._nc.subscribe(
            f"{subjects.node_commands(self._own.node_id)}.*.*", cb=self._inflight.wrap(self._serve)
        )

    async def close(self, timeout: float = 10.0) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
            self._sub = None
        await self._inflight.drain(timeout)

    async def _serve(self, msg: nats.aio.msg.Msg) -> None:
        _, kind, partition = msg.subject.rsplit(".", 2)
        with tracing.command(kind, self._own.node_id, msg.headers):
            reply = await self._decode_and_handle(kind, partition, msg.data)
        if msg.reply:
            try:
                await msg.respond(_ENCODE.encode(reply))
            except nats.errors.Error as e:
                log.warning("reply_failed", error=str(e))

    async def _decode_and_handle(self, kind: str, partition: str, data: bytes) -> Reply:
        decoder = _DECODERS.get(kind)
        if decoder is None or not partition.isdigit() or int(partition) >= self._own.count:
            return Reply(error=Refused(code="invalid_command", message=f"no command {kind!r}",
                                       hint="see actors/cluster/commands.py"))  # fmt: skip
        if too_deep(data):
            return Reply(error=TOO_DEEP)
        try:
            command = decoder.decode(data)
        except msgspec.DecodeError as e:
            return Reply(error=Refused(code="invalid_command", message=str(e),
                                       hint="see actors/messages.py"))  # fmt: skip
        # Served only while owned here: a sender with an old view is told to route again. The
        # sender's request bounds how long it waits; this bounds nothing it has not.
        return await self._local(int(partition), kind, command, _FORWARDED_TIMEOUT)


async def _handle(engine: SessionDirectory, kind: str, command: Any) -> Reply:
    handlers: dict[str, Callable[[Any], Awaitable[Any]]] = {
        "submit": engine.submit,
        "stop": engine.stop,
        "clear": engine.clear,
        "phase": engine.set_phase,
        "resolve": engine.resolve_approval,
        "fork": engine.fork,
    }
    result = await handlers[kind](command)
    if isinstance(result, Refused):
        return Reply(error=result)
    if isinstance(result, Accepted):
        return Reply(accepted=result)
    if isinstance(result, StopResult):
        return Reply(stop=result)
    if isinstance(result, Cleared):
        return Reply(cleared=result)
    if isinstance(result, Forked):
        return Reply(forked=result)
    if isinstance(result, PhaseMoved):
        return Reply(phase=result)
    return Reply(resolved=result)


def _timeout(kind: str, timeout: float) -> Refused:
    if kind == "submit":
        return Refused(code="accept_timeout",
                       message=f"the session did not answer within {timeout:g} s",
                       hint="the node is overloaded or stuck; the message may still have been "
                       "accepted, check the session's turns")  # fmt: skip
    return Refused(code="command_timeout", message=f"no answer within {timeout:g} s",
                   hint="the node is overloaded or stuck; retry")  # fmt: skip


def _empty() -> Refused:
    return Refused(code="internal_error", message="the command's answer was empty",
                   hint="this is a bug in Dispach; the node's log has the details")  # fmt: skip

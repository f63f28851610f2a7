"""What a node is doing, for ``GET /v1/activity``: the turns it runs, the outbox items it is
sending, whether it holds the schedule clock. Every node answers ``<cluster>.activity`` (NATS
request/reply); the asking node gathers the answers of the members its lease bucket lists, for
a bounded time, and names the ones that did not answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from importlib import resources

import msgspec
import nats.aio.client
import nats.aio.msg
import nats.aio.subscription
import nats.errors
import structlog

from actors.messages import NodeActivity
from eventstore import EventStore, StoreError, subjects

log = structlog.get_logger("dispach.activity")

_NODE_SQL = resources.files("actors.cluster").joinpath("sql", "activity_node.sql").read_bytes()
TURN_TASK = "turn "
"""The prefix of a running turn's task name (actors/turn/actor.py names it ``turn <id>``)."""


_ENCODE = msgspec.json.Encoder()
_DECODE = msgspec.json.Decoder(NodeActivity)


async def node_activity(
    node_id: str, running: Iterable[asyncio.Task[object]], store: EventStore, scheduler: bool
) -> NodeActivity:
    """This node's activity: ``running`` are the tasks of its turns (SessionDirectory.running)."""
    turns = sorted(t.get_name().removeprefix(TURN_TASK) for t in running
                   if t.get_name().startswith(TURN_TASK))  # fmt: skip
    ((inflight, hooks),) = await store.afetch(_NODE_SQL, {"node": node_id})
    return NodeActivity(node=node_id, idle=not turns and inflight == 0 and hooks == 0,
                        turns_running=len(turns), turns=turns, outbox_inflight=int(inflight),
                        webhooks_inflight=int(hooks), scheduler=scheduler)  # fmt: skip


class Activity:
    """Answers for this node, and gathers the cluster's answers."""

    def __init__(
        self, nc: nats.aio.client.Client, local: Callable[[], Awaitable[NodeActivity]]
    ) -> None:
        self._nc = nc
        self.local = local
        self._sub: nats.aio.subscription.Subscription | None = None

    async def listen(self) -> None:
        self._sub = await self._nc.subscribe(subjects.activity(), cb=self._answer)

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except nats.errors.Error as e:
                log.warning("activity_unsubscribe_failed", error=str(e))
            self._sub = None

    async def _answer(self, msg: nats.aio.msg.Msg) -> None:
        if not msg.reply:
            return
        try:
            answer = await self.local()
            await self._nc.publish(msg.reply, _ENCODE.encode(answer))
        except (StoreError, nats.errors.Error) as e:  # the asker names this node as missing
            log.warning("activity_answer_failed", error=str(e))

    async def gather(
        self, members: Iterable[str], timeout: float = 1.0
    ) -> tuple[list[NodeActivity], list[str]]:
        """Every member's answer within ``timeout`` seconds (sorted by node), and the members
        that gave none."""
        expected = set(members)
        found: dict[str, NodeActivity] = {}
        inbox = self._nc.new_inbox()
        sub = await self._nc.subscribe(inbox)
        try:
            await self._nc.publish(subjects.activity(), b"", reply=inbox)
            deadline = time.monotonic() + timeout
            while not expected <= set(found):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    msg = await sub.next_msg(timeout=left)
                except nats.errors.TimeoutError:
                    break
                try:
                    answer = _DECODE.decode(msg.data)
                except msgspec.DecodeError:
                    continue
                found[answer.node] = answer
        finally:
            await sub.unsubscribe()
        return [found[n] for n in sorted(found)], sorted(expected - set(found))

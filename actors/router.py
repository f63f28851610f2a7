"""Commands reach session actors over NATS: ``dispach.session.<agent>.<session>`` carries a
``Submit`` and ``dispach.turn.<turnId>`` a ``StopTurn``; the answer is a ``Reply``. Every node
serves both in one queue group, so each command is handled once. (With several nodes a session
lease decides which node serves a session; until leases exist, run one node per database.)"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
import nats.aio.client
import nats.aio.msg
import nats.aio.subscription
import nats.errors
import structlog

from actors.bridge import InFlight
from actors.engine import Engine
from actors.messages import (
    TOO_DEEP,
    ClearSession,
    Refused,
    Reply,
    ResolveApproval,
    StopTurn,
    Submit,
    too_deep,
)
from eventstore import subjects

log = structlog.get_logger("dispach.router")

_QUEUE = "dispach-nodes"
C = TypeVar("C")
_SUBMIT = msgspec.json.Decoder(Submit)
_STOP = msgspec.json.Decoder(StopTurn)
_CLEAR = msgspec.json.Decoder(ClearSession)
_RESOLVE = msgspec.json.Decoder(ResolveApproval)
_REPLY = msgspec.json.Encoder()


class Router:
    def __init__(self, nc: nats.aio.client.Client, engine: Engine) -> None:
        self._nc = nc
        self._engine = engine
        self._subs: list[nats.aio.subscription.Subscription] = []
        self._inflight = InFlight()

    async def start(self) -> None:
        wrap = self._inflight.wrap
        self._subs = [
            await self._nc.subscribe(f"{subjects.PREFIX}.session.>", _QUEUE, cb=wrap(self._submit)),
            await self._nc.subscribe(f"{subjects.PREFIX}.turn.>", _QUEUE, cb=wrap(self._stop)),
            await self._nc.subscribe(
                f"{subjects.PREFIX}.sessionadmin.>", _QUEUE, cb=wrap(self._clear)
            ),
            await self._nc.subscribe(
                f"{subjects.PREFIX}.approval.>", _QUEUE, cb=wrap(self._resolve)
            ),
        ]

    async def stop(self, timeout: float = 10.0) -> None:
        for sub in self._subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._subs = []
        await self._inflight.drain(timeout)

    async def _submit(self, msg: nats.aio.msg.Msg) -> None:
        async def handle(submit: Submit) -> Reply:
            result = await self._engine.submit(submit)
            return Reply(error=result) if isinstance(result, Refused) else Reply(accepted=result)

        await _serve(msg, _SUBMIT, handle)

    async def _stop(self, msg: nats.aio.msg.Msg) -> None:
        async def handle(stop: StopTurn) -> Reply:
            return Reply(stop=await self._engine.stop(stop))

        await _serve(msg, _STOP, handle)

    async def _clear(self, msg: nats.aio.msg.Msg) -> None:
        async def handle(clear: ClearSession) -> Reply:
            result = await self._engine.clear(clear)
            return Reply(error=result) if isinstance(result, Refused) else Reply(cleared=result)

        await _serve(msg, _CLEAR, handle)

    async def _resolve(self, msg: nats.aio.msg.Msg) -> None:
        async def handle(resolve: ResolveApproval) -> Reply:
            result = await self._engine.resolve_approval(resolve)
            return Reply(error=result) if isinstance(result, Refused) else Reply(resolved=result)

        await _serve(msg, _RESOLVE, handle)


async def _serve(
    msg: nats.aio.msg.Msg,
    decoder: msgspec.json.Decoder[C],
    handle: Callable[[C], Awaitable[Reply]],
) -> None:
    """Decode a command and answer it; a body that is not one gets ``invalid_command``, one
    nested too deeply to decode ``body_too_deep``."""
    if too_deep(msg.data):
        await _answer(msg, Reply(error=TOO_DEEP))
        return
    try:
        command = decoder.decode(msg.data)
    except msgspec.DecodeError as e:  # not JSON, or not a command
        await _answer(msg, Reply(error=_invalid(e)))
        return
    await _answer(msg, await handle(command))


def _invalid(e: msgspec.DecodeError) -> Refused:
    return Refused(code="invalid_command", message=str(e), hint="see actors/messages.py")


async def _answer(msg: nats.aio.msg.Msg, reply: Reply) -> None:
    if msg.reply:
        try:
            await msg.respond(_REPLY.encode(reply))
        except nats.errors.Error as e:
            log.warning("reply_failed", error=str(e))

"""NATS ingress for internal producers: a request on ``dispach.ingress.<agent>`` with
``{text, sessionKey?, source?, concurrency?}`` is answered ``{turnId, sessionKey}`` once the turn
is accepted (its ``turn.start`` committed), or ``{error: {code, message, hint}}``."""

from __future__ import annotations

import contextlib
from typing import Literal

import msgspec
import nats.aio.client
import nats.aio.msg
import nats.aio.subscription
import nats.errors
import structlog

from actors.bridge import InFlight
from actors.messages import Accepted, Refused, Reply, StopTurn, Submit
from eventstore import subjects

log = structlog.get_logger("dispach.ingress")

MAX_TEXT = 200_000
DEFAULT_SESSION = "api:default"


class IngressMessage(msgspec.Struct, frozen=True, kw_only=True, rename="camel",
                     forbid_unknown_fields=True):  # fmt: skip
    text: str
    session_key: str = DEFAULT_SESSION
    source: str = "nats"
    concurrency: Literal["queue", "reject", "interrupt"] | None = None


class Error(msgspec.Struct, frozen=True):
    error: Refused


_DECODE = msgspec.json.Decoder(IngressMessage)
_REPLY = msgspec.json.Decoder(Reply)
_ENCODE = msgspec.json.Encoder()


async def submit(
    nc: nats.aio.client.Client, agent_id: str, message: IngressMessage, timeout: float = 30.0
) -> Accepted | Refused:
    """Send a message to its session's actor over NATS and wait for the acceptance."""
    command = Submit(agent_id=agent_id, session_key=message.session_key, text=message.text,
                     source=message.source, concurrency=message.concurrency)  # fmt: skip
    try:
        answer = await nc.request(
            subjects.session(agent_id, message.session_key), _ENCODE.encode(command), timeout
        )
    except nats.errors.NoRespondersError:
        return Refused(code="no_node", message="no node serves sessions right now",
                       hint="start a node (`dispach serve`) against this NATS")  # fmt: skip
    except nats.errors.TimeoutError:
        return Refused(code="accept_timeout",
                       message=f"the session did not answer within {timeout:g} s",
                       hint="the node is overloaded or stuck; the message may still have been "
                       "accepted, check the session's turns")  # fmt: skip
    reply = _REPLY.decode(answer.data)
    if reply.error is not None:
        return reply.error
    assert reply.accepted is not None
    return reply.accepted


async def stop(nc: nats.aio.client.Client, turn_id: str, by: str, timeout: float = 10.0) -> Reply:
    answer = await nc.request(
        subjects.turn(turn_id), _ENCODE.encode(StopTurn(turn_id=turn_id, by=by)), timeout
    )
    return _REPLY.decode(answer.data)


class Ingress:
    def __init__(self, nc: nats.aio.client.Client, agents: set[str]) -> None:
        self._nc = nc
        self._agents = agents
        self._sub: nats.aio.subscription.Subscription | None = None
        self._inflight = InFlight()

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(
            f"{subjects.PREFIX}.ingress.*", "dispach-ingress", cb=self._inflight.wrap(self._handle)
        )

    async def stop(self, timeout: float = 10.0) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
            self._sub = None
        await self._inflight.drain(timeout)

    async def _handle(self, msg: nats.aio.msg.Msg) -> None:
        agent_id = msg.subject.rsplit(".", 1)[-1]
        result = await self._accept(agent_id, msg.data)
        if msg.reply:
            body = _ENCODE.encode(Error(result) if isinstance(result, Refused) else result)
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(body)

    async def _accept(self, agent_id: str, data: bytes) -> Accepted | Refused:
        if agent_id not in self._agents:
            return Refused(code="agent_not_found", message=f"no agent {agent_id!r}",
                           hint=f"known agents: {', '.join(sorted(self._agents))}")  # fmt: skip
        try:
            message = _DECODE.decode(data)
        except msgspec.DecodeError as e:
            field = None
            if isinstance(e, msgspec.ValidationError) and "`$." in str(e):
                field = str(e).split("`$.", 1)[1].rstrip("`")
            return Refused(code="invalid_message", message=f"the message is not valid: {e}",
                           hint='send JSON like {"text": "hello", "sessionKey": "api:default"}',
                           field=field)  # fmt: skip
        if not message.text.strip():
            return Refused(code="empty_text", message="the message has no text",
                           hint="send a non-empty `text`", field="text")  # fmt: skip
        if len(message.text) > MAX_TEXT:
            return Refused(code="text_too_long",
                           message=f"the text has {len(message.text)} characters",
                           hint=f"send at most {MAX_TEXT} characters", field="text")  # fmt: skip
        return await submit(self._nc, agent_id, message)

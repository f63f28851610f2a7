"""NATS ingress for internal producers: a request on ``dispach.ingress.<agent>`` with
``{text, sessionKey?, source?, concurrency?}`` is answered ``{turnId, sessionKey}`` once the turn
is accepted (its ``turn.start`` committed), or ``{error: {code, message, hint}}``."""

from __future__ import annotations

import contextlib
import re
from typing import Literal

import msgspec
import nats.aio.client
import nats.aio.msg
import nats.aio.subscription
import nats.errors
import structlog

from actors.idempotency import key_refused
from actors.inflight import InFlight
from actors.messages import (
    HANDOFF,
    TOO_DEEP,
    Accepted,
    CommandPath,
    Refused,
    Submit,
    too_deep,
)
from actors.tracing import attached
from actors.tracing import headers as trace_headers
from eventstore import subjects
from eventstore.catalogue import Deliver, Sender

log = structlog.get_logger("dispach.ingress")

MAX_TEXT = 200_000
MAX_SESSION_KEY = 512
# A character that is not blank: whitespace is the union of Python's (`str.isspace`) and JSON
# Schema's (ECMA `\s`), so the OpenAPI document's pattern and this check agree exactly.
NOT_BLANK = (
    "[^\t\n\x0b\x0c\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff]"
)
_SOMETHING = re.compile(NOT_BLANK)
DEFAULT_SESSION = "api:default"


class IngressMessage(msgspec.Struct, frozen=True, kw_only=True, rename="camel",
                     forbid_unknown_fields=True):  # fmt: skip
    """A message from an internal producer (NATS), and what the HTTP and WS gateways build."""

    text: str
    session_key: str = DEFAULT_SESSION
    source: str = "nats"
    concurrency: Literal["queue", "reject", "interrupt"] | None = None
    deliver: Deliver | None = None
    idempotency_key: str | None = None
    sender: Sender | None = msgspec.field(default=None, name="from")


class Error(msgspec.Struct, frozen=True):
    error: Refused


_DECODE = msgspec.json.Decoder(IngressMessage)
_ENCODE = msgspec.json.Encoder()


async def submit(
    commands: CommandPath, agent_id: str, message: IngressMessage, timeout: float = 30.0
) -> Accepted | Refused:
    """Hand a checked message to its session (through its partition's owner) and wait for the
    acceptance."""
    command = Submit(agent_id=agent_id, session_key=message.session_key, text=message.text,
                     source=message.source, concurrency=message.concurrency,
                     deliver=message.deliver, idempotency_key=message.idempotency_key,
                     sender=message.sender)  # fmt: skip
    return await commands.submit(command, timeout)


async def request(
    nc: nats.aio.client.Client, agent_id: str, message: IngressMessage, timeout: float = 30.0
) -> Accepted | Refused:
    """Submit a message through the NATS door, as an internal producer does (any node of the
    deployment answers; the message then takes the command path to its session's owner)."""
    try:
        answer = await nc.request(subjects.ingress(agent_id), _ENCODE.encode(message), timeout,
                                  headers=trace_headers())  # fmt: skip
    except nats.errors.NoRespondersError:
        return Refused(code="no_node", message="no node serves sessions right now",
                       hint="start a node (`dispach serve`) against this NATS")  # fmt: skip
    except nats.errors.TimeoutError:
        return Refused(code="accept_timeout",
                       message=f"the session did not answer within {timeout:g} s",
                       hint="the node is overloaded or stuck; the message may still have been "
                       "accepted, check the session's turns")  # fmt: skip
    decoded = msgspec.json.decode(answer.data)
    if "error" in decoded:
        return msgspec.convert(decoded["error"], Refused)
    return msgspec.convert(decoded, Accepted)


# The fields whose misfit has a code of its own (Dispach v1's), whatever door the message came
# through: the code, and what a fitting value looks like.
_SHAPES = {
    "deliver": ("deliver_invalid",
                'send {"channel": "<a channel of the agent>", "to": "<recipient>"}, or leave it '
                "out for no delivery: a bare channel id names no recipient"),
    "from": ("sender_invalid",
             'send {"id": "<who sent it>", "name": "<optional>", "kind": "user" or "agent"}'),
}  # fmt: skip


def field_of(error: str) -> str | None:
    """The field a msgspec validation error is about: ``… - at `$.a.b``` and, for a missing
    field, ``Object missing required field `x```."""
    at = error.split("`$.", 1)[1].split("`", 1)[0] if "`$." in error else None
    if "missing required field `" in error:
        missing = error.split("missing required field `", 1)[1].split("`", 1)[0]
        return f"{at}.{missing}" if at else missing
    return at


def shape_refused(field: str | None, detail: str) -> Refused | None:
    """The refusal of a message whose ``deliver`` or ``from`` does not fit its type
    (``deliver_invalid``, ``sender_invalid``, as v1 answers), given the field the decoder
    named and its words; None for any other field (each door's generic refusal)."""
    shape = _SHAPES.get((field or "").split(".", 1)[0])
    if shape is None:
        return None
    code, hint = shape
    return Refused(code=code, message=f"`{field}` does not fit: {detail}", hint=hint,
                   field=field)  # fmt: skip


def session_key_problem(key: str) -> Refused | None:
    """Why ``key`` cannot name a session (checked by :func:`check`, and where a session is
    named without a message: stream tokens), or None."""
    if "\x00" in key:  # check() has said nul_character by then: this is for the other callers
        return Refused(code="session_key_invalid", message="the session key contains a NUL",
                       hint="remove the \\u0000 characters", field="sessionKey")  # fmt: skip
    if "/" in key:
        return Refused(code="session_key_invalid",
                       message=f"the session key {key!r} contains '/'",
                       hint="use ':' or '.' as a separator: session keys are path segments in "
                       "the API", field="sessionKey")  # fmt: skip
    if not key or len(key) > MAX_SESSION_KEY:
        return Refused(code="session_key_invalid",
                       message=f"the session key has {len(key)} characters",
                       hint=f"use 1 to {MAX_SESSION_KEY} characters, e.g. 'api:default'",
                       field="sessionKey")  # fmt: skip
    if not _SOMETHING.search(key):
        return Refused(code="session_key_invalid", message="the session key is blank",
                       hint="use a key with a visible character, e.g. 'api:default'",
                       field="sessionKey")  # fmt: skip
    return None


def check(message: IngressMessage) -> Refused | None:
    """What every door checks before a message reaches its session (HTTP, WS and NATS alike)."""
    for field, value in _texts(message):
        if "\x00" in value:
            return Refused(code="nul_character", message=f"`{field}` contains a NUL character",
                           hint="remove the \\u0000 characters; they cannot be stored",
                           field=field)  # fmt: skip
    if message.source == HANDOFF:  # a member's work comes only from its supervisor's turn
        return Refused(code="source_reserved",
                       message=f"`source` {HANDOFF!r} is the runtime's own (a handoff's)",
                       hint="name your producer in `source`, e.g. 'nats' or 'billing'",
                       field="source")  # fmt: skip
    if not _SOMETHING.search(message.text):
        return Refused(code="message_text_required", message="the message has no text",
                       hint="send a non-empty `text`", field="text")  # fmt: skip
    if len(message.text) > MAX_TEXT:
        return Refused(code="text_too_long",
                       message=f"the text has {len(message.text)} characters",
                       hint=f"send at most {MAX_TEXT} characters", field="text")  # fmt: skip
    problem = session_key_problem(message.session_key)
    if problem is not None:
        return problem
    if message.idempotency_key is not None:
        return key_refused(message.idempotency_key)
    return None


class Ingress:
    def __init__(self, nc: nats.aio.client.Client, agents: set[str], commands: CommandPath) -> None:
        self._nc = nc
        self._agents = agents
        self._commands = commands
        self._sub: nats.aio.subscription.Subscription | None = None
        self._inflight = InFlight()

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(
            subjects.ingress_all(), subjects.queue("ingress"), cb=self._inflight.wrap(self._handle)
        )

    async def stop(self, timeout: float = 10.0) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
            self._sub = None
        await self._inflight.drain(timeout)

    async def _handle(self, msg: nats.aio.msg.Msg) -> None:
        agent_id = msg.subject.rsplit(".", 1)[-1]
        # A producer's traceparent/tracestate headers, when it sends them and tracing is on.
        with attached(msg.headers):
            result = await self._accept(agent_id, msg.data)
        if msg.reply:
            body = _ENCODE.encode(Error(result) if isinstance(result, Refused) else result)
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(body)

    async def _accept(self, agent_id: str, data: bytes) -> Accepted | Refused:
        if agent_id not in self._agents:
            return Refused(code="agent_not_found", message=f"no agent {agent_id!r}",
                           hint=f"known agents: {', '.join(sorted(self._agents))}")  # fmt: skip
        if too_deep(data):  # before decoding: msgspec would recurse into it
            return TOO_DEEP
        try:
            message = _DECODE.decode(data)
        except msgspec.DecodeError as e:
            field = field_of(str(e)) if isinstance(e, msgspec.ValidationError) else None
            return shape_refused(field, str(e)) or Refused(
                code="invalid_message", message=f"the message is not valid: {e}",
                hint='send JSON like {"text": "hello", "sessionKey": "api:default"}',
                field=field)  # fmt: skip
        return check(message) or await submit(self._commands, agent_id, message)


def _texts(message: IngressMessage) -> list[tuple[str, str]]:
    texts = [("text", message.text), ("sessionKey", message.session_key)]
    if message.deliver is not None:
        texts += [("deliver.channel", message.deliver.channel), ("deliver.to", message.deliver.to)]
    if message.sender is not None:
        texts += [("from.id", message.sender.id), ("from.name", message.sender.name or "")]
    return texts

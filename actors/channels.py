"""The channel host: where a message that arrived through a channel (Telegram, ...) becomes a
turn, by the same door as an HTTP message (the command path to the session's owner, then
SessionDirectory.submit there: acceptance, idempotency, the session's concurrency policy), or is
refused on the record (``channel.rejected``).

A channel message's Idempotency-Key is its provider id (``<channel>:<bot>:<update_id>``), so a
provider delivering the same update twice, or a poll repeated after a crash, makes one turn. The
reply goes back to where the message came from: the same chat, and the same forum topic.
"""

from __future__ import annotations

import structlog

from actors.messages import Accepted, CommandPath, Submit, not_addressable
from actors.outbox import InboundMessage
from actors.session.directory import SessionDirectory
from eventstore import ANY, Metadata, NewEvent, StoreError, streams
from eventstore.bridge import settled
from eventstore.catalogue import ChannelRejected, Deliver, Sender

log = structlog.get_logger("dispach.inbox")


class ChannelHost:
    """One per agent: its channels hand inbound messages here."""

    def __init__(self, engine: SessionDirectory, commands: CommandPath, agent_id: str) -> None:
        self._engine = engine
        self._commands = commands
        self._agent_id = agent_id

    async def receive(self, message: InboundMessage) -> None:
        agent = self._engine.agents[self._agent_id]
        channel = agent.channels.get(message.channel_id)
        session_key = _session_key(message)
        if channel is None:
            return
        if not _allowed(channel.allow_from, message):
            who = f"@{message.sender_handle}" if message.sender_handle else message.sender_id
            await self._reject(message, session_key, "denied",
                               f"{who} is not on the allow-list of channel {message.channel_id!r}",
                               f'add "{message.sender_id}" to allow_from of channel '
                               f"{message.channel_id!r} in agents/{self._agent_id}.yaml "
                               '(or "*" to admit anyone)')  # fmt: skip
            return
        closed = not_addressable(self._agent_id, agent.addressable, None)
        if closed is not None:  # a team's member: its work comes from its supervisor only
            await self._reject(message, session_key, "refused", closed.message, closed.hint)
            return
        if message.text is None:
            await self._reject(message, session_key, "unsupported",
                               "the message has no text (a photo, a sticker, a file ...)",
                               "send the request as text")  # fmt: skip
            return
        result = await self._commands.submit(
            Submit(
                agent_id=self._agent_id,
                session_key=session_key,
                text=message.text,
                source=message.channel_id,
                deliver=Deliver(channel=message.channel_id, to=message.peer, thread=message.thread),
                idempotency_key=f"{message.channel_id}:{message.update_id}",
                sender=Sender(
                    id=message.sender_id, name=message.sender_handle or message.sender_name
                ),
            )
        )
        if isinstance(result, Accepted):
            if result.replayed:
                again = f"update {message.update_id} came again; it is turn {result.turn_id}"
                await self._reject(message, session_key, "duplicate", again, "",
                                   turn_id=result.turn_id)  # fmt: skip
            return
        await self._reject(message, session_key, "refused", result.message, result.hint)

    async def _reject(
        self,
        message: InboundMessage,
        session_key: str,
        reason: str,
        text: str,
        hint: str,
        turn_id: str | None = None,
    ) -> None:
        event = ChannelRejected(
            channel_id=message.channel_id, reason=reason,  # type: ignore[arg-type]
            message=text, hint=hint, update_id=message.update_id,
            sender_id=message.sender_id, turn_id=turn_id,
        )  # fmt: skip
        log.info("channel_rejected", agent=self._agent_id, channel=message.channel_id,
                 reason=reason, update=message.update_id)  # fmt: skip
        meta = Metadata(agent_id=self._agent_id, session_key=session_key)
        stream = streams.channel(self._agent_id, message.channel_id)
        try:
            await settled(
                self._engine.store.submit(stream, [NewEvent(event=event, metadata=meta)], ANY)
            )
        except StoreError as e:
            log.warning("channel_rejected_not_stored", error=e.message)


def _session_key(message: InboundMessage) -> str:
    """One session per conversation (and per forum topic), not per sender: everyone in a group
    shares it."""
    key = f"{message.channel_id}:{message.peer}"
    return f"{key}:{message.thread}" if message.thread else key


def _allowed(allow_from: frozenset[str], message: InboundMessage) -> bool:
    if "*" in allow_from:
        return True
    handle = (message.sender_handle or "").lower()
    return message.sender_id in allow_from or (bool(handle) and handle in allow_from)

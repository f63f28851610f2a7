"""The Telegram channel, over the Bot API (``https://api.telegram.org/bot<token>/<method>``).

Inbound: long polling (``getUpdates`` with an offset; the offset confirms what came before it,
so an update fetched again after a crash is simply a duplicate, dropped by its update id) or
Telegram's webhook, whose ``X-Telegram-Bot-Api-Secret-Token`` header is checked in constant time.
Outbound: ``sendMessage``, 4,096 characters counted in UTF-16 code units. Telegram takes no
idempotency key, so a resend after a crash may show twice: the channel says so
(``idempotent = False``), the resend is flagged ``uncertain`` on the record, and
``on_uncertain: skip`` trades that duplicate for a possibly missing reply. A send whose answer is
lost (the connection dropped or timed out once the request could have gone out, or a 5xx other
than the front's 502/503/504) is the same doubt: its result says ``in_doubt`` and the outbox
treats it as it treats a crash. Only what proves the request was not taken is retried blindly: a
connection that never opened (refused, DNS, connect timeout), a 429, the front's 502/503/504.

The bot token is part of every request URL: it is never logged (errors are reported without the
URL, and redacted where a library puts it in a message or a log line: httpx2 logs every request's
URL at INFO).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

import httpx2
import msgspec
import structlog

from actors.outbox import Inbound, InboundMessage, Outbound, SendResult, utf16_len
from eventstore import subjects
from gateways.channels.config import ChannelError, ChannelKind, ChannelSettings, secret

log = structlog.get_logger("dispach.telegram")

MAX_CHARS = 4096
_INTEGER = re.compile(r"-?[0-9]{1,20}")
_USERNAME = re.compile(r"@[A-Za-z][A-Za-z0-9_]{3,31}")
_POLL_BACKOFF_S = (1.0, 2.0, 5.0, 15.0, 30.0)
_SECRET_HEADER = "x-telegram-bot-api-secret-token"  # noqa: S105 - a header name


_NOT_SENT = (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout,
             httpx2.UnsupportedProtocol)  # fmt: skip
"""Transport failures raised before a byte of the request went out: no connection was made (DNS
failure and refusal are ConnectError), or none was free. Every other one (ReadTimeout,
WriteTimeout, ReadError, WriteError, RemoteProtocolError: the server closed without answering)
may come after Telegram read the request: in doubt."""
_FRONT = frozenset({502, 503, 504})
"""What nginx in front of the Bot API answers when the API behind it is away: nothing was sent.
Any other 5xx is the API's own, which may come after the message went out."""


class TelegramConfig(ChannelSettings, frozen=True, kw_only=True, tag="telegram",
                     tag_field="type"):  # fmt: skip
    token_env: str = "TELEGRAM_BOT_TOKEN"  # noqa: S105 - the name of a variable
    mode: Literal["longpoll", "webhook"] = "longpoll"
    secret_token_env: str | None = None
    """webhook mode: the variable holding the secret Telegram echoes in
    ``X-Telegram-Bot-Api-Secret-Token`` (required in webhook mode)."""
    api_base_url: str = "https://api.telegram.org"
    allow_from: list[str] = msgspec.field(default_factory=list)
    """Who may talk to the agent: user ids, ``@usernames``, or ``"*"`` for anyone. Closed by
    default: a sender not listed is refused (``channel.rejected``, with the line to add)."""
    poll_timeout_s: Annotated[int, msgspec.Meta(ge=0, le=50)] = 25
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=55)] = 30.0
    """How long a ``sendMessage`` may take; past it the send is in doubt (it may have been
    delivered), not retried blindly. Under the outbox's own 60 s cut."""


def build(agent_id: str, config: TelegramConfig, env: Mapping[str, str]) -> TelegramChannel:
    token = secret(agent_id, config.id, config.token_env, env)
    webhook_secret = None
    if config.mode == "webhook":
        if config.secret_token_env is None:
            raise ChannelError(
                f"agent {agent_id!r}: channel {config.id!r} takes webhooks without a secret token",
                "set secret_token_env to a variable holding a random string; Telegram sends it "
                "back with every update so forged updates are refused",
                field="channels.secret_token_env",
            )
        webhook_secret = secret(agent_id, config.id, config.secret_token_env, env)
    return TelegramChannel(config, token, webhook_secret)


class TelegramError(Exception):
    def __init__(
        self,
        status: int,
        description: str,
        retry_after: float | None,
        *,
        in_doubt: bool = False,
        code: str = "",
    ) -> None:
        super().__init__(description)
        self.status = status
        self.description = description
        self.retry_after = retry_after
        self.in_doubt = in_doubt
        """The call may have been carried out (see ``_NOT_SENT`` and ``_FRONT``)."""
        self.code = code or f"telegram_{status}"


class TelegramChannel:
    type = "telegram"
    ordered = True
    idempotent = False
    concurrency = 8
    max_chars = MAX_CHARS

    def __init__(self, config: TelegramConfig, token: str, webhook_secret: str | None) -> None:
        self.id = config.id
        self.config = config
        self.on_uncertain: Literal["resend", "skip"] = config.on_uncertain
        self.backoff_s = tuple(config.backoff_s)
        self.measure: Callable[[str], int] = utf16_len
        # Handles match without their @ and in any case; ids match as given.
        self.allow_from = frozenset(a.strip().lower().removeprefix("@") for a in config.allow_from)
        self.bot_id = token.split(":", 1)[0]
        # One long poll per bot across the cluster (two would split its updates between them).
        self.singleton = (
            f"telegram.{subjects.token(self.bot_id)}" if config.mode == "longpoll" else None
        )
        self._token = token
        self._base = f"{config.api_base_url.rstrip('/')}/bot{token}/"
        self._webhook_secret = webhook_secret
        self._timeout = config.timeout_s
        self._client = httpx2.AsyncClient(timeout=self._timeout)
        self._redactor = _Redactor(token)
        logging.getLogger("httpx2").addFilter(self._redactor)
        self._poller: asyncio.Task[None] | None = None
        self._inbound: Inbound | None = None
        self._paused = False
        """The agent is stopped: no getUpdates (Telegram keeps the updates), webhooks get 503."""

    def __repr__(self) -> str:  # the token stays out of logs and tracebacks
        return f"TelegramChannel(id={self.id!r}, mode={self.config.mode!r})"

    # --- the Bot API --------------------------------------------------------------------------

    async def call(
        self,
        method: str,
        payload: dict[str, Any],
        timeout: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """One Bot API call: its ``result``, or TelegramError (never with the URL in it) that
        says whether the call may have been carried out all the same (``in_doubt``)."""
        try:
            response = await self._client.post(
                self._base + method, json=payload, timeout=timeout or self._timeout,
                headers=headers,
            )  # fmt: skip
        except httpx2.HTTPError as e:
            raise _transport_error(e, self._redact(f"{type(e).__name__}: {e}")) from None
        status = response.status_code
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if not isinstance(answer, dict):  # not the API's envelope: a front's page, or garbage
            doubt = 200 <= status < 300 or (status >= 500 and status not in _FRONT)
            raise TelegramError(status, f"HTTP {status} without the Bot API's answer", None,
                                in_doubt=doubt)  # fmt: skip
        if answer.get("ok") is True:
            return answer.get("result")
        params = answer.get("parameters") or {}
        retry_after = params.get("retry_after") if isinstance(params, dict) else None
        code = int(answer.get("error_code") or status)
        raise TelegramError(
            code,
            self._redact(str(answer.get("description") or "no description")),
            float(retry_after) if isinstance(retry_after, int | float) else None,
            in_doubt=code >= 500 and code not in _FRONT,
        )

    def _redact(self, text: str) -> str:
        return text.replace(self._token, "<token>")

    # --- outbound -----------------------------------------------------------------------------

    def target_problem(self, to: str, thread: str | None) -> str | None:
        if not (_INTEGER.fullmatch(to) or _USERNAME.fullmatch(to)):
            return (f"{to!r} is not a Telegram chat: give the numeric chat id (a private chat "
                    "needs it) or @channelusername")  # fmt: skip
        if thread is not None and not _INTEGER.fullmatch(thread):
            return f"thread {thread!r} is not a forum topic id (a number)"
        return None

    async def send(self, item: Outbound) -> SendResult:
        payload: dict[str, Any] = {"chat_id": _chat(item.to), "text": item.text}
        problem = self.target_problem(item.to, item.thread)
        if problem is not None:  # accepted before this check existed, or by another version
            return SendResult(ok=False, code="telegram_target_invalid", error=problem)
        if item.thread is not None:
            payload["message_thread_id"] = int(item.thread)
        headers = {"x-dispach-uncertain": "1"} if item.uncertain else None
        try:
            result = await self.call("sendMessage", payload, headers=headers)
        except TelegramError as e:
            return _classify(e)
        message_id = result.get("message_id", "") if isinstance(result, dict) else ""
        return SendResult(ok=True, provider_message_id=str(message_id))

    # --- inbound ------------------------------------------------------------------------------

    async def start(self, inbound: Inbound) -> None:
        self._inbound = inbound
        self._polling()

    async def stop(self) -> None:
        self._inbound = None  # webhook updates from now on are answered 503
        await self._hold()

    async def pause(self, paused: bool) -> None:
        """While the agent is stopped nothing is fetched: the long poll in flight is cancelled
        (what it fetched and had not taken is unconfirmed, so Telegram sends it again) and
        none is made until the agent starts; a webhook update is answered 503, which Telegram
        retries. The updates wait at Telegram meanwhile, and the offset it holds confirms only
        what was taken, so none is lost."""
        self._paused = paused
        if paused:
            await self._hold()
        else:
            self._polling()

    def _polling(self) -> None:
        """Begin the long poll, when the channel has inbound, is not paused, and polls none."""
        if self.config.mode != "longpoll" or self._inbound is None or self._paused:
            return
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll(self._inbound),
                                               name=f"telegram-{self.id}")  # fmt: skip

    async def _hold(self) -> None:
        poller, self._poller = self._poller, None
        if poller is not None:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller

    async def aclose(self) -> None:
        await self._client.aclose()
        logging.getLogger("httpx2").removeFilter(self._redactor)

    async def _poll(self, inbound: Inbound) -> None:
        offset: int | None = None
        failures = 0
        timeout = self.config.poll_timeout_s
        while True:
            payload: dict[str, Any] = {"timeout": timeout, "allowed_updates": ["message"]}
            if offset is not None:
                payload["offset"] = offset
            try:
                updates = await self.call("getUpdates", payload, timeout=timeout + 10)
            except TelegramError as e:
                pause = _POLL_BACKOFF_S[min(failures, len(_POLL_BACKOFF_S) - 1)]
                if e.retry_after is not None:
                    pause = e.retry_after
                if failures % 8 == 0:  # the first failure, then every eighth
                    log.warning("telegram_poll_failed", channel=self.id, status=e.status,
                                error=e.description, retry_in_s=pause)  # fmt: skip
                failures += 1
                await asyncio.sleep(pause)
                continue
            failures = 0
            for update in updates if isinstance(updates, list) else []:
                if isinstance(update, dict) and isinstance(update.get("update_id"), int):
                    try:
                        await self._take(inbound, update)
                    except Exception:
                        # The node could not take it (an outage, a bug): left unconfirmed, it
                        # comes again with the next poll, after a pause, instead of the loop
                        # dying and the channel going deaf.
                        log.exception("telegram_update_failed", channel=self.id,
                                      update=update["update_id"])  # fmt: skip
                        await asyncio.sleep(_POLL_BACKOFF_S[0])
                        break
                    # Confirmed with the next getUpdates: a crash before then fetches the
                    # update again, and its id makes it a duplicate, not a second turn.
                    offset = update["update_id"] + 1

    async def webhook(self, headers: dict[str, str], update: Any) -> tuple[int, str]:
        """An update Telegram POSTed: ``(status, detail)`` for the HTTP answer."""
        given = headers.get(_SECRET_HEADER, "")
        expected = self._webhook_secret
        if self.config.mode != "webhook" or expected is None:
            return 404, "this channel does not take webhooks"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            return 401, "secret token mismatch"
        if not isinstance(update, dict) or not isinstance(update.get("update_id"), int):
            return 400, "not a Telegram update"
        if self._inbound is None:
            return 503, "the node is not taking messages now"
        if self._paused:
            return 503, "the agent is stopped; Telegram sends the update again later"
        await self._take(self._inbound, update)
        return 200, "ok"

    async def _take(self, inbound: Inbound, update: dict[str, Any]) -> None:
        message = self.parse(update)
        if message is not None:
            await inbound.receive(message)

    def parse(self, update: dict[str, Any]) -> InboundMessage | None:
        """The message an update carries, or None for updates that are not messages (or not
        shaped like one: a malformed update must not stop the channel)."""
        message = _dict(update.get("message"))
        chat, sender = _dict(message.get("chat")), _dict(message.get("from"))
        chat_id = chat.get("id")
        if not isinstance(chat_id, int | str):
            return None
        thread = message.get("message_thread_id") if message.get("is_topic_message") else None
        text = message.get("text")
        names = (sender.get("first_name"), sender.get("last_name"))
        handle = sender.get("username")
        return InboundMessage(
            channel_id=self.id,
            update_id=f"{self.bot_id}:{update['update_id']}",
            peer=str(chat_id),
            thread=str(thread) if isinstance(thread, int) else None,
            sender_id=str(sender.get("id", chat_id)),
            sender_handle=handle if isinstance(handle, str) and handle else None,
            sender_name=" ".join(n for n in names if isinstance(n, str) and n) or None,
            text=text if isinstance(text, str) and text.strip() else None,
        )


class _Redactor(logging.Filter):
    """Masks the token in httpx2's records, which carry each request's URL (a filter on that
    logger, so the line is clean before any handler formats it, whatever the log setup)."""

    def __init__(self, token: str) -> None:
        super().__init__()
        self._token = token

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self._token in message:
            record.msg, record.args = message.replace(self._token, "<token>"), ()
        return True


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _chat(to: str) -> int | str:
    """Chat ids are integers; ``@channelusername`` is allowed for channels."""
    try:
        return int(to)
    except ValueError:
        return to


def _transport_error(error: httpx2.HTTPError, description: str) -> TelegramError:
    if isinstance(error, _NOT_SENT):
        return TelegramError(0, description, None, code="delivery_unreachable")
    code = "delivery_timeout" if isinstance(error, httpx2.TimeoutException) else (
        "delivery_connection_lost")  # fmt: skip
    return TelegramError(0, description, None, in_doubt=True, code=code)


def _classify(error: TelegramError) -> SendResult:
    """A failed ``sendMessage``: in doubt (the outbox follows ``on_uncertain``), retried blindly
    (nothing was sent: not connected, flood control, the front's 5xx), or final (other 4xx)."""
    status = error.status
    retryable = error.in_doubt or status in {0, 409, 429} or status >= 500
    return SendResult(
        ok=False,
        retryable=retryable,
        in_doubt=error.in_doubt,
        code=error.code,
        error=error.description,
        retry_after_s=error.retry_after if status == 429 else None,
    )


KIND = ChannelKind(TelegramConfig, build)
"""Inbound: a long poll on one node at a time (``singleton``), or Telegram's webhook."""

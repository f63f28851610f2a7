"""A faithful fake of the Telegram Bot API, served on a real local socket.

A bot client talks to it unchanged at ``{fake.url}/bot<TOKEN>/<method>`` (GET or POST; parameters
in the query string, a JSON body or a form-urlencoded body, as the real API takes them). Every
answer has the real envelope: ``{"ok": true, "result": ...}`` or ``{"ok": false, "error_code":
..., "description": ..., "parameters": {"retry_after": N}}``. A wrong token answers 401, an
unknown method 404, method names are case-insensitive.

``getUpdates`` follows the real semantics: updates have increasing ``update_id``; a call with
``offset=N`` forgets (confirms) every update below N; without an offset unconfirmed updates come
back again; ``timeout`` holds the request (at most ``MAX_POLL_SECONDS``) until an update arrives,
and a newer ``getUpdates`` ends a waiting one with 409, like the real "terminated by other
getUpdates request". While a webhook is set, ``getUpdates`` answers 409 too.

Faults are scripted per method, first in first out: ``fail_next`` (an error answer),
``front_error_next`` (an HTML error page from the nginx in front of the API: the call never
reached it), ``drop_next`` (the connection closes with no answer) and ``hold_next`` (a late
answer, past a client's timeout if it likes). A dropped or held call is carried out first (the
message *is* sent) unless ``processed=False``: the provider got the bytes and acted, only the
answer is lost or late, which is the window where duplicates are born.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

from tests.fakes._local_server import Drop, Handler, Hold, LocalServer, phrase

__all__ = ["MAX_POLL_SECONDS", "MAX_TEXT_LENGTH", "Call", "FakeTelegram"]

MAX_TEXT_LENGTH = 4096
MAX_POLL_SECONDS = 30.0
PARSE_MODES = frozenset({"HTML", "Markdown", "MarkdownV2"})
BOT_USER = {"id": 7000000001, "is_bot": True, "first_name": "Dispach", "username": "dispach_bot"}
_TERMINATED = "Conflict: terminated by other getUpdates request; make sure that only one bot "
_TERMINATED += "instance is running"
_WEBHOOK_ACTIVE = "Conflict: can't use getUpdates method while webhook is active; use "
_WEBHOOK_ACTIVE += "deleteWebhook to delete the webhook first"


@dataclass(frozen=True)
class Call:
    """One API call as the fake read it: query and body parameters merged, headers lowercased."""

    method: str
    params: dict[str, Any]
    headers: dict[str, str]
    caller: str | None = None
    """Who made the call, as ``FakeTelegram.identify`` names the client's address (None when no
    ``identify`` is set or it could not tell)."""


@dataclass(frozen=True)
class _Fail:
    status: int
    description: str
    retry_after: int | None
    front: bool = False
    """Answered by the front (an HTML page, not the API's envelope): nothing was carried out."""


class _ApiError(Exception):
    def __init__(self, status: int, description: str, retry_after: int | None = None) -> None:
        super().__init__(description)
        self.status, self.description, self.retry_after = status, description, retry_after

    def payload(self) -> dict[str, Any]:
        body: dict[str, Any] = {"ok": False, "error_code": self.status}
        body["description"] = self.description
        if self.retry_after is not None:
            body["parameters"] = {"retry_after": self.retry_after}
        return body


_Answer = tuple[int, dict[str, Any] | str] | None
"""The status and the JSON payload (or a front's HTML page); None: close without an answer."""


class FakeTelegram(LocalServer):
    """The fake Bot API server. Thread-safe; use as a context manager or ``start()``/``stop()``
    (which ends long polls and holds at once and cuts every open connection); ``url`` is the
    API root, a method lives at ``{url}/bot{token}/{method}``."""

    def __init__(
        self, token: str, *, first_update_id: int = 1000, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        super().__init__(_Handler, "fake-telegram", host=host, port=port)
        self.token = token
        self._pending: list[dict[str, Any]] = []
        self._next_update_id = first_update_id
        self._confirmed = 0
        self._poll_generation = 0
        self._allowed: frozenset[str] | None = None
        self._webhook_url = ""
        self._message_ids: dict[int | str, int] = {}
        self._chats: dict[int | str, dict[str, Any]] = {}
        self._forbidden: set[int | str] = set()
        self._faults: dict[str, deque[_Fail | Drop | Hold]] = {}
        self._calls: list[Call] = []
        self._sent: list[dict[str, Any]] = []
        self.identify: Callable[[tuple[str, int]], str | None] | None = None
        """Names the caller from the client's (host, port), on the connection thread while the
        connection is open (e.g. which of several bot processes polls): kept in ``Call.caller``."""

    # the test's side ------------------------------------------------------------------------

    def push_message(
        self,
        chat_id: int,
        text: str,
        *,
        from_id: int | None = None,
        username: str | None = None,
        first_name: str = "Ada",
        message_thread_id: int | None = None,
        chat_type: str = "private",
    ) -> dict[str, Any]:
        """Queue an Update carrying a text message a user wrote in ``chat_id``; return it."""
        default_sender = chat_id if chat_type == "private" else 424242
        sender: dict[str, Any] = {"id": from_id if from_id is not None else default_sender}
        sender |= {"is_bot": False, "first_name": first_name}
        if username is not None:
            sender["username"] = username
        chat: dict[str, Any] = {"id": chat_id, "type": chat_type}
        if chat_type == "private":
            chat |= {k: v for k, v in sender.items() if k in ("first_name", "username")}
        else:
            chat["title"] = f"Chat {chat_id}"
            if message_thread_id is not None:
                chat["is_forum"] = True
        with self._changed:
            self._chats[chat_id] = chat
            message = self._new_message(chat_id, sender, text, message_thread_id)
        return self.push_update({"message": message})

    def push_update(self, update: dict[str, Any]) -> dict[str, Any]:
        """Queue a raw Update (given an ``update_id`` if it has none); return it."""
        update = dict(update)
        with self._changed:
            update.setdefault("update_id", self._next_update_id)
            self._next_update_id = max(self._next_update_id, update["update_id"] + 1)
            self._pending.append(update)
            self._changed.notify_all()
        return update

    @property
    def updates_confirmed(self) -> int:
        """The highest offset a ``getUpdates`` call has passed (0 before any)."""
        with self._lock:
            return self._confirmed

    def forbid_chat(self, chat_id: int | str) -> None:
        """From now on sending to ``chat_id`` answers 403, as when the user blocked the bot."""
        with self._lock:
            self._forbidden.add(chat_id)

    def fail_next(
        self,
        method: str,
        status: int,
        description: str,
        *,
        retry_after: int | None = None,
        count: int = 1,
    ) -> None:
        """Answer the next ``count`` calls of ``method`` with an error (429 + ``retry_after`` is
        the real flood-control shape) without carrying them out."""
        self._script(method, [_Fail(status, description, retry_after)] * count)

    def front_error_next(self, method: str, status: int, *, count: int = 1) -> None:
        """Answer the next ``count`` calls of ``method`` from the front (``502``/``503``/``504``
        as an nginx HTML page) without carrying them out: the API never saw them."""
        self._script(method, [_Fail(status, phrase(status), None, front=True)] * count)

    def drop_next(self, method: str, count: int = 1, *, processed: bool = True) -> None:
        """Close the connection of the next ``count`` calls without an answer."""
        self._script(method, [Drop(processed)] * count)

    def hold_next(self, method: str, seconds: float) -> None:
        """Carry out the next call of ``method`` but answer it ``seconds`` late."""
        self._script(method, [Hold(seconds)])

    def _script(self, method: str, faults: list[_Fail | Drop | Hold]) -> None:
        with self._lock:
            self._faults.setdefault(method.lower(), deque()).extend(faults)

    # records --------------------------------------------------------------------------------

    @property
    def sent(self) -> list[dict[str, Any]]:
        """Every message sent (chat_id, text, message_thread_id, reply_to_message_id,
        parse_mode, message_id, headers), in order."""
        with self._lock:
            return list(self._sent)

    def calls(self, method: str | None = None) -> list[Call]:
        """Every call (of ``method``, if given) that passed the token check, in order."""
        with self._lock:
            return [c for c in self._calls if method is None or c.method.lower() == method.lower()]

    def wait_for_sent(self, n: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Block until at least ``n`` messages have been sent; return them all."""
        with self._changed:
            if not self._changed.wait_for(lambda: len(self._sent) >= n, timeout):
                raise TimeoutError(f"{len(self._sent)} of {n} messages sent in {timeout} s")
            return list(self._sent)

    # answering (on connection threads) ------------------------------------------------------

    def _answer(
        self,
        path: str,
        query: str,
        headers: dict[str, str],
        raw: bytes,
        peer: tuple[str, int] | None = None,
    ) -> _Answer:
        """The status and JSON payload to answer, or None to drop the connection."""
        token, _, method = path.removeprefix("/bot").partition("/")
        if not path.startswith("/bot") or not method:
            return 404, _ApiError(404, "Not Found").payload()
        if token != self.token:
            return 401, _ApiError(401, "Unauthorized").payload()
        entry = _METHODS.get(method.lower())
        if entry is None:
            return 404, _ApiError(404, "Not Found").payload()
        name, run = entry
        fault: _Fail | Drop | Hold | None = None
        try:
            identify = self.identify
            caller = identify(peer) if identify is not None and peer is not None else None
            call = Call(name, _params(query, headers.get("content-type", ""), raw), headers, caller)
            with self._changed:
                self._calls.append(call)
                script = self._faults.get(name.lower())
                fault = script.popleft() if script else None
            if isinstance(fault, _Fail) and fault.front:
                return fault.status, _front_page(fault.status)
            if isinstance(fault, _Fail):
                raise _ApiError(fault.status, fault.description, fault.retry_after)
            if isinstance(fault, Drop) and not fault.processed:
                return None
            answer: tuple[int, dict[str, Any] | str] = 200, {"ok": True, "result": run(self, call)}
        except _ApiError as error:
            answer = error.status, error.payload()
        if isinstance(fault, Hold) and self._stopping.wait(fault.seconds):
            return None
        return None if isinstance(fault, Drop) else answer

    def _new_message(
        self, chat_id: int | str, sender: dict[str, Any], text: str, thread: int | None
    ) -> dict[str, Any]:
        """A Message numbered in its chat (ids are shared by both directions); lock held."""
        self._message_ids[chat_id] = message_id = self._message_ids.get(chat_id, 0) + 1
        chat = self._chats.get(chat_id) or _guess_chat(chat_id)
        message = {"message_id": message_id, "from": sender, "chat": chat}
        message |= {"date": int(time.time()), "text": text}
        if thread is not None:
            message |= {"message_thread_id": thread, "is_topic_message": True}
        return message

    def _get_me(self, call: Call) -> Any:
        return dict(BOT_USER)

    def _get_updates(self, call: Call) -> Any:
        offset = _int(call, "offset")
        limit = min(max(_int(call, "limit") or 100, 1), 100)
        try:
            timeout = min(max(float(call.params.get("timeout") or 0), 0.0), MAX_POLL_SECONDS)
        except (TypeError, ValueError):
            raise _ApiError(400, "Bad Request: invalid timeout specified") from None
        allowed = _json(call, "allowed_updates")
        deadline = time.monotonic() + timeout
        with self._changed:
            if self._webhook_url:
                raise _ApiError(409, _WEBHOOK_ACTIVE)
            if allowed is not None:  # remembered for later calls, as the real API does
                self._allowed = frozenset(allowed) or None
            if offset is not None:
                self._confirmed = max(self._confirmed, offset)
                self._pending = [u for u in self._pending if u["update_id"] >= offset]
            if self._allowed is not None:
                self._pending = [u for u in self._pending if self._allowed & u.keys()]
            self._poll_generation += 1
            mine = self._poll_generation
            self._changed.notify_all()
            while not self._pending and not self._stopping.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(remaining)
                if self._poll_generation != mine:
                    raise _ApiError(409, _TERMINATED)
            return self._pending[:limit]

    def _send_message(self, call: Call) -> Any:
        chat_id = _chat_id(call)
        text = str(call.params.get("text") or "")
        if not text.strip():
            raise _ApiError(400, "Bad Request: message text is empty")
        if len(text) > MAX_TEXT_LENGTH:
            raise _ApiError(400, "Bad Request: message is too long")
        parse_mode = call.params.get("parse_mode") or None
        if parse_mode is not None and parse_mode not in PARSE_MODES:
            raise _ApiError(400, f"Bad Request: unsupported parse_mode {parse_mode!r}")
        thread = _int(call, "message_thread_id")
        reply = _json(call, "reply_parameters")
        reply_to = reply.get("message_id") if isinstance(reply, dict) else None
        reply_to = reply_to if reply_to is not None else _int(call, "reply_to_message_id")
        with self._changed:
            if chat_id in self._forbidden:
                raise _ApiError(403, "Forbidden: bot was blocked by the user")
            message = self._new_message(chat_id, dict(BOT_USER), text, thread)
            sent = dict(chat_id=chat_id, text=text, message_thread_id=thread, parse_mode=parse_mode)
            sent |= dict(reply_to_message_id=reply_to, message_id=message["message_id"])
            self._sent.append(sent | {"headers": call.headers})
            self._changed.notify_all()
        return message

    def _send_chat_action(self, call: Call) -> Any:
        chat_id = _chat_id(call)
        if not call.params.get("action"):
            raise _ApiError(400, "Bad Request: action is empty")
        with self._lock:
            if chat_id in self._forbidden:
                raise _ApiError(403, "Forbidden: bot was blocked by the user")
        return True

    def _set_webhook(self, call: Call) -> Any:
        with self._changed:
            self._webhook_url = str(call.params.get("url") or "")
            self._poll_generation += 1  # a waiting getUpdates ends, as on the real API
            self._changed.notify_all()
        return True

    def _delete_webhook(self, call: Call) -> Any:
        with self._lock:
            self._webhook_url = ""
            if str(call.params.get("drop_pending_updates")).lower() == "true":
                self._pending.clear()
        return True


_Method = Callable[[FakeTelegram, Call], Any]
_METHODS: dict[str, tuple[str, _Method]] = {
    name.lower(): (name, run)
    for name, run in [
        ("getMe", FakeTelegram._get_me),
        ("getUpdates", FakeTelegram._get_updates),
        ("sendMessage", FakeTelegram._send_message),
        ("sendChatAction", FakeTelegram._send_chat_action),
        ("setWebhook", FakeTelegram._set_webhook),
        ("deleteWebhook", FakeTelegram._delete_webhook),
    ]
}


# --------------------------------------------------------------------------------------------
# Parameters: the real API takes the same names from the query, a JSON body or a form body.


def _params(query: str, content_type: str, raw: bytes) -> dict[str, Any]:
    params: dict[str, Any] = dict(parse_qsl(query))
    if "json" in content_type and raw:
        try:
            body = json.loads(raw)
        except ValueError:
            raise _ApiError(400, "Bad Request: can't parse JSON object") from None
        if not isinstance(body, dict):
            raise _ApiError(400, "Bad Request: can't parse JSON object")
        params.update(body)
    elif "x-www-form-urlencoded" in content_type:
        params.update(parse_qsl(raw.decode()))
    return params


def _int(call: Call, name: str) -> int | None:
    value = call.params.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise _ApiError(400, f"Bad Request: invalid {name} specified") from None


def _json(call: Call, name: str) -> Any:
    """A structured parameter: sent as such in a JSON body, JSON-serialised in a form."""
    value = call.params.get(name)
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise _ApiError(400, f"Bad Request: can't parse {name} JSON object") from None
    return value


def _chat_id(call: Call) -> int | str:
    value = call.params.get("chat_id")
    if value is None or value == "":
        raise _ApiError(400, "Bad Request: chat_id is empty")
    if isinstance(value, str) and value.startswith("@"):
        return value
    try:
        return int(value)
    except (TypeError, ValueError):
        raise _ApiError(400, "Bad Request: chat not found") from None


def _guess_chat(chat_id: int | str) -> dict[str, Any]:
    """The chat of an id no message came from: positive ids are users, negative ones groups."""
    if isinstance(chat_id, str) or chat_id < 0:
        return {"id": chat_id, "type": "supergroup", "title": f"Chat {chat_id}"}
    return {"id": chat_id, "type": "private", "first_name": "Ada"}


# --------------------------------------------------------------------------------------------
# The handler


class _Handler(Handler[FakeTelegram]):
    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def _serve(self) -> None:
        fake = self.owner
        raw = self._read_body()
        path, _, query = self.path.partition("?")
        try:
            peer = (str(self.client_address[0]), int(self.client_address[1]))
            answer = fake._answer(path, query, self._lowered_headers(), raw, peer)
        except Exception as error:  # a bug in the fake: say so, as a 500
            fake._record_error(error)
            answer = 500, {"ok": False, "error_code": 500, "description": repr(error)}
        if answer is None:
            self._drop()
            return
        status, payload = answer
        if isinstance(payload, str):
            self._reply(status, payload.encode(), _FRONT_HEADERS)
            return
        data = json.dumps(payload, ensure_ascii=False).encode()
        self._reply(status, data, _HEADERS)


_HEADERS = (("Server", "nginx"), ("Content-Type", "application/json"))
_FRONT_HEADERS = (("Server", "nginx"), ("Content-Type", "text/html"))


def _front_page(status: int) -> str:
    """The page nginx answers when the API behind it is away (a 502, 503 or 504)."""
    title = f"{status} {phrase(status)}"
    return (f"<html>\r\n<head><title>{title}</title></head>\r\n<body>\r\n"
            f"<center><h1>{title}</h1></center>\r\n<hr><center>nginx</center>\r\n"
            "</body>\r\n</html>\r\n")  # fmt: skip

"""A small Python client for a node's HTTP API: send a message, then follow its turn live.

```python
from gateways.client import Client

with Client("http://127.0.0.1:7420", token=None) as client:
    accepted = client.send("assistant", "calculate 6*7")
    for frame in client.stream_turn("assistant", accepted.turn_id):
        if frame.event == "model.chunk":
            print(frame.data["data"]["delta"], end="")
```

The live stream is the log (DESIGN.md 2.4): every event frame carries its cursor as the SSE
``id``, so after a dropped connection :meth:`Client.stream_turn` reconnects with
``Last-Event-ID`` and carries on exactly after the last event it yielded.

:meth:`Client.send` sends every message with an ``Idempotency-Key`` (a fresh random one unless
the caller gives one) and sends it again, with the same key, when the answer says to retry or is
lost: a ``503`` (the node is starting, or a dependency is down: after its ``Retry-After``), a
``504 accept_timeout``, or a connection that broke or timed out after the request went out. The
key makes the retry safe: a message the node had accepted is replayed, never run twice.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple
from urllib.parse import quote

import httpx2
import msgspec

__all__ = ["DEFAULT_URL", "Accepted", "Client", "ClientError", "SseFrame", "StreamFrame", "parse"]

DEFAULT_URL = "http://127.0.0.1:7420"

# Waits before reconnection attempts 1..10 (13 s in all). A frame that arrives resets the count,
# so only a node that stays unreachable this long ends the stream.
RECONNECT_DELAYS = (0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0, 2.0, 2.0)
# How long send() keeps sending a message again (with its key) while the node says to retry;
# one retry is always made. A Retry-After is followed up to MAX_RETRY_AFTER_S.
SEND_RETRY_S = 30.0
MAX_RETRY_AFTER_S = 5.0

_UNREACHABLE_HINT = (
    "start a node with `dispach serve`, or point DISPACH_URL (or --url) at a running one"
)


class ClientError(Exception):
    """A refusal from the node (its error envelope) or a failure to reach it (``status`` None)."""

    def __init__(
        self,
        status: int | None,
        code: str,
        message: str,
        hint: str,
        field: str | None = None,
        *,
        retry_after: float = 1.0,
    ) -> None:
        super().__init__(f"{code}: {message} (hint: {hint})")
        self.status = status
        self.code = code
        self.message = message
        self.hint = hint
        self.field = field
        self.retry_after = retry_after
        """Seconds the node asked to wait before a retry (its ``Retry-After``; default 1)."""


class Accepted(msgspec.Struct, frozen=True, rename="camel"):
    """A durably accepted message; ``replayed`` when an idempotency key matched an earlier one."""

    turn_id: str
    session_key: str
    replayed: bool = False


class StreamFrame(msgspec.Struct, frozen=True):
    """One SSE frame of a turn's stream. For an event frame ``id`` is its cursor and ``data`` the
    public envelope (the event's payload is ``data["data"]``); control frames (``stream.replay``,
    ``stream.ended``) have no ``id``."""

    event: str
    id: str | None
    data: dict[str, Any]


class SseFrame(NamedTuple):
    event: str
    id: str | None
    data: str


def parse(lines: Iterable[str]) -> Iterator[SseFrame]:
    """Server-sent event frames from lines without their line ends (the WHATWG rules, except
    that ``id`` belongs to one frame: control frames have none and must not inherit one)."""
    event: str | None = None
    frame_id: str | None = None
    data: list[str] = []
    for line in lines:
        if not line:
            if data or event is not None:
                yield SseFrame(event or "message", frame_id, "\n".join(data))
            event, frame_id, data = None, None, []
            continue
        if line.startswith(":"):
            continue  # a comment: the server's heartbeat
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
        elif name == "id" and "\0" not in value:
            frame_id = value
        # `retry` and unknown fields are ignored: reconnection is paced by RECONNECT_DELAYS.


_JSON = msgspec.json.Decoder(dict[str, Any])
_JSON_LIST = msgspec.json.Decoder(list[dict[str, Any]])


class Client:
    """A blocking client; one connection pool, closed by :meth:`close` or ``with``.

    ``timeout`` bounds each request; a stream may stay silent for ``stream_idle_timeout``
    seconds (the node sends heartbeats well within it) before it counts as dropped.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        stream_idle_timeout: float = 60.0,
        reconnect_delays: Sequence[float] = RECONNECT_DELAYS,
        send_retry: float = SEND_RETRY_S,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"User-Agent": "dispach-client/1", "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx2.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self._stream_timeout = httpx2.Timeout(timeout, read=stream_idle_timeout)
        self._delays = tuple(reconnect_delays)
        self._send_retry = send_retry

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def send(
        self,
        agent: str,
        text: str,
        *,
        session_key: str | None = None,
        idempotency_key: str | None = None,
        deliver: object = None,
        concurrency: str | None = None,
    ) -> Accepted:
        """Send a message; returns once its turn is durably accepted. Without
        ``idempotency_key`` a fresh random one is sent; either way a retry (see the module's
        docstring) reuses it, so the message makes one turn at most."""
        body: dict[str, object] = {"text": text}
        if session_key is not None:
            body["sessionKey"] = session_key
        if deliver is not None:
            body["deliver"] = deliver
        if concurrency is not None:
            body["concurrency"] = concurrency
        headers = {"Idempotency-Key": idempotency_key or str(uuid.uuid4())}
        path = f"/v1/agents/{agent}/messages"
        deadline = time.monotonic() + self._send_retry
        retried = False
        while True:
            try:
                response = self._request("POST", path, json=body, headers=headers)
                return msgspec.json.decode(response.content, type=Accepted)
            except ClientError as e:
                wait = _retry_wait(e)
                if wait is None or (retried and time.monotonic() + wait > deadline):
                    raise
            time.sleep(wait)
            retried = True

    def turn(self, turn_id: str, agent: str | None = None) -> dict[str, Any]:
        """The turn resource: ``status`` is ``running`` until the end, then the end reason."""
        path = f"/v1/agents/{agent}/turns/{turn_id}" if agent else f"/v1/turns/{turn_id}"
        return _JSON.decode(self._request("GET", path).content)

    def events(self, agent: str, turn_id: str, after: str | None = None) -> list[dict[str, Any]]:
        """Every stored event of the turn after the cursor ``after``, as public envelopes."""
        found: list[dict[str, Any]] = []
        cursor = after
        while True:
            params = {"after": cursor} if cursor else {}
            page = _JSON.decode(
                self._request(
                    "GET", f"/v1/agents/{agent}/turns/{turn_id}/events", params=params
                ).content
            )
            found.extend(page["events"])
            cursor = page.get("next")
            if not cursor or not page["events"]:
                return found

    def stop(self, agent: str, turn_id: str) -> dict[str, Any]:
        """Ask a running turn to stop (cooperative: its ``turn.end`` follows on the stream)."""
        return _JSON.decode(
            self._request("POST", f"/v1/agents/{agent}/turns/{turn_id}/stop").content
        )

    def cluster(self) -> dict[str, Any]:
        """The cluster as the node reads its lease bucket: nodes, partitions, epochs, ages."""
        return _JSON.decode(self._request("GET", "/v1/cluster").content)

    def keys(self) -> dict[str, Any]:
        """``{keys: [...]}``: every key's id, label, scope, agents, created, last used, revoked."""
        return _JSON.decode(self._request("GET", "/v1/keys").content)

    def create_key(self, body: dict[str, Any], claim: str | None = None) -> dict[str, Any]:
        """Mint a key (the answer holds its ``secret``, once); ``claim``: the boot claim."""
        headers = {"Authorization": f"Bearer {claim}"} if claim else None
        return _JSON.decode(self._request("POST", "/v1/keys", json=body, headers=headers).content)

    def revoke_key(self, key_id: str) -> dict[str, Any]:
        return _JSON.decode(self._request("DELETE", f"/v1/keys/{_seg(key_id)}").content)

    def agents(self) -> list[dict[str, Any]]:
        """The agents this client may reach: ``id``, ``name``, ``status``, ``model``, …"""
        return _JSON_LIST.decode(self._request("GET", "/v1/agents").content)

    def agent(self, agent: str) -> dict[str, Any]:
        """One agent in detail: model, tool count, ``limits``, ``channels``, ``schedules``, …"""
        return _JSON.decode(self._request("GET", f"/v1/agents/{_seg(agent)}").content)

    def change_agent(
        self, agent: str, kind: str, *, reason: str | None = None, by: str = "cli"
    ) -> dict[str, Any]:
        """``kind``: ``reload`` (the manifest read again, for new turns on every node),
        ``stop`` (new messages refused ``agent_stopped``) or ``start``; the agent's state."""
        body = {"by": by, **({"reason": reason} if reason is not None else {})}
        return _JSON.decode(
            self._request("POST", f"/v1/agents/{_seg(agent)}/{kind}", json=body).content
        )

    def tools(self, agent: str) -> list[dict[str, Any]]:
        """The agent's tools: ``slug``, ``summary``, ``mutating``, ``policy``, ``timeoutS``, …"""
        return _JSON_LIST.decode(self._request("GET", f"/v1/agents/{_seg(agent)}/tools").content)

    def schedules(self, agent: str) -> list[dict[str, Any]]:
        """The agent's schedules (its manifest's and those made over the API)."""
        path = f"/v1/agents/{_seg(agent)}/schedules"
        return list(_JSON.decode(self._request("GET", path).content)["schedules"])

    def sessions(
        self,
        agent: str,
        *,
        q: str | None = None,
        status: str | None = None,
        limit: int | None = None,
    ) -> list[dict[str, Any]]:
        """The agent's sessions, most recently active first; ``q`` keeps the keys that contain
        it, ``status`` those whose last turn ended so (a node that predates either ignores it)."""
        params = {k: str(v) for k, v in (("q", q), ("status", status), ("limit", limit))
                  if v is not None}  # fmt: skip
        path = f"/v1/agents/{_seg(agent)}/sessions"
        return _JSON_LIST.decode(self._request("GET", path, params=params).content)

    def session(self, agent: str, key: str) -> dict[str, Any]:
        """One session's summary: ``turns``, ``messages``, ``lastTurnId``, times."""
        path = f"/v1/agents/{_seg(agent)}/sessions/{_seg(key)}"
        return _JSON.decode(self._request("GET", path).content)

    def messages(
        self, agent: str, key: str, *, limit: int | None = None, before: int | None = None
    ) -> dict[str, Any]:
        """A page of the session's history, newest first (``messages``, ``nextBefore``)."""
        params = {k: str(v) for k, v in (("limit", limit), ("before", before)) if v is not None}
        path = f"/v1/agents/{_seg(agent)}/sessions/{_seg(key)}/messages"
        return _JSON.decode(self._request("GET", path, params=params).content)

    def fork(
        self,
        agent: str,
        key: str,
        at_turn: str | int,
        *,
        new_key: str | None = None,
        to_agent: str | None = None,
    ) -> dict[str, Any]:
        """Start a new session from this one's history up to and including a turn (its id, or
        its 1-based index); the source is untouched. Returns the new session and its origin."""
        body: dict[str, object] = {"atTurn": at_turn}
        if new_key is not None:
            body["newKey"] = new_key
        if to_agent is not None:
            body["agent"] = to_agent
        path = f"/v1/agents/{_seg(agent)}/sessions/{_seg(key)}/fork"
        return _JSON.decode(self._request("POST", path, json=body).content)

    def approvals(self, agent: str, *, private: bool = False) -> list[dict[str, Any]]:
        """The agent's tool calls waiting for a person (``approvalId``, ``slug``, ``turnId``, …;
        with ``private``, the ``args`` each call would run with: the API token only)."""
        path = f"/v1/agents/{_seg(agent)}/approvals" + ("?private=true" if private else "")
        return list(_JSON.decode(self._request("GET", path).content)["approvals"])

    def decide(self, agent: str, approval_id: str, granted: bool) -> dict[str, Any]:
        """Answer an approval: the turn runs the call (granted) or reads a refusal."""
        path = f"/v1/agents/{_seg(agent)}/approvals/{_seg(approval_id)}"
        return _JSON.decode(self._request("POST", path, json={"granted": granted}).content)

    def stream_turn(
        self,
        agent: str,
        turn_id: str,
        *,
        after: str | None = None,
        chunks: bool = True,
        reasoning: bool = False,
    ) -> Iterator[StreamFrame]:
        """The turn's frames from after the cursor ``after`` (from its start when None) until it
        ends. A ``stream.replay`` frame opens every connection, reconnections included. A
        dropped connection, or one closed before ``turn.end``, is reopened after the last event
        yielded; every event is yielded once. Raises :class:`ClientError` when the node refuses
        the stream or stays unreachable through every reconnection delay. ``reasoning``: the
        model's thinking too (``model.chunk`` frames of kind ``reasoning``)."""
        last = after
        seen: set[str] = set()
        ended = False
        failures = 0
        while True:
            try:
                for frame in self._connect(agent, turn_id, last, chunks, reasoning):
                    if frame.id is not None:
                        if frame.id in seen:
                            continue
                        seen.add(frame.id)
                        last = frame.id
                        failures = 0
                    ended = ended or frame.event == "turn.end"
                    yield frame
                    if frame.event == "stream.ended":
                        return
                if ended:
                    return
                cause = "the node closed the stream before turn.end"
            except _StreamOver:
                return
            except ClientError as e:
                if e.status is not None and e.status < 500:
                    raise
                if ended:
                    return
                cause = e.message
            if failures == len(self._delays):
                raise ClientError(
                    None,
                    "stream_lost",
                    f"the stream of turn {turn_id} broke and {failures} reconnections failed"
                    f" (last: {cause})",
                    f"resume with after={last!r}; {_UNREACHABLE_HINT}",
                )
            time.sleep(self._delays[failures])
            failures += 1

    def _connect(
        self, agent: str, turn_id: str, after: str | None, chunks: bool, reasoning: bool
    ) -> Iterator[StreamFrame]:
        headers = {"Accept": "text/event-stream"}
        if after is not None:
            headers["Last-Event-ID"] = after
        url = f"/v1/agents/{agent}/turns/{turn_id}/stream"
        params = {"chunks": "true" if chunks else "false"}
        if reasoning:
            params["reasoning"] = "true"
        try:
            with self._http.stream(
                "GET", url, params=params, headers=headers, timeout=self._stream_timeout
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _refusal(response)
                if response.status_code == 204:  # resumed at or past turn.end: nothing more
                    raise _StreamOver
                for frame in parse(response.iter_lines()):
                    try:
                        data = _JSON.decode(frame.data)
                    except msgspec.DecodeError as e:
                        raise ClientError(
                            response.status_code,
                            "invalid_stream",
                            f"a {frame.event} frame's data is not a JSON object: {e}",
                            f"is {self.base_url} a Dispach node?",
                        ) from e
                    yield StreamFrame(frame.event, frame.id, data)
        except httpx2.HTTPError as e:
            raise _unreachable(self.base_url, e) from e

    def _request(
        self,
        method: str,
        path: str,
        *,
        json: object = None,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx2.Response:
        try:
            response = self._http.request(method, path, json=json, params=params, headers=headers)
        except httpx2.HTTPError as e:
            raise _unreachable(self.base_url, e) from e
        if response.status_code >= 400:
            raise _refusal(response)
        return response


def _retry_wait(error: ClientError) -> float | None:
    """Seconds to wait before sending a message again, or None when that would not help."""
    if error.status is None:
        # Unreachable: nothing was sent when the connection could not be made (no node there,
        # which a retry rarely changes); otherwise the answer was lost on the way back.
        return None if isinstance(error.__cause__, httpx2.ConnectError) else 0.1
    if error.status == 503:
        return error.retry_after
    if error.code == "accept_timeout":
        return 0.1
    return None


def _seg(value: str) -> str:
    """``value`` as one path segment (a session key may hold ``?``, ``#`` or spaces)."""
    return quote(value, safe=":@")


class _StreamOver(Exception):
    """The node answered 204: the cursor is at or past the turn's end."""


def _refusal(response: httpx2.Response) -> ClientError:
    """The node's error envelope as a ClientError (or the facts, when the body is not one)."""
    retry_after = _seconds(response.headers.get("retry-after"))
    try:
        error = msgspec.json.decode(response.content)["error"]
        return ClientError(
            response.status_code, error["code"], error["message"], error["hint"],
            error.get("field"), retry_after=retry_after,
        )  # fmt: skip
    except (msgspec.DecodeError, KeyError, TypeError):
        return ClientError(
            response.status_code,
            "http_error",
            f"{response.request.method} {response.request.url.path} answered"
            f" {response.status_code} {response.reason_phrase}: {response.text[:200]!r}",
            "check that DISPACH_URL (or --url) points at a Dispach node",
            retry_after=retry_after,
        )


def _seconds(retry_after: str | None) -> float:
    """A ``Retry-After`` in seconds (1 when absent or an HTTP date), at most MAX_RETRY_AFTER_S."""
    try:
        return min(max(float(retry_after or 1), 0.0), MAX_RETRY_AFTER_S)
    except ValueError:
        return 1.0


def _unreachable(base_url: str, error: httpx2.HTTPError) -> ClientError:
    if isinstance(error, httpx2.TimeoutException) and not isinstance(error, httpx2.ConnectTimeout):
        return ClientError(
            None,
            "server_timeout",
            f"{base_url} did not answer in time ({type(error).__name__})",
            "the node may be overloaded or stuck; check its logs",
        )
    return ClientError(
        None,
        "server_unreachable",
        f"cannot reach {base_url} ({type(error).__name__}: {error})",
        _UNREACHABLE_HINT,
    )

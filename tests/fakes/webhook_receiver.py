"""A local receiver for Dispach's outbound webhook channel, served on a real socket.

The wire contract it checks, in this order, for a ``POST`` to any path:

1. ``X-Dispach-Timestamp: <unix seconds>`` and ``X-Dispach-Signature: v1=<hex>``, where hex is
   ``HMAC-SHA256(secret, f"{timestamp}.{raw body}")``. Several comma-separated ``v1=`` values
   are allowed (a secret being rotated); one must match. A missing or wrong signature, or a
   timestamp more than ``max_age`` seconds away from now (replay protection), answers 401.
2. ``Idempotency-Key: <key>``: missing answers 400.
3. A JSON body: anything else answers 400.

A new key is kept (``kept``, in arrival order) and answered 200 ``{"id": "<receiver id>"}``. A
repeated key is not kept again: it gets the first answer once more and is recorded with
``duplicate=True``; a repeat whose body differs from the first one answers 422, as payment APIs
do, since a retry must resend the same request.

Faults are scripted first in first out: ``fail_next`` answers an error before any checking (a
load balancer or an overloaded app: nothing is kept); ``drop_next`` keeps the request (unless
``processed=False``) and closes the connection without an answer, the crash window where the
sender cannot know; ``hold_next`` keeps it and answers late. Every request is recorded in
``received``. The handler stays lean (no logging, one response write, keep-alive) because a
benchmark drains thousands of deliveries a second through it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from tests.fakes._local_server import Drop, Handler, Hold, LocalServer, phrase

__all__ = ["Received", "WebhookReceiver", "sign"]


def sign(secret: str, timestamp: str, raw: bytes) -> str:
    """The ``X-Dispach-Signature`` value for a body sent at ``timestamp``."""
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + raw, hashlib.sha256)
    return f"v1={digest.hexdigest()}"


@dataclass(frozen=True)
class Received:
    """One request as it arrived; ``status`` is what it was answered (None: dropped)."""

    idempotency_key: str | None
    body: Any
    raw: bytes
    headers: dict[str, str]
    signature_ok: bool
    duplicate: bool
    path: str
    status: int | None


@dataclass(frozen=True)
class _Fail:
    status: int
    retry_after: int | None
    body: Any


class WebhookReceiver(LocalServer):
    """The receiving server. Thread-safe; use as a context manager or ``start()``/``stop()``
    (which ends holds at once and cuts every open connection)."""

    def __init__(
        self, secret: str, *, max_age: float | None = 300.0, host: str = "127.0.0.1"
    ) -> None:
        super().__init__(_Handler, "webhook-receiver", host=host)
        self.secret = secret
        self.max_age = max_age
        self._faults: deque[_Fail | Drop | Hold] = deque()
        self._received: list[Received] = []
        self._kept: dict[str, Any] = {}
        self._answers: dict[str, bytes] = {}

    @property
    def url(self) -> str:
        """Where to post (any path under it is accepted)."""
        return f"{super().url}/hooks/dispach"

    # scripting ------------------------------------------------------------------------------

    def fail_next(
        self, status: int, count: int = 1, retry_after: int | None = None, body: Any = None
    ) -> None:
        """Answer the next ``count`` requests with ``status`` (and ``Retry-After``, if given)."""
        with self._lock:
            self._faults.extend([_Fail(status, retry_after, body)] * count)

    def drop_next(self, count: int = 1, *, processed: bool = True) -> None:
        """Read the next ``count`` requests, then close their connections without an answer."""
        with self._lock:
            self._faults.extend([Drop(processed)] * count)

    def hold_next(self, seconds: float) -> None:
        """Answer the next request ``seconds`` late (it is kept at once)."""
        with self._lock:
            self._faults.append(Hold(seconds))

    # records --------------------------------------------------------------------------------

    @property
    def received(self) -> list[Received]:
        """Every request, in arrival order (a copy)."""
        with self._lock:
            return list(self._received)

    @property
    def kept(self) -> dict[str, Any]:
        """Idempotency-Key to body, one per key, the first arrival wins (a copy)."""
        with self._lock:
            return dict(self._kept)

    def wait_for(self, n_kept: int, timeout: float = 5.0) -> dict[str, Any]:
        """Block until at least ``n_kept`` distinct keys are kept; return ``kept``."""
        with self._changed:
            if not self._changed.wait_for(lambda: len(self._kept) >= n_kept, timeout):
                raise TimeoutError(f"{len(self._kept)} of {n_kept} kept in {timeout} s")
            return dict(self._kept)

    # answering (on connection threads) ------------------------------------------------------

    def _answer(self, path: str, headers: dict[str, str], raw: bytes) -> _Answer:
        """Check, keep and record one request; return the answer, or None to drop it."""
        key = headers.get("idempotency-key") or None
        signature_ok = self._signature_ok(headers, raw)
        try:
            body, is_json = json.loads(raw), True
        except ValueError:
            body, is_json = None, False
        with self._changed:
            fault = self._faults.popleft() if self._faults else None
            duplicate = False
            if isinstance(fault, _Fail):
                answer: _Answer = _fail_answer(fault)
            elif isinstance(fault, Drop) and not fault.processed:
                answer = None
            elif not signature_ok:
                answer = 401, _json({"error": "bad signature"}), ()
            elif key is None:
                answer = 400, _json({"error": "missing Idempotency-Key"}), ()
            elif not is_json:
                answer = 400, _json({"error": "body is not JSON"}), ()
            elif key in self._answers:
                duplicate = True
                same = self._kept[key] == body
                answer = (200, self._answers[key], ()) if same else (422, _REUSED, ())
            else:
                self._kept[key] = body
                self._answers[key] = _json({"id": f"rcv_{len(self._answers) + 1:06d}"})
                answer = 200, self._answers[key], ()
            if isinstance(fault, Drop):
                answer = None
            status = None if answer is None else answer[0]
            received = Received(key, body, raw, headers, signature_ok, duplicate, path, status)
            self._received.append(received)
            self._changed.notify_all()
        if isinstance(fault, Hold) and self._stopping.wait(fault.seconds):
            return None
        return answer

    def _signature_ok(self, headers: dict[str, str], raw: bytes) -> bool:
        timestamp = headers.get("x-dispach-timestamp", "")
        offered = [v.strip() for v in headers.get("x-dispach-signature", "").split(",")]
        if not timestamp.isdigit():
            return False
        if self.max_age is not None and abs(time.time() - int(timestamp)) > self.max_age:
            return False
        expected = sign(self.secret, timestamp, raw)
        return any(hmac.compare_digest(expected, value) for value in offered)


_Answer = tuple[int, bytes, tuple[tuple[str, str], ...]] | None
_REUSED = b'{"error": "Idempotency-Key reused with a different body"}'
_JSON_TYPE = ("Content-Type", "application/json")


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def _fail_answer(fault: _Fail) -> _Answer:
    body = fault.body if fault.body is not None else {"error": phrase(fault.status)}
    retry = () if fault.retry_after is None else (("Retry-After", str(fault.retry_after)),)
    return fault.status, _json(body), retry


# --------------------------------------------------------------------------------------------
# The handler: lean (one response write, keep-alive), a benchmark drains thousands a second


class _Handler(Handler[WebhookReceiver]):
    def do_POST(self) -> None:
        receiver = self.owner
        raw = self._read_body()
        try:
            answer = receiver._answer(self.path, self._lowered_headers(), raw)
        except Exception as error:  # a bug in the receiver: say so, as a 500
            receiver._record_error(error)
            answer = 500, _json({"error": repr(error)}), ()
        if answer is None:
            self._drop()
            return
        status, data, extra = answer
        self._reply(status, data, (_JSON_TYPE, *extra))

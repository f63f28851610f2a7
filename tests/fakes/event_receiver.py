"""A local receiver of Dispach's event webhooks (``POST /v1/webhooks``), on a real socket.

It verifies each POST as a Standard Webhooks consumer does: ``webhook-signature`` is ``v1,`` +
base64 HMAC-SHA256 over ``<webhook-id>.<webhook-timestamp>.<body>`` with the key the secret
(``whsec_`` + base64) encodes. Every request is recorded (``received``) with whether its
signature verified. It answers 200, or what is scripted: ``status`` for every request (a broken
receiver), or ``die_next()``: read the next request, then cut the connection without an answer
and stop serving (the process was killed mid-POST). A new receiver on the same ``port`` is the
restarted process.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any

from tests.fakes._local_server import Handler, LocalServer


def verify(secret: str, headers: dict[str, str], raw: bytes) -> bool:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{headers.get('webhook-id')}.{headers.get('webhook-timestamp')}.".encode() + raw
    expected = "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    offered = headers.get("webhook-signature", "").split(" ")
    return any(hmac.compare_digest(expected, value) for value in offered)


@dataclass(frozen=True)
class Got:
    headers: dict[str, str]
    body: Any
    raw: bytes

    @property
    def delivery(self) -> str:
        return self.headers["webhook-id"]

    @property
    def redelivery(self) -> bool:
        return self.headers.get("webhook-redelivery") == "1"


class EventReceiver(LocalServer):
    def __init__(self, *, port: int = 0, status: int = 200) -> None:
        super().__init__(_Handler, "event-receiver", port=port)
        self.status = status
        self._die = False
        self._received: list[Got] = []
        self.died = False

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def die_next(self) -> None:
        with self._lock:
            self._die = True

    @property
    def received(self) -> list[Got]:
        with self._lock:
            return list(self._received)

    def wait(self, done: Any, timeout: float) -> list[Got]:
        """Block until ``done(received)`` holds (else TimeoutError)."""
        with self._changed:
            if not self._changed.wait_for(lambda: done(self._received), timeout):
                raise TimeoutError(f"{len(self._received)} requests so far")
            return list(self._received)

    def _take(self, headers: dict[str, str], raw: bytes) -> int | None:
        with self._changed:
            self._received.append(Got(headers, json.loads(raw), raw))
            self._changed.notify_all()
            if self._die:
                self._die, self.died = False, True
                return None
            return self.status


class _Handler(Handler[EventReceiver]):
    def do_POST(self) -> None:
        raw = self._read_body()
        status = self.owner._take(self._lowered_headers(), raw)
        if status is None:
            self._drop()
            return
        self._reply(status, b"{}", (("Content-Type", "application/json"),))

"""What a client is told when its message's acceptance does not answer in time.

The session may have accepted the message all the same: the answer was lost, or the append is
still waiting in the writer and commits later. Where the node can know, it says so. With an
``Idempotency-Key`` it looks the key up in the log (the turn a key names has a derived id,
actors/idempotency.py): a stored turn is answered as a replay (``200``, ``replayed: true``), or
``409 idempotency_key_reused`` if the key went to another request. Otherwise the answer is
``504 accept_timeout`` with ``accepted: "unknown"`` and the one safe next step: send again with
the same key, which replays the turn if it was accepted and accepts it once if it was not.
"""

from __future__ import annotations

import asyncio

from starlette.responses import Response

from actors.idempotency import look_up
from actors.messages import Accepted, Refused
from eventstore import EventStore, StoreError
from gateways.http.errors import error_response
from gateways.ingress import IngressMessage

LOOKUP_TIMEOUT_S = 2.0


async def after_timeout(
    store: EventStore | None, agent_id: str, message: IngressMessage, waited: float
) -> Accepted | Refused:
    """The turn the message's key names if it is stored, else the timeout, told honestly."""
    key = message.idempotency_key
    if key is None:
        return Refused(code="accept_timeout",
                       message=f"the session did not answer within {waited:g} s; whether the "
                       "message was accepted is not known",
                       hint="look for it in GET …/turns?sessionKey=… before sending it again; "
                       "send an Idempotency-Key header so that a retry can never make a second "
                       "turn")  # fmt: skip
    if store is not None and store.health.up:
        try:
            async with asyncio.timeout(LOOKUP_TIMEOUT_S):
                found = await look_up(store, agent_id, key, message.session_key,
                                                  message.text, message.deliver)  # fmt: skip
        except (StoreError, TimeoutError):
            found = None
        if found is not None:
            return found
    return Refused(code="accept_timeout",
                   message=f"the session did not answer within {waited:g} s and no turn holds "
                   "this Idempotency-Key yet; the message may still be accepted",
                   hint="send it again with the same Idempotency-Key: that replays the turn if "
                   "it was accepted, or accepts it once if it was not")  # fmt: skip


def unknown(refusal: Refused) -> Response:
    """``504`` for an acceptance whose outcome is not known."""
    return error_response(
        504, refusal.code, refusal.message, refusal.hint, accepted="unknown",
        headers={"Retry-After": "1"},
    )  # fmt: skip

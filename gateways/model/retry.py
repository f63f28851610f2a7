"""When to send a failed model request again: shared by every provider's adapter.

Retries before the first byte are the adapter's own (each SDK's are switched off), so each one
is an event (``model.retry``) with the delay the server asked for.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

RETRYABLE_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504, 529})
MAX_SERVER_DELAY_S = 60.0


def delay(headers: Mapping[str, str] | None, attempt: int) -> float:
    """The wait before retry ``attempt``: what the server asked for (``retry-after-ms``, then
    ``retry-after`` in seconds), else exponential backoff with jitter (0.5 s doubling, capped at
    8 s)."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name) if headers else None
        if value:
            try:
                seconds = float(value) * scale
            except ValueError:
                continue
            if seconds > 0:
                return min(seconds, MAX_SERVER_DELAY_S)
    backoff: float = min(0.5 * 2 ** (attempt - 1), 8.0)
    return backoff * (1 - 0.25 * random.random())  # noqa: S311 - jitter, not security

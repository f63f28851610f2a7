"""Expected-version sentinels for :meth:`EventStore.append` (Message DB / KurrentDB vocabulary)."""

from __future__ import annotations

from typing import Final

NO_STREAM: Final = -1
"""The stream must not exist yet: its first event gets version 0."""

ANY: Final = -2
"""Append at the head whatever it is (no concurrency check)."""

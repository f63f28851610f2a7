"""What every channel kind shares: the settings every channel of a manifest has (``channels:``),
the declaration of a kind (:class:`ChannelKind`: its settings and its factory), and reading the
secrets a channel names.

Secrets are never in the manifest: it names the environment variable that holds each one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from actors.outbox import Channel
from eventstore.errors import DispachError

_ID = r"^[a-z][a-z0-9_-]{0,31}$"
ChannelId = Annotated[str, msgspec.Meta(pattern=_ID)]
Pauses = Annotated[list[Annotated[float, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=20)]
_BACKOFF = [1.0, 5.0, 25.0, 120.0, 600.0]
"""Pauses before attempts 2..6 (seconds, jittered by ±20 %)."""


class ChannelError(DispachError):
    code = "invalid_channel"


class ChannelSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The settings of every channel; a kind's own settings subclass it, tagged with the kind's
    ``type`` (``tag="telegram", tag_field="type"``)."""

    id: ChannelId
    on_uncertain: Literal["resend", "skip"] = "resend"
    """An item whose send may have happened (the node died in its send window, or the answer was
    lost: a dropped connection, a timeout): send it again (flagged), or record it as uncertain
    and send nothing."""
    backoff_s: Pauses = msgspec.field(default_factory=lambda: list(_BACKOFF))
    enabled: bool = True


Factory = Callable[[str, Any, Mapping[str, str]], Channel]
"""Builds a channel of the kind from its settings and the node's environment (the agent's id
names it in errors). What it builds is the whole channel: the outbound transport and, if the
kind has one, its inbound side (``start``/``stop``, run under ``singleton`` when it names one;
``webhook`` for updates pushed to ``POST /v1/channels/{channel}/webhook/{agent}``)."""


@dataclass(frozen=True)
class ChannelKind:
    """One kind of channel, as manifests see it."""

    config: type[ChannelSettings]
    """Its settings: a tagged struct, its tag the manifest's ``type``."""
    build: Factory

    @property
    def type(self) -> str:
        return str(self.config.__struct_config__.tag)


def secret(agent_id: str, channel_id: str, name: str, env: Mapping[str, str]) -> str:
    """The value of the variable ``name`` a channel's settings name, or a ChannelError."""
    value = env.get(name, "")
    if not value.strip():
        raise ChannelError(
            f"agent {agent_id!r}: channel {channel_id!r} needs {name}, which is not set",
            f"export {name}=... before `dispach serve` (secrets never go in the manifest)",
            field="channels",
        )
    return value

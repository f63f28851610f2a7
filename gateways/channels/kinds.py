"""The kinds of channel a manifest may declare, in one place: a new kind is a module of its own
(its settings, a tagged :class:`~gateways.channels.config.ChannelSettings`, its transport and its
:class:`~gateways.channels.config.ChannelKind`) and its entry in :data:`KINDS`. The manifest's
``channels`` union and :func:`build` are derived from it; nothing else names a kind."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Union

from actors.outbox import Channel
from gateways.channels import telegram, webhook
from gateways.channels.config import ChannelKind, ChannelSettings

KINDS: tuple[ChannelKind, ...] = (telegram.KIND, webhook.KIND)

if TYPE_CHECKING:  # the union of the kinds' settings, known when the registry is
    ChannelConfig = ChannelSettings
else:
    ChannelConfig = Union[tuple(kind.config for kind in KINDS)]  # noqa: UP007 - built at run time
    """A channel's settings in a manifest, told apart by their ``type``."""

_BY_CONFIG = {kind.config: kind for kind in KINDS}


def build(agent_id: str, config: ChannelSettings, env: Mapping[str, str]) -> Channel:
    """The channel ``config`` declares."""
    return _BY_CONFIG[type(config)].build(agent_id, config, env)

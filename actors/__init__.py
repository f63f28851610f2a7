"""Session, Turn, Outbox and Scheduler actors (pure decide/evolve cores, thin pykka shells)."""

from actors.bridge import Portal
from actors.host import ActorHost

__all__ = ["ActorHost", "Portal"]

"""Session, Turn, Outbox and Scheduler actors (pure decide/evolve cores, thin pykka shells)."""

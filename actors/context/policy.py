"""An agent's context policy: its window, the output reserve, and the compaction ladder."""

from __future__ import annotations

from dataclasses import dataclass

from actors.context.rungs import DEFAULT_THRESHOLDS


@dataclass(frozen=True)
class ContextPolicy:
    window: int = 200_000
    """The model's context window, in tokens."""
    reserve_output: int = 4096
    """Tokens kept free for the reply."""
    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS
    """Fractions of the prompt budget at which each rung starts, in the order of
    :data:`actors.context.rungs.RUNGS`."""
    excerpt_over: int = 1000
    """excerpt: tool results bigger than this many tokens are cut to a head and a tail..."""
    excerpt_keep: int = 300
    """...of this many tokens in all."""
    keep_turns: int = 2
    """digest: the newest turns kept verbatim."""
    count_tokens: bool = False
    """Ask the provider to count each request's tokens before sending it."""
    requests_share: float = 0.3
    """digest/reset: the share of the prompt budget the verbatim list of the person's earlier
    requests may take; past it the earliest are summarised instead (a session of thousands of
    turns keeps working rather than ending every turn over budget)."""

    @property
    def budget(self) -> int:
        """The prompt budget: what a request may hold, the window less the output reserve."""
        return max(1, self.window - self.reserve_output)

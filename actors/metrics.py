"""Prometheus metrics of turns, observed by the turn runner (default registry).

Labels stay low-cardinality: agent ids, tool names and end reasons come from manifests and the
catalogue; a turn id or a session key is never a label.
"""

from __future__ import annotations

import functools
import time

from prometheus_client import Counter, Gauge, Histogram

from actors.model import Usage

# Model calls and whole steps run from well under a second to minutes.
_LONG = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
_TOOL = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

TURNS_ENDED = Counter(
    "dispach_turns_ended",
    "Turns this node ended (its turn.end committed), by agent and end reason.",
    ["agent", "reason"],
)

TURNS_RUNNING = Gauge(
    "dispach_turns_running",
    "Turns whose step loop runs on this node now (including resumed ones).",
)

STEP_SECONDS = Histogram(
    "dispach_step_seconds",
    "Seconds of one completed step: a model call and the tool calls of its reply.",
    ["agent"],
    buckets=_LONG,
)

MODEL_CALL_SECONDS = Histogram(
    "dispach_model_call_seconds",
    "Seconds of one model call, from the request to the final message or the error.",
    ["agent", "outcome"],
    buckets=_LONG,
)

MODEL_TOKENS = Counter(
    "dispach_model_tokens",
    "Tokens of model calls, by agent, model and kind: prompt (everything the model read, the "
    "cache's reads and writes included, as model.result counts it), output, cache_read, "
    "cache_write.",
    ["agent", "model", "kind"],
)

TOOL_CALL_SECONDS = Histogram(
    "dispach_tool_call_seconds",
    "Seconds of one tool call, as recorded in its tool.result (ok, or error/timeout).",
    ["tool", "outcome"],
    buckets=_TOOL,
)


class StepClock:
    """Times one turn's steps for ``dispach_step_seconds``. A step ends at its last tool result,
    at the turn's end, or where the next model call begins (a paused reply sent straight back).
    A step begun before a crash has no start on this node and is not observed, nor is a step
    cut short by an error or a stop."""

    def __init__(self, histogram: Histogram) -> None:
        self._histogram = histogram
        self._started: float | None = None

    def start(self) -> None:
        self.done()
        self._started = time.monotonic()

    def done(self) -> None:
        if self._started is not None:
            self._histogram.observe(time.monotonic() - self._started)
            self._started = None


@functools.cache
def _token_series(agent_id: str, model: str) -> tuple[Counter, ...]:
    """The four ``dispach_model_tokens_total`` series of an agent's model, looked up once."""
    kinds = ("prompt", "output", "cache_read", "cache_write")
    return tuple(MODEL_TOKENS.labels(agent_id, model, kind) for kind in kinds)


def count_tokens(agent_id: str, model: str, usage: Usage) -> None:
    """``dispach_model_tokens_total``, once per model call (a reply discarded to be asked
    again included: its tokens were spent). ``prompt`` is everything the model read, as in
    ``model.result``: the cache's reads and writes are part of it."""
    counts = (usage.prompt_tokens, usage.output_tokens, usage.cache_read_tokens,
              usage.cache_write_tokens)  # fmt: skip
    for counter, tokens in zip(_token_series(agent_id, model), counts, strict=True):
        if tokens:
            counter.inc(tokens)

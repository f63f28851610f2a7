"""Running tool calls: bounded in time, failures turned into outcomes the model can read."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from actors import tracing
from actors.tools.errors import ToolCallFailed
from actors.tools.spec import ToolContext, ToolOutcome, ToolOutput, ToolSpec
from eventstore.bridge import abandonable

MAX_IMAGE_CHARS = 5_000_000
"""The base64 of one image a result may carry to the model (Anthropic takes 5 MB an image);
a larger one is left out with a note, like everything over a limit."""
MAX_IMAGES = 8

Call = tuple[ToolSpec, dict[str, Any], ToolContext]


async def execute(
    spec: ToolSpec,
    args: dict[str, Any],
    ctx: ToolContext,
    *,
    timeout_s: float,
    max_output_chars: int,
) -> ToolOutcome:
    """Run one call. A timeout or an exception becomes a failed outcome; ``CancelledError`` (the
    turn is being stopped) propagates.

    A plain function runs in a worker thread, which cannot be stopped: after a timeout it runs on
    to its end and its result is dropped. Coroutine tools are cancelled at the timeout.
    """
    started = time.perf_counter()
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            result = await _run(spec, args, ctx)
    except TimeoutError as e:
        if not deadline.expired():
            # The tool's own TimeoutError (a socket, a lock): a failure like any other.
            return _outcome(False, _describe(e), started, max_output_chars, "tool_failed")
        message = f"the tool did not finish within {timeout_s:g} s"
        return _outcome(False, message, started, max_output_chars, "tool_timeout")
    except ToolCallFailed as e:  # the tool chose its code and its words
        return _outcome(False, str(e), started, max_output_chars, e.code)
    except Exception as e:  # noqa: BLE001 - whatever a tool raises, the model reads it as output
        return _outcome(False, _describe(e), started, max_output_chars, "tool_failed")
    if isinstance(result, ToolOutput):
        return _output(result, started, max_output_chars)
    if not isinstance(result, str):
        message = f"the tool returned {type(result).__name__}, not the str a tool must return"
        return _outcome(False, message, started, max_output_chars, "tool_failed")
    return _outcome(True, result, started, max_output_chars)


async def execute_calls(
    calls: Sequence[Call],
    *,
    timeout_for: Callable[[ToolSpec], float],
    max_output_chars: int,
) -> list[ToolOutcome]:
    """Run the calls of one model step; the outcomes are in the order of ``calls``.

    Read-only calls run first, all at once: they have no effects, so their order cannot matter
    and the step waits only for the slowest. Mutating calls then run one at a time in the order
    the model gave them, so their effects happen in that order (an append before a replace stays
    before it). The reads therefore see the state from before this step's writes.
    """
    outcomes: dict[int, ToolOutcome] = {}

    async def run(index: int) -> None:
        spec, args, ctx = calls[index]
        with tracing.tool_call(spec.name, ctx.call_id) as call:
            outcome = await execute(
                spec, args, ctx, timeout_s=timeout_for(spec), max_output_chars=max_output_chars
            )
            if not outcome.ok:
                call.failed(outcome.error_code or "tool_failed")
        outcomes[index] = outcome

    # A TaskGroup owns the parallel reads: if the turn is cancelled, it cancels and awaits them
    # all before the cancellation goes on, so no tool outlives the step that started it.
    async with asyncio.TaskGroup() as group:
        for index, (spec, _, _) in enumerate(calls):
            if not spec.mutating:
                group.create_task(run(index))
    for index, (spec, _, _) in enumerate(calls):
        if spec.mutating:
            await run(index)
    return [outcomes[index] for index in range(len(calls))]


async def _run(spec: ToolSpec, args: dict[str, Any], ctx: ToolContext) -> object:
    if inspect.iscoroutinefunction(spec.run):
        return await spec.run(args, ctx)
    result: object = await abandonable(spec.run, args, ctx)  # a thread that may never end
    if inspect.isawaitable(result):  # a plain callable that returns a coroutine
        return await result
    return result


def _outcome(
    ok: bool, output: str, started: float, limit: int, error_code: str | None = None
) -> ToolOutcome:
    latency_ms = round((time.perf_counter() - started) * 1000)
    kept, truncated = truncate(output, limit)
    size = len(output.encode("utf-8", "surrogatepass"))
    return ToolOutcome(
        ok=ok,
        output=kept,
        truncated=truncated,
        bytes=size,
        latency_ms=latency_ms,
        error_code=error_code,
    )


def _output(result: ToolOutput, started: float, limit: int) -> ToolOutcome:
    """A :class:`ToolOutput` as an outcome: its text cut to ``limit`` like any output, its
    images kept while they fit (:data:`MAX_IMAGES`, :data:`MAX_IMAGE_CHARS`), a note for each
    left out; content blocks only when an image remains."""
    outcome = _outcome(not result.error, result.text, started, limit,
                       "tool_error" if result.error else None)  # fmt: skip
    images: list[dict[str, Any]] = []
    notes: list[str] = []
    for block in result.blocks:
        if block.get("type") != "image":
            continue
        size = len(str((block.get("source") or {}).get("data", "")))
        if size > MAX_IMAGE_CHARS or len(images) == MAX_IMAGES:
            notes.append(f"[an image of {size} base64 characters was left out: over the limit "
                         f"of {MAX_IMAGES} images of {MAX_IMAGE_CHARS} characters]")  # fmt: skip
        else:
            images.append(block)
    if not images and not notes:
        return outcome
    text = "\n".join([outcome.output, *notes]) if notes else outcome.output
    content = [{"type": "text", "text": text}, *images] if images else None
    return msgspec.structs.replace(outcome, output=text, content=content)


def truncate(text: str, limit: int) -> tuple[str, bool]:
    """``text`` if it fits in ``limit`` characters; else its head (3/4) and tail (1/4) with a note
    between them saying how much was left out. The tail is kept because that is where errors and
    totals usually are."""
    total = len(text)
    if total <= limit:
        return text, False
    head = limit * 3 // 4
    tail = limit - head
    omitted = total - head - tail
    note = f"\n…[truncated: {omitted} of {total} characters omitted]…\n"
    return text[:head] + note + text[total - tail :], True


def _describe(error: BaseException) -> str:
    message = str(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__
